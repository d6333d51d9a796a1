"""policy="async": the boundary's parameter all-reduce runs while the next window trains.

At a boundary the ranks exchange only the small control region, synchronously, so every decision
(plans, stops, checkpoints) stays coherent. The weighted parameters go out in a background
all-reduce; the next boundary collects the average ``θ̄_b`` and moves each rank by
``alpha * (θ̄_b − θ_b)``, where ``θ_b`` is the rank's own parameters when the reduce was launched:
the local progress made meanwhile is kept, the drift of boundary b is corrected one window late.
With ``alpha < 1`` the correction is blended (EASGD's elastic pull).

The ranks therefore never hold exactly the same parameters between such boundaries. Wherever
Lightning needs a consensus (the last window of an epoch, before validation; a checkpoint; a stop)
the boundary is a full synchronous one, decided from the control data on every rank alike.
Cost: one more copy of the parameters (the launch snapshot) and a second, tiny collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_elche.comm.averaging import BoundaryResult, CohortControl, ControlExchange, FlatAverager


@dataclass
class _InFlight:
    work: dist.Work
    total_weight: float
    movers: float
    finite: bool  # this rank's parameters were finite at launch (otherwise it contributed nothing)


class OverlappedAverager:
    """Wraps a :class:`FlatAverager`: same buffer and layout, the parameter reduce overlapped."""

    def __init__(self, averager: FlatAverager, alpha: float = 1.0) -> None:
        self.averager = averager
        self.alpha = alpha
        self._exchange_control = ControlExchange(averager)
        self._snapshot = torch.empty_like(averager._param_region)
        self._float_snapshot = torch.empty_like(averager._float_region)
        self._in_flight: Optional[_InFlight] = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @torch.no_grad()
    def exchange(
        self,
        weight: float,
        moved: bool,
        fields: dict[str, float],
        flags: dict[str, bool],
        needs_consensus: Callable[[CohortControl], bool],
    ) -> BoundaryResult:
        """One boundary: control now; the previous window's average applied; this one launched or,
        where ``needs_consensus(control)``, a full synchronous average."""
        round_ = self._exchange_control(weight, moved, fields, flags)
        control = round_.control
        divergence = self._collect()
        if needs_consensus(control):
            result = self.averager.exchange(round_.weight, round_.moved, round_.fields, flags)
            return BoundaryResult(control=control, divergence=result.divergence, averaged=result.averaged)
        self._launch(round_.weight, round_.moved, round_.finite, control)
        return BoundaryResult(control=control, divergence=divergence, averaged=True)

    def _launch(self, weight: float, moved: bool, finite: bool, control: CohortControl) -> None:
        averager = self.averager
        params, floats = averager._param_region, averager._float_region
        if finite:
            averager._pack(self._snapshot, averager.params)
            averager._pack(self._float_snapshot, averager.float_buffers)
            params.copy_(self._snapshot).mul_(weight)
            if moved:
                floats.copy_(self._float_snapshot)
            else:
                floats.zero_()
        else:
            params.zero_()
            floats.zero_()
        if averager.rank == 0:
            averager._pack(averager._int_region, averager.int_buffers)
        else:
            averager._int_region.zero_()
        averager._control_region.zero_()
        work = dist.all_reduce(averager.flat, op=dist.ReduceOp.SUM, group=averager.group, async_op=True)
        self._in_flight = _InFlight(
            work=work,
            total_weight=math.fsum(control.per_rank["weight"]),
            movers=math.fsum(control.per_rank["moved"]),
            finite=finite,
        )

    def _collect(self) -> float:
        """Wait for the reduce launched at the previous boundary and move this rank toward its average.

        Returns this rank's drift from that average at launch time.
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return 0.0
        flight.work.wait()
        averager = self.averager
        params, floats = averager._param_region, averager._float_region
        divergence = 0.0
        if flight.total_weight > 0:
            params.div_(flight.total_weight)
            if averager.outer is not None:
                averager.outer.step(params)
            if flight.finite:
                norm = float(torch.linalg.vector_norm(params))
                params.sub_(self._snapshot)  # the correction θ̄_b − θ_b
                divergence = float(torch.linalg.vector_norm(params)) / norm if norm > 0 else 0.0
                self._move(params, averager.params, self.alpha)
            else:  # its own parameters were not finite: take the average outright
                averager._unpack(params, averager.params)
        if flight.movers > 0:
            floats.div_(flight.movers)
            if flight.finite:
                self._move(floats.sub_(self._float_snapshot), averager.float_buffers, self.alpha)
            else:
                averager._unpack(floats, averager.float_buffers)
        averager._unpack(averager._int_region, averager.int_buffers)
        return divergence

    @staticmethod
    def _move(corrections: torch.Tensor, tensors: list[torch.Tensor], alpha: float) -> None:
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            delta = corrections[offset : offset + n].view(tensor.shape)
            tensor.detach().add_(delta.to(tensor.device, tensor.dtype), alpha=alpha)
            offset += n
