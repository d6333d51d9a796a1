"""ElChe's part of a Lightning checkpoint: written at boundaries only, read back for an exact resume.

What is saved is the cohort core's :class:`~lightning_elche.cohort.resume.ResumePoint` (coverage,
counters, controller and guard state, every rank's optimizer states, the outer optimizer's
momentum, every rank's error feedback under ``compression``) under the controller callback's key;
see docs/resume.md.

In an elastic fit a member lost while a checkpoint is taken or written (its gathers, or the
leader dying as it writes) does not end the fit: the survivors regroup, take the checkpoint again
among themselves and the new rank 0 writes it, so the file holds the cohort that trains on.
"""

from __future__ import annotations

import pickle
import re
from typing import Any, Optional

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from typing_extensions import override

from lightning_elche.cohort.pool import Claims
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.comm.compressed import CompressedAverager
from lightning_elche.comm.groups import boundary_group, from_rank0, gather_to_all, gather_to_rank0
from lightning_elche.comm.liveness import CohortFailure, first_line, resume_advice
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.host import StrategyHost


class CheckpointNotWritten(RuntimeError):
    """Rank 0 could not write a checkpoint; every rank raises it, naming the last one that was written."""


class CohortCheckpoints(StrategyHost):
    """Mixed into :class:`~lightning_elche.ElCheStrategy` ahead of DDPStrategy, whose checkpoint I/O it wraps."""

    _dump_outdated = False  # members were lost while the checkpoint being saved was taken

    def checkpoint_state(self) -> dict[str, Any]:
        """ElChe's part of a checkpoint; Lightning's ``dump_checkpoint`` asks every rank at the same point."""
        if self.cohort is None:
            return {}
        outer = None if self.outer_optimizer is None else self.outer_optimizer.state_dict()
        try:
            point = self.cohort.resume_point(self._gather_optimizer_states, outer, self._gather_claims)
            if point is not None and isinstance(self.averager, CompressedAverager):
                point.averager_states = self._gather_averager_states(self.averager)
        except CohortFailure as failure:
            self._regroup_or_raise(failure)  # ``save_checkpoint`` then takes it again among the survivors
            return {}
        return {} if point is None else point.to_state()

    def _regroup_or_raise(self, failure: CohortFailure) -> None:
        if not self.continues_at_boundary(failure):
            raise failure
        self.continue_at_boundary(failure.lost)
        self._dump_outdated = True

    def _gather_optimizer_states(self) -> Optional[list[list[dict[str, Any]]]]:
        """Every rank's optimizer states, on rank 0 (which writes): each rank resumes its own trajectory."""
        states = [move_data_to_device(self.optimizer_state(opt), torch.device("cpu")) for opt in self.optimizers]
        group = boundary_group(self.reduce_on, self._timeout)
        with self.naming_lost_ranks("in the checkpoint's gather of optimizer states"):
            return gather_to_rank0(states, self.global_rank, self.world_size, group)

    def _gather_averager_states(self, averager: CompressedAverager) -> Optional[list[dict[str, Any]]]:
        """Every rank's error feedback (compressed boundaries), on rank 0: what each has not sent yet."""
        group = boundary_group(self.reduce_on, self._timeout)
        with self.naming_lost_ranks("in the checkpoint's gather of error-feedback states"):
            return gather_to_rank0(averager.state_dict(), self.global_rank, self.world_size, group)

    def _gather_claims(self, mine: Claims) -> list[Claims]:
        """Every rank's claims (dynamic dispatch), on every rank: together they say what was trained."""
        group = boundary_group(self.reduce_on, self._timeout)
        with self.naming_lost_ranks("in the checkpoint's gather of claimed samples"):
            return gather_to_all(mine, self.world_size, group)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's ElChe state for the fit that resumes from it (callbacks load before ``setup``)."""
        try:
            self._resume = ResumePoint.from_state(state)
        except ValueError as error:  # every rank reads the same file, so every rank raises here
            path = getattr(self.lightning_module.trainer, "ckpt_path", None) if self.lightning_module else None
            raise ValueError(f"ElChe cannot resume from the checkpoint {path}: {error}") from error

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        own = self._resume.optimizer_states_for(self.global_rank) if self._resume is not None else None
        if own is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": own})

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Weights-only unless the user said otherwise (``trainer.fit(..., weights_only=False)``).

        Lightning passes ``None`` through to ``torch.load``, which unpickles anything on the torch
        releases before 2.6 that ``torch>=2.4`` allows: loading a checkpoint could run its code.
        ElChe's own state is tensors, numbers, lists and dicts, so a weights-only load costs nothing.
        """
        weights_only = True if weights_only is None else weights_only
        try:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            raise
        except Exception as exc:
            raise load_error(checkpoint_path, exc, weights_only) from exc

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Rank 0 writes, then tells every rank whether it could.

        Otherwise a failed write (a full disk, a quota) stops rank 0 alone: the others wait in the
        next collective for a rank that is leaving, then name the file that was never written as
        the checkpoint to resume from. In an elastic fit that lost members while the checkpoint was
        taken or written, the survivors take it again and their rank 0 writes it.
        """
        self._check_collective("a checkpoint save (`trainer.save_checkpoint`?)")
        while True:
            if self._dump_outdated:
                self._dump_outdated = False
                assert self.lightning_module is not None  # members are lost in a fit only
                trainer = self.lightning_module.trainer
                checkpoint = _lightning.dump_checkpoint(trainer, weights_only="optimizer_states" not in checkpoint)
            try:
                self._write_on_rank0(checkpoint, filepath, storage_options)
                return
            except CohortFailure as failure:
                self._regroup_or_raise(failure)

    def _write_on_rank0(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        failure: Optional[Exception] = None
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # writes on rank 0 only
        except Exception as error:  # noqa: BLE001 - every rank raises it below
            failure = error
        consensus = self.cohort  # the cohort whose consensus the checkpoint holds, if it holds ElChe's state
        if consensus is not None and self.callback.state_key not in checkpoint.get("callbacks", {}):
            consensus = None
        if consensus is not None and failure is None and self.global_rank == 0:  # a restart can resume from it
            consensus.last_checkpoint_path = str(filepath)
        outcome = None if failure is None else first_line(failure)
        group = boundary_group(self.reduce_on, self._timeout)
        with self.naming_lost_ranks(f"while rank 0 wrote the checkpoint {filepath}"):
            refusal = from_rank0(outcome, self.global_rank, self.world_size, group)
        if refusal is not None:
            last = self.cohort.last_checkpoint_path if self.cohort is not None else None
            raise CheckpointNotWritten(
                f"ElChe: rank 0 could not write the checkpoint {filepath} ({refusal}), so every rank stops here "
                f"instead of training on without it. {resume_advice(last)}"
            ) from failure
        if consensus is not None:
            consensus.last_checkpoint_path = str(filepath)  # a consensus checkpoint a restart can resume from


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
