"""What a cohort simulation reports: the speed changes it was given and the result it predicts.

Plain data only: :func:`lightning_elche.sim.simulator.simulate_cohort` fills these from the
:class:`~lightning_elche.cohort.core.Cohort` it drives, :mod:`lightning_elche.sim.cli` prints them
and :mod:`lightning_elche.sim.plot` draws them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class SpeedChange:
    """Rank ``rank`` runs at relative speed ``speed`` from cohort step ``at_step`` on.

    The cohort step is the DDP-equivalent step (all ranks' optimizer steps over the world size),
    so ElChe, DDP and the ideal all change speed after the same amount of work. ElChe picks the
    change up at the first window that starts at or after that step.
    """

    rank: int
    at_step: int
    speed: float


@dataclass(frozen=True)
class BoundaryStats:
    """One simulated boundary: the window it closed and what the controller decided there."""

    time_s: float  # simulated clock at the end of this boundary
    epoch: int
    steps: tuple[int, ...]  # optimizer steps each rank ran in the window that closed here
    window_ms: float  # the window's wall time: when the slowest rank arrived
    idle_ms: tuple[float, ...]  # per rank, the wait for the slowest rank
    boundary_ms: float  # the boundary's own cost (pack, all-reduce, unpack)
    anchor: int  # after this boundary
    anchor_rank: Optional[int]
    overhead: float  # the controller's own estimate: boundary / (anchor window + boundary)

    @property
    def shares(self) -> tuple[float, ...]:
        """Fraction of the window's samples each rank trained."""
        total = sum(self.steps)
        return tuple(n / total for n in self.steps)


@dataclass(frozen=True)
class DdpEstimate:
    """DDP on the same ranks and samples: equal batches, every step waits for the slowest rank."""

    seconds: float
    samples_per_s: float
    idle_fraction: tuple[float, ...]  # per rank, time spent waiting for the slowest rank
    overhead_fraction: float  # time spent in the per-step all-reduce


@dataclass(frozen=True)
class SimResult:
    """What a simulated run did, and the throughput it predicts against DDP and the ideal.

    Equality ignores the two real-time measurements (controller cost and wall time), so two runs
    with the same seed compare equal.
    """

    speeds: tuple[float, ...]  # initial relative speeds
    batch_size: int
    seconds: float  # simulated training clock
    steps: tuple[int, ...]  # optimizer steps per rank
    train_ms: tuple[float, ...]
    idle_ms: tuple[float, ...]
    boundary_ms_total: float  # time every rank spent in boundaries, waiting excluded
    boundaries: tuple[BoundaryStats, ...]
    final_anchor: int
    final_counts: tuple[int, ...]  # the next window's steps per rank
    anchor_rank: Optional[int]
    ideal_samples_per_s: float
    ddp: DdpEstimate
    controller_us: tuple[float, ...] = field(compare=False, repr=False)  # real cost of each boundary's decision
    dispatch: str = "planned"
    claim_ms: tuple[float, ...] = ()  # per rank, time spent claiming tickets (dynamic dispatch)
    wall_s: float = field(compare=False, default=0.0)  # real time the simulation took

    @property
    def world_size(self) -> int:
        return len(self.speeds)

    @property
    def samples(self) -> int:
        return sum(self.steps) * self.batch_size

    @property
    def cohort_steps(self) -> int:
        """DDP-equivalent steps: what ``trainer.global_step`` reads under ElChe."""
        return sum(self.steps) // self.world_size

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def speedup_vs_ddp(self) -> float:
        return self.samples_per_s / self.ddp.samples_per_s if self.ddp.samples_per_s > 0 else math.inf

    @property
    def fraction_of_ideal(self) -> float:
        return self.samples_per_s / self.ideal_samples_per_s if self.ideal_samples_per_s > 0 else 0.0

    @property
    def idle_fraction(self) -> tuple[float, ...]:
        """Per rank, the share of the training clock spent waiting for slower ranks."""
        total_ms = self.seconds * 1000.0
        return tuple(ms / total_ms if total_ms > 0 else 0.0 for ms in self.idle_ms)

    @property
    def claim_fraction(self) -> tuple[float, ...]:
        """Per rank, the share of its training time spent claiming tickets (dynamic dispatch)."""
        return tuple(ms / train if train > 0 else 0.0 for ms, train in zip(self.claim_ms, self.train_ms))

    @property
    def overhead_fraction(self) -> float:
        """Share of the training clock spent in boundaries (the same for every rank)."""
        total_ms = self.seconds * 1000.0
        return self.boundary_ms_total / total_ms if total_ms > 0 else 0.0

    @property
    def final_shares(self) -> tuple[float, ...]:
        total = sum(self.final_counts)
        return tuple(c / total for c in self.final_counts)

    @property
    def controller_us_median(self) -> float:
        return statistics.median(self.controller_us) if self.controller_us else 0.0

    @property
    def controller_us_max(self) -> float:
        return max(self.controller_us, default=0.0)

    def as_dict(self, boundaries: bool = True) -> dict[str, Any]:
        """Plain data for ``--json`` and scripts; per-boundary records only when asked."""
        summary: dict[str, Any] = {
            "world_size": self.world_size,
            "speeds": list(self.speeds),
            "batch_size": self.batch_size,
            "seconds": self.seconds,
            "cohort_steps": self.cohort_steps,
            "samples": self.samples,
            "samples_per_s": self.samples_per_s,
            "ideal_samples_per_s": self.ideal_samples_per_s,
            "fraction_of_ideal": self.fraction_of_ideal,
            "ddp": {
                "samples_per_s": self.ddp.samples_per_s,
                "seconds": self.ddp.seconds,
                "idle_fraction": list(self.ddp.idle_fraction),
                "overhead_fraction": self.ddp.overhead_fraction,
            },
            "speedup_vs_ddp": self.speedup_vs_ddp,
            "idle_fraction": list(self.idle_fraction),
            "overhead_fraction": self.overhead_fraction,
            "dispatch": self.dispatch,
            "claim_fraction": list(self.claim_fraction),
            "steps": list(self.steps),
            "final_anchor": self.final_anchor,
            "anchor_rank": self.anchor_rank,
            "final_counts": list(self.final_counts),
            "final_shares": list(self.final_shares),
            "boundary_count": len(self.boundaries),
            "controller_us_per_boundary": {"median": self.controller_us_median, "max": self.controller_us_max},
            "wall_s": self.wall_s,
        }
        if boundaries:
            summary["boundaries"] = [
                {
                    "time_s": b.time_s,
                    "epoch": b.epoch,
                    "steps": list(b.steps),
                    "window_ms": b.window_ms,
                    "idle_ms": list(b.idle_ms),
                    "boundary_ms": b.boundary_ms,
                    "anchor": b.anchor,
                    "anchor_rank": b.anchor_rank,
                    "overhead": b.overhead,
                }
                for b in self.boundaries
            ]
        return summary
