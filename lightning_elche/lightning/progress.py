"""ElChe in Lightning's progress bar: this rank's expected batches as the total, the anchor and share beside.

ElChe's sampler has no length (a rank's share of the epoch is decided window by window), so
Lightning would show ``18/?`` with no percentage and no ETA. The total is set on the two bars
Lightning ships, re-estimated at every boundary (:func:`expected_batches`), exact once the epoch's
last window closed. The last boundary's anchor and this rank's share go into
``trainer.progress_bar_metrics``, which any progress bar built on Lightning's ``get_metrics`` shows,
custom ones included; not into ``trainer.callback_metrics`` (``self.log`` would put them there too),
whose ``elche/`` values are the same on every rank (the share is this rank's own). TensorBoard has
them as ``elche/anchor`` and ``elche/rank{r}/share``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_elche.cohort.core import Cohort


def expected_batches(cohort: Cohort, batches_done: int) -> Optional[int]:
    """This rank's batches in the current epoch as far as can be told after ``batches_done`` of them:
    its share (the controller's) of the samples the cohort has not trained yet, on top. Exact once
    the epoch's last window closed; None where the epoch has no end."""
    plan, data = cohort.plan, cohort.data
    if plan is None or data is None or plan.total_steps is None:  # no plan yet, or an epoch without an end
        return None
    trained = 0
    for record in reversed(cohort.history):
        if record.epoch != plan.epoch:
            break
        trained += sum(record.samples)
    left = max(plan.usable - trained, 0)
    return batches_done + math.ceil(left * cohort.controller.shares[cohort.rank] / data.rank_batch_size(cohort.rank))


def show_progress(trainer: "pl.Trainer", cohort: Cohort, batches_done: int, last_batch: bool) -> None:
    """The bar's total after ``batches_done`` batches of this epoch, and the last boundary's anchor and share.
    Until this rank's last batch the total stays ahead of the count, so the bar never reads 100 %
    early when the estimate runs short."""
    total = expected_batches(cohort, batches_done)
    if total is not None:
        set_train_total(trainer.progress_bar_callback, total)
        if not last_batch:
            keep_total_ahead(trainer.progress_bar_callback, batches_done)
    if cohort.history:
        record = cohort.history[-1]
        shown = {"elche_anchor": float(record.anchor)}
        if cohort.rank < len(record.samples):  # a rank admitted at the last boundary has no share in it yet
            shown["elche_share"] = record.samples[cohort.rank] / (sum(record.samples) or 1)
        # the dict the property returns is the logger connector's own (tests/test_lightning_internals.py)
        trainer.progress_bar_metrics.update(shown)


def keep_total_ahead(bar: Optional[pl.Callback], batches_done: int) -> None:
    """Before this rank's last batch: a total the count has reached grows by one (the estimate ran short)."""
    total = train_total(bar)
    if total is not None and total <= batches_done:
        set_train_total(bar, batches_done + 1)


def train_total(bar: Optional[pl.Callback]) -> Optional[float]:
    """The train total Lightning's TQDM or Rich bar shows now (None: none, or another bar)."""
    if (tqdm := _tqdm_train_bar(bar)) is not None:
        return tqdm.total
    if (rich := _rich_train_task(bar)) is not None:
        progress, task = rich
        return progress.tasks[task].total
    return None


def set_train_total(bar: Optional[pl.Callback], total: int) -> None:
    """Give Lightning's TQDM or Rich bar its train total (other bars keep theirs)."""
    if (tqdm := _tqdm_train_bar(bar)) is not None:
        tqdm.total = total
    elif (rich := _rich_train_task(bar)) is not None:
        progress, task = rich
        progress.update(task, total=total)


def _tqdm_train_bar(bar: Optional[pl.Callback]) -> Any:
    if isinstance(bar, TQDMProgressBar) and bar.is_enabled:
        with contextlib.suppress(TypeError):  # no train bar yet (Lightning raises TypeError then)
            return bar.train_progress_bar
    return None


def _rich_train_task(bar: Optional[pl.Callback]) -> Optional[tuple[Any, Any]]:
    if isinstance(bar, RichProgressBar) and bar.is_enabled and bar.progress is not None:
        task = getattr(bar, "train_progress_bar_id", None)  # declared, set once the train bar exists
        if task is not None:
            return bar.progress, task
    return None
