"""Cohort simulator: ElChe's own cohort core driven by simulated ranks instead of GPUs.

The question it answers is "what would ElChe buy me on these GPUs?" before anyone rents them:
given relative per-rank speeds, a step time, per-step noise and the cost of a boundary, it
predicts ElChe's cohort throughput, each rank's idle time and the averaging overhead, next to
the DDP estimate from the same timings and the ideal (the sum of the solo rates).

Only time is simulated. Everything else is the object the strategy itself runs, not a copy of
it: a :class:`~lightning_elche.cohort.core.Cohort` (with
:class:`~lightning_elche.cohort.guards.NoGuard`: there is no model here, hence no divergence to
guard). The cohort builds each epoch's plan (:meth:`~lightning_elche.cohort.core.Cohort.begin_epoch`),
freezes windows ``lookahead_batches`` ahead of training, lets the last window of an epoch split
what remains and cuts the final windows so that a ``steps`` budget is met exactly, like
``Trainer(max_steps=...)``. At every boundary the simulator hands it the control data an
exchange would return (:func:`~lightning_elche.cohort.control.gather_reports`): per rank the
training time of the window that just closed, the optimizer steps and samples it ran, and the
duration of its *previous* boundary (waiting included, 0 at the start of the fit). Then
:meth:`~lightning_elche.cohort.core.Cohort.boundary` decides, through the same controller and
anchor governor as in training. So the fit's first window is warm-up, windows are one-step
probes until every rank has a speed reading, the anchor grows from the overhead rule, and a
decision reaches the ranks one frozen window later, because that is what the cohort does.

The simulator works in whole optimizer steps (``batch_size`` samples per step and rank): an
epoch of ``epoch_samples`` samples has ``epoch_samples // batch_size`` steps, and a partial last
batch is dropped (the plan's ``drop_last``), so every simulated step carries ``batch_size`` samples.

Timing model, per window: rank r runs its ``n_r`` steps in ``n_r * step_ms / speed_r`` times a
mean-one lognormal noise factor; the boundary starts when the slowest rank arrives (the others
idle until then) and costs ``boundary_ms + boundary_ms_per_rank * world_size`` for everybody, plus,
on a simulated link, the ring all-reduce of ElChe's payload (:func:`~lightning_elche.cohort.link.link_ms`,
the model the controller sizes its anchor with). DDP runs the same samples in equal per-rank
batches: every step lasts as long as the slowest rank's noisy step plus one gradient all-reduce
(of the uncompressed model on that link). Nothing here touches processes, clocks (except
to measure the cohort's decision itself) or global randomness: a seed fixes the result.

The result types live in :mod:`lightning_elche.sim.results`, the plot in
:mod:`lightning_elche.sim.plot` (both re-exported here), the command line in
:mod:`lightning_elche.sim.cli`.
"""

from __future__ import annotations

import math
import random
import time
from typing import Optional, Sequence

from lightning_elche.cohort.control import gather_reports
from lightning_elche.cohort.controller import ControllerConfig
from lightning_elche.cohort.core import Cohort
from lightning_elche.cohort.guards import NoGuard
from lightning_elche.cohort.limits import FitLimits
from lightning_elche.cohort.plan import EpochPlan
from lightning_elche.cohort.settings import DISPATCHES, resolve_dispatch
from lightning_elche.cohort.train_data import TrainData
from lightning_elche.sim.claims import claim_costs, split_pool
from lightning_elche.sim.link import check_link_arguments, config_with_link, simulated_costs
from lightning_elche.sim.plot import PLOTTED_RANKS, matplotlib_available, plot
from lightning_elche.sim.results import BoundaryStats, DdpEstimate, SimResult, SpeedChange

__all__ = [
    "SIMULATED_POLICIES", "BoundaryStats", "DdpEstimate", "PLOTTED_RANKS", "SimResult", "SpeedChange",
    "matplotlib_available", "plot", "simulate_cohort", "spread_speeds",
]

