"""The fit's limits and schedules in DDP-equivalent steps and on rank 0's clock, which only a boundary can decide.

Lightning judges ``max_steps``, ``min_steps``, ``ModelCheckpoint(every_n_train_steps)``,
``Trainer(max_time)``, ``val_check_interval`` / ``check_val_every_n_epoch`` and
``ModelCheckpoint(train_time_interval)`` on each rank's own counters and clock after every batch.
Ranks run different numbers of batches here, so the adapter takes these settings over
(``lightning/takeover.py``) and the cohort core decides them at boundaries, where every rank knows
the cohort step and rank 0's clock. The step-counted ones are *milestones*: the windows before one
are cut so that a boundary lands on it exactly (planned dispatch), so validation, checkpoints and
their names fall on the global steps DDP would give them. They carry over unchanged from one
generation of an elastic cohort to the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

CLOCK_VALIDATION = 1  # bit 0 of a report's "clock_due": rank 0's validation interval has elapsed


def time_checkpoint_bit(index: int) -> int:
    """The "clock_due" bit of the ``index``-th ``ModelCheckpoint(train_time_interval=...)``."""
    return 2 << index


@dataclass(frozen=True)
class ValidationSchedule:
    """When Lightning would validate inside a fit under DDP, when that is not simply at each epoch's end.

    Exactly one of ``every_n_batches`` (``val_check_interval=N``), ``epoch_fraction``
    (``val_check_interval=0.25``) and ``every_s`` (a time-based ``val_check_interval``) is set;
    ``every_n_epochs`` is ``check_val_every_n_epoch`` (None: ``every_n_batches`` counts the fit's
    batches across epochs, as DDP's ``total_batch_idx`` does).
    """

    every_n_batches: Optional[int] = None
    epoch_fraction: Optional[float] = None
    every_s: Optional[float] = None
    every_n_epochs: Optional[int] = 1

    def validates_in(self, epoch: int) -> bool:
        """Whether ``epoch`` validates at all (``check_val_every_n_epoch``)."""
        return self.every_n_epochs is None or (epoch + 1) % self.every_n_epochs == 0

    @property
    def counts_across_epochs(self) -> bool:
        return self.every_n_batches is not None and self.every_n_epochs is None

    def epoch_steps(self, epoch: int, start_step: int, ddp_batches: int, accumulation: int) -> tuple[int, ...]:
        """The cohort steps at which epoch ``epoch`` validates when it starts at ``start_step`` and DDP
        would give each rank ``ddp_batches`` batches of it: after each ``val_check_batch``-th batch of the
        epoch, as DDP's ``batch_idx`` counts them (validation inside an accumulation lands on the step
        that completes it)."""
        if not self.validates_in(epoch) or self.counts_across_epochs or self.every_s is not None:
            return ()
        if self.every_n_batches is not None:
            every = self.every_n_batches
        else:
            assert self.epoch_fraction is not None
            every = max(1, int(ddp_batches * self.epoch_fraction))  # Lightning's val_check_batch
        return tuple(start_step + -(-k * every // accumulation) for k in range(1, ddp_batches // every + 1))

    def next_across_epochs(self, step: int, accumulation: int) -> Optional[int]:
        """The first cohort step after ``step`` at which a count across epochs validates (None: not one)."""
        if not self.counts_across_epochs:
            return None
        assert self.every_n_batches is not None
        every = self.every_n_batches
        k = step * accumulation // every + 1  # the first k with k * every / accumulation > step
        return -(-k * every // accumulation)


@dataclass(frozen=True)
class FitLimits:
    """What ends the fit, or needs a consensus, at a boundary.

    Args:
        max_steps: ``Trainer(max_steps)`` in DDP-equivalent steps (-1: none); the last windows are
            cut so that the cohort lands on it exactly.
        min_steps: ``Trainer(min_steps)``; a stop request waits until the cohort has reached it.
        step_checkpoint_every: the ``every_n_train_steps`` of step checkpoints, which need a consensus.
        time_limits_s: ``Trainer(max_time)`` durations, judged on rank 0's training clock.
        validation: when validation runs inside the fit (None: Lightning's own, at each epoch's end).
    """

    max_steps: int = -1
    min_steps: Optional[int] = None
    step_checkpoint_every: tuple[int, ...] = ()
    time_limits_s: tuple[float, ...] = ()
    validation: Optional[ValidationSchedule] = None

    def steps_left(self, cohort_steps_total: int, world_size: int) -> Optional[int]:
        """Optimizer steps all ranks together may still take (None: no ``max_steps``)."""
        return None if self.max_steps < 0 else self.max_steps * world_size - cohort_steps_total

    def steps_allowed(
        self, start_total: int, world_size: int, accumulation: int, epoch_validations: Sequence[int]
    ) -> Optional[int]:
        """Optimizer steps of all ranks a window that starts at ``start_total`` (all ranks' steps so far)
        may take so that the cohort lands exactly on ``max_steps`` and on the next milestone (None: no
        limit). Short of one step per rank the window still takes one each, and the cohort step
        (the total over the world size, rounded down) still lands on the milestone."""
        step = start_total // world_size
        targets = [self.max_steps] if self.max_steps >= 0 else []
        milestone = self.next_milestone(step, accumulation, epoch_validations)
        if milestone is not None:
            targets.append(milestone)
        return min(targets) * world_size - start_total if targets else None

    def next_milestone(self, step: int, accumulation: int, epoch_validations: Sequence[int]) -> Optional[int]:
        """The first cohort step after ``step`` that a step checkpoint or a validation falls on."""
        candidates = [(step // every + 1) * every for every in self.step_checkpoint_every]
        candidates.extend(s for s in epoch_validations if s > step)
        across = None if self.validation is None else self.validation.next_across_epochs(step, accumulation)
        if across is not None:
            candidates.append(across)
        return min(candidates, default=None)

    def validation_due(
        self, before: int, after: int, accumulation: int, epoch_validations: Sequence[int], epoch_ends: bool
    ) -> bool:
        """Whether a step validation falls in ``(before, after]``; at the epoch's last boundary, any of its
        own validations not reached yet too (DDP's last batch validates where the schedule meets it)."""
        if self.validation is None:
            return False
        across = self.validation.next_across_epochs(before, accumulation)
        if across is not None and across <= after:
            return True
        return any(before < s <= after or (epoch_ends and s > before) for s in epoch_validations)

    def reached(self, cohort_step: int) -> bool:
        """Whether ``max_steps`` is reached at ``cohort_step``."""
        return self.max_steps >= 0 and cohort_step >= self.max_steps

    def may_stop(self, cohort_step: int) -> bool:
        """Whether a stop request may take effect at ``cohort_step`` (``min_steps`` met)."""
        return not self.min_steps or cohort_step >= self.min_steps

    def checkpoint_due(self, before: int, after: int) -> bool:
        """Whether a step checkpoint's multiple lies in ``(before, after]``."""
        return any(after // every > before // every for every in self.step_checkpoint_every)

    def time_is_up(self, train_s: float) -> bool:
        """Whether rank 0's training clock has reached a ``max_time``."""
        return any(train_s >= limit for limit in self.time_limits_s)

    @property
    def has_step_milestones(self) -> bool:
        """Whether something falls on given cohort steps (which planned dispatch lands on exactly)."""
        validation = self.validation
        return bool(self.step_checkpoint_every) or (validation is not None and validation.every_s is None)


@dataclass(frozen=True)
class EpochMilestones:
    """The current epoch's milestones: the fit's limits, where the epoch began (``start_step``) and the
    cohort steps at which it validates by its own batch count (``validations``)."""

    limits: FitLimits
    start_step: int = 0
    validations: tuple[int, ...] = ()
    accumulation: int = 1  # DDP's batches per optimizer step

    @classmethod
    def of_epoch(
        cls, limits: FitLimits, epoch: int, start_step: int, ddp_batches: Optional[int], accumulation: int
    ) -> "EpochMilestones":
        """Epoch ``epoch``, begun at ``start_step``, of ``ddp_batches`` DDP batches per rank (None: endless)."""
        schedule = limits.validation
        validations = () if schedule is None or ddp_batches is None else schedule.epoch_steps(
            epoch, start_step, ddp_batches, accumulation
        )  # fmt: skip
        return cls(limits, start_step, validations, accumulation)

    def window_cap(self, start_total: int, world_size: int) -> Optional[int]:
        """Steps of all ranks a window starting at ``start_total`` may take (:meth:`FitLimits.steps_allowed`)."""
        return self.limits.steps_allowed(start_total, world_size, self.accumulation, self.validations)

    def consensus_due(self, before: int, after: int, clock_due: int) -> bool:
        """Whether a boundary that moves the cohort from step ``before`` to ``after`` inside the epoch, rank 0's
        clock saying ``clock_due``, leads to something that needs every rank's parameters the same: a step
        checkpoint or validation, ``max_steps``, a time-based validation or checkpoint."""
        limits = self.limits
        validation = limits.validation_due(before, after, self.accumulation, self.validations, epoch_ends=False)
        return limits.checkpoint_due(before, after) or limits.reached(after) or validation or clock_due != 0

    def acted_on(self, before: int, after: int, epoch_ends: bool, clock_due: int) -> dict[str, Any]:
        """What the boundary that moved the cohort from ``before`` to ``after`` (the epoch's last one:
        ``epoch_ends``) does besides averaging, as :class:`~lightning_elche.cohort.records.Outcome`'s fields:
        validate (a step validation passed, or rank 0's clock says one is due), which time checkpoints save."""
        validation = self.limits.validation_due(before, after, self.accumulation, self.validations, epoch_ends)
        return {
            "validate": validation or bool(clock_due & CLOCK_VALIDATION),
            "time_checkpoints": clock_due & ~CLOCK_VALIDATION,
        }


def ddp_batches_per_rank(num_samples: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches each rank runs per epoch under DDP: Lightning's DistributedSampler pads the dataset to a
    multiple of the world size, then each rank's DataLoader batches its part."""
    per_rank = math.ceil(num_samples / world_size)
    return per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)


NO_LIMITS = FitLimits()  # a fit that only its data ends
