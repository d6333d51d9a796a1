"""Lightning's collectives under ElChe: refused where they cannot pair up, and naming lost ranks.

Ranks run different numbers of batches, so a collective issued inside a training batch (a
``self.log(..., sync_dist=True)`` per step, ``self.all_gather``, a barrier) would deadlock; it is
refused with an error that says what to do instead. Every collective that fails because a rank
stopped answering becomes an error naming that rank (the membership mode's roll call); in an
elastic fit the survivors go on without it where every rank holds the consensus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, TypeVar

from lightning_elche.comm.liveness import CohortFailure
from lightning_elche.lightning import _lightning

if TYPE_CHECKING:
    from lightning_elche.lightning.session import FitSession
    from lightning_elche.lightning.world import World

T = TypeVar("T")


class CollectivesHost(Protocol):
    """What the guard reads of the strategy: the fit in progress (its session, none in its set-up), the membership
    mode, and whether a fit is under way at all."""

    @property
    def session(self) -> Optional[FitSession]: ...

    @property
    def world(self) -> World: ...

    @property
    def fitting(self) -> bool: ...


class GuardedCollectives:
    """The strategy's ``reduce``, ``all_gather``, ``broadcast`` and ``barrier``, each through :meth:`run`."""

    def __init__(self, host: CollectivesHost, strict: bool) -> None:
        self.host = host
        self.strict = strict

    def check(self, what: str) -> None:
        """Refuse ``what`` inside a training batch, where ranks cannot pair it up; note one between validation
        steps, which keeps validation's batch counts equal on every rank (``lightning/validation.py``)."""
        session = self.host.session
        if session is not None and _lightning.in_validation_step(session.trainer):
            session.validation.per_step_collectives = True
        if self.strict and session is not None and session.cohort.in_window:
            raise RuntimeError(
                f"ElCheStrategy: {what} inside a training batch. Under ElChe ranks run different numbers of "
                "batches, so a per-batch collective cannot be matched and would deadlock. Log per epoch instead "
                "(`self.log(..., on_step=False, on_epoch=True, sync_dist=True)`), or per step without "
                "`sync_dist`; move gathers to `on_train_epoch_end` or validation. "
                "`ElCheStrategy(faults=Faults(strict_collectives=False))` turns this check off."
            )

    def run(self, what: str, collective: Callable[[], T], alone: Optional[Callable[[], T]] = None) -> T:
        """One of Lightning's collectives (``what``, for the messages). A joiner, before it has the cohort's
        state, has nobody to pair with: ``alone()`` answers for it (its set-up checks get its own answer).
        Lost ranks as :func:`regrouping` says."""
        world = self.host.world
        if alone is not None and world.joining:
            return alone()
        self.check(what)
        during = f"in {what.split(' (')[0]} of Lightning's"
        if not self.host.fitting:  # `trainer.validate` after a fit, say: no train loop to resume, a loss is raised
            with world.naming_lost_ranks(None, during):
                return collective()
        return regrouping(world, self.host.session, during, collective)


def regrouping(world: World, session: Optional[FitSession], during: str, collective: Callable[[], T]) -> T:
    """``collective`` (``during`` says which, for the messages), with a failure naming the lost ranks. In an
    elastic fit whose members all hold the consensus (validation, a checkpoint, an epoch's end, the set-up
    before the first window) the survivors go on without them and run it again among themselves, all of
    them: a rank whose part completed learns of the loss in the vote that follows (``World.confirm_done``)."""
    while True:
        try:
            with world.naming_lost_ranks(session, during):
                result = collective()
            world.confirm_done(session, during)
            return result
        except CohortFailure as failure:
            if not world.continues_at_boundary(session, failure):
                raise
            world.continue_at_boundary(session, failure.lost)