SIMULATED_POLICIES = ("sync", "cadence")  # "async" overlaps the all-reduce, which this model does not


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
    dispatch: str = "auto",
    claim_ms: float = 0.2,
    store_op_us: float = 20.0,
    link_mbit_s: Optional[float] = None,
    link_latency_ms: float = 0.0,
    boundary_bytes: int = 0,
    model_bytes: Optional[int] = None,
) -> SimResult:
    """Run ElChe's cohort core against simulated ranks and predict throughput, idle and overhead.

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
            of each epoch splits what remains (a partial last batch is dropped). Without it the
            run is one endless epoch.
        speed_changes: speed changes during the run (a GPU that throttles, a node that joins a busy host).
        config: the controller's settings (anchor, overhead target, policy, ...); its
            ``world_size`` must be ``len(speeds)``. Defaults to ElChe's defaults.
        lookahead_batches: how far ahead windows are frozen (the DataLoader's prefetch depth:
            1 without workers, as in ``lightning_elche.cohort.plan.prefetch_depth``).
        seed: seeds the noise; the same seed gives the same result.
        ddp_sample_steps: noisy DDP steps drawn per speed segment to estimate how long the
            slowest of the ranks takes per step.
        dispatch: ``"planned"`` (shares decided a window ahead), ``"dynamic"`` (ranks claim
            one-step tickets from the window's pool; ``lightning_elche.sim.claims``) or ``"auto"``
            (default), resolved from ``config`` as ``ElCheStrategy`` resolves it.
        claim_ms: dynamic dispatch: a store operation's network round trip.
        store_op_us: dynamic dispatch: the store server's time per operation (it serves one at a
            time, so thousands of ranks queue; see ``lightning_elche.sim.claims``).
        link_mbit_s: bandwidth of the slowest link between ranks in Mbit/s; None (default): no
            link is simulated and the boundary costs only ``boundary_ms`` (and its per-rank part).
            With a link, a boundary also pays the ring all-reduce of ``boundary_bytes``
            (``latency + 2 (W - 1) / W * bytes * 8 / (link_mbit_s * 1000)`` ms, in TCP's frames with the
            other direction's ACKs: :func:`~lightning_elche.cohort.link.link_ms`) and the controller is told the link and
            the payload (unless ``config`` already names them), so it sizes the anchor for it at once.
        link_latency_ms: the link's fixed cost per all-reduce (needs ``link_mbit_s``).
        boundary_bytes: the payload one ElChe boundary all-reduces: the parameters' bytes, or the
            compressed payload's.
        model_bytes: the bytes DDP all-reduces every step (the fp32 gradients, uncompressed) for
            the default ``allreduce_ms``; defaults to ``boundary_bytes``.
    """
    started = time.perf_counter()
    world = len(speeds)
    _check_arguments(speeds, step_ms, noise, boundary_ms, boundary_ms_per_rank, allreduce_ms, batch_size,
                     steps, seconds, epochs, epoch_samples, speed_changes, lookahead_batches, ddp_sample_steps)
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    if not (claim_ms >= 0 and store_op_us >= 0 and math.isfinite(claim_ms) and math.isfinite(store_op_us)):
        raise ValueError(f"claim_ms and store_op_us must be numbers >= 0, got {claim_ms!r} and {store_op_us!r}")
    check_link_arguments(link_mbit_s, link_latency_ms, boundary_bytes, model_bytes)
    config = ControllerConfig(world_size=world) if config is None else config
    if config.world_size != world:
        raise ValueError(f"config.world_size is {config.world_size} but {world} speeds were given")
    config = config_with_link(config, link_mbit_s, link_latency_ms, boundary_bytes)
    if config.policy not in SIMULATED_POLICIES:
        raise ValueError(
            f"the simulator models blocking boundaries (policies {SIMULATED_POLICIES}), got {config.policy!r}"
        )
    if epoch_samples is not None and epoch_samples // batch_size < world:
        raise ValueError(
            f"an epoch of {epoch_samples // batch_size} steps cannot give each of {world} ranks a step"
        )

    dispatch = resolve_dispatch(dispatch, config.policy, config.partition_ratios, config.max_batch_diff, world)
    # The simulated fit, seen from rank 0: every decision below is the cohort's.
    cohort = Cohort(config, NoGuard(), rank=0, limits=FitLimits(max_steps=-1 if steps is None else steps), dispatch=dispatch)
    cohort.set_train_data(
        TrainData(num_samples=epoch_samples, seed=seed, shuffle=False, batch_size=batch_size,
                  samples_per_step=batch_size, drop_last=True),
        lookahead_batches,
    )
    schedule = _SpeedSchedule(speeds, speed_changes)
    rng = random.Random(seed)
    cost, ddp_allreduce_ms = simulated_costs(
        world, boundary_ms, boundary_ms_per_rank, allreduce_ms, link_mbit_s, link_latency_ms, boundary_bytes,
        model_bytes,
    )
    stop_ms = math.inf if seconds is None else seconds * 1000.0

    now_ms = 0.0
    last_boundary = [0.0] * world  # the callback starts a fit with 0: no previous boundary
    train_ms = [0.0] * world
    idle_ms = [0.0] * world
    rank_steps = [0] * world
    claim_ms_total = [0.0] * world
    records: list[BoundaryStats] = []
    controller_us: list[float] = []
    epoch = 0
    running = True

    while running:
        plan = cohort.begin_epoch(epoch)
        while not (plan.complete and cohort.clock.window >= plan.window_count):
            window = cohort.clock.window
            speeds_now = schedule.at(cohort.cohort_steps_total / world)
            if cohort.dynamic:  # (until claims cost too much: the cohort then falls back to planned)
                # the window's noise is drawn on the expected steps, then the pool splits by the noisy speeds
                expected = [max(1, c) for c in cohort.controller.counts]
                ms = [step_ms / s * _noise_factor(rng, noise / math.sqrt(n)) for n, s in zip(expected, speeds_now)]
                claims = claim_costs(ms, cohort.controller.window_ms, claim_ms, store_op_us / 1000.0)
                ms = [m + extra for m, extra in zip(ms, claims.ms_per_step)]
                counts = split_pool(plan.logged_units(window, True), ms)
                window_ms = [n * m for n, m in zip(counts, ms)]
                window_claim_ms = [n * extra for n, extra in zip(counts, claims.ms_per_step)]
            else:
                assert isinstance(plan, EpochPlan)  # planned dispatch
                counts = [plan.steps(window, rank) for rank in range(world)]
                window_ms = [
                    n * step_ms / s * _noise_factor(rng, noise / math.sqrt(n)) for n, s in zip(counts, speeds_now)
                ]
                window_claim_ms = [0.0] * world
            slowest = max(window_ms)
            waits = [slowest - ms for ms in window_ms]
            control = gather_reports([
                {"window_ms": ms, "steps": n, "samples": n * batch_size, "boundary_ms": previous, "claim_ms": claim}
                for ms, n, previous, claim in zip(window_ms, counts, last_boundary, window_claim_ms)
            ])
            tick = time.perf_counter_ns()
            outcome = cohort.boundary(control, 0.0, True)
            controller_us.append((time.perf_counter_ns() - tick) / 1000.0)

            now_ms += slowest + cost
            last_boundary = [wait + cost for wait in waits]
            record = cohort.close_boundary(last_boundary[0])  # rank 0's boundary, its wait included
            for rank in range(world):
                train_ms[rank] += window_ms[rank]
                idle_ms[rank] += waits[rank]
                rank_steps[rank] += counts[rank]
                claim_ms_total[rank] += window_claim_ms[rank]
            records.append(
                BoundaryStats(
                    time_s=now_ms / 1000.0, epoch=record.epoch, steps=tuple(record.steps), window_ms=slowest,
                    idle_ms=tuple(waits), boundary_ms=cost, anchor=record.anchor,
                    anchor_rank=cohort.controller.anchor_rank, overhead=cohort.controller.overhead,
                )
            )
            if now_ms >= stop_ms or outcome.max_steps_reached:
                running = False
                break
        epoch += 1
        if epochs is not None and epoch >= epochs:
            running = False

    cohort_total = cohort.cohort_steps_total
    segments = schedule.segments(cohort_total / world)
    ideal_ms = sum(length * world / sum(s / step_ms for s in speeds_then) for length, speeds_then in segments)
    samples = cohort_total * batch_size
    ddp = _estimate_ddp(
        world, segments, step_ms, noise, ddp_allreduce_ms, samples, rng, ddp_sample_steps,
    )
    controller = cohort.controller
    return SimResult(
        speeds=schedule.initial, batch_size=batch_size, seconds=now_ms / 1000.0, steps=tuple(rank_steps),
        train_ms=tuple(train_ms), idle_ms=tuple(idle_ms), boundary_ms_total=cost * len(records),
        boundaries=tuple(records), final_anchor=controller.anchor, final_counts=tuple(controller.counts),
        anchor_rank=controller.anchor_rank,
        ideal_samples_per_s=samples / (ideal_ms / 1000.0) if ideal_ms > 0 else 0.0,
        ddp=ddp, controller_us=tuple(controller_us), wall_s=time.perf_counter() - started,
        dispatch=dispatch, claim_ms=tuple(claim_ms_total) if dispatch == "dynamic" else (),
    )


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


def _noise_factor(rng: random.Random, sigma: float) -> float:
    """A mean-one lognormal factor; exactly 1 without noise (and no draw, so runs stay comparable)."""
    if sigma <= 0.0:
        return 1.0
    return math.exp(rng.gauss(0.0, sigma) - 0.5 * sigma * sigma)


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
