"""The boundary collective: one all-reduce carrying weighted parameters, buffers and control data.

This module owns every collective ElChe issues during training. A boundary packs, into one
persistent flat buffer (allocated once, reused every window):

    [ w_r * params_r | moved_r * float buffers_r | (r == 0) * integer buffers | control_r ]

and SUM-reduces it. Dividing by the summed weights gives the work-weighted consensus; float
buffers (BatchNorm statistics) are averaged over the ranks that stepped; integer buffers take
rank 0's values; the control region returns every rank's timings and flags in its own slots,
from which every rank derives the same next plan without a second round trip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_elche.comm.outer import OuterNesterov

PER_RANK_FIELDS = (
    "window_ms", "steps", "samples", "boundary_ms", "weight", "moved", "fingerprint", "nonfinite", "train_s",
    "divergence",  # the rank's drift from the consensus at the previous boundary (known only after it)
)
COHORT_FLAGS = ("sigterm", "stop", "requeue")
DRIFT_CHUNK = 1 << 20  # elements per temporary when measuring a rank's drift from the consensus


class ControlLayout:
    """Slots of the control region: one per rank for each field, one summed slot per flag.

    ``extra_fields`` are more per-rank slots (the users' scalars rolled up across ranks).
    """

    def __init__(self, world_size: int, extra_fields: Sequence[str] = ()) -> None:
        self.world_size = world_size
        self.fields = PER_RANK_FIELDS + tuple(extra_fields)
        self.size = len(self.fields) * world_size + len(COHORT_FLAGS)

    def field_slice(self, name: str) -> slice:
        start = self.fields.index(name) * self.world_size
        return slice(start, start + self.world_size)

    def flag_index(self, name: str) -> int:
        return len(self.fields) * self.world_size + COHORT_FLAGS.index(name)

    def encode(self, rank: int, fields: dict[str, float], flags: dict[str, bool]) -> torch.Tensor:
        control = torch.zeros(self.size, dtype=torch.float64)
        for name in self.fields:
            control[self.field_slice(name).start + rank] = float(fields.get(name, 0.0))
        for name in COHORT_FLAGS:
            control[self.flag_index(name)] = 1.0 if flags.get(name) else 0.0
        return control

    def decode(self, control: list[float]) -> "CohortControl":
        per_rank = {name: control[self.field_slice(name)] for name in self.fields}
        flags = {name: control[self.flag_index(name)] > 0 for name in COHORT_FLAGS}
        return CohortControl(per_rank=per_rank, flags=flags)


@dataclass(frozen=True)
class CohortControl:
    """Everybody's control data after the all-reduce: identical on every rank."""

    per_rank: dict[str, list[float]]
    flags: dict[str, bool]

    def ints(self, name: str) -> list[int]:
        return [int(round(v)) for v in self.per_rank[name]]


@dataclass(frozen=True)
class BoundaryResult:
    control: CohortControl
    divergence: float  # ||theta_before - theta_after|| / ||theta_after|| on this rank
    averaged: bool  # False when no rank contributed (nobody stepped, or every rank non-finite)


def flat_dtype(module: nn.Module) -> torch.dtype:
    """The dtype to average in: float64 models stay exact, everything else accumulates in float32."""
    dtypes = {p.dtype for p in module.parameters()} | {b.dtype for b in module.buffers() if b.is_floating_point()}
    return torch.float64 if torch.float64 in dtypes else torch.float32


class FlatAverager:
    """Work-weighted parameter averaging through one persistent flat buffer.

    ``group`` is the process group of the reduce (None: the default group); ``device`` is where
    the flat buffer lives: the model's device for backend "device", host memory for backend
    "cpu" (pinned when CUDA is present, so device-to-host copies are fast).
    """

    def __init__(
        self,
        module: nn.Module,
        rank: int,
        world_size: int,
        device: torch.device,
        group: Optional[dist.ProcessGroup] = None,
        outer: Optional[OuterNesterov] = None,
        extra_fields: Sequence[str] = (),
    ) -> None:
        self.rank = rank
        self.outer = outer
        self.world_size = world_size
        self.group = group
        self.params = [p for p in module.parameters()]
        self.float_buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.int_buffers = [b for b in module.buffers() if not b.is_floating_point()]
        self.layout = ControlLayout(world_size, extra_fields)
        self.num_param_values = sum(p.numel() for p in self.params)
        self.num_float_buffer_values = sum(b.numel() for b in self.float_buffers)
        num_int_values = sum(b.numel() for b in self.int_buffers)
        total = self.num_param_values + self.num_float_buffer_values + num_int_values + self.layout.size
        pin = device.type == "cpu" and torch.cuda.is_available()
        self.flat = torch.zeros(total, dtype=flat_dtype(module), device=device, pin_memory=pin)
        end_params = self.num_param_values
        end_floats = end_params + self.num_float_buffer_values
        end_ints = end_floats + num_int_values
        self._param_region = self.flat[:end_params]
        self._float_region = self.flat[end_params:end_floats]
        self._int_region = self.flat[end_floats:end_ints]
        self._control_region = self.flat[end_ints:]
        # Between boundaries the regions hold the last consensus, kept for a cohort that goes non-finite.
        self._pack(self._param_region, self.params)
        self._pack(self._float_region, self.float_buffers)
        if outer is not None:
            outer.bind(self._param_region)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @staticmethod
    def _pack(region: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            region[offset : offset + n].copy_(tensor.detach().reshape(-1))
            offset += n

    @torch.no_grad()
    def exchange(
        self,
        weight: float,
        moved: bool,
        fields: dict[str, float],
        flags: dict[str, bool],
        needs_consensus: Optional[Callable[["CohortControl"], bool]] = None,
    ) -> BoundaryResult:
        """Run one boundary: pack, all-reduce, unpack the consensus into the module in place.

        Every boundary here is a consensus, so ``needs_consensus`` (the overlapped averager's
        question) is not asked.

        A rank whose parameters are not finite contributes nothing; if no rank is finite, every
        rank goes back to the last consensus, which the regions still hold until packed over.
        """
        finite = self._module_is_finite()
        last_consensus = None
        if finite:
            self._pack(self._param_region, self.params)
            self._pack(self._float_region, self.float_buffers)
            self._param_region.mul_(weight)
        else:
            weight, moved = 0.0, False
            last_consensus = (self._param_region.clone(), self._float_region.clone())
            self._param_region.zero_()
        if not moved:
            self._float_region.zero_()
        if self.rank == 0:
            self._pack(self._int_region, self.int_buffers)
        else:
            self._int_region.zero_()
        fields = control_fields(fields, weight, moved, finite)
        self._control_region.copy_(self.layout.encode(self.rank, fields, flags))

        dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=self.group)

        control = self.layout.decode(self._control_region.tolist())
        total_weight = math.fsum(control.per_rank["weight"])
        movers = math.fsum(control.per_rank["moved"])
        divergence = 0.0
        if total_weight > 0:
            self._param_region.div_(total_weight)
            if self.outer is not None:
                self.outer.step(self._param_region)
            divergence = self._unpack_params()
        if movers > 0:
            self._float_region.div_(movers)
            self._unpack(self._float_region, self.float_buffers)
        self._unpack(self._int_region, self.int_buffers)
        if total_weight == 0 and last_consensus is not None:
            self._param_region.copy_(last_consensus[0])
            self._float_region.copy_(last_consensus[1])
            self._unpack(self._param_region, self.params)
            self._unpack(self._float_region, self.float_buffers)
        return BoundaryResult(control=control, divergence=divergence, averaged=total_weight > 0)

    def _module_is_finite(self) -> bool:
        """One sum per tensor, one host sync: a sum is NaN or inf as soon as one element is."""
        tensors = self.params + self.float_buffers
        if not tensors:
            return True
        return bool(torch.isfinite(torch.stack([t.detach().sum().to(self.flat.dtype) for t in tensors]).sum()))

    def _unpack_params(self) -> float:
        """Copy the consensus into the parameters and return this rank's relative drift from it."""
        drift_sq = torch.zeros((), dtype=self.flat.dtype, device=self.flat.device)
        offset = 0
        for param in self.params:
            n = param.numel()
            consensus = self._param_region[offset : offset + n]
            # Chunked, so the drift never needs a temporary the size of the largest parameter.
            for local, average in zip(param.detach().reshape(-1).split(DRIFT_CHUNK), consensus.split(DRIFT_CHUNK)):
                drift_sq += (local.to(average.device, average.dtype) - average).square().sum()
            param.copy_(consensus.view_as(param))
            offset += n
        norm = float(torch.linalg.vector_norm(self._param_region))
        return math.sqrt(float(drift_sq)) / norm if norm > 0 else 0.0

    @staticmethod
    def _unpack(region: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            values = region[offset : offset + n].view(tensor.shape)
            tensor.copy_(values.round() if not tensor.is_floating_point() else values)
            offset += n


def control_fields(fields: dict[str, float], weight: float, moved: bool, finite: bool) -> dict[str, float]:
    """The rank's control fields plus the three every averager's decode relies on."""
    return dict(fields, weight=weight, moved=1.0 if moved else 0.0, nonfinite=0.0 if finite else 1.0)


@dataclass
class ControlRound:
    """What a control-only exchange established: the cohort's control data and this rank's part."""

    control: CohortControl
    weight: float  # 0 when this rank's parameters are not finite
    moved: bool
    finite: bool
    fields: dict[str, float]


class ControlExchange:
    """The control region alone, all-reduced in float64 on every rank.

    For boundaries whose parameter reduce runs in the background (``policy="async"``) or on a
    node's group (hierarchical averaging): the decisions still come from every rank's numbers.
    """

    def __init__(self, averager: FlatAverager) -> None:
        self.averager = averager
        self._buffer = torch.zeros(averager.layout.size, dtype=torch.float64, device=averager.flat.device)

    @torch.no_grad()
    def __call__(self, weight: float, moved: bool, fields: dict[str, float], flags: dict[str, bool]) -> ControlRound:
        averager = self.averager
        finite = averager._module_is_finite()
        if not finite:
            weight, moved = 0.0, False
        fields = control_fields(fields, weight, moved, finite)
        self._buffer.copy_(averager.layout.encode(averager.rank, fields, flags))
        dist.all_reduce(self._buffer, op=dist.ReduceOp.SUM, group=averager.group)
        control = averager.layout.decode(self._buffer.tolist())
        return ControlRound(control=control, weight=weight, moved=moved, finite=finite, fields=fields)
