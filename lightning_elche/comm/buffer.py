"""One module's persistent flat buffer, and the steps every averager takes around its reduce.

The buffer is allocated once and reused at every boundary:

    [ params | float buffers | integer buffers | control ]

Before a reduce a rank *contributes*: ``w_r * params_r`` (nothing if its parameters are not
finite), its float buffers if it stepped (BatchNorm statistics, averaged over the ranks that
moved), rank 0's integer buffers. After the SUM the ranks *settle*: divide by the summed weights
and movers, unpack into the module. A composed averager (``composed.py``) reduces the parts on
their own: the float and integer buffers with the control data (the *tail*), the parameters, or
spans of them, at their level and time; :meth:`FlatBuffer.unpack_spans` and
:meth:`FlatBuffer.move_params` then bring an average into the module at once or one window late.
The reduces themselves belong to the averagers; nothing here communicates.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from lightning_elche.comm.outer import OuterNesterov

DRIFT_CHUNK = 1 << 20  # elements per temporary when measuring a rank's drift from the consensus


def flat_dtype(module: nn.Module) -> torch.dtype:
    """The dtype to average in: float64 models stay exact, everything else accumulates in float32."""
    dtypes = {p.dtype for p in module.parameters()} | {b.dtype for b in module.buffers() if b.is_floating_point()}
    return torch.float64 if torch.float64 in dtypes else torch.float32


@dataclass(frozen=True)
class Fragment:
    """Whole parameter tensors ``[first_tensor, end_tensor)``, at ``[start, end)`` of the parameter region."""

    first_tensor: int
    end_tensor: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def merge_spans(spans: Sequence[Fragment]) -> list[Fragment]:
    """``spans`` in order, without those inside another (a node-level average of every parameter and
    the fragment that crossed nodes at the same boundary cover the parameters once)."""
    merged: list[Fragment] = []
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        if not merged or span.start >= merged[-1].end:
            merged.append(span)
    return merged


def split_into_fragments(params: Sequence[torch.Tensor], count: int) -> list[Fragment]:
    """``count`` runs of consecutive whole tensors, each cut at the tensor boundary nearest to an
    equal share of the values: what streaming averages one at a time."""
    if count > len(params):
        raise ValueError(
            f"ElCheStrategy: `fragments` must be at most the model's number of parameter tensors ({len(params)}), "
            f"got {count}: a fragment is made of whole tensors"
        )
    ends = list(itertools.accumulate(p.numel() for p in params))  # ends[i]: the offset after tensor i
    cuts = [0]  # the tensors before each fragment's first
    for k in range(1, count):
        target = ends[-1] * k / count
        candidates = range(cuts[-1] + 1, len(params) - (count - k) + 1)  # leave a tensor for each fragment after
        cuts.append(min(candidates, key=lambda cut: abs(ends[cut - 1] - target)))
    cuts.append(len(params))
    return [
        Fragment(first, end, ends[first - 1] if first else 0, ends[end - 1]) for first, end in zip(cuts, cuts[1:])
    ]


@dataclass
class Snapshot:
    """A copy of the parameter and float-buffer regions (flat, in the buffer's dtype and device)."""

    params: torch.Tensor
    float_buffers: torch.Tensor


class FlatBuffer:
    """The flat buffer of one module on ``device``; ``rank`` decides whose integer buffers count.

    ``device`` is the model's device for reduce_on "device", host memory for reduce_on "cpu"
    (pinned when CUDA is present, so device-to-host copies are fast). ``control_size`` slots
    at the end carry the control data (``control.py``).

    Between boundaries of the flat averager the parameter and float regions hold the last consensus;
    a composed averager's parameter region holds the last average it took, at either level.
    """

    def __init__(self, module: nn.Module, device: torch.device, rank: int, control_size: int) -> None:
        self.rank = rank
        self.params = [p for p in module.parameters()]
        self.float_buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.int_buffers = [b for b in module.buffers() if not b.is_floating_point()]
        end_params = sum(p.numel() for p in self.params)
        end_floats = end_params + sum(b.numel() for b in self.float_buffers)
        end_ints = end_floats + sum(b.numel() for b in self.int_buffers)
        pin = device.type == "cpu" and torch.cuda.is_available()
        self.flat = torch.zeros(end_ints + control_size, dtype=flat_dtype(module), device=device, pin_memory=pin)
        self.param_region = self.flat[:end_params]
        self.float_region = self.flat[end_params:end_floats]
        self.int_region = self.flat[end_floats:end_ints]
        self.control_region = self.flat[end_ints:]
        # everything but the parameters: what a composed averager reduces exactly at every boundary
        self.tail_region = self.flat[end_params:]
        self.whole = Fragment(0, len(self.params), 0, end_params)  # every parameter, as one span
        self.pack(self.param_region, self.params)
        self.pack(self.float_region, self.float_buffers)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def device(self) -> torch.device:
        return self.flat.device

    # ------------------------------------------------------------------ primitives

    @staticmethod
    def pack(region: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` one after the other into ``region``."""
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            region[offset : offset + n].copy_(tensor.detach().reshape(-1))
            offset += n

    @staticmethod
    def unpack(region: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``region`` back into ``tensors`` (rounded for integer tensors)."""
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            values = region[offset : offset + n].view(tensor.shape)
            tensor.copy_(values.round() if not tensor.is_floating_point() else values)
            offset += n

    def is_finite(self) -> bool:
        """Whether every parameter and float buffer is finite: one reduction per tensor, one host sync.

        A tensor's minimum and maximum are NaN or infinite exactly when one of its elements is,
        and, unlike a sum, they never overflow: an fp16 LayerNorm weight of 70,000 ones sums to
        inf in fp16 although every element is 1. ``aminmax`` is one pass with no temporary the
        size of the tensor (``isfinite(t).all()`` is several times slower on CPU).
        """
        dtype = self.flat.dtype  # wide enough for every tensor's values (float64 when any tensor is)
        tensors = [t.detach() for t in self.params + self.float_buffers if t.numel()]
        extremes = [torch.stack(torch.aminmax(t)).to(dtype) for t in tensors]
        if not extremes:
            return True
        return bool(torch.isfinite(torch.cat(extremes)).all())

    def unpack_params(self, fragment: Optional["Fragment"] = None) -> float:
        """Copy the parameter region (of ``fragment``: all by default) into the parameters and return
        this rank's relative drift from it."""
        return self.unpack_spans([fragment or self.whole])

    @torch.no_grad()
    def unpack_spans(self, spans: Sequence[Fragment]) -> float:
        """Copy the parameter region's ``spans`` into the parameters; this rank's relative drift from
        them, over the spans together (0 without any)."""
        sums = torch.zeros(2, dtype=self.flat.dtype, device=self.flat.device)  # ||local - average||², ||average||²
        for span in spans:
            region = self.param_region[span.start : span.end]
            offset = 0
            for param in self.params[span.first_tensor : span.end_tensor]:
                n = param.numel()
                consensus = region[offset : offset + n]
                # Chunked, so the drift never needs a temporary the size of the largest parameter.
                local_chunks = torch.split(param.detach().reshape(-1), DRIFT_CHUNK)
                for local, average in zip(local_chunks, torch.split(consensus, DRIFT_CHUNK)):
                    sums[0] += (local.to(average.device, average.dtype) - average).square().sum()
                param.copy_(consensus.view_as(param))
                offset += n
            sums[1] += torch.linalg.vector_norm(region).square()
        drift_sq, norm_sq = sums.tolist()
        return math.sqrt(drift_sq / norm_sq) if norm_sq > 0 else 0.0

    @torch.no_grad()
    def move_params(self, start: torch.Tensor, spans: Sequence[Fragment], alpha: float) -> float:
        """Move the parameters of ``spans`` by ``alpha * (average - start)``: the average in the parameter
        region, ``start`` (flat, like it) the parameters when its reduce was launched (``policy="async"``).

        The local progress made meanwhile is kept. Returns ``||average - start|| / ||average||`` over
        the spans. The region is left as it is (it may be a compressed averager's reference), so the
        difference is taken in chunks, never in a temporary the size of the largest parameter.
        """
        sums = torch.zeros(2, dtype=self.flat.dtype, device=self.flat.device)  # ||average - start||², ||average||²
        for span in spans:
            offset = span.start
            for param in self.params[span.first_tensor : span.end_tensor]:
                n = param.numel()
                average, launched = self.param_region[offset : offset + n], start[offset : offset + n]
                # a parameter that is not contiguous (rare: a transposed view) moves in one piece
                local = param.detach().view(-1) if param.is_contiguous() else param.detach()
                step = DRIFT_CHUNK if param.is_contiguous() else max(n, 1)
                for first in range(0, n, step):
                    chunk = slice(first, first + step)
                    correction = average[chunk] - launched[chunk]
                    sums[0] += correction.square().sum()
                    sums[1] += average[chunk].square().sum()
                    target = local[chunk] if param.is_contiguous() else local
                    target.add_(correction.view(target.shape).to(local.device, local.dtype), alpha=alpha)
                offset += n
        change_sq, norm_sq = sums.tolist()
        return math.sqrt(change_sq / norm_sq) if norm_sq > 0 else 0.0

    def snapshot(self) -> Snapshot:
        """A copy of what the parameter and float regions hold (between boundaries: the last consensus)."""
        return Snapshot(self.param_region.clone(), self.float_region.clone())

    def restore(self, snapshot: Snapshot) -> None:
        """Put ``snapshot`` back into the regions and into the module."""
        self.param_region.copy_(snapshot.params)
        self.float_region.copy_(snapshot.float_buffers)
        self.unpack(self.param_region, self.params)
        self.unpack(self.float_region, self.float_buffers)

    # ------------------------------------------------------------------ around a reduce

    @torch.no_grad()
    def contribute(self, weight: float, moved: bool, finite: bool) -> None:
        """Fill the regions with this rank's share of a SUM reduce of the whole buffer.

        ``weight * params`` (zeros when not ``finite``: such a rank contributes nothing), the
        float buffers where ``moved`` (zeros otherwise), the integer buffers on rank 0 (zeros
        elsewhere). The control region is left alone.
        """
        self.contribute_params(weight, finite)
        self.contribute_buffers(finite and moved)

    @torch.no_grad()
    def contribute_params(self, weight: float, finite: bool) -> None:
        """``weight * params`` into the parameter region (zeros when not ``finite``)."""
        if finite:
            self.pack(self.param_region, self.params)
            self.param_region.mul_(weight)
        else:
            self.param_region.zero_()

    def contribute_buffers(self, moved: bool) -> None:
        """The float buffers if this rank ``moved`` (zeros otherwise) and rank 0's integer buffers:
        the part of a contribution that is never weighted (a composed averager's tail)."""
        if moved:
            self.pack(self.float_region, self.float_buffers)
        else:
            self.float_region.zero_()
        if self.rank == 0:
            self.pack(self.int_region, self.int_buffers)
        else:
            self.int_region.zero_()

    @torch.no_grad()
    def settle(self, total_weight: float, movers: float, outer: Optional[OuterNesterov] = None) -> float:
        """After the reduce of the whole buffer: divide, unpack into the module, return this rank's drift.

        The parameters are divided by ``total_weight`` and stepped by ``outer`` (if any) where some
        rank contributed; :meth:`settle_buffers` does the rest.
        """
        divergence = 0.0
        if total_weight > 0:
            self.param_region.div_(total_weight)
            if outer is not None:
                outer.step(self.param_region)
            divergence = self.unpack_params()
        self.settle_buffers(movers)
        return divergence

    @torch.no_grad()
    def settle_buffers(self, movers: float) -> None:
        """The float buffers divided by ``movers`` where some rank moved, the integer buffers (rank 0's)."""
        if movers > 0:
            self.float_region.div_(movers)
            self.unpack(self.float_region, self.float_buffers)
        self.unpack(self.int_region, self.int_buffers)
