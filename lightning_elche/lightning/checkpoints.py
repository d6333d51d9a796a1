"""ElChe's part of a Lightning checkpoint: written at boundaries only, read back for an exact resume.

What is saved is the cohort core's :class:`~lightning_elche.cohort.resume.ResumePoint` (coverage,
counters, controller and guard state, the outer optimizer's momentum) under the controller
callback's key, and each rank's own states (its optimizer's, its averager's error feedback under
``compression``) in a part of its own that every rank writes at once (``checkpoint_parts.py``):
rank 0 gathers nothing, and what it writes and holds does not grow with the world size. See
docs/resume.md.

In an elastic fit a member lost while a checkpoint is taken or written (its gathers, or the
leader dying as it writes) does not end the fit: the survivors regroup, take the checkpoint again
among themselves and the new rank 0 writes it, so the file holds the cohort that trains on.
"""

from __future__ import annotations

import pickle
import posixpath
import re
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from lightning_elche.cohort.claims import Claims
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.comm.groups import boundary_group, from_rank0, gather_to_all, gather_to_rank0
from lightning_elche.comm.liveness import CohortFailure, resume_advice
from lightning_elche.comm.store import first_line
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.checkpoint_parts import (
    PartsRecord,
    SavedParts,
    discard,
    keep_only,
    parts_folder,
    remove_parts,
    write_part,
)
from lightning_elche.lightning.settings import ElCheSettings

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_elche.lightning.session import FitSession
    from lightning_elche.lightning.world import World


STATE_KEY = "ElCheCallback"  # the controller callback's key in a checkpoint's "callbacks"


class CheckpointNotWritten(RuntimeError):
    """A rank could not write its part of a checkpoint, or rank 0 the checkpoint; every rank raises it,
    naming the last one that was written."""


