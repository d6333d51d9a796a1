"""Step-interval LR schedulers that follow the cohort step instead of each rank's batches.

Lightning steps an ``interval="step"`` scheduler after every optimizer step of *this* rank, so
with uneven ranks the learning rate would drift apart (measured: 0.00282 vs 0.00656 after one
run). ElChe swaps each such scheduler for a :class:`CohortScheduler` whose ``step()`` does
nothing; the real scheduler is stepped once per ``frequency`` DDP-equivalent steps the cohort
crosses. Between boundaries each rank follows its interpolated position in the window (a rank
that runs three times the steps of another takes a third of a DDP step per batch), so a warmup
or decay is traced step by step rather than as one stair per window; at every boundary the
cohort step is exact and every rank has DDP's learning rate at that ``global_step``. The
interpolation never runs ahead of the boundary's exact step, so no scheduler is ever rewound.
"""

from __future__ import annotations

from typing import Any


class CohortScheduler:
    """Wraps a scheduler: Lightning's per-batch ``step()`` is absorbed, ElChe drives it instead."""

    def __init__(self, scheduler: Any, frequency: int, position: int) -> None:
        self.scheduler = scheduler
        self.frequency = frequency
        self.position = position  # the DDP-equivalent step the real scheduler has been stepped to

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's per-batch call: ignored, the cohort step decides."""

    def follow(self, cohort_step: int) -> None:
        """Step the real scheduler for every multiple of ``frequency`` between its position and ``cohort_step``."""
        if cohort_step <= self.position:
            return
        for _ in range(cohort_step // self.frequency - self.position // self.frequency):
            self.scheduler.step()
        self.position = cohort_step

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


def wrap_step_schedulers(configs: list, cohort_step: int) -> list:
    """Replace every non-plateau ``interval="step"`` scheduler in ``configs``; return the wrappers.

    ``cohort_step`` is where the schedulers stand: 0, or the step of the checkpoint resumed from.
    """
    wrappers = []
    for config in configs:
        if config.interval == "step" and not config.reduce_on_plateau and not isinstance(config.scheduler, CohortScheduler):
            config.scheduler = CohortScheduler(config.scheduler, config.frequency, cohort_step)
            wrappers.append(config.scheduler)
    return wrappers


def unwrap_schedulers(configs: list) -> None:
    for config in configs:
        if isinstance(config.scheduler, CohortScheduler):
            config.scheduler = config.scheduler.scheduler
