"""Goodput of an elastic cohort, predicted with the cohort core: ranks fail, survivors go on, replacements join.

    from lightning_elche.simulate import simulate_elastic
    simulate_elastic([1.0, 1.0, 1.0], step_ms=57, batch_size=64, epochs=12, epoch_samples=60000,
                     fail_every_s=30, detect_s=0.1, rejoin_s=1.6)

What happens at a failure is what ``ElCheStrategy(elastic=True)`` does, decided by the same objects: a
rank fails during a window, or inside the boundary that closes it (the boundary then rolls back on every
survivor, and the whole of the victim's window goes back to the epoch); the survivors find out at that
boundary (their exchange fails), once they reach it and the victim has died, after ``detect_s`` (the
launcher's exit note is read within about 0.1 s; a stalled rank or a lost machine takes the heartbeat
probe, 1.5 s), agree on the next generation, regroup (``regroup_ms``) and redo the boundary;
:func:`~lightning_elche.cohort.membership.survivors_point` puts the failed rank's part of the window
back into the epoch, and a new :class:`~lightning_elche.cohort.core.Cohort` plans
the rest of it for the survivors, their speed readings carried over. A replacement (a spare that was
waiting, or a process started after the failure) is ready ``rejoin_s`` after the failure and is
admitted at the first boundary after that, at ``join_ms`` for everybody (the checkpoint sent in
memory, the new group, the train iterators started again); it has the failed rank's speed and starts
from its count and speed readings, as in training (:func:`~lightning_elche.cohort.controller.controller_state_for`).

Failures strike every ``fail_every_s`` seconds of simulated time (or at exponential intervals of that
mean, ``random_failures=True``), one rank at a time, chosen by a seeded draw. Steps take
``step_ms / speed`` and a boundary ``boundary_ms``; noise, dynamic dispatch and DDP are
:func:`~lightning_elche.sim.simulator.simulate_cohort`'s subject, not this one's.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_elche.cohort.control import gather_reports
from lightning_elche.cohort.controller import ControllerConfig
from lightning_elche.cohort.core import Cohort
from lightning_elche.cohort.guards import NoGuard
from lightning_elche.cohort.membership import survivors_point
from lightning_elche.cohort.plan import EpochPlan
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.cohort.train_data import TrainData


@dataclass(frozen=True)
class ElasticResult:
    """A simulated elastic fit beside the same fit without failures."""

    seconds: float
    failure_free_seconds: float
    useful_samples: int
    failures: int
    joins: int
    lost_samples: int  # trained by a rank in the window it failed in, then trained again by others

    @property
    def goodput(self) -> float:
        """Useful samples per second over the failure-free fit's (1.0: failures cost nothing)."""
        return self.failure_free_seconds / self.seconds

    def summary(self) -> str:
        return (
            f"elastic fit {self.seconds:.1f} s against {self.failure_free_seconds:.1f} s without failures: goodput "
            f"{self.goodput:.3f}; {self.failures} failure(s), {self.joins} join(s), {self.lost_samples} samples trained "
            "in a failed rank's last window and trained again"
        )


