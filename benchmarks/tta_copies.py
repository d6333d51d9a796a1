"""Copies of the cohort's consensus model at a fixed sample interval, for the time-to-accuracy benchmark.

Evaluation happens after the job, on copies, so that it costs the training clock nothing but the
copy itself (a ``clone()`` of the parameters, timed and reported). A copy is taken at the first
point where the ranks hold one model at or after each multiple of ``every`` samples trained by the
whole cohort: after any step for the fast device alone and DDP, after a committed synchronisation
for DiLoCo, after a boundary for ElChe. The interval is in samples, not seconds, so every
configuration is evaluated at the same points of its training, however fast it runs; where a
method's consensus points lie further apart than ``every`` (long ElChe windows), the copies follow
them and the results show the gaps.

``policy="async"`` leaves the ranks with different parameters after a boundary: its consensus is the
work-weighted average that the boundary's background all-reduce computes (and applies one window
late). Every rank then keeps its own copies with its weight, and :func:`consensus_points` averages
them, boundary by boundary, exactly as that all-reduce does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override


class SampleCopies:
    """The model at the first consensus at or after each multiple of ``every`` cohort samples, and at the end."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"the evaluation interval must be at least one sample, got {every}")
        self.every = every
        self.next = every
        self.points: list[dict[str, Any]] = []
        self.copy_s = 0.0  # training-clock seconds spent copying

    def offer(self, net: nn.Module, seconds: float, samples: int, weight: float = 1.0, boundary: Optional[int] = None) -> None:
        """The ranks agree on ``net`` now, ``seconds`` into training, ``samples`` trained by the cohort."""
        if samples >= self.next:
            self._copy(net, seconds, samples, weight, boundary)
            self.next = (samples // self.every + 1) * self.every

    def finish(self, net: nn.Module, seconds: float, samples: int, path: Path, weight: float = 1.0, boundary: Optional[int] = None) -> None:
        """Add the final model (the same samples for every configuration) and save the copies to ``path``."""
        if not self.points or self.points[-1]["samples"] < samples:
            self._copy(net, seconds, samples, weight, boundary)
        torch.save({"points": self.points, "copy_s": self.copy_s}, path)

    def _copy(self, net: nn.Module, seconds: float, samples: int, weight: float, boundary: Optional[int]) -> None:
        started = time.perf_counter()
        state = {key: value.detach().clone() for key, value in net.state_dict().items()}
        self.copy_s += time.perf_counter() - started
        self.points.append({"seconds": seconds, "samples": samples, "weight": weight, "boundary": boundary, "state": state})


def consensus_points(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One point per consensus: rank 0's copies, or, when several ranks kept copies (``policy="async"``),
    the weighted average of the ranks' copies of each boundary."""
    if len(per_rank) == 1:
        return per_rank[0]
    lengths = {len(points) for points in per_rank}
    boundaries = [[p["boundary"] for p in points] for points in per_rank]
    if len(lengths) != 1 or any(b != boundaries[0] for b in boundaries):
        raise ValueError(f"the ranks kept copies at different boundaries: {boundaries}")
    merged = []
    for copies in zip(*per_rank):
        total = sum(c["weight"] for c in copies)
        state = {
            key: sum(c["state"][key] * (c["weight"] / total) for c in copies) if copies[0]["state"][key].is_floating_point()
            else copies[0]["state"][key]
            for key in copies[0]["state"]
        }  # fmt: skip
        merged.append(dict(copies[0], state=state, weight=total))
    return merged


class ConsensusAtSamples(pl.Callback):
    """Rank's training clock (wall seconds since its fit's training began), the cohort's samples, and a
    copy of the model into ``copies`` at consensus points (on rank 0, or on ``every_rank``).

    Under ElChe a consensus is a boundary: its record (``ElCheStrategy.boundaries``, appended by
    ElChe's callback, which runs before this one) gives every rank's samples and steps, the same on
    every rank, so every rank copies at the same boundaries. Elsewhere every optimizer step ends on
    one model (one process, or DDP's equal shards), and the cohort's samples are this rank's times
    the world size."""

    def __init__(self, copies: Optional[SampleCopies], every_rank: bool = False, gamma: float = 1.0) -> None:
        self.copies, self.every_rank, self.gamma = copies, every_rank, gamma
        self.samples = 0  # this rank's
        self.cohort_samples = 0
        self.boundaries_seen = 0
        self.weight = 1.0  # this rank's averaging weight at the last boundary (steps ** gamma)
        self.started: Optional[float] = None
        self.seconds = 0.0
        self.started_unix = self.ended_unix = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.started if self.started is not None else 0.0

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.started, self.started_unix = time.perf_counter(), time.time()

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.seconds, self.ended_unix = self.now(), time.time()

    def _consensus(self, trainer: "pl.Trainer") -> bool:
        records = getattr(trainer.strategy, "boundaries", None)
        if records is None:
            self.cohort_samples = self.samples * trainer.world_size
            return True
        new = records[self.boundaries_seen :]
        self.boundaries_seen = len(records)
        self.cohort_samples += sum(sum(record.samples) for record in new)
        if new:
            self.weight = float(new[-1].steps[trainer.global_rank]) ** self.gamma
        return bool(new)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        self.samples += len(batch[0] if isinstance(batch, (list, tuple)) else batch)
        if self._consensus(trainer) and self.copies is not None and (self.every_rank or trainer.global_rank == 0):
            self.copies.offer(pl_module.net, self.now(), self.cohort_samples, self.weight, self.boundaries_seen)
