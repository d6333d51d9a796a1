"""Heterogeneous hardware on equal hardware: make chosen ranks k times slower.

``Slowdown({1: 3.0})`` makes rank 1 three times slower per optimizer step by sleeping
``(k - 1)`` times the step's measured duration just before the optimizer step. Sleeping, not spinning, leaves the
shared cores to the fast ranks, so a 2-process run on one machine behaves like a fast and a
slow GPU (reference/benchmarking.md). ``k`` may be a function of the rank's local step count,
to model a GPU that throttles mid-run.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Literal, Mapping, Union

import lightning.pytorch as pl
from torch.optim import Optimizer
from typing_extensions import override

Factor = Union[float, Callable[[int], float]]


class Slowdown(pl.Callback):
    """Make the ranks in ``factors`` ``k`` times slower per optimizer step.

    Args:
        factors: global rank -> k (>= 1), or rank -> ``f(local_step) -> k``. ``local_step``
            counts this rank's optimizer steps since the fit started, from 0.
        clock: ``"wall"`` (default) measures the step in wall time, so time spent waiting in
            collectives (DDP's gradient all-reduce) is stretched k times too; ``"cpu"`` measures
            the process's CPU time, which leaves waiting out: the rank computes k times slower
            while its communication keeps its speed, as with a slower GPU on the same network.
            CPU time adds up every thread, so use ``"cpu"`` with ``torch.set_num_threads(1)``.

    The measured duration runs from the end of the batch of the previous optimizer step (or the
    epoch start) to this step: data loading, forward and backward of every accumulated batch and
    Lightning's per-batch work, so the whole step is k times longer. Callbacks that ran in the
    previous batch's ``on_train_batch_end`` before this one (ElChe's averaging boundary among
    them) are not counted. Sleeping before the optimizer step keeps the slowness inside the
    batch that caused it. Gradient accumulation and manual optimization (one sleep per
    ``optimizer.step()``) are covered. Works with any strategy, DDP included.
    """

    def __init__(self, factors: Mapping[int, Factor], clock: Literal["wall", "cpu"] = "wall") -> None:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"Slowdown: `clock` must be 'wall' or 'cpu', got {clock!r}")
        for rank, factor in factors.items():
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise ValueError(f"Slowdown: ranks must be non-negative integers, got {rank!r}")
            if not callable(factor):
                self._check_factor(rank, factor)
        self.factors = dict(factors)
        self.clock = clock
        self._now = time.perf_counter if clock == "wall" else time.process_time
        self.local_step = 0
        self.slept_s = 0.0
        self._mark = self._now()
        self._stepped = False

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
        self.slept_s = 0.0

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._mark = self._now()  # validation and epoch start-up are not part of a step

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer) -> None:
        """Sleep before the step, so the slowness stays inside the batch that caused it."""
        extra = (self.factor(trainer.global_rank) - 1.0) * (self._now() - self._mark)
        if extra > 0:
            time.sleep(extra)
            self.slept_s += extra
        self.local_step += 1
        self._stepped = True
        self._mark = self._now()  # a second optimizer in the same batch measures from here

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stepped:  # the next step starts now; accumulation batches keep counting
            self._mark = self._now()
            self._stepped = False
