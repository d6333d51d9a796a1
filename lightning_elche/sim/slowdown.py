"""Heterogeneous hardware on equal hardware: make chosen ranks k times slower, or the link between them.

``Slowdown({1: 3.0})`` makes rank 1 three times slower per optimizer step by sleeping
``(k - 1)`` times the step's measured duration just before the optimizer step. Sleeping, not spinning, leaves the
shared cores to the fast ranks, so a 2-process run on one machine behaves like a fast and a
slow GPU (docs/simulator.md). ``k`` may be a function of the rank's local step count,
to model a GPU that throttles mid-run.

What is measured decides what is stretched. A slower GPU computes slower, but its network and its
waiting for others do not change, so the default clock is the training thread's own CPU time:
communication runs in the process group's threads and waiting costs no CPU, so neither is
stretched, whatever the strategy. :class:`StepStretcher` is the same rule for a plain PyTorch loop,
so that a benchmark's non-Lightning peers are slowed exactly like Lightning runs.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Literal, Mapping, Union

import lightning.pytorch as pl
from torch.optim import Optimizer
from typing_extensions import override

from lightning_elche.cohort.link import transfer_ms

Factor = Union[float, Callable[[int], float]]
Clock = Literal["thread", "cpu", "wall"]
CLOCKS: dict[str, Callable[[], float]] = {"thread": time.thread_time, "cpu": time.process_time, "wall": time.perf_counter}


class StepStretcher:
    """Stretch a step k times: sleep ``(k - 1)`` times what ``clock`` measured since :meth:`restart`.

    ``clock``: ``"thread"`` (default) counts the calling thread's CPU time only, so communication
    (gloo's threads) and waiting (blocked, no CPU) are left out: only computation is slowed. Run
    the computation on that thread (``torch.set_num_threads(1)``): work on torch's other intra-op
    threads is not counted. ``"cpu"`` counts every thread of the process, so gloo's communication
    threads are stretched too (measured DDP then reads 16-31 % low); ``"wall"`` stretches waiting
    in collectives as well.
    """

    def __init__(self, clock: Clock = "thread") -> None:
        if clock not in CLOCKS:
            raise ValueError(f"Slowdown: `clock` must be one of {sorted(CLOCKS)}, got {clock!r}")
        self.clock = clock
        self._now = CLOCKS[clock]
        self.slept_s = 0.0
        self._mark = self._now()

    def restart(self) -> None:
        """The step starts now (an epoch's start, the end of the previous step)."""
        self._mark = self._now()

    def stretch(self, factor: float) -> float:
        """Sleep so that the step since :meth:`restart` takes ``factor`` times as long; restart."""
        extra = (factor - 1.0) * (self._now() - self._mark)
        if extra > 0:
            time.sleep(extra)
            self.slept_s += extra
        self.restart()
        return max(extra, 0.0)


class Slowdown(pl.Callback):
    """Make the ranks in ``factors`` ``k`` times slower per optimizer step.

    Args:
        factors: global rank -> k (>= 1), or rank -> ``f(local_step) -> k``. ``local_step``
            counts this rank's optimizer steps since the fit started, from 0.
        clock: what a step's duration is measured in (see :class:`StepStretcher`): ``"thread"``
            (default; the training thread's CPU time, so communication and waiting keep their
            speed, as with a slower GPU on the same network), ``"cpu"`` (the whole process's CPU
            time) or ``"wall"``.

    The measured duration runs from the end of the batch of the previous optimizer step (or the
    epoch start) to this step: data loading, forward and backward of every accumulated batch and
    Lightning's per-batch work, so the whole step is k times longer. Callbacks that ran in the
    previous batch's ``on_train_batch_end`` before this one (ElChe's averaging boundary among
    them) are not counted. Sleeping before the optimizer step keeps the slowness inside the
    batch that caused it. Gradient accumulation and manual optimization (one sleep per
    ``optimizer.step()``) are covered. Works with any strategy, DDP included.

    Each validation batch is stretched k times too, measured on its own from the batch's start: a
    slower device evaluates slower as well. Validation does not count in the next training step.
    """

    def __init__(self, factors: Mapping[int, Factor], clock: Clock = "thread") -> None:
        self._stretcher = StepStretcher(clock)
        self._validation = StepStretcher(clock)
        for rank, factor in factors.items():
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise ValueError(f"Slowdown: ranks must be non-negative integers, got {rank!r}")
            if not callable(factor):
                self._check_factor(rank, factor)
        self.factors = dict(factors)
        self.clock = clock
        self.local_step = 0
        self._stepped = False

    @property
    def slept_s(self) -> float:
        """Seconds slept to stretch training steps (validation's are apart: ``validation_slept_s``)."""
        return self._stretcher.slept_s

    @property
    def validation_slept_s(self) -> float:
        return self._validation.slept_s

    @staticmethod
    def _check_factor(rank: int, factor: Any) -> float:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
            raise ValueError(f"Slowdown: the factor for rank {rank} must be a number >= 1, got {factor!r}")
        return float(factor)

    def factor(self, rank: int) -> float:
        factor = self.factors.get(rank, 1.0)
        value = factor(self.local_step) if callable(factor) else factor
        return self._check_factor(rank, value)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.local_step = 0
        self._stretcher.slept_s = 0.0

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stretcher.restart()  # validation and epoch start-up are not part of a step

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer) -> None:
        """Sleep before the step, so the slowness stays inside the batch that caused it."""
        self._stretcher.stretch(self.factor(trainer.global_rank))  # a second optimizer in the batch measures from here
        self.local_step += 1
        self._stepped = True

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stepped:  # the next step starts now; accumulation batches keep counting
            self._stretcher.restart()
            self._stepped = False

    @override
    def on_validation_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._validation.restart()

    @override
    def on_validation_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._validation.stretch(self.factor(trainer.global_rank))

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stretcher.restart()  # the next training step starts measuring now, not before validation


class SlowLink:
    """A slower link between the ranks, for benchmarks and tests: ``ElCheStrategy(simulated_link=SlowLink(100))``.

    Every boundary collective then waits, after it returns, as long as the bytes this rank sent
    for it take at ``mbit_s`` megabits per second, plus ``latency_ms`` (``lightning_elche.comm.link``
    counts the bytes: a ring all-reduce sends ``2 (W-1)/W`` of its tensor). It needs no root and
    no traffic shaping; its limits are in docs/slow-links.md. The controller is told the link (as
    ``link_mbit_s`` would) unless ``link_mbit_s`` says otherwise.
    """

    def __init__(self, mbit_s: float, latency_ms: float = 0.0) -> None:
        if isinstance(mbit_s, bool) or not isinstance(mbit_s, (int, float)) or not (math.isfinite(mbit_s) and mbit_s > 0):
            raise ValueError(f"SlowLink: `mbit_s` must be a positive number of megabits per second, got {mbit_s!r}")
        if isinstance(latency_ms, bool) or not isinstance(latency_ms, (int, float)) or not (
            math.isfinite(latency_ms) and latency_ms >= 0
        ):
            raise ValueError(f"SlowLink: `latency_ms` must be a number of milliseconds >= 0, got {latency_ms!r}")
        self.mbit_s = float(mbit_s)
        self.latency_ms = float(latency_ms)

    def __repr__(self) -> str:
        return f"SlowLink(mbit_s={self.mbit_s:g}, latency_ms={self.latency_ms:g})"

    def seconds(self, sent_bytes: int) -> float:
        """How long sending ``sent_bytes`` takes on this link."""
        return transfer_ms(sent_bytes, self.mbit_s, self.latency_ms) / 1000.0
