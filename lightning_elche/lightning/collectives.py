"""Lightning's collectives under ElChe: refused where they cannot pair up, and naming lost ranks.

Ranks run different numbers of batches, so a collective issued inside a training batch (a
``self.log(..., sync_dist=True)`` per step, ``self.all_gather``, a barrier) would deadlock; it is
refused with an error that says what to do instead. Every collective that fails because a rank
stopped answering becomes an error naming that rank (the roll call in ``comm/liveness.py``); in an
elastic fit the survivors go on without it where every rank holds the consensus.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Optional, TypeVar

from typing_extensions import override

from lightning_elche.comm import liveness
from lightning_elche.comm.liveness import CohortFailure, FailurePlace
from lightning_elche.comm.membership import naming_silent_members
from lightning_elche.lightning.host import StrategyHost

T = TypeVar("T")


class CohortCollectives(StrategyHost):
    """Mixed into :class:`~lightning_elche.ElCheStrategy` ahead of DDPStrategy, whose collectives it wraps.

    ``_joining`` (ElasticCohort's): a rank joining an elastic fit, before it has the cohort's state, has
    nobody to pair its collectives with."""

    def _check_collective(self, what: str) -> None:
        if self.strict_collectives and self.cohort is not None and self.cohort.in_window:
            raise RuntimeError(
                f"ElCheStrategy: {what} inside a training batch. Under ElChe ranks run different numbers of "
                "batches, so a per-batch collective cannot be matched and would deadlock. Log per epoch instead "
                "(`self.log(..., on_step=False, on_epoch=True, sync_dist=True)`), or per step without "
                "`sync_dist`; move gathers to `on_train_epoch_end` or validation. "
                "`ElCheStrategy(strict_collectives=False)` turns this check off."
            )

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        if self._joining:  # Lightning's set-up checks (a loader's length on every rank): this rank's own answer
            return tensor
        self._check_collective("a reduce (`self.log(..., sync_dist=True)` with on_step=True?)")
        return self._survived("in a reduce of Lightning's", lambda: super(CohortCollectives, self).reduce(
            tensor, group=group, reduce_op=reduce_op))

    @override
    def all_gather(self, tensor: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        self._check_collective("an all_gather (`self.all_gather`?)")
        return self._survived("in an all_gather of Lightning's", lambda: super(CohortCollectives, self).all_gather(
            tensor, group=group, sync_grads=sync_grads))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._joining:  # the members are mid-fit: this rank's set-up (a checkpoint folder, say) is its own
            return obj
        self._check_collective("a broadcast")
        return self._survived("in a broadcast of Lightning's", lambda: super(CohortCollectives, self).broadcast(obj, src))

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._joining:
            return
        self._check_collective("a barrier (`trainer.save_checkpoint`?)")
        self._survived("in a barrier of Lightning's", lambda: super(CohortCollectives, self).barrier(*args, **kwargs))

    def _survived(self, during: str, collective: Callable[[], T]) -> T:
        """Run one of Lightning's collectives; a failure names the lost ranks, and in an elastic fit whose
        members all hold the consensus (validation, a checkpoint, an epoch's end) the survivors go on
        without them and run the collective again among themselves."""
        while True:
            try:
                with self.naming_lost_ranks(during):
                    return collective()
            except CohortFailure as failure:
                if not self.continues_at_boundary(failure):
                    raise
                self.continue_at_boundary(failure.lost)

    def naming_lost_ranks(self, during: Optional[str] = None) -> AbstractContextManager[None]:
        """Turn a collective that failed because ranks stopped answering into an error that names them
        (see :func:`lightning_elche.comm.liveness.naming_lost_ranks`). ``during``: what the cohort is
        doing when not in a boundary, so that a rank lost in a checkpoint is not said to have missed a boundary."""
        timeout_s = self._timeout.total_seconds()
        if self.membership is not None:  # an elastic fit: the heartbeats tell who is lost
            return naming_silent_members(self.membership, timeout_s, lambda: self._failure_place(during))
        return liveness.naming_lost_ranks(
            self.liveness, self.global_rank, self.world_size, timeout_s, lambda: self._failure_place(during)
        )

    def claiming(self) -> AbstractContextManager[None]:
        """Dynamic dispatch's claims between boundaries: a store that stopped answering (its host died)
        becomes an error saying so and naming the last checkpoint, not a bare socket error."""
        place = lambda: self._failure_place(  # noqa: E731
            "under dynamic dispatch", operation="claiming the next step from the rendezvous store"
        )
        return liveness.naming_a_lost_store(self._timeout.total_seconds(), place)

    def _failure_place(self, during: Optional[str] = None, operation: str = "a collective") -> FailurePlace:
        cohort = self.cohort
        if cohort is None:
            return FailurePlace(
                boundary=0, epoch=-1, window=0, cohort_step=0, last_checkpoint=None, during=during, operation=operation
            )
        return FailurePlace(
            boundary=len(cohort.history),
            epoch=cohort.plan.epoch if cohort.plan is not None else -1,
            window=cohort.clock.window,
            cohort_step=cohort.cohort_step,
            last_checkpoint=cohort.last_checkpoint_path,
            during=during,
            operation=operation,
        )
