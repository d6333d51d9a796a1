"""Step-interval LR schedulers that follow the cohort step instead of each rank's batches.

Lightning steps an ``interval="step"`` scheduler after every optimizer step of *this* rank, so
with uneven ranks the learning rate would drift apart (measured: 0.00282 vs 0.00656 after one
run, reference/lightning-internals.md section G.6). ElChe swaps each such scheduler for a
:class:`CohortScheduler` whose ``step()`` does nothing; at every boundary the strategy advances
the real scheduler once per ``frequency`` cohort steps crossed. Every rank then has the same
learning rate, equal to the DDP run's at the same ``global_step``, constant within a window.
"""

from __future__ import annotations

from typing import Any


class CohortScheduler:
    """Wraps a scheduler: Lightning's per-batch ``step()`` is absorbed, ElChe drives it instead."""

    def __init__(self, scheduler: Any, frequency: int) -> None:
        self.scheduler = scheduler
        self.frequency = frequency

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's per-batch call: ignored, the cohort step decides."""

    def advance(self, cohort_before: int, cohort_after: int) -> None:
        """Step the real scheduler for every multiple of ``frequency`` crossed by the cohort step."""
        for _ in range(cohort_after // self.frequency - cohort_before // self.frequency):
            self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined here: optimizer, get_last_lr, base_lrs, ...
        scheduler = self.__dict__.get("scheduler")
        if scheduler is None:  # during unpickling or copying, before __init__'s attributes exist
            raise AttributeError(name)
        return getattr(scheduler, name)


def wrap_step_schedulers(configs: list) -> list:
    """Replace every non-plateau ``interval="step"`` scheduler in ``configs``; return the wrappers."""
    wrappers = []
    for config in configs:
        if config.interval == "step" and not config.reduce_on_plateau and not isinstance(config.scheduler, CohortScheduler):
            config.scheduler = CohortScheduler(config.scheduler, config.frequency)
            wrappers.append(config.scheduler)
    return wrappers


def unwrap_schedulers(configs: list) -> None:
    for config in configs:
        if isinstance(config.scheduler, CohortScheduler):
            config.scheduler = config.scheduler.scheduler
