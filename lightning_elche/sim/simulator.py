"""Cohort simulator: the real ElChe controller driven by simulated ranks instead of GPUs.

The question it answers is "what would ElChe buy me on these GPUs?" before anyone rents them:
given relative per-rank speeds, a step time, per-step noise and the cost of a boundary, it
predicts ElChe's cohort throughput, each rank's idle time and the averaging overhead, next to
the DDP estimate from the same timings and the ideal (the sum of the solo rates).

Only time is simulated. The decisions come from the production code, unchanged: the
:class:`~lightning_elche.cohort.controller.Controller` behind an
:class:`~lightning_elche.cohort.governor.AnchorGovernor` (with :class:`~lightning_elche.cohort.guards.NoGuard`:
there is no model here, hence no divergence to guard), fed one
:class:`~lightning_elche.cohort.controller.WindowReport` per boundary exactly as
``ElCheCallback._boundary`` feeds it: per rank the training time of the window that just closed,
the optimizer steps it ran, and the duration of its *previous* boundary (waiting included).
So the fit's first window is warm-up, windows are one-step probes until every rank has a speed
reading, and the anchor grows from the overhead rule, because that is what the controller does.

The data plan is mirrored too (``EpochPlan`` and ``ElCheStrategy.next_window_steps``, in whole
optimizer steps): windows are frozen ``lookahead_batches`` ahead of training, so a decision taken
at a boundary reaches the ranks one window later; no window spans two epochs; the last window of
an epoch splits what remains; and a ``steps`` budget cuts the final windows so that the cohort
lands on it, like ``Trainer(max_steps=...)``.

Timing model, per window: rank r runs its ``n_r`` steps in ``n_r * step_ms / speed_r`` times a
mean-one lognormal noise factor; the boundary starts when the slowest rank arrives (the others
idle until then) and costs ``boundary_ms + boundary_ms_per_rank * world_size`` for everybody.
DDP runs the same samples in equal per-rank batches: every step lasts as long as the slowest
rank's noisy step plus one gradient all-reduce. Nothing here touches torch, clocks (except to
measure the controller itself) or global randomness: a seed fixes the result.
"""

from __future__ import annotations

import importlib.util
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from lightning_elche.cohort.controller import Controller, ControllerConfig, WindowReport, split_by_weights
from lightning_elche.cohort.governor import AnchorGovernor
from lightning_elche.cohort.guards import NoGuard

SIMULATED_POLICIES = ("sync", "cadence")  # "async" overlaps the all-reduce, which this model does not


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


class _SpeedSchedule:
    """Every rank's relative speed as a function of the cohort step."""

    def __init__(self, speeds: Sequence[float], changes: Sequence[SpeedChange]) -> None:
        self.initial = tuple(float(s) for s in speeds)
        self.changes = sorted(changes, key=lambda c: c.at_step)  # stable: same step, later entry wins

    def at(self, cohort_step: float) -> list[float]:
        speeds = list(self.initial)
        for change in self.changes:
            if change.at_step > cohort_step:
                break
            speeds[change.rank] = change.speed
        return speeds

    def segments(self, cohort_steps: float) -> list[tuple[float, list[float]]]:
        """(length in cohort steps, speeds) pieces covering ``[0, cohort_steps)``."""
        cuts = sorted({0.0, *(float(c.at_step) for c in self.changes if c.at_step < cohort_steps)})
        ends = cuts[1:] + [cohort_steps]
        return [(end - start, self.at(start)) for start, end in zip(cuts, ends) if end > start]


class _WindowPlan:
    """``EpochPlan`` in whole optimizer steps: windows frozen ahead, the last one splitting what remains."""

    def __init__(self, world_size: int, total_steps: Optional[int]) -> None:
        self.world_size = world_size
        self.remaining = total_steps  # None: an endless epoch (no epoch structure simulated)
        self.windows: list[list[int]] = []
        self.complete = False

    def freeze(self, counts: list[int]) -> None:
        if self.remaining is not None:
            if self.remaining - sum(counts) < self.world_size:
                counts = split_by_weights(self.remaining, counts, minimum=1)
                self.complete = True
            self.remaining -= sum(counts)
        self.windows.append(counts)

    def steps_from(self, window: int) -> int:
        return sum(sum(counts) for counts in self.windows[window:])

    def frozen_after(self, window: int) -> int:
        """The fewest steps any rank has frozen beyond ``window`` (what its DataLoader may prefetch)."""
        ahead = self.windows[window + 1 :]
        return min(map(sum, zip(*ahead))) if ahead else 0

    def freeze_ahead(self, next_window: int, lookahead: int, plan_steps: Callable[[], list[int]]) -> None:
        while not self.complete and (len(self.windows) <= next_window or self.frozen_after(next_window) < lookahead):
            self.freeze(plan_steps())


