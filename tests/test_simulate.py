"""Slowdown: argument validation and what it does to a real single-process Trainer run."""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import pytest
import torch
from fake_clock import FakeClock
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elche import Slowdown
from lightning_elche.sim import slowdown as slowdown_module
from lightning_elche.sim.slowdown import StepStretcher

# --------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "rank",
    [-1, True, False, 1.0, "0", None, (0,)],
    ids=repr,
)
def test_rank_must_be_a_non_negative_int(rank):
    with pytest.raises(ValueError, match="ranks must be non-negative integers"):
        Slowdown({rank: 2.0})


@pytest.mark.parametrize(
    "factor",
    [0.5, 0, -2, 0.999, float("nan"), float("inf"), True, False, "2", None, [2.0]],
    ids=repr,
)
def test_factor_must_be_a_number_at_least_one(factor):
    with pytest.raises(ValueError, match="rank 3 must be a number >= 1"):
        Slowdown({3: factor})


@pytest.mark.parametrize("factor", [1, 1.0, 2, 3.5, 100.0])
def test_good_factors(factor):
    slowdown = Slowdown({0: factor, 5: 1.0})
    assert slowdown.factor(0) == float(factor)
    assert slowdown.factor(5) == 1.0
    assert slowdown.factor(1) == 1.0  # not listed: full speed
    assert slowdown.local_step == 0 and slowdown.slept_s == 0.0


def test_empty_mapping_is_allowed():
    slowdown = Slowdown({})
    assert slowdown.factor(0) == 1.0


def test_callable_factor_is_allowed_and_sees_local_step():
    calls = []

    def ramp(step: int) -> float:
        calls.append(step)
        return 1.0 + step

    slowdown = Slowdown({0: ramp})
    assert slowdown.factor(0) == 1.0
    slowdown.local_step = 4
    assert slowdown.factor(0) == 5.0
    assert calls == [0, 4]


def test_callable_factor_returning_a_bad_value_fails_when_used():
    slowdown = Slowdown({2: lambda step: 0.5})  # accepted: only checked per step
    with pytest.raises(ValueError, match="rank 2 must be a number >= 1"):
        slowdown.factor(2)


def test_factors_are_copied():
    factors = {0: 2.0}
    slowdown = Slowdown(factors)
    factors[0] = 0.1
    assert slowdown.factor(0) == 2.0


# --------------------------------------------------------------------------------- real runs
#
# What a Slowdown measures and how long it sleeps is asserted on a fake clock (time passes only in the
# model's forward and in Slowdown's sleeps), so the arithmetic and the hooks it runs in are checked exactly
# however loaded the machine is. The real clocks' part (what the thread, cpu and wall clocks leave out) is
# asserted on one-sided bounds, each interval read on two clocks at once, which load can only widen.


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the thread clock counts the training thread only, and the cpu-versus-wall
    comparison below needs no second thread computing while the first one waits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

FEATURES = 128
BATCH = 32
FORWARD_SLEEP_S = 0.006
WORK_S = 0.01  # a step's work on the fake clock


class HeavyModule(LightningModule):
    """A model whose step takes a few milliseconds: a stack of dense matmuls plus ``work()`` in the
    forward, by default a ``FORWARD_SLEEP_S`` sleep standing for time the step spends waiting (for the
    device, or in a collective): a slow step, not a wait for anything. On a fake clock ``work`` advances
    that clock instead."""

    def __init__(self, depth: int = 4, work: Callable[[], None] = lambda: time.sleep(FORWARD_SLEEP_S)) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ParameterList(
            nn.Parameter(torch.randn(FEATURES, FEATURES, generator=g) / FEATURES**0.5) for _ in range(depth)
        )
        self.head = nn.Linear(FEATURES, 1)
        self.work = work

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.work()
        for weight in self.layers:
            x = torch.tanh(x @ weight)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * BATCH, FEATURES, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1].clone()), batch_size=BATCH)


