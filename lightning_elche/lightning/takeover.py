"""What ElChe takes over from the Trainer for one fit, and gives back when the fit ends.

Lightning judges several settings on each rank's own counters and clock after every batch, which
ranks running different numbers of batches cannot share: ``max_steps``, step-interval LR schedulers,
``ModelCheckpoint(every_n_train_steps=N)``, ``Trainer(max_time=...)``, and its SIGTERM handling (a
broadcast per batch). :class:`TrainerTakeover` is their one owner: it disables Lightning's per-rank
check of each, hands the cohort core what it must decide at boundaries instead
(:class:`~lightning_elche.cohort.limits.FitLimits`), applies those decisions, and restores every
setting at teardown, so a later fit (or ``trainer.validate``) sees the Trainer as the user built it.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_elche.cohort.limits import FitLimits
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.schedulers import CohortScheduler, unwrap_schedulers, wrap_step_schedulers


class TrainerTakeover:
    """One fit's hold on the Trainer's per-rank settings; :meth:`give_back` ends it."""

    def __init__(self, trainer: "pl.Trainer", scheduler_configs: list[Any]) -> None:
        """Take the settings over from ``trainer``: what they asked for becomes :attr:`limits`."""
        self.trainer = trainer
        self._scheduler_configs = scheduler_configs
        self._schedulers: list[CohortScheduler] = []
        self._step_timers = _lightning.step_timers(trainer)
        for timer, _ in self._step_timers:
            _lightning.set_timer_interval(timer, "epoch")  # Lightning's epoch-end check is collective and coherent
        self._step_checkpoints = [
            (checkpoint, _lightning.step_checkpoint_interval(checkpoint))
            for checkpoint in trainer.checkpoint_callbacks
            if isinstance(checkpoint, ModelCheckpoint) and _lightning.step_checkpoint_interval(checkpoint) > 0
        ]
        self.open_step_checkpoints(0, 0)
        self.limits = FitLimits(
            max_steps=_lightning.take_over_max_steps(trainer),
            min_steps=trainer.fit_loop.min_steps,
            step_checkpoint_every=tuple(every_n for _, every_n in self._step_checkpoints),
            time_limits_s=tuple(duration for _, duration in self._step_timers),
        )

    def follow_lr_schedules(self, automatic_optimization: bool, cohort_step: int) -> None:
        """Step-interval LR schedulers follow the cohort step from ``cohort_step`` on (0, or where the fit
        resumed); manual optimization steps its schedulers itself."""
        if automatic_optimization:
            self._schedulers = wrap_step_schedulers(self._scheduler_configs, cohort_step)

    def follow_schedules(self, cohort_step: int) -> None:
        """Move step-interval LR schedulers to ``cohort_step`` (never back)."""
        for scheduler in self._schedulers:
            scheduler.follow(cohort_step)

    def handle_signals(self, on_sigterm: Callable[[int], None], on_requeue: Callable[[int], None]) -> None:
        """SIGTERM and SLURM's requeue signal are recorded for the next boundary instead of broadcast."""
        _lightning.install_sigterm_patches(self.trainer, on_sigterm, on_requeue)

    def open_step_checkpoints(self, cohort_before: int, cohort_after: int) -> None:
        """``ModelCheckpoint(every_n_train_steps=N)`` saves at the first boundary at or past each multiple of
        N: its own check (per rank, after every batch) is opened (``every_n_train_steps=1``) for exactly the
        boundary batches that cross a multiple of N cohort steps, closed otherwise. ModelCheckpoint runs
        after ElChe's callback in the same batch."""
        for checkpoint, every_n in self._step_checkpoints:
            crossed = cohort_after // every_n > cohort_before // every_n
            _lightning.set_step_checkpoint_interval(checkpoint, 1 if crossed else 0)

    def train_s(self) -> float:
        """Rank 0's training clock for ``max_time``, carried in the boundary's control data (0 without one)."""
        return self._step_timers[0][0].time_elapsed() if self._step_timers else 0.0

    def hand_back_max_steps(self, max_steps: int) -> None:
        """The cohort reached ``max_steps``: Lightning then ends the fit after this batch as under DDP."""
        _lightning.restore_max_steps(self.trainer, max_steps)

    def give_back(self) -> None:
        """Every setting as the user built it, and Lightning's own signal handling."""
        _lightning.remove_sigterm_patches(self.trainer)
        self.hand_back_max_steps(self.limits.max_steps)
        unwrap_schedulers(self._scheduler_configs)
        self._schedulers = []
        for checkpoint, every_n in self._step_checkpoints:
            _lightning.set_step_checkpoint_interval(checkpoint, every_n)
        for timer, _ in self._step_timers:
            _lightning.set_timer_interval(timer, "step")
