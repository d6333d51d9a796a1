"""The cohort's membership, one mode chosen once: fixed (:class:`FixedWorld`) or elastic.

With ``elastic=False`` the ranks are the launcher's for the whole fit, and a rank that stops
answering ends the fit on every rank with an error that names it (``comm/liveness.py``'s roll call),
after which ``torchrun --max-restarts`` or a requeue resumes from the last checkpoint. With
``elastic=True`` (:class:`~lightning_elche.lightning.elastic.ElasticWorld`) the survivors go on
without it and joiners come in at boundaries. The strategy, the callback and the checkpoints ask the
mode what to do and never which mode it is.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch
from lightning.fabric.plugins import ClusterEnvironment

from lightning_elche.cohort.control import CohortControl, LocalReport
from lightning_elche.comm import liveness
from lightning_elche.comm.interface import BoundaryResult, NeedsConsensus
from lightning_elche.comm.liveness import CohortFailure, FailurePlace
from lightning_elche.lightning.validation import split_by_speed

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_elche.cohort.resume import ResumePoint
    from lightning_elche.lightning.session import FitSession


@dataclass(frozen=True)
class GroupHost:
    """What a membership mode needs of the strategy to set up and re-form the process group."""

    setup_launched_group: Callable[[], None]  # DDP's group over the launcher's ranks (torchrun's restarts too)
    backend: Callable[[], str]  # the process group's backend for this strategy and device
    device_id: Optional[torch.device]  # the device the group binds (None on CPU)
    place_rank: Callable[[int, int], None]  # tell Lightning this rank's place (rank, world size) in a generation
    move_to_slot: Callable[[int], None]  # take over local rank ``slot``'s device (a spare in a lost member's place)


class ResumeHolder(Protocol):
    """Where the checkpoint state a fit resumes from is kept (the strategy's checkpoints)."""

    resume: Optional[ResumePoint]


class OutdatedDumps(Protocol):
    """The checkpoints' note that members were lost while a checkpoint was taken (the survivors regrouped)."""

    def take_outdated(self) -> bool: ...


class World(Protocol):
    """How the cohort's membership behaves; every method is called on every rank at the same point."""

    @property
    def joining(self) -> bool: ...  # a joiner before it has the cohort's state: its collectives pair with nobody

    @property
    def generation(self) -> Optional[int]: ...  # the current generation's number (None: a fixed world)

    @property
    def control_fields(self) -> list[str]: ...  # what the mode adds to every boundary's control data

    def members(self, world_size: int) -> Sequence[int]:
        """The cohort's member ids in rank order (a fixed world's are its ranks)."""

    def nodes(self, world_size: int) -> Optional[list[int]]:
        """Each rank's node for hierarchical averaging (None: ``ranks_per_node`` consecutive ranks)."""

    def needs_consensus(self, control: CohortControl) -> bool:
        """Whether this boundary must leave every rank with the same parameters for the mode's own sake
        (an elastic cohort admitting joiners hands them the consensus)."""

    def cluster_environment(self, given: Optional[ClusterEnvironment]) -> Optional[ClusterEnvironment]: ...

    def setup_distributed(self, host: GroupHost) -> None: ...

    def sampler_kwargs(self, launched: dict[str, int], rank: int, world_size: int) -> dict[str, int]: ...

    def validation_loader(self, dataloader: object, session: FitSession, whole_set: bool) -> object:
        """A validation loader of the fit, as Lightning made it (``whole_set``: it validates the whole set)."""

    def before_fit(self, trainer: "pl.Trainer", checkpoints: ResumeHolder) -> None:
        """In the strategy's setup, before the cohort starts (a joiner receives the cohort's state here)."""

    def before_exchange(self, session: FitSession, report: LocalReport) -> None:
        """This rank is about to contribute ``report`` to a boundary."""

    def exchange(self, session: FitSession, report: LocalReport, needs_consensus: NeedsConsensus) -> BoundaryResult:
        """This rank's part of a boundary's exchange, as the membership mode commits it: a failure raises a
        CohortFailure naming the lost ranks (an elastic cohort's survivors have then undone the boundary)."""

    def naming_lost_ranks(self, session: Optional[FitSession], during: Optional[str]) -> AbstractContextManager[None]:
        """A collective that fails because ranks stopped answering becomes a CohortFailure naming them
        (``session``: the fit in progress, None outside one; ``during``: what the cohort is doing when not
        in a boundary, so that a rank lost in a checkpoint is not said to have missed a boundary)."""

    def continues_without(self, failure: CohortFailure, world_size: int) -> bool: ...

    def continue_without(self, session: FitSession, lost: Sequence[int], report: LocalReport, checkpoints: OutdatedDumps) -> None:
        """Members were lost in a boundary: the survivors average their window and go on, and spares waiting
        for the lost members' places come in (elastic only)."""

    def confirm_done(self, session: Optional[FitSession], during: str) -> None:
        """Every member did the work just done between boundaries (a checkpoint's save, one of Lightning's
        collectives; ``during`` names it), or a CohortFailure names the ranks lost in it."""

    def continues_at_boundary(self, session: Optional[FitSession], failure: CohortFailure) -> bool: ...

    def continue_at_boundary(self, session: Optional[FitSession], lost: Sequence[int]) -> None:
        """Members were lost while every member held the consensus (or in Lightning's set-up, before the fit's
        session, ``None``, exists): the survivors go on from it."""

    def after_boundary(self, session: FitSession, control: CohortControl, checkpoints: OutdatedDumps) -> None:
        """A boundary that did not end the fit is over (joiners that asked come in here)."""

    def training_starts(self, trainer: "pl.Trainer") -> bool:
        """A batch begins; True on a joiner's first (its clock starts then)."""

    def fit_ends(self, rank: int) -> None: ...


def place_of(session: Optional[FitSession], during: Optional[str], operation: str = "a collective") -> FailurePlace:
    """Where the cohort stands, for a failure message (outside a fit: before its first boundary)."""
    if session is None:
        return FailurePlace(boundary=0, epoch=-1, window=0, cohort_step=0, last_checkpoint=None, during=during,
                            operation=operation)  # fmt: skip
    return session.failure_place(during, operation)


class FixedWorld:
    """The launcher's ranks for the whole fit: a lost rank stops the fit, naming it."""

    joining = False
    generation = None
    control_fields: list[str] = []

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def cluster_environment(self, given: Optional[ClusterEnvironment]) -> Optional[ClusterEnvironment]:
        return given

    def members(self, world_size: int) -> Sequence[int]:
        return range(world_size)

    def nodes(self, world_size: int) -> Optional[list[int]]:
        return None

    def needs_consensus(self, control: CohortControl) -> bool:
        return False

    def setup_distributed(self, host: GroupHost) -> None:
        host.setup_launched_group()

    def sampler_kwargs(self, launched: dict[str, int], rank: int, world_size: int) -> dict[str, int]:
        return launched

    def validation_loader(self, dataloader: object, session: FitSession, whole_set: bool) -> object:
        """Split by speed (``lightning/validation.py``): the cohort's ranks are the launch's for the whole fit."""
        cohort = session.cohort
        return split_by_speed(
            dataloader, cohort.rank, cohort.world_size, lambda: cohort.controller.ms_per_step, session.validation, whole_set
        )

    def before_fit(self, trainer: "pl.Trainer", checkpoints: ResumeHolder) -> None:
        """Nothing to receive or share: every rank starts the fit together."""

    def before_exchange(self, session: FitSession, report: LocalReport) -> None:
        """Nobody asks to join a fixed world, and nobody needs another's claims."""

    def exchange(self, session: FitSession, report: LocalReport, needs_consensus: NeedsConsensus) -> BoundaryResult:
        """The exchange as it is: a rank lost in it stops the fit (no survivor goes on), so nothing is undone."""
        with self.naming_lost_ranks(session, None):
            return session.averager.exchange(report, needs_consensus=needs_consensus)

    def naming_lost_ranks(self, session: Optional[FitSession], during: Optional[str]) -> AbstractContextManager[None]:
        """The roll call of ``comm/liveness.py`` (outside a fit nobody keeps marks: errors pass unchanged)."""
        if session is None:
            return nullcontext()
        ranks = session.ranks
        return liveness.naming_lost_ranks(
            session.liveness, ranks.global_rank, ranks.world_size, self.timeout_s, lambda: place_of(session, during)
        )

    def continues_without(self, failure: CohortFailure, world_size: int) -> bool:
        return False

    def continue_without(self, session: FitSession, lost: Sequence[int], report: LocalReport, checkpoints: OutdatedDumps) -> None:
        raise AssertionError("a fixed world never continues without a rank")  # continues_without said no

    def confirm_done(self, session: Optional[FitSession], during: str) -> None:
        """A rank lost in it raised already: the fit stops, nobody does it again."""

    def continues_at_boundary(self, session: Optional[FitSession], failure: CohortFailure) -> bool:
        return False

    def continue_at_boundary(self, session: Optional[FitSession], lost: Sequence[int]) -> None:
        raise AssertionError("a fixed world never continues without a rank")  # continues_at_boundary said no

    def after_boundary(self, session: FitSession, control: CohortControl, checkpoints: OutdatedDumps) -> None:
        """Nobody joins a fixed world."""

    def training_starts(self, trainer: "pl.Trainer") -> bool:
        return False

    def fit_ends(self, rank: int) -> None:
        """Nobody waits for a place."""