class StepClock(Callback):
    """Placed after Slowdown: times each batch from its start to after Slowdown's sleep (on ``now``), and
    records Slowdown's counters after every batch."""

    def __init__(self, slowdown: Slowdown | None = None, now: Callable[[], float] = time.perf_counter) -> None:
        self.slowdown = slowdown
        self.now = now
        self.durations: list[float] = []
        self.trace: list[tuple[int, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = self.now()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.durations.append(self.now() - self._start)
        if self.slowdown is not None:
            self.trace.append((self.slowdown.local_step, self.slowdown.slept_s))


def fit(steps: int, slowdown: Slowdown | None = None, accumulate: int = 1, clock: FakeClock | None = None,
        callbacks: Sequence[Callback] = ()) -> StepClock:
    """A one-epoch fit of ``steps`` batches; on ``clock`` (see :func:`fake_wall`) each forward is ``WORK_S``."""
    recorder = StepClock(slowdown) if clock is None else StepClock(slowdown, now=clock.perf_counter)
    module = HeavyModule() if clock is None else HeavyModule(work=lambda: clock.advance(WORK_S))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy="auto",
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        callbacks=[*callbacks, *([slowdown] if slowdown is not None else []), recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=loader(steps))
    assert trainer.global_step == steps // accumulate
    return recorder


@pytest.fixture
def fake_wall(monkeypatch) -> FakeClock:
    """Slowdowns made after this (``clock="wall"``) read and sleep on a fake clock."""
    clock = FakeClock()
    monkeypatch.setitem(slowdown_module.CLOCKS, "wall", clock.perf_counter)
    monkeypatch.setattr(slowdown_module, "time", clock)
    return clock


class Elapses(Callback):
    """Placed before Slowdown: ``at_start`` of fake time passes as each batch starts (the step's own
    start-up, counted), ``at_end`` as it ends and as the epoch starts, before Slowdown's turn (an averaging
    boundary, the epoch's start-up: not counted)."""

    def __init__(self, clock: FakeClock, at_start: float, at_end: float) -> None:
        self.clock, self.at_start, self.at_end = clock, at_start, at_end

    def on_train_epoch_start(self, trainer, pl_module):
        self.clock.advance(self.at_end)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.advance(self.at_start)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock.advance(self.at_end)


@pytest.mark.timeout(60)
def test_factor_three_makes_steps_three_times_slower(fake_wall):
    steps, start_s, boundary_s = 12, 0.002, 0.005
    slowdown = Slowdown({0: 3.0}, clock="wall")
    slowed = fit(steps, slowdown, clock=fake_wall, callbacks=[Elapses(fake_wall, start_s, boundary_s)])
    assert slowdown.local_step == steps
    # Each step is its start-up and its forward's WORK_S, then (3 - 1) times that slept before the optimizer
    # step; the previous batch's boundary is not part of it.
    step_s = start_s + WORK_S
    assert fake_wall.sleeps == pytest.approx([2 * step_s] * steps)
    assert slowdown.slept_s == pytest.approx(2 * step_s * steps)
    # as timed from the batch's start (after its start-up) to its end (after the boundary)
    assert slowed.durations == pytest.approx([WORK_S + 2 * step_s + boundary_s] * steps)


@pytest.mark.timeout(60)
def test_callable_factor_sleeps_only_after_step_ten(fake_wall):
    slowdown = Slowdown({0: lambda step: 1.0 if step < 10 else 4.0}, clock="wall")
    clock = fit(20, slowdown, clock=fake_wall)
    assert slowdown.local_step == 20
    # trace[i] = (local_step, slept_s) after batch i: nothing slept during steps 0..9.
    assert [step for step, _ in clock.trace] == list(range(1, 21))
    assert all(slept == 0.0 for step, slept in clock.trace if step <= 10), clock.trace[:11]
    # From step 10 on, each step sleeps 3x its own duration.
    assert clock.durations == pytest.approx([WORK_S] * 10 + [4 * WORK_S] * 10)
    assert slowdown.slept_s == pytest.approx(10 * 3 * WORK_S)


@pytest.mark.timeout(60)
def test_rank_not_listed_does_not_sleep():
    slowdown = Slowdown({1: 5.0, 3: lambda step: 2.0})
    fit(12, slowdown)
    assert slowdown.local_step == 12
    assert slowdown.slept_s == 0.0


@pytest.mark.timeout(60)
def test_counts_optimizer_steps_under_gradient_accumulation(fake_wall):
    slowdown = Slowdown({0: 2.0}, clock="wall")
    clock = fit(12, slowdown, accumulate=3, clock=fake_wall)
    assert slowdown.local_step == 4
    # Sleeps happen only on the batches that complete an optimizer step ...
    sleeps = [b - a for (_, a), (_, b) in zip([(0, 0.0)] + clock.trace, clock.trace)]
    assert [s > 0 for s in sleeps] == [False, False, True] * 4, sleeps
    # ... and with k = 2 they last as long as the three batches each completes (sleeping for one batch
    # of the three would give 1/3 of that, for each batch separately 3 times that).
    assert fake_wall.sleeps == pytest.approx([3 * WORK_S] * 4)
    assert clock.durations == pytest.approx([WORK_S, WORK_S, 4 * WORK_S] * 4)


@pytest.mark.timeout(60)
def test_counters_reset_on_a_new_fit():
    slowdown = Slowdown({0: 1.5}, clock="wall")
    fit(6, slowdown)
    first = slowdown.slept_s
    assert slowdown.local_step == 6 and first > 0
    fit(4, slowdown)
    assert slowdown.local_step == 4
    assert 0 < slowdown.slept_s


def test_clock_must_be_thread_cpu_or_wall():
    with pytest.raises(ValueError, match=r"`clock` must be one of \['cpu', 'thread', 'wall'\]"):
        Slowdown({0: 2.0}, clock="gpu")


def read_also(slowdown: Slowdown, other: Callable[[], float]) -> list[tuple[float, float]]:
    """For each interval ``slowdown`` stretches: its length on the slowdown's own clock (what the sleep
    was computed from) and on ``other``, read at the same points."""
    stretcher = slowdown._stretcher
    marks = [other()]
    intervals: list[tuple[float, float]] = []
    restart, stretch = stretcher.restart, stretcher.stretch

    def restart_too() -> None:
        restart()
        marks.append(other())

    def stretch_too(factor: float) -> float:
        on_other = other() - marks[-1]
        extra = stretch(factor)  # restarts, through restart_too
        intervals.append((extra / (factor - 1.0), on_other))
        return extra

    stretcher.restart, stretcher.stretch = restart_too, stretch_too  # type: ignore[method-assign]
    return intervals


@pytest.mark.timeout(60)
def test_cpu_clock_stretches_compute_but_not_waiting():
    """clock="cpu" leaves time spent blocked (here the forward's sleep, standing in for a wait in
    a collective) out of the step, so only computation is made k times slower."""
    steps = 20
    cpu = Slowdown({0: 3.0}, clock="cpu")
    intervals = read_also(cpu, time.perf_counter)
    fit(steps, cpu)
    assert len(intervals) == steps and cpu.slept_s == pytest.approx(2 * sum(c for c, _ in intervals))
    # Each step's wall time holds its FORWARD_SLEEP_S of waiting, which its CPU time does not: one
    # thread computes, so CPU time grows no faster than wall time, and a loaded machine only adds
    # wall time. (The 0.9 leaves room for the microseconds between reading the two clocks.)
    assert all(wall - cpu_s >= 0.9 * FORWARD_SLEEP_S for cpu_s, wall in intervals), intervals
    assert cpu.slept_s > 0  # the matmuls are still stretched


class BackgroundWork(Callback):
    """Spins a second thread for ``BACKGROUND_S`` during every batch and waits for it, standing in
    for gloo's communication threads: CPU time of the process that is not the training thread's."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        def spin() -> None:
            end = time.thread_time() + BACKGROUND_S
            while time.thread_time() < end:
                pass

        worker = threading.Thread(target=spin)
        worker.start()
        worker.join()


BACKGROUND_S = 0.01


@pytest.mark.timeout(60)
def test_thread_clock_leaves_other_threads_out():
    """The default clock counts only the training thread's CPU time: another thread's work (gloo
    communicating) is not stretched, where clock="cpu" (the process's CPU time) would stretch it."""
    steps = 20
    thread = Slowdown({0: 3.0})
    assert thread.clock == "thread"
    intervals = read_also(thread, time.process_time)
    fit(steps, thread, callbacks=[BackgroundWork()])
    assert len(intervals) == steps and thread.slept_s == pytest.approx(2 * sum(t for t, _ in intervals))
    # The other thread spun BACKGROUND_S of its own CPU time inside each interval: the process's CPU
    # time holds it, the training thread's does not (CPU time, which no load stretches; 0.9 for the
    # microseconds between reading the two clocks).
    assert all(process - thread_s >= 0.9 * BACKGROUND_S for thread_s, process in intervals), intervals
    assert thread.slept_s > 0  # the training thread's matmuls are still stretched


def test_step_stretcher_in_a_plain_loop_stretches_only_the_threads_computation():
    """The plain-loop form the benchmarks' non-Lightning peers use: k - 1 times the thread's CPU
    time since the last restart, however long the step waited."""
    stretcher = StepStretcher()
    total = 0.0
    for _ in range(3):
        stretcher.restart()
        spun_from = time.thread_time()
        while time.thread_time() < spun_from + 0.02:  # 20 ms of computation ...
            pass
        spun = time.thread_time() - spun_from
        time.sleep(0.05)  # ... and 50 ms of waiting (a slow step, not a wait), which a slower device would not stretch
        slept = stretcher.stretch(3.0)
        total += slept
        # Twice the thread's CPU time since the restart: at least the spin inside it, and short of the
        # 2 x 50 ms the waiting would add were it counted (what the thread did besides spinning is a few
        # microseconds of CPU time, which a loaded machine does not lengthen: waiting for a core is not CPU time).
        assert 2 * spun <= slept < 2 * spun + 0.05, (slept, spun)
    assert stretcher.slept_s == pytest.approx(total)
    assert stretcher.stretch(1.0) == 0.0