def simulate_elastic(
    speeds: Sequence[float],
    *,
    step_ms: float,
    batch_size: int,
    epochs: int,
    epoch_samples: int,
    fail_every_s: Optional[float],
    detect_s: float = 0.1,
    regroup_ms: float = 100.0,
    rejoin_s: Optional[float] = 2.0,
    join_ms: float = 300.0,
    boundary_ms: float = 10.0,
    random_failures: bool = False,
    config: Optional[ControllerConfig] = None,
    seed: int = 0,
) -> ElasticResult:
    """Simulate the fit with failures (``fail_every_s``; None: none) and without; see the module docstring.
    ``rejoin_s=None``: failed ranks are not replaced, the cohort shrinks for good (at least one rank stays)."""
    for name, value in (("step_ms", step_ms), ("detect_s", detect_s), ("regroup_ms", regroup_ms), ("join_ms", join_ms),
                        ("boundary_ms", boundary_ms), ("rejoin_s", 0.0 if rejoin_s is None else rejoin_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if fail_every_s is not None and not (math.isfinite(fail_every_s) and fail_every_s > 0):
        raise ValueError(f"fail_every_s must be a positive number of seconds (or None: no failures), got {fail_every_s!r}")
    if not speeds or any(not (math.isfinite(s) and s > 0) for s in speeds):
        raise ValueError(f"speeds must be positive numbers, one per rank, got {list(speeds)!r}")
    if epochs < 1 or epoch_samples // batch_size < len(speeds):
        raise ValueError(f"{epochs} epoch(s) of {epoch_samples // batch_size} steps cannot give {len(speeds)} ranks a step each")
    config = ControllerConfig(world_size=len(speeds)) if config is None else config
    run = _ElasticRun(config, step_ms, batch_size, epoch_samples, boundary_ms, seed,
                      _FailureModel(detect_s, regroup_ms, rejoin_s, join_ms, random_failures))
    failure_free = run.fit(list(speeds), epochs, None)
    with_failures = run.fit(list(speeds), epochs, fail_every_s)
    return ElasticResult(
        seconds=with_failures.now_ms / 1000.0, failure_free_seconds=failure_free.now_ms / 1000.0,
        useful_samples=with_failures.useful_steps * batch_size, failures=with_failures.failures,
        joins=with_failures.joins, lost_samples=with_failures.lost_steps * batch_size,
    )


@dataclass
class _Tally:
    now_ms: float = 0.0
    useful_steps: int = 0
    lost_steps: int = 0
    failures: int = 0
    joins: int = 0


@dataclass(frozen=True)
class _FailureModel:
    detect_s: float
    regroup_ms: float
    rejoin_s: Optional[float]
    join_ms: float
    random_failures: bool


class _ElasticRun:
    def __init__(self, config: ControllerConfig, step_ms: float, batch_size: int, epoch_samples: int,
                 boundary_ms: float, seed: int, failures: _FailureModel) -> None:
        self.config, self.step_ms, self.boundary_ms, self.seed = config, step_ms, boundary_ms, seed
        self.failures = failures
        self.data = TrainData(num_samples=epoch_samples, seed=seed, shuffle=False, batch_size=batch_size,
                              samples_per_step=batch_size, drop_last=True)

    def cohort(self, world: int, resume: Optional[ResumePoint]) -> Cohort:
        """The cohort of a generation, as the strategy's ``_start_cohort`` builds it."""
        cohort = Cohort(dataclasses.replace(self.config, world_size=world), NoGuard(), rank=0, resume=resume,
                        dispatch="planned")
        cohort.set_train_data(self.data, 1)
        return cohort

    def fit(self, speeds: list[float], epochs: int, fail_every_s: Optional[float]) -> _Tally:
        rng, tally, model = random.Random(self.seed), _Tally(), self.failures
        next_failure_ms = self._interval(rng, fail_every_s)
        ready_ms: list[tuple[float, float]] = []  # (when a replacement can join, its speed)
        cohort, epoch = self.cohort(len(speeds), None), 0
        previous_boundary = [0.0] * len(speeds)
        while epoch < epochs:
            plan = cohort.begin_epoch(epoch)
            assert isinstance(plan, EpochPlan)  # the simulated elastic cohort dispatches planned
            epoch = plan.epoch  # the next one when a membership change came at the end of this one
            if epoch >= epochs:
                break
            while not (plan.complete and cohort.clock.window >= plan.window_count):
                counts = [plan.steps(cohort.clock.window, rank) for rank in range(len(speeds))]
                window_ms = [n * self.step_ms / s for n, s in zip(counts, speeds)]
                end_ms = tally.now_ms + max(window_ms)
                if next_failure_ms < end_ms + self.boundary_ms and len(speeds) > 1:  # a rank fails in this window or boundary
                    victim = rng.randrange(len(speeds))
                    survivors = [r for r in range(len(speeds)) if r != victim]
                    steps = sum(counts[r] for r in survivors)
                    tally.failures += 1
                    tally.useful_steps += steps
                    # what it trained of the window goes back to the epoch: all of it when it died inside the
                    # boundary, which rolls back on every survivor (the survivors redo it among themselves)
                    victim_step_ms = self.step_ms / speeds[victim]
                    tally.lost_steps += min(counts[victim], max(0, int((next_failure_ms - tally.now_ms) // victim_step_ms)))
                    # the survivors find out once they are at the boundary and the victim has died
                    found_ms = max(max(tally.now_ms + window_ms[r] for r in survivors), next_failure_ms)
                    tally.now_ms = found_ms + model.detect_s * 1000 + model.regroup_ms + self.boundary_ms
                    if model.rejoin_s is not None:
                        ready_ms.append((next_failure_ms + model.rejoin_s * 1000, speeds[victim]))
                    cohort = self.cohort(len(survivors), survivors_point(cohort, survivors, steps, steps))
                    speeds = [speeds[r] for r in survivors]
                    previous_boundary = [0.0] * len(speeds)
                    next_failure_ms += self._interval(rng, fail_every_s)
                    break  # the survivors plan the rest of the epoch
                control = gather_reports([
                    {"window_ms": ms, "steps": n, "samples": n * self.data.batch_size, "boundary_ms": before}
                    for ms, n, before in zip(window_ms, counts, previous_boundary)
                ])
                cohort.boundary(control, 0.0, True)
                tally.useful_steps += sum(counts)
                previous_boundary = [end_ms - tally.now_ms - ms + self.boundary_ms for ms in window_ms]
                tally.now_ms = end_ms + self.boundary_ms
                joining = [speed for at, speed in ready_ms if at <= tally.now_ms]
                if joining and not (plan.complete and cohort.clock.window >= plan.window_count and epoch + 1 >= epochs):
                    ready_ms = [(at, speed) for at, speed in ready_ms if at > tally.now_ms]
                    point = cohort.resume_point(lambda: None, None)
                    assert point is not None
                    point = point.for_members([*range(len(speeds)), *[None] * len(joining)])
                    cohort, speeds = self.cohort(len(speeds) + len(joining), point), [*speeds, *joining]
                    previous_boundary = [0.0] * len(speeds)
                    tally.joins += len(joining)
                    tally.now_ms += model.join_ms
                    break  # the larger cohort plans the rest of the epoch
            else:
                epoch += 1
        return tally

    def _interval(self, rng: random.Random, every_s: Optional[float]) -> float:
        if every_s is None:
            return math.inf
        return (rng.expovariate(1.0 / every_s) if self.failures.random_failures else every_s) * 1000.0