class CheckpointHost(Protocol):
    """What the checkpoints read of the strategy: this rank's place and optimizers, the fit in progress."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]: ...

    @property
    def lightning_module(self) -> Optional["pl.LightningModule"]: ...

    @property
    def session(self) -> Optional[FitSession]: ...

    @property
    def world(self) -> World: ...


class CohortCheckpoints:
    """ElChe's part of every checkpoint (taken at boundaries), and what a resumed fit takes from one."""

    def __init__(self, host: CheckpointHost, settings: ElCheSettings) -> None:
        self.host = host
        self.settings = settings
        self.resume: Optional[ResumePoint] = None  # loaded with the checkpoint, handed to the fit's cohort
        self._parts: Optional[SavedParts] = None  # the per-rank parts of the checkpoint resumed from
        self._loaded: Optional[tuple[str, bool]] = None  # the checkpoint file last loaded, and whether weights-only
        self._dump_outdated = False  # members were lost while the checkpoint being saved was taken
        # Not a setting: the single-file layout of earlier versions (every rank's states gathered to rank 0
        # and written in the one file), kept so that benchmarks/checkpoint.py can measure it against the
        # per-rank parts and the tests can write the old format that must still resume.
        self.single_file = False

    def take_outdated(self) -> bool:
        """Whether members were lost while the last checkpoint was taken (the survivors regrouped, so it
        holds the old cohort): then it must be taken again. Reading the note clears it."""
        outdated, self._dump_outdated = self._dump_outdated, False
        return outdated

    def state(self) -> dict[str, Any]:
        """ElChe's part of a checkpoint; Lightning's ``dump_checkpoint`` asks every rank at the same point."""
        session = self.host.session
        if session is None:
            return {}
        outer = self.settings.outer_optimizer
        gathered = self._gather_optimizer_states if self.single_file else lambda: None  # else each rank's part
        try:
            point = session.cohort.resume_point(gathered, None if outer is None else outer.state_dict(), self._gather_claims)
            if point is not None:
                # each rank's averager state goes into its part (``save``), the single file gathers them here; None
                # also drops those a cohort resumed in memory carries over from the point it resumed from
                averager_state = session.averager.state_dict() if self.single_file else {}  # empty: it keeps none
                point.averager_states = self._gather("averager states", averager_state) if averager_state else None
        except CohortFailure as failure:
            self._regroup_or_raise(session, failure)  # ``save`` then takes it again among the survivors
            return {}
        return {} if point is None else point.to_state()

    def _regroup_or_raise(self, session: FitSession, failure: CohortFailure) -> None:
        world = self.host.world
        if not world.continues_at_boundary(session, failure):
            raise failure
        world.continue_at_boundary(session, failure.lost)
        self._dump_outdated = True

    def _gather_optimizer_states(self) -> Optional[list[list[dict[str, Any]]]]:
        """Every rank's optimizer states, on rank 0 (the single-file layout)."""
        host = self.host
        states = [move_data_to_device(host.optimizer_state(opt), torch.device("cpu")) for opt in host.optimizers]
        return self._gather("optimizer states", states)

    def _gather(self, what: str, mine: Any) -> Optional[list[Any]]:
        """Every rank's ``mine``, on rank 0 (which writes)."""
        host, session = self.host, self.host.session
        assert session is not None
        group = boundary_group(self.settings.averaging.reduce_on, self.settings.timeout)
        with host.world.naming_lost_ranks(session, f"in the checkpoint's gather of {what}"):
            return gather_to_rank0(mine, host.global_rank, host.world_size, group)

    def _gather_claims(self, mine: Claims) -> list[Claims]:
        """Every rank's claims (dynamic dispatch), on every rank: together they say what was trained."""
        host, session = self.host, self.host.session
        assert session is not None
        group = boundary_group(self.settings.averaging.reduce_on, self.settings.timeout)
        with host.world.naming_lost_ranks(session, "in the checkpoint's gather of claimed samples"):
            return gather_to_all(mine, host.world_size, group)

    def load(self, checkpoint_path: Any, weights_only: Optional[bool], load: Callable[[Any, bool], dict[str, Any]]) -> dict[str, Any]:
        """The checkpoint file, loaded weights-only unless the user said otherwise
        (:func:`load_checkpoint_weights_only`); its path tells where its parts are."""
        checkpoint = load_checkpoint_weights_only(checkpoint_path, weights_only, load)
        self._loaded = (str(checkpoint_path), True if weights_only is None else weights_only)
        return checkpoint

    def load_state(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's ElChe state for the fit that resumes from it (callbacks load before ``setup``),
        with its parts, which a fit checks on every rank before it starts (a validation needs only the weights)."""
        path, weights_only = self._loaded or (None, True)  # a joiner's checkpoint is in memory, with no parts
        try:
            self.resume = ResumePoint.from_state(state)
            self._parts = None
            if "parts" in state:
                if path is None:
                    raise ValueError("it records per-rank parts, which are found beside its file, and it was not loaded from one")
                self._parts = SavedParts(path, PartsRecord.from_state(state["parts"]), state.get("averager_state"), weights_only)
                module = self.host.lightning_module
                trainer = None if module is None else _lightning.module_trainer(module)
                if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                    self._parts.check()
        except ValueError as error:  # every rank reads the same files, so every rank raises here
            raise ValueError(f"ElChe cannot resume from the checkpoint {path}: {error}") from error

    def forget_resume(self) -> None:
        """The fit is over: the next one resumes from its own checkpoint, or from none."""
        self.resume, self._parts, self._loaded = None, None, None

    def optimizer_states(self, checkpoint: Any) -> Any:
        """The checkpoint Lightning restores this rank's optimizers from, with this rank's own states: those of
        its part (saved rank ``rank % saved world size``; rank 0's are the checkpoint's own), or of the single
        file that holds every rank's."""
        rank, own = self.host.global_rank, None
        if self._parts is not None:
            saved = rank % self._parts.record.world_size
            own = None if saved == 0 else self._parts.optimizer_states(saved)
        elif self.resume is not None:
            own = self.resume.optimizer_states_for(rank)
        return checkpoint if own is None else {**checkpoint, "optimizer_states": own}

    def averager_states(self) -> Optional[list[dict[str, Any]]]:
        """Every saved rank's averager state (error feedback), for the averager to resume from; None if none."""
        if self._parts is not None:
            return self._parts.averager_states()
        return None if self.resume is None else self.resume.averager_states

    def remove_parts(self, filepath: Any) -> None:
        """A checkpoint is removed (a ModelCheckpoint's top k moved on): rank 0 removes its parts as well."""
        if self.host.global_rank == 0:
            remove_parts(str(filepath))

    def save(self, checkpoint: dict[str, Any], filepath: Any, write: Callable[[dict[str, Any]], None]) -> None:
        """Every other rank writes its part, then rank 0 the checkpoint (``write``, DDP's save), and each
        write's outcome is told to every rank.

        Otherwise a failed write (a full disk, a quota) stops one rank alone: the others wait in the
        next collective for a rank that is leaving, then name the file that was never written as
        the checkpoint to resume from. The checkpoint is written once every part is, so a save that
        fails leaves the last checkpoint of that name whole. In an elastic fit that lost members
        while the checkpoint was taken or written, the survivors take it again and their rank 0 writes it.
        """
        while True:
            session = self.host.session
            while self.take_outdated():  # again if members were lost as it was taken again
                assert session is not None  # members are lost in a fit only
                checkpoint = _lightning.dump_checkpoint(session.trainer, weights_only="optimizer_states" not in checkpoint)
            try:
                state = checkpoint.get("callbacks", {}).get(STATE_KEY)
                if not state or self.single_file:  # nothing of ElChe's, or every rank's states in the one file
                    self._write_on_rank0(checkpoint, filepath, write)
                else:
                    self._write_with_parts(checkpoint, state, filepath, write)
                if session is not None:  # every member saved it, or every survivor saves it again
                    self.host.world.confirm_done(session, f"as the checkpoint {filepath} was saved")
                return
            except CohortFailure as failure:
                assert session is not None  # a CohortFailure comes from a fit's collectives
                self._regroup_or_raise(session, failure)

    def _write_with_parts(
        self, checkpoint: dict[str, Any], state: dict[str, Any], filepath: Any, write: Callable[[dict[str, Any]], None]
    ) -> None:
        record, filepath = self._write_parts(checkpoint, state, filepath)
        try:
            self._write_on_rank0(checkpoint, filepath, write)
        except CheckpointNotWritten:
            if self.host.global_rank == 0:
                discard(parts_folder(filepath), record)
            raise
        if self.host.global_rank == 0:
            keep_only(parts_folder(filepath), record)  # the parts of earlier saves of this name

    def _write_parts(self, checkpoint: dict[str, Any], state: dict[str, Any], filepath: Any) -> tuple[PartsRecord, str]:
        """Every rank but 0 writes its own states beside rank 0's ``filepath`` (the ranks' ModelCheckpoints may
        name it after metrics of their own), and every rank learns whether all could. The record and the path
        go into rank 0's checkpoint, with rank 0's averager state; its optimizer states are Lightning's own."""
        host, session = self.host, self.host.session
        assert session is not None  # ElChe's state is a fit's
        group = boundary_group(self.settings.averaging.reduce_on, self.settings.timeout)
        with host.world.naming_lost_ranks(session, f"as the checkpoint {filepath} was begun"):
            token, path = from_rank0((uuid.uuid4().hex[:12], str(filepath)), host.global_rank, host.world_size, group)
        record = PartsRecord(host.world_size, token, posixpath.basename(parts_folder(path)))
        averager_state = session.averager.state_dict()
        failure: Optional[Exception] = None
        if host.global_rank > 0:
            try:
                write_part(parts_folder(path), record, host.global_rank, checkpoint.get("optimizer_states"), averager_state)
            except Exception as error:  # noqa: BLE001 - every rank raises it below
                failure = error
        with host.world.naming_lost_ranks(session, f"while the ranks wrote their parts of the checkpoint {path}"):
            outcomes = gather_to_all(None if failure is None else first_line(failure), host.world_size, group)
        refused = {rank: outcome for rank, outcome in enumerate(outcomes) if outcome is not None}
        if refused:
            if host.global_rank == 0:
                discard(parts_folder(path), record)  # what this save wrote; the last checkpoint's parts stay
            last = session.cohort.last_checkpoint_path
            said = "; ".join(f"rank {rank}: {outcome}" for rank, outcome in refused.items())
            raise CheckpointNotWritten(
                f"ElChe: rank(s) {sorted(refused)} could not write their part of the checkpoint {path} ({said}), so "
                f"the checkpoint was not written and every rank stops here instead of training on without it. "
                f"{resume_advice(last)}"
            ) from failure
        state["parts"] = record.to_state()
        if averager_state:
            state["averager_state"] = averager_state
        return record, path

    def _write_on_rank0(self, checkpoint: dict[str, Any], filepath: Any, write: Callable[[dict[str, Any]], None]) -> None:
        host, session = self.host, self.host.session
        failure: Optional[Exception] = None
        try:
            write(checkpoint)  # writes on rank 0 only
        except Exception as error:  # noqa: BLE001 - every rank raises it below
            failure = error
        # the cohort whose consensus the checkpoint holds, if it holds ElChe's state
        consensus = None if session is None or STATE_KEY not in checkpoint.get("callbacks", {}) else session.cohort
        if consensus is not None and failure is None and host.global_rank == 0:  # a restart can resume from it
            consensus.note_checkpoint(str(filepath))
        outcome = None if failure is None else first_line(failure)
        group = boundary_group(self.settings.averaging.reduce_on, self.settings.timeout)
        with host.world.naming_lost_ranks(session, f"while rank 0 wrote the checkpoint {filepath}"):
            refusal = from_rank0(outcome, host.global_rank, host.world_size, group)
        if refusal is not None:
            last = session.cohort.last_checkpoint_path if session is not None else None
            raise CheckpointNotWritten(
                f"ElChe: rank 0 could not write the checkpoint {filepath} ({refusal}), so every rank stops here "
                f"instead of training on without it. {resume_advice(last)}"
            ) from failure
        if consensus is not None:
            consensus.note_checkpoint(str(filepath))  # a consensus checkpoint a restart can resume from


def load_checkpoint_weights_only(
    checkpoint_path: Any, weights_only: Optional[bool], load: Callable[[Any, bool], dict[str, Any]]
) -> dict[str, Any]:
    """Load a checkpoint with DDP's ``load``, weights-only unless the user said otherwise
    (``trainer.fit(..., weights_only=False)``).

    Lightning passes ``None`` through to ``torch.load``, which unpickles anything on the torch
    releases before 2.6 that ``torch>=2.4`` allows: loading a checkpoint could run its code.
    ElChe's own state is tensors, numbers, lists and dicts, so a weights-only load costs nothing.
    """
    weights_only = True if weights_only is None else weights_only
    try:
        return load(checkpoint_path, weights_only)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as exc:
        raise load_error(checkpoint_path, exc, weights_only) from exc


def load_error(path: Any, error: Exception, weights_only: bool) -> RuntimeError:
    """What to tell the user when ``torch.load`` failed: a weights-only refusal is not a corrupted file."""
    message = str(error)
    refused = re.search(r"GLOBAL (\S+) was not an allowed global", message)  # torch's wording
    if weights_only and isinstance(error, pickle.UnpicklingError) and refused:
        name = refused.group(1)
        return RuntimeError(
            f"ElChe loaded the checkpoint {path} weights-only (the default) and refused what it holds besides "
            f"tensors and plain containers: a pickled `{name}`, which only a full unpickle can rebuild, and a full "
            "unpickle can run any code the file carries. If you trust the file, allow that type with "
            f"`torch.serialization.add_safe_globals([{name}])` before `trainer.fit`, or load everything with "
            "`trainer.fit(model, ckpt_path=..., weights_only=False)`."
        )
    if weights_only and isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in message:
        return RuntimeError(
            f"ElChe loaded the checkpoint {path} weights-only (the default) and could not read it "
            f"({first_line(error)}). Either it is corrupted (resume from an earlier checkpoint), or it holds "
            "something only a full unpickle can read: if you trust the file, pass "
            "`trainer.fit(model, ckpt_path=..., weights_only=False)`."
        )
    return RuntimeError(
        f"ElChe cannot read the checkpoint {path} ({first_line(error)}). It is truncated or corrupted, for "
        "instance by a job killed while writing it; resume from an earlier checkpoint."
    )
