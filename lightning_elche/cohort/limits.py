"""The fit's limits in DDP-equivalent steps and on rank 0's clock, which only a boundary can decide.

Lightning judges ``max_steps``, ``min_steps``, ``ModelCheckpoint(every_n_train_steps)`` and
``Trainer(max_time)`` on each rank's own counters and clock after every batch. Ranks run different
numbers of batches here, so the adapter takes these settings over (``lightning/takeover.py``) and the
cohort core decides them at boundaries, where every rank knows the cohort step and rank 0's clock.
They carry over unchanged from one generation of an elastic cohort to the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class FitLimits:
    """What ends the fit, or needs a consensus, at a boundary.

    Args:
        max_steps: ``Trainer(max_steps)`` in DDP-equivalent steps (-1: none); the last windows are
            cut so that the cohort lands on it exactly.
        min_steps: ``Trainer(min_steps)``; a stop request waits until the cohort has reached it.
        step_checkpoint_every: the ``every_n_train_steps`` of step checkpoints, which need a consensus.
        time_limits_s: ``Trainer(max_time)`` durations, judged on rank 0's training clock.
    """

    max_steps: int = -1
    min_steps: Optional[int] = None
    step_checkpoint_every: tuple[int, ...] = ()
    time_limits_s: tuple[float, ...] = ()

    def steps_left(self, cohort_steps_total: int, world_size: int) -> Optional[int]:
        """Optimizer steps all ranks together may still take (None: no ``max_steps``)."""
        return None if self.max_steps < 0 else self.max_steps * world_size - cohort_steps_total

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


NO_LIMITS = FitLimits()  # a fit that only its data ends
