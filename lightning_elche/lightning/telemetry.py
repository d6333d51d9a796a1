"""What the controller did, for callbacks, the trainer's loggers and the end-of-fit summary.

The series of a boundary come from its record, which every rank holds identically (it is decoded
from the all-reduced control data): every rank puts them in ``trainer.callback_metrics``, so a
``ModelCheckpoint`` or ``EarlyStopping`` monitoring one decides alike on every rank, and rank 0 logs
them, both without any extra collective. Metric names live under ``elche/`` and are part of the
public interface (docs/observability.md).
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Mapping

import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_elche.lightning import _lightning

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_elche.cohort.core import Cohort
    from lightning_elche.cohort.records import BoundaryRecord, Outcome

# One chart per quantity with a line per rank (TensorBoard's custom-scalars plugin).
CUSTOM_SCALARS_LAYOUT = {
    "ElChe per rank": {
        "share of the samples": ["Multiline", [r"elche/rank\d+/share"]],
        "ms per optimizer step": ["Multiline", [r"elche/rank\d+/step_ms"]],
        "idle fraction of the window": ["Multiline", [r"elche/rank\d+/idle"]],
        "steps per window": ["Multiline", [r"elche/rank\d+/steps"]],
        "samples per second": ["Multiline", [r"elche/rank\d+/samples_per_s"]],
    },
    "ElChe cohort": {
        "throughput vs DDP estimate": ["Multiline", ["elche/throughput", "elche/ddp_estimate"]],
        "anchor": ["Multiline", ["elche/anchor"]],
        "overhead": ["Multiline", ["elche/overhead", "elche/boundary_ms"]],
        "divergence": ["Multiline", ["elche/divergence", "elche/divergence_mean"]],
        "guard verdicts": ["Multiline", ["elche/guard/suppress", "elche/guard/nudge"]],
    },
}


def boundary_cost_ms(record: "BoundaryRecord") -> float:
    """The cohort's pure boundary cost: the cheapest rank's (the last to arrive waits for nobody)."""
    positive = [ms for ms in record.previous_boundary_ms if ms > 0 and math.isfinite(ms)]
    return min(positive) if positive else 0.0


def boundary_metrics(record: "BoundaryRecord") -> dict[str, float]:
    """The ``elche/`` scalars of one boundary.

    The DDP estimate uses the same timings: DDP gives every rank an equal share and each step waits
    for the slowest, so its cohort rate is world size over the slowest rank's seconds per sample
    (optimistic for DDP: its per-step all-reduce is not counted).
    """
    world = len(record.steps)
    window_ms = max(record.window_ms)
    cost_ms = boundary_cost_ms(record)
    samples = sum(record.samples)
    metrics = {
        "elche/anchor": float(record.anchor),
        "elche/boundary_ms": cost_ms,
        "elche/overhead": cost_ms / (window_ms + cost_ms) if window_ms + cost_ms > 0 else 0.0,
        "elche/divergence": record.cohort_divergence,
        "elche/divergence_mean": record.cohort_divergence_mean,
        "elche/throughput": samples / ((window_ms + cost_ms) / 1000.0) if window_ms + cost_ms > 0 else 0.0,
    }
    seconds_per_sample = [ms / 1000.0 / n for ms, n in zip(record.window_ms, record.samples) if n > 0 and ms > 0]
    if len(seconds_per_sample) == world:
        metrics["elche/ddp_estimate"] = world / max(seconds_per_sample)
        metrics["elche/speedup_vs_ddp"] = metrics["elche/throughput"] / metrics["elche/ddp_estimate"]
    for rank in range(world):
        steps, ms, n = record.steps[rank], record.window_ms[rank], record.samples[rank]
        metrics[f"elche/rank{rank}/steps"] = float(steps)
        metrics[f"elche/rank{rank}/share"] = n / samples if samples else 0.0
        metrics[f"elche/rank{rank}/idle"] = 1.0 - ms / window_ms if window_ms > 0 else 0.0
        if steps > 0:
            metrics[f"elche/rank{rank}/step_ms"] = ms / steps
        if ms > 0:
            metrics[f"elche/rank{rank}/samples_per_s"] = n / (ms / 1000.0)
    return metrics


def cohort_series(record: "BoundaryRecord") -> dict[str, float]:
    """The ``elche/`` scalars of a boundary that every rank computes alike, from the exchanged data:
    what callbacks may monitor (the boundary's metrics and the users' rolled-up ones)."""
    metrics = boundary_metrics(record)
    metrics.update({f"elche/user/{name}": value for name, value in record.user_scalars.items()})
    return metrics


def leader_series(history: list["BoundaryRecord"], sent_bytes: int) -> dict[str, float]:
    """The scalars only rank 0 logs, which are not the same on every rank: the guard's verdicts counted
    over this rank's history (an elastic joiner's begins at its admission) and the bytes it sent."""
    return {
        "elche/guard/suppress": float(sum(r.verdict == "suppress" for r in history)),
        "elche/guard/nudge": float(sum(r.verdict == "nudge" for r in history)),
        "elche/boundary_bytes": float(sent_bytes),  # what rank 0 sent: the link's load per boundary
    }


def logs_boundary(step_before: int, step_after: int, every_n_steps: int, stops: bool) -> bool:
    """Lightning's ``log_every_n_steps`` on the cohort step axis: a boundary is logged when the steps it
    closed, ``(step_before, step_after]``, hold a multiple of ``every_n_steps``, or when the fit stops
    there (Lightning also logs the batch at which the trainer stops); nothing with ``every_n_steps=0``.

    Lightning logs a batch whose step is one below a multiple; a boundary moves the step by a whole
    window, which would jump over most multiples, so the test is whether one was passed.
    """
    if every_n_steps <= 0:
        return False
    return stops or step_after // every_n_steps > step_before // every_n_steps


def offer_to_callbacks(trainer: "pl.Trainer", metrics: Mapping[str, float]) -> None:
    """Put ``metrics`` in ``trainer.callback_metrics``, where ModelCheckpoint and EarlyStopping look for
    their ``monitor``; they stay until a boundary replaces them (Lightning clears the dict at a fit's start).

    ``self.log`` would convert and place every value per call; the dict is the logger connector's own
    (``tests/test_lightning_internals.py`` checks that it is not a copy).
    """
    trainer.callback_metrics.update({name: torch.tensor(value) for name, value in metrics.items()})


def publish(trainer: "pl.Trainer", cohort: "Cohort", outcome: "Outcome", sent_bytes: int) -> None:
    """The boundary just closed (``cohort.history[-1]``), on every rank: its series go to the callbacks,
    and rank 0 logs them at ``trainer.global_step`` when :func:`logs_boundary` says so. A guard verdict
    other than "stable" is an event, not a series: TensorBoard gets its reason at every such boundary."""
    record = cohort.history[-1]
    metrics = cohort_series(record)
    offer_to_callbacks(trainer, metrics)
    if trainer.global_rank != 0 or not trainer.loggers:
        return
    step_before = (cohort.cohort_steps_total - sum(record.steps)) // cohort.world_size
    every_n_steps = _lightning.connector_attributes(trainer).log_every_n_steps
    logged = logs_boundary(step_before, record.cohort_step, every_n_steps, outcome.stops)
    metrics.update(leader_series(cohort.history, sent_bytes))
    for logger in trainer.loggers:
        if logged:
            logger.log_metrics(metrics, step=record.cohort_step)
        if record.verdict != "stable" and isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(
                "elche/guard", f"{record.verdict}: {outcome.guard_reason or 'held'} (anchor {record.anchor})", record.cohort_step
            )


def summary(history: list["BoundaryRecord"], wall_s: float) -> str:
    """The end-of-fit table: where the time went, per rank and for the cohort."""
    if not history:
        return "ElChe summary: no boundary ran"
    # An elastic cohort's ranks change at membership changes (a loss, a join): the table covers the ranks as
    # they are at the end, the trailing boundaries with as many ranks as the last.
    changes = [i for i, record in enumerate(history) if record.level.startswith("membership")]
    world = len(history[-1].steps)
    start = len(history) - 1
    while start > 0 and len(history[start - 1].steps) == world:
        start -= 1
    generation = history[start:]
    samples = [sum(record.samples[rank] for record in generation) for rank in range(world)]
    window_ms = [sum(record.window_ms[rank] for record in generation) for rank in range(world)]
    wall_windows = sum(max(record.window_ms) for record in generation) or 1.0
    metrics = [boundary_metrics(record) for record in history]
    overhead = statistics.fmean(m["elche/overhead"] for m in metrics)
    speedups = [m["elche/speedup_vs_ddp"] for m in metrics if "elche/speedup_vs_ddp" in m]
    lines = [
        f"ElChe summary: {wall_s:.1f} s of training, {sum(sum(r.samples) for r in history)} samples, "
        f"{len(history)} boundaries, final anchor {history[-1].anchor}, mean boundary overhead {overhead:.1%}"
        + (f", estimated speedup vs DDP {statistics.median(speedups):.2f}x" if speedups else "")
        + (f"; {len(changes)} membership change(s), the table covers the ranks at the end" if changes else ""),
        "  rank | share | busy",
    ]
    total = sum(samples) or 1
    for rank in range(world):
        lines.append(f"  {rank:>4} | {samples[rank] / total:5.1%} | {window_ms[rank] / wall_windows:5.1%}")
    return "\n".join(lines)
