"""Slowdown: argument validation and what it does to a real single-process Trainer run."""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elche import Slowdown
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


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: a multi-threaded matmul on a shared machine waits on its slowest
    thread, which makes step times far noisier than the effect being measured."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

FEATURES = 128
BATCH = 32
FORWARD_SLEEP_S = 0.006


class HeavyModule(LightningModule):
    """A model whose step takes a few milliseconds: a stack of dense matmuls plus a fixed
    ``FORWARD_SLEEP_S`` of simulated device time in the forward. The fixed part keeps the step
    time stable on a shared, loaded CI machine, where a purely CPU-bound step was seen to
    double from one run to the next; the timing comparisons below need the baseline to hold
    still far more than they need the work to be real."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ParameterList(
            nn.Parameter(torch.randn(FEATURES, FEATURES, generator=g) / FEATURES**0.5) for _ in range(depth)
        )
        self.head = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_SLEEP_S)
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
    """Placed after Slowdown: times each batch from its start to after Slowdown's sleep, and
    records Slowdown's counters after every batch."""

    def __init__(self, slowdown: Slowdown | None = None) -> None:
        self.slowdown = slowdown
        self.durations: list[float] = []
        self.trace: list[tuple[int, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.durations.append(time.perf_counter() - self._start)
        if self.slowdown is not None:
            self.trace.append((self.slowdown.local_step, self.slowdown.slept_s))


def fit(steps: int, slowdown: Slowdown | None = None, accumulate: int = 1) -> StepClock:
    clock = StepClock(slowdown)
    callbacks = ([slowdown] if slowdown is not None else []) + [clock]
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy="auto",
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(HeavyModule(), train_dataloaders=loader(steps))
    assert trainer.global_step == steps // accumulate
    return clock


@pytest.mark.timeout(60)
def test_factor_three_makes_steps_three_times_slower():
    # Each step against its own busy time, not against a baseline fit: on a loaded machine a process
    # that sleeps two thirds of the time is served faster by the scheduler while it computes, so the
    # step time of a slowed fit over a plain one measured the scheduler (x1.5 to x3.8 under load).
    steps = 40
    fit(4)  # warm up kernels and Lightning's imports so the measured run does not pay for them
    slowdown = Slowdown({0: 3.0}, clock="wall")
    slowed = fit(steps, slowdown)
    assert slowdown.local_step == steps
    slept_totals = [0.0] + [slept for _, slept in slowed.trace]
    slept = [after - before for before, after in zip(slept_totals, slept_totals[1:])]
    assert all(s > 0 for s in slept) and sum(slept) == pytest.approx(slowdown.slept_s)
    ratio = statistics.median(d / (d - s) for d, s in zip(slowed.durations[2:], slept[2:]))
    # Slowdown sleeps (k - 1) times the measured step. Its step starts at the previous batch's end, a
    # little before the durations recorded here, so the ratio leans above 3 when the machine is busy.
    assert 2.5 < ratio < 3.6, f"a slowed step took x{ratio:.2f} its busy time, expected about x3"


@pytest.mark.timeout(60)
def test_callable_factor_sleeps_only_after_step_ten():
    slowdown = Slowdown({0: lambda step: 1.0 if step < 10 else 4.0}, clock="wall")
    clock = fit(20, slowdown)
    assert slowdown.local_step == 20
    assert slowdown.slept_s > 0
    # trace[i] = (local_step, slept_s) after batch i: nothing slept during steps 0..9.
    assert [step for step, _ in clock.trace] == list(range(1, 21))
    assert all(slept == 0.0 for step, slept in clock.trace if step <= 10), clock.trace[:11]
    slept = [s for _, s in clock.trace]
    assert all(later > earlier for earlier, later in zip(slept[9:], slept[10:])), slept
    # From step 10 on, each step sleeps about 3x its own duration.
    busy = sum(clock.durations[10:]) - slowdown.slept_s
    assert 2.4 < slowdown.slept_s / busy < 3.6, (slowdown.slept_s, busy)  # 3, not 2 or 4; a loaded machine stretches it


@pytest.mark.timeout(60)
def test_rank_not_listed_does_not_sleep():
    slowdown = Slowdown({1: 5.0, 3: lambda step: 2.0})
    fit(12, slowdown)
    assert slowdown.local_step == 12
    assert slowdown.slept_s == 0.0


@pytest.mark.timeout(60)
def test_counts_optimizer_steps_under_gradient_accumulation():
    slowdown = Slowdown({0: 2.0}, clock="wall")
    clock = fit(12, slowdown, accumulate=3)
    assert slowdown.local_step == 4
    # Sleeps happen only on the batches that complete an optimizer step ...
    sleeps = [b - a for (_, a), (_, b) in zip([(0, 0.0)] + clock.trace, clock.trace)]
    assert [s > 0 for s in sleeps] == [False, False, True] * 4, sleeps
    # ... and with k = 2 they last about as long as the three batches each completes (summed over
    # the four steps). Wall-clock ratios swing with a loaded machine's scheduling (2.2 was seen on
    # CI), so the bounds only tell the right sum from the wrong ones: sleeping for one batch of the
    # three gives about 1/3, for each batch separately about 3.
    slept = sum(sleeps[3 * group + 2] for group in range(4))
    worked = sum(clock.durations) - slept
    assert 0.5 < slept / worked < 2.6, (clock.durations, sleeps)


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


@pytest.mark.timeout(60)
def test_cpu_clock_stretches_compute_but_not_waiting():
    """clock="cpu" leaves time spent blocked (here the forward's sleep, standing in for a wait in
    a collective) out of the step, so only computation is made k times slower."""
    steps = 20
    wall = Slowdown({0: 3.0}, clock="wall")
    cpu = Slowdown({0: 3.0}, clock="cpu")
    fit(steps, wall)
    fit(steps, cpu)
    waiting_stretched_by_wall = 2 * FORWARD_SLEEP_S * steps
    assert wall.slept_s - cpu.slept_s > 0.8 * waiting_stretched_by_wall
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
    communicating) is not stretched, where clock="cpu" stretches it k times."""
    steps = 20
    thread = Slowdown({0: 3.0})
    cpu = Slowdown({0: 3.0}, clock="cpu")
    assert thread.clock == "thread"
    for slowdown in (thread, cpu):
        clock = StepClock(slowdown)
        Trainer(
            accelerator="cpu", devices=1, max_epochs=1, callbacks=[BackgroundWork(), slowdown, clock], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ).fit(HeavyModule(), train_dataloaders=loader(steps))
    background_stretched_by_cpu = 2 * BACKGROUND_S * steps
    assert cpu.slept_s - thread.slept_s > 0.8 * background_stretched_by_cpu, (cpu.slept_s, thread.slept_s)
    assert thread.slept_s > 0  # the training thread's matmuls are still stretched


def test_step_stretcher_in_a_plain_loop_stretches_only_the_threads_computation():
    """The plain-loop form the benchmarks' non-Lightning peers use: k - 1 times the thread's CPU
    time since the last restart, however long the step waited."""
    stretcher = StepStretcher()
    for _ in range(3):
        stretcher.restart()
        end = time.thread_time() + 0.02
        while time.thread_time() < end:  # 20 ms of computation ...
            pass
        time.sleep(0.05)  # ... and 50 ms of waiting, which a slower device would not stretch
        slept = stretcher.stretch(3.0)
        assert 0.038 <= slept < 0.05, slept
    assert stretcher.slept_s == pytest.approx(3 * 0.04, rel=0.25)
    assert stretcher.stretch(1.0) == 0.0