def _noise_factor(rng: random.Random, sigma: float) -> float:
    """A mean-one lognormal factor; exactly 1 without noise (and no draw, so runs stay comparable)."""
    if sigma <= 0.0:
        return 1.0
    return math.exp(rng.gauss(0.0, sigma) - 0.5 * sigma * sigma)


def simulate_cohort(
    speeds: Sequence[float],
    *,
    step_ms: float = 100.0,
    noise: float = 0.0,
    boundary_ms: float = 10.0,
    boundary_ms_per_rank: float = 0.0,
    allreduce_ms: Optional[float] = None,
    batch_size: int = 1,
    steps: Optional[int] = None,
    seconds: Optional[float] = None,
    epochs: Optional[int] = None,
    epoch_samples: Optional[int] = None,
    speed_changes: Sequence[SpeedChange] = (),
    config: Optional[ControllerConfig] = None,
    lookahead_batches: int = 1,
    seed: int = 0,
    ddp_sample_steps: int = 128,
) -> SimResult:
    """Run ElChe's controller against simulated ranks and predict throughput, idle and overhead.

    Args:
        speeds: relative speed per rank; rank r's step takes ``step_ms / speeds[r]``.
        step_ms: milliseconds per optimizer step at speed 1.0 (data, forward, backward, step).
        noise: sigma of a mean-one lognormal factor on every step; a window of n steps gets the
            aggregate factor (sigma / sqrt(n)), so long windows average the noise out as real ones do.
        boundary_ms: fixed cost of one boundary (pack, all-reduce of the parameters, unpack).
        boundary_ms_per_rank: added to the boundary cost once per rank, for collectives whose
            latency grows with the world size.
        allreduce_ms: DDP's gradient all-reduce per step; defaults to the boundary cost (the same
            bytes on the wire, no overlap with backward assumed).
        batch_size: samples per optimizer step per rank, to report samples per second.
        steps: stop at this cohort step (DDP-equivalent), like ``Trainer(max_steps=...)``.
        seconds: stop at the first boundary at or past this simulated training time.
        epochs: stop after this many epochs of ``epoch_samples`` samples.
        epoch_samples: samples per epoch; windows then never span two epochs and the last window
            of each epoch splits what remains. Without it the run is one endless epoch.
        speed_changes: speed changes during the run (a GPU that throttles, a node that joins a busy host).
        config: the controller's settings (anchor, overhead target, policy, ...); its
            ``world_size`` must be ``len(speeds)``. Defaults to ElChe's defaults.
        lookahead_batches: how far ahead windows are frozen (the DataLoader's prefetch depth:
            1 without workers, as in ``lightning_elche.cohort.plan.prefetch_depth``).
        seed: seeds the noise; the same seed gives the same result.
        ddp_sample_steps: noisy DDP steps drawn per speed segment to estimate how long the
            slowest of the ranks takes per step.
    """
    started = time.perf_counter()
    world = len(speeds)
    _check_arguments(speeds, step_ms, noise, boundary_ms, boundary_ms_per_rank, allreduce_ms, batch_size,
                     steps, seconds, epochs, epoch_samples, speed_changes, lookahead_batches, ddp_sample_steps)
    config = ControllerConfig(world_size=world) if config is None else config
    if config.world_size != world:
        raise ValueError(f"config.world_size is {config.world_size} but {world} speeds were given")
    if config.policy not in SIMULATED_POLICIES:
        raise ValueError(
            f"the simulator models blocking boundaries (policies {SIMULATED_POLICIES}), got {config.policy!r}"
        )
    epoch_steps = None if epoch_samples is None else epoch_samples // batch_size
    if epoch_steps is not None and epoch_steps < world:
        raise ValueError(f"an epoch of {epoch_steps} steps cannot give each of {world} ranks a step")

    controller = Controller(config)
    governor = AnchorGovernor(NoGuard())
    schedule = _SpeedSchedule(speeds, speed_changes)
    rng = random.Random(seed)
    cost = boundary_ms + boundary_ms_per_rank * world
    stop_ms = math.inf if seconds is None else seconds * 1000.0

    now_ms = 0.0
    cohort_total = 0  # optimizer steps of all ranks
    last_boundary = [0.0] * world  # the callback starts a fit with 0: no previous boundary
    train_ms = [0.0] * world
    idle_ms = [0.0] * world
    rank_steps = [0] * world
    records: list[BoundaryStats] = []
    controller_us: list[float] = []
    epoch = 0
    running = True

    def next_window_steps(plan: _WindowPlan, windows_closed: int) -> list[int]:
        """``ElCheStrategy.next_window_steps``: the controller's counts, cut to land on ``steps``."""
        counts = list(controller.counts)
        if steps is None:
            return counts
        allowed = steps * world - cohort_total - plan.steps_from(windows_closed)
        if sum(counts) <= allowed:
            return counts
        return split_by_weights(max(allowed, world), counts, minimum=1)

    while running:
        plan = _WindowPlan(world, epoch_steps)
        controller.set_max_total_steps(epoch_steps)
        window = 0
        plan.freeze_ahead(0, lookahead_batches, lambda: next_window_steps(plan, 0))
        while window < len(plan.windows):
            counts = plan.windows[window]
            speeds_now = schedule.at(cohort_total / world)
            window_ms = [
                n * step_ms / s * _noise_factor(rng, noise / math.sqrt(n)) for n, s in zip(counts, speeds_now)
            ]
            slowest = max(window_ms)
            waits = [slowest - ms for ms in window_ms]
            report = WindowReport(window_ms=window_ms, steps=list(counts), boundary_ms=last_boundary)
            tick = time.perf_counter_ns()
            governor.boundary(controller, report, previous_divergence=0.0, lr=None)
            controller_us.append((time.perf_counter_ns() - tick) / 1000.0)

            cohort_total += sum(counts)
            now_ms += slowest + cost
            last_boundary = [wait + cost for wait in waits]
            for rank in range(world):
                train_ms[rank] += window_ms[rank]
                idle_ms[rank] += waits[rank]
                rank_steps[rank] += counts[rank]
            records.append(
                BoundaryStats(
                    time_s=now_ms / 1000.0, epoch=epoch, steps=tuple(counts), window_ms=slowest,
                    idle_ms=tuple(waits), boundary_ms=cost, anchor=controller.anchor,
                    anchor_rank=controller.anchor_rank, overhead=controller.overhead,
                )
            )
            window += 1
            if now_ms >= stop_ms or (steps is not None and cohort_total // world >= steps):
                running = False
                break
            plan.freeze_ahead(window, lookahead_batches, lambda: next_window_steps(plan, window))
        epoch += 1
        if epochs is not None and epoch >= epochs:
            running = False

    cohort_steps = cohort_total / world
    segments = schedule.segments(cohort_steps)
    ideal_ms = sum(length * world / sum(s / step_ms for s in speeds_then) for length, speeds_then in segments)
    samples = cohort_total * batch_size
    ddp = _estimate_ddp(
        world, segments, step_ms, noise, cost if allreduce_ms is None else allreduce_ms, samples, rng,
        ddp_sample_steps,
    )
    return SimResult(
        speeds=schedule.initial, batch_size=batch_size, seconds=now_ms / 1000.0, steps=tuple(rank_steps),
        train_ms=tuple(train_ms), idle_ms=tuple(idle_ms), boundary_ms_total=cost * len(records),
        boundaries=tuple(records), final_anchor=controller.anchor, final_counts=tuple(controller.counts),
        anchor_rank=controller.anchor_rank,
        ideal_samples_per_s=samples / (ideal_ms / 1000.0) if ideal_ms > 0 else 0.0,
        ddp=ddp, controller_us=tuple(controller_us), wall_s=time.perf_counter() - started,
    )


def _estimate_ddp(
    world: int,
    segments: list[tuple[float, list[float]]],
    step_ms: float,
    noise: float,
    allreduce_ms: float,
    samples: int,
    rng: random.Random,
    sample_steps: int,
) -> DdpEstimate:
    """DDP time for the same cohort steps: per step, the slowest rank's noisy step plus one all-reduce.

    The expected maximum over noisy ranks is drawn, not assumed: with many ranks the straggler
    of each step is what DDP pays for, and it grows with the world size.
    """
    total_ms = 0.0
    idle = [0.0] * world
    for length, speeds in segments:
        solo = [step_ms / s for s in speeds]
        if noise > 0.0:
            draws = max(1, min(sample_steps, math.ceil(length)))
            slowest = sum(max(ms * _noise_factor(rng, noise) for ms in solo) for _ in range(draws)) / draws
        else:
            slowest = max(solo)
        total_ms += length * (slowest + allreduce_ms)
        for rank, ms in enumerate(solo):
            idle[rank] += length * max(0.0, slowest - ms)  # a lone rank's sampled mean can dip below ms
    if total_ms <= 0:
        return DdpEstimate(0.0, 0.0, tuple(idle), 0.0)
    steps = sum(length for length, _ in segments)
    return DdpEstimate(
        seconds=total_ms / 1000.0,
        samples_per_s=samples / (total_ms / 1000.0),
        idle_fraction=tuple(ms / total_ms for ms in idle),
        overhead_fraction=steps * allreduce_ms / total_ms,
    )


def _check_arguments(
    speeds: Sequence[float],
    step_ms: float,
    noise: float,
    boundary_ms: float,
    boundary_ms_per_rank: float,
    allreduce_ms: Optional[float],
    batch_size: int,
    steps: Optional[int],
    seconds: Optional[float],
    epochs: Optional[int],
    epoch_samples: Optional[int],
    speed_changes: Sequence[SpeedChange],
    lookahead_batches: int,
    ddp_sample_steps: int,
) -> None:
    def positive(name: str, value: float) -> None:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")

    def non_negative(name: str, value: float) -> None:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")

    if not speeds:
        raise ValueError("speeds must name at least one rank")
    for rank, speed in enumerate(speeds):
        positive(f"the speed of rank {rank}", speed)
    positive("step_ms", step_ms)
    non_negative("noise", noise)
    non_negative("boundary_ms", boundary_ms)
    non_negative("boundary_ms_per_rank", boundary_ms_per_rank)
    if allreduce_ms is not None:
        non_negative("allreduce_ms", allreduce_ms)
    for name, count in (("batch_size", batch_size), ("lookahead_batches", lookahead_batches),
                        ("ddp_sample_steps", ddp_sample_steps)):
        if count < 1:
            raise ValueError(f"{name} must be >= 1, got {count}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if seconds is not None:
        positive("seconds", seconds)
    if epochs is not None and (epochs < 1 or epoch_samples is None):
        raise ValueError("epochs must be >= 1 and needs epoch_samples (the samples of one epoch)")
    if epoch_samples is not None and epoch_samples < 1:
        raise ValueError(f"epoch_samples must be >= 1, got {epoch_samples}")
    if steps is None and seconds is None and epochs is None:
        raise ValueError("give the run a length: steps, seconds or epochs")
    for change in speed_changes:
        if not 0 <= change.rank < len(speeds):
            raise ValueError(f"speed change for rank {change.rank}, but the ranks are 0..{len(speeds) - 1}")
        if change.at_step < 0:
            raise ValueError(f"a speed change's step must be >= 0, got {change.at_step}")
        positive(f"the new speed of rank {change.rank}", change.speed)


def spread_speeds(ranks: int, spread: float) -> list[float]:
    """``ranks`` speeds spaced geometrically from 1.0 down to ``1 / spread`` (a mixed fleet)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if not (math.isfinite(spread) and spread >= 1.0):
        raise ValueError(f"spread (fastest / slowest) must be >= 1, got {spread!r}")
    if ranks == 1:
        return [1.0]
    return [spread ** (-rank / (ranks - 1)) for rank in range(ranks)]


def matplotlib_available() -> bool:
    """Whether :func:`plot` can run; checked before a long simulation rather than after it."""
    return importlib.util.find_spec("matplotlib") is not None


PLOTTED_RANKS = 8  # beyond this many ranks the plot shows the fastest, median and slowest rank


def plot(result: SimResult, path: Union[str, Path]) -> None:
    """Write a PNG of each rank's share and of the anchor over the simulated clock.

    Needs matplotlib, which is not a dependency of lightning-elche (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from error

    times = [b.time_s for b in result.boundaries]
    world = result.world_size
    if world <= PLOTTED_RANKS:
        shown = list(range(world))
    else:
        by_speed = sorted(range(world), key=lambda r: (-result.speeds[r], r))
        shown = [by_speed[0], by_speed[world // 2], by_speed[-1]]
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    for rank in shown:
        top.step(times, [b.shares[rank] for b in result.boundaries], where="pre",
                 label=f"rank {rank} (speed {result.speeds[rank]:.3g})")
    top.set_ylabel("share of the window's samples")
    top.legend(fontsize="small")
    top.set_title(
        f"{world} ranks: {result.samples_per_s:.0f} samples/s, {result.speedup_vs_ddp:.2f}x DDP, "
        f"{result.fraction_of_ideal:.0%} of ideal"
    )
    bottom.step(times, [b.anchor for b in result.boundaries], where="pre", color="black")
    bottom.set_ylim(0, max(b.anchor for b in result.boundaries) * 1.1 + 1)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("anchor (steps per window)")
    bottom.set_xlabel("simulated training time (s)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
