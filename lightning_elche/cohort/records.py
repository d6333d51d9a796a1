"""What a boundary decided: the record every rank keeps, and the outcome the adapter applies.

Both are computed from the exchanged control data, identical on every rank, so rank 0 can publish
a record without any collective and every rank applies the same outcome.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from lightning_elche.cohort.control import CohortControl

if TYPE_CHECKING:
    from lightning_elche.cohort.controller import Controller

SCALAR_REDUCTIONS = ("sum", "mean", "max", "min")


@dataclass
class BoundaryRecord:
    """What one boundary decided, kept for tests, logging and the end-of-fit summary."""

    epoch: int
    window: int
    steps: list[int]
    samples: list[int]
    window_ms: list[float]
    boundary_ms: float  # what this boundary cost this rank, waiting for the others included
    anchor: int
    counts: list[int]
    cohort_step: int
    divergence: float  # this rank's ||theta_before - theta_after|| / ||theta_after|| at this boundary
    cohort_divergence: float  # the largest rank's divergence at the previous boundary (same on every rank)
    cohort_divergence_mean: float
    verdict: str  # the convergence guard's: "stable", "suppress" (anchor held) or "nudge" (anchor cut)
    previous_boundary_ms: list[float] = field(default_factory=list)  # every rank's, at the boundary before
    user_scalars: dict[str, float] = field(default_factory=dict)  # ElCheStrategy(scalar_reductions=...) rolled up
    level: str = "global"  # "node": averaged inside each node only (ElCheStrategy(node_sync_every=m));
    # "membership:<n>": the survivors of a lost rank averaged their window, generation n begins (elastic)


@dataclass(frozen=True)
class Outcome:
    """What the adapter applies to the trainer after a boundary, on every rank alike."""

    cohort_step: int  # the DDP-equivalent step: ``trainer.global_step``
    cohort_step_before: int  # the cohort step at the boundary before (step checkpoints open on a crossing)
    logger_step: int  # the loggers' step to set now (Lightning adds the current batch if it stepped)
    requeue_signal: Optional[int]  # SLURM asked for a requeue: run its handler now on every rank
    sigterm: bool  # some rank got SIGTERM: checkpoint here and stop every rank
    max_steps_reached: bool  # hand ``max_steps`` back to Lightning, which ends the fit after this batch
    data_left: bool  # the epoch has samples beyond this boundary (a batch that ends on max_steps is not its last)
    should_stop: bool  # a stop request (EarlyStopping, max_time) takes effect on every rank now
    guard_reason: str  # why the guard held or cut the anchor ("" when stable)
    validate: bool = False  # a step or time validation is due: every rank validates after this batch
    time_checkpoints: int = 0  # the "clock_due" bits of the time checkpoints to save after this batch

    @property
    def stops(self) -> bool:
        """Whether the fit ends at this boundary, on every rank."""
        return self.sigterm or self.should_stop or self.max_steps_reached or self.requeue_signal is not None


def boundary_record(
    epoch: int, window: int, control: CohortControl, controller: Controller, cohort_step: int, divergence: float,
    verdict: str, user_scalars: dict[str, float], level: str,
) -> BoundaryRecord:
    """The record of the boundary that closed ``window``, from its exchanged control data and the plan the
    ``controller`` made for the next window (``boundary_ms`` is filled in once the boundary is over)."""
    previous_divergence = control.per_rank["divergence"]
    return BoundaryRecord(
        epoch=epoch,
        window=window,
        steps=control.ints("steps"),
        samples=control.ints("samples"),
        window_ms=list(control.per_rank["window_ms"]),
        boundary_ms=0.0,
        anchor=controller.anchor,
        counts=list(controller.counts),
        cohort_step=cohort_step,
        divergence=divergence,
        cohort_divergence=max(previous_divergence),
        cohort_divergence_mean=sum(previous_divergence) / len(previous_divergence),
        verdict=verdict,
        previous_boundary_ms=list(control.per_rank["boundary_ms"]),
        user_scalars=user_scalars,
        level=level,
    )


def user_field(name: str) -> str:
    """The control-data slot of a user metric rolled up across ranks."""
    return f"user:{name}"


def roll_up(per_rank: Mapping[str, Sequence[float]], reductions: Mapping[str, str]) -> dict[str, float]:
    """Each user metric reduced over the ranks that have logged it (a rank that has not sends NaN)."""
    rolled = {}
    for name, how in reductions.items():
        values = [v for v in per_rank[user_field(name)] if math.isfinite(v)]
        if not values:
            continue
        if how == "sum":
            rolled[name] = math.fsum(values)
        elif how == "mean":
            rolled[name] = math.fsum(values) / len(values)
        else:
            rolled[name] = max(values) if how == "max" else min(values)
    return rolled
