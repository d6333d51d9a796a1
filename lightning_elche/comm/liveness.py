"""Which rank stopped answering: a roll call and boundary marks in the rendezvous store.

When a rank dies mid-window, the survivors block in the next collective until gloo reports a
closed connection or the process-group timeout expires; neither error names the rank that died.
Each rank writes the last boundary it reached into the store behind the default process group
(one fire-and-forget ``set`` per boundary). When a collective fails, the survivors hold a roll
call in the store: the ranks that never answer stopped, and their marks say where.

The store is the TCPStore that rank 0 hosts under Lightning's launcher (the agent hosts it under
torchrun). If that process died, reading fails and the message says so instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar, Union

import torch.distributed as dist

from lightning_elche.comm.store import StoreUnreachable, default_store, first_line, private_connection

DEFAULT_PREFIX = "elche/liveness"  # PrefixStore adds the "/" before each key
ROLL_CALL_POLL_S = 0.05
ROLL_CALL_GRACE_S = 10.0  # survivors of a lost rank fail within seconds of each other
STORE_ANSWER_S = 2.0  # how long a store that is alive may take to answer a few reads
T = TypeVar("T")


class Liveness:
    """Boundary marks and the roll call of one fit, in the rendezvous store."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, prefix: str = DEFAULT_PREFIX) -> None:
        self.rank = rank
        self.world_size = world_size
        self._store = dist.PrefixStore(prefix, private_connection(store))
        self._blocked: Optional[threading.Thread] = None

    @classmethod
    def from_default_group(cls, rank: int, world_size: int, prefix: str = DEFAULT_PREFIX) -> Optional["Liveness"]:
        """Liveness over the default process group's store, or None without one (nothing to ask)."""
        store = default_store()
        return None if store is None else cls(store, rank, world_size, prefix)

    def reached(self, boundary: int) -> None:
        """Record that this rank reached ``boundary`` (a TCPStore ``set`` is sent without waiting for a reply)."""
        self._raise_if_blocked()
        try:
            self._store.set(f"mark/{self.rank}", str(boundary))
        except RuntimeError as error:  # DistNetworkError: the server closed the connection
            raise StoreUnreachable(first_line(error)) from error

    def last_boundaries(self, timeout_s: float = 2.0) -> dict[int, Optional[int]]:
        """Every rank's last recorded boundary (None if it never recorded one)."""

        def read() -> dict[int, Optional[int]]:
            marks: dict[int, Optional[int]] = {}
            for rank in range(self.world_size):
                key = f"mark/{rank}"
                # check() answers at once; get() of an absent key would wait for the store timeout
                marks[rank] = int(self._store.get(key)) if self._store.check([key]) else None
            return marks

        return self._ask(read, timeout_s)

    def silent(self, grace_s: float) -> list[int]:
        """Roll call after a failed collective: announce this rank, wait up to ``grace_s`` for the others.

        Survivors of a lost rank all fail within a short time of each other (a closed connection,
        or the same process-group timeout); the ranks that never answer are the ones that stopped.
        A rank that left its error in the store (:meth:`failed`) without answering will not answer:
        once only such ranks are missing, nobody waits out the grace.
        """

        def call() -> list[int]:
            self._store.set(f"alive/{self.rank}", "1")
            waiting = [rank for rank in range(self.world_size) if rank != self.rank]
            deadline = time.monotonic() + grace_s
            polled = False
            while waiting and time.monotonic() < deadline:
                try:
                    waiting = [rank for rank in waiting if not self._store.check([f"alive/{rank}"])]
                    if all(self._store.check([f"failed/{rank}"]) for rank in waiting):
                        break
                except RuntimeError:
                    if not polled:
                        raise  # the store was gone before the roll call began
                    break  # its host left after its own roll call: who had not answered stays silent
                polled = True
                if waiting:
                    time.sleep(ROLL_CALL_POLL_S)
            return waiting

        return self._ask(call, grace_s + STORE_ANSWER_S)

    def failed(self, error: BaseException) -> None:
        """Leave this rank's error in the store before it exits, for the survivors' message to quote."""
        try:
            self._raise_if_blocked()
            self._store.set(f"failed/{self.rank}", first_line(error)[:300])
        except RuntimeError:  # StoreUnreachable, DistNetworkError: the store is gone, nothing to tell
            pass

    def failures(self, ranks: Sequence[int], timeout_s: float = 2.0) -> dict[int, str]:
        """The errors that ``ranks`` left in the store before they stopped (see :meth:`failed`)."""

        def read() -> dict[int, str]:
            keys = {rank: f"failed/{rank}" for rank in ranks}
            return {rank: self._store.get(key).decode() for rank, key in keys.items() if self._store.check([key])}

        return self._ask(read, timeout_s)

    def finished(self) -> None:
        """Tell the process hosting the store that this rank has read what it needed."""
        self._store.set(f"done/{self.rank}", "1")

    def wait_finished(self, ranks: Sequence[int], timeout_s: float) -> None:
        """Keep the store's host alive until ``ranks`` have read it (or ``timeout_s`` passes)."""

        def wait() -> None:
            deadline = time.monotonic() + timeout_s
            pending = [rank for rank in ranks if rank != self.rank]
            while pending and time.monotonic() < deadline:
                pending = [rank for rank in pending if not self._store.check([f"done/{rank}"])]
                if pending:
                    time.sleep(ROLL_CALL_POLL_S)

        self._ask(wait, timeout_s + STORE_ANSWER_S)

    def _ask(self, question: Callable[[], T], timeout_s: float) -> T:
        """Run store reads in a daemon thread abandoned after ``timeout_s``.

        A dead server fails at once, but a hung one (stopped process, network partition) never
        answers, and TCPStore's ``check``/``get`` wait for the reply without any timeout.
        """
        self._raise_if_blocked()
        answer: list[T] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                answer.append(question())
            except Exception as error:  # noqa: BLE001 - handed to the caller below
                failure.append(error)

        reader = threading.Thread(target=run, name="elche-liveness", daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive():
            self._blocked = reader
            raise StoreUnreachable(f"no answer within {timeout_s:g} s")
        if failure:
            raise StoreUnreachable(first_line(failure[0])) from failure[0]
        return answer[0]

    def _raise_if_blocked(self) -> None:
        if self._blocked is not None and self._blocked.is_alive():
            raise StoreUnreachable("an earlier read from the store is still waiting for an answer")


def lost_ranks(silent: Sequence[int], last_boundaries: dict[int, Optional[int]]) -> list[int]:
    """The silent ranks that fell behind the furthest boundary reached: those stopped answering.

    A survivor that only learns of the failure through its own process-group timeout may miss
    the roll call although it is alive; it reached the same boundary as the others, so it is not
    blamed when some silent rank is behind. When none is behind, every silent rank is.
    """
    reached = [boundary for boundary in last_boundaries.values() if boundary is not None]
    if not reached:
        return list(silent)
    furthest = max(reached)
    behind = [rank for rank in silent if (last := last_boundaries.get(rank)) is None or last < furthest]
    return behind or list(silent)


class CohortFailure(RuntimeError):
    """A collective failed because a rank stopped answering; the message names it, ``lost`` lists
    the ranks the roll call found gone (empty when the store could not tell)."""

    def __init__(self, message: str, lost: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.lost = list(lost)


@dataclass(frozen=True)
class FailurePlace:
    """Where the cohort was when a collective failed, for the message that names the lost ranks."""

    boundary: int  # boundaries completed in this fit
    epoch: int  # -1 before the first epoch's plan
    window: int
    cohort_step: int
    last_checkpoint: Optional[str]  # the last consensus checkpoint a restart would resume from
    during: Optional[str] = None  # what the cohort did after the last boundary (a checkpoint...); None: a boundary
    operation: str = "a collective"  # what failed (a collective, or a claim in the store under dynamic dispatch)


@contextmanager
def naming_lost_ranks(
    liveness: Optional[Liveness], rank: int, world_size: int, timeout_s: float, where: Callable[[], FailurePlace]
) -> Iterator[None]:
    """Turn a collective that failed because ranks stopped answering into a :class:`CohortFailure` naming them.

    The survivors hold a roll call in the rendezvous store; if every rank answers, nobody was
    lost and the original error is raised unchanged. ``where`` is asked only after a failure.
    """
    try:
        yield
    except RuntimeError as error:  # gloo and NCCL errors, timeouts (torch's DistError is one)
        if liveness is None or isinstance(error, CohortFailure):
            raise
        grace = min(ROLL_CALL_GRACE_S, timeout_s)
        reported: dict[int, str] = {}
        last: dict[int, Optional[int]]
        lost: Union[list[int], StoreUnreachable]
        try:
            silent = liveness.silent(grace)
        except StoreUnreachable as unreachable:
            silent, last, lost = [], {}, unreachable
        else:
            if not silent:
                raise
            try:
                last = liveness.last_boundaries()
                lost = lost_ranks(silent, last)
                with suppress(StoreUnreachable):  # only a detail: the ranks are named without it
                    reported = liveness.failures(lost)
                liveness.finished()
                if rank == 0:  # under srun and Lightning's launcher rank 0 hosts the store:
                    # keep it up for every survivor, also one that only learns of the failure
                    # through its own process-group timeout
                    survivors = [r for r in range(world_size) if r not in lost]
                    liveness.wait_finished(survivors, timeout_s + grace)
            except StoreUnreachable:
                last, lost = {}, list(silent)
        place = where()
        raise CohortFailure(
            describe_failure(lost, last, place, timeout_s, error, reported=reported),
            lost=[] if isinstance(lost, StoreUnreachable) else lost,
        ) from error


@contextmanager
def naming_a_lost_store(timeout_s: float, where: Callable[[], FailurePlace]) -> Iterator[None]:
    """Turn a store operation that found the store gone (:class:`StoreUnreachable`) into a
    :class:`CohortFailure` that says so; other errors pass unchanged (no roll call: nobody is asked)."""
    try:
        yield
    except StoreUnreachable as lost:
        place = where()
        raise CohortFailure(
            describe_failure(lost, {}, place, timeout_s, lost)
        ) from lost


def describe_failure(
    silent: Union[Sequence[int], StoreUnreachable, None],
    last_boundaries: dict[int, Optional[int]],
    place: FailurePlace,
    timeout_s: float,
    error: BaseException,
    reported: Optional[dict[int, str]] = None,
) -> str:
    """The error the survivors raise when a collective fails because ranks stopped answering.

    ``silent`` is what ``Liveness.silent`` returned, the StoreUnreachable it raised, or None
    when there was no store to ask. ``place.during`` says what the cohort was doing if not a boundary
    (a checkpoint after boundary ``place.boundary - 1``, say); ``reported`` the errors lost ranks left.
    """
    boundary, during, operation = place.boundary, place.during, place.operation
    numbers = f"(epoch {place.epoch}, window {place.window}, step {place.cohort_step})"
    if during is None:
        where = f"at boundary {boundary} {numbers}"
    else:
        after = f"after boundary {boundary - 1}" if boundary > 0 else "before the first boundary"
        where = f"{during}, {after} {numbers}"
    reported = reported or {}
    if isinstance(silent, StoreUnreachable):
        head = (
            f"ElChe: {operation} failed {where} and the rendezvous store did not answer either ({silent}): "
            "the process hosting it (rank 0 under Lightning's launcher, the torchrun agent or the launcher "
            "otherwise) has died, or this machine is cut off from it by a network partition (an elastic cohort's ranks "
            "that still reach it then train on without this one)."
        )
    elif silent is None:
        head = (
            f"ElChe: {operation} failed {where}; which rank stopped answering is unknown (the process group "
            "has no rendezvous store to ask)."
        )
    else:
        ranks = ", ".join(str(rank) for rank in silent)
        lasts = "; ".join(
            f"rank {rank}: {_last(last_boundaries[rank]) if rank in last_boundaries else UNKNOWN_LAST}"
            + (f"; it raised {reported[rank]}" if rank in reported else "")
            for rank in silent
        )
        plural = "ranks" if len(silent) > 1 else "rank"
        head = f"ElChe: {plural} {ranks} stopped answering {where} ({lasts})."
    resume = resume_advice(place.last_checkpoint)
    return f"{head} {resume} Process-group timeout: {timeout_s:g} s. Underlying error: {first_line(error)}"


def resume_advice(last_checkpoint: Optional[str]) -> str:
    """Where a restart resumes from, for every error that stops the cohort."""
    if last_checkpoint is not None:
        return (
            f"Last consensus checkpoint: {last_checkpoint} - restart the job to resume from it "
            "(torchrun --max-restarts, SLURM requeue, or Trainer.fit(ckpt_path=...))."
        )
    return (
        "No checkpoint was written yet, so a restart begins from scratch; add "
        "ModelCheckpoint(every_n_train_steps=...) or OnExceptionCheckpoint to resume next time."
    )


def _last(last: Optional[int]) -> str:
    return "it never reached a boundary" if last is None else f"the last boundary it reached was {last}"


UNKNOWN_LAST = "its last boundary is unknown (the store went away)"
