"""What ElChe takes over from the Trainer for one fit, and gives back when the fit ends.

Lightning judges several settings on each rank's own counters and clock after every batch, which
ranks running different numbers of batches cannot share: ``max_steps``, step-interval LR schedulers,
``ModelCheckpoint(every_n_train_steps=N)`` and ``(train_time_interval=...)``, ``Trainer(max_time=...)``,
``val_check_interval`` other than once per epoch, ``limit_train_batches`` and its SIGTERM handling (a
broadcast per batch). :class:`TrainerTakeover` is their one owner: it disables Lightning's per-rank
check of each, hands the cohort core what it must decide at boundaries instead
(:class:`~lightning_elche.cohort.limits.FitLimits`), applies those decisions, and restores every
setting at teardown, so a later fit (or ``trainer.validate``) sees the Trainer as the user built it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_elche.cohort.limits import CLOCK_VALIDATION, FitLimits, ValidationSchedule, time_checkpoint_bit
from lightning_elche.cohort.records import Outcome
from lightning_elche.lightning import _lightning
from lightning_elche.lightning.schedulers import CohortScheduler, unwrap_schedulers, wrap_step_schedulers


def validation_schedule(trainer: "pl.Trainer") -> Optional[ValidationSchedule]:
    """When the user's settings validate under DDP, where that is not at each epoch's end (None)."""
    every_n_epochs, every_s = trainer.check_val_every_n_epoch, _lightning.val_check_time_interval(trainer)
    if every_s is not None:  # (Lightning leaves ``trainer.val_check_interval`` unset then)
        return ValidationSchedule(every_s=every_s, every_n_epochs=every_n_epochs)
    interval = trainer.val_check_interval
    if isinstance(interval, int):
        return ValidationSchedule(every_n_batches=interval, every_n_epochs=every_n_epochs)
    if interval != 1.0:
        return ValidationSchedule(epoch_fraction=interval, every_n_epochs=every_n_epochs)
    return None


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
        checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        self._step_checkpoints = [
            (checkpoint, _lightning.step_checkpoint_interval(checkpoint))
            for checkpoint in checkpoints
            if _lightning.step_checkpoint_interval(checkpoint) > 0
        ]
        self._time_checkpoints = [
            (checkpoint, interval) for checkpoint in checkpoints
            if (interval := _lightning.train_time_interval(checkpoint)) is not None
        ]  # fmt: skip
        self._last_time_checkpoint = [time.monotonic()] * len(self._time_checkpoints)
        for checkpoint, _ in self._time_checkpoints:
            _lightning.set_train_time_interval(checkpoint, None)
        self.close_checkpoints()
        self._validation = validation_schedule(trainer)
        self._validation_due = False
        self._epoch_fraction = None if self._validation is None else self._validation.epoch_fraction
        if self._epoch_fraction is not None:
            trainer.val_check_interval = _lightning.BATCH_VALIDATION_STANDIN
        if self._validation is not None:
            _lightning.decide_validation(trainer, self._take_validation_due)
        self._user_batch_limit = trainer.limit_train_batches
        self.batch_limit = self._take_over_batch_limit(trainer)
        self.limits = FitLimits(
            max_steps=_lightning.take_over_max_steps(trainer),
            min_steps=trainer.fit_loop.min_steps,
            step_checkpoint_every=tuple(every_n for _, every_n in self._step_checkpoints),
            time_limits_s=tuple(duration for _, duration in self._step_timers),
            validation=self._validation,
        )

    @staticmethod
    def _take_over_batch_limit(trainer: "pl.Trainer") -> Optional[Union[int, float]]:
        """``limit_train_batches`` as the epoch's plan applies it (None: whole epochs). Lightning would cap
        each rank's batches, cutting the fast rank's larger share; ``fast_dev_run``'s cap becomes the
        ``max_steps`` it also sets, and 0 (no training) stays Lightning's."""
        limit = trainer.limit_train_batches
        whole = isinstance(limit, float) and limit == 1.0
        if whole or limit == 0:
            return None
        trainer.limit_train_batches = 1.0
        return None if _lightning.connector_attributes(trainer).fast_dev_run else limit

    def _take_validation_due(self) -> bool:
        due, self._validation_due = self._validation_due, False
        return due

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

    def clock_due(self) -> int:
        """What this rank's clock says is due (rank 0's decides for the cohort): a time-based validation
        (``limits.CLOCK_VALIDATION``) and each time checkpoint (``limits.time_checkpoint_bit``)."""
        due, now = 0, time.monotonic()
        every_s = None if self._validation is None else self._validation.every_s
        if every_s is not None and _lightning.seconds_since_validation(self.trainer) >= every_s:
            due |= CLOCK_VALIDATION
        for index, ((_, interval), last) in enumerate(zip(self._time_checkpoints, self._last_time_checkpoint)):
            if now - last >= interval.total_seconds():
                due |= time_checkpoint_bit(index)
        return due

    def close_checkpoints(self) -> None:
        """Step and time checkpoints save only after the batches a boundary opens them for."""
        for checkpoint, _ in [*self._step_checkpoints, *self._time_checkpoints]:
            _lightning.set_step_checkpoint_interval(checkpoint, 0)

    def apply(self, outcome: Outcome) -> None:
        """A boundary's decisions on validation and checkpoints, for the batch it closes.

        ``ModelCheckpoint(every_n_train_steps=N)`` saves where the cohort step reaches a multiple of N
        (exactly on it under planned dispatch, at the first boundary past it under dynamic dispatch),
        a time checkpoint where rank 0's clock said its interval had passed: each one's own check (per
        rank, after every batch; ModelCheckpoint runs after ElChe's callback) is opened
        (``every_n_train_steps=1``) for this batch only. Validation runs after it if the cohort says so."""
        before, after = outcome.cohort_step_before, outcome.cohort_step
        for checkpoint, every_n in self._step_checkpoints:
            if after // every_n > before // every_n:
                _lightning.set_step_checkpoint_interval(checkpoint, 1)
        now = time.monotonic()
        for index, (checkpoint, _) in enumerate(self._time_checkpoints):
            if outcome.time_checkpoints & time_checkpoint_bit(index):
                _lightning.set_step_checkpoint_interval(checkpoint, 1)
                self._last_time_checkpoint[index] = now
        self._validation_due = self._validation_due or outcome.validate

    def train_s(self) -> float:
        """Rank 0's training clock for ``max_time``, carried in the boundary's control data (0 without one)."""
        return self._step_timers[0][0].time_elapsed() if self._step_timers else 0.0

    def hand_back_max_steps(self, max_steps: int) -> None:
        """The cohort reached ``max_steps``: Lightning then ends the fit after this batch as under DDP."""
        _lightning.restore_max_steps(self.trainer, max_steps)

    def give_back(self) -> None:
        """Every setting as the user built it, and Lightning's own signal handling and validation decision."""
        trainer = self.trainer
        _lightning.remove_sigterm_patches(trainer)
        self.hand_back_max_steps(self.limits.max_steps)
        unwrap_schedulers(self._scheduler_configs)
        self._schedulers = []
        for checkpoint, every_n in self._step_checkpoints:
            _lightning.set_step_checkpoint_interval(checkpoint, every_n)
        for checkpoint, interval in self._time_checkpoints:
            _lightning.set_step_checkpoint_interval(checkpoint, 0)
            _lightning.set_train_time_interval(checkpoint, interval)
        for timer, _ in self._step_timers:
            _lightning.set_timer_interval(timer, "step")
        _lightning.restore_validation_decision(trainer)
        if self._epoch_fraction is not None:
            trainer.val_check_interval = self._epoch_fraction
        trainer.limit_train_batches = self._user_batch_limit
