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

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

from lightning_elche.cohort.control import CohortControl, LocalReport
from lightning_elche.comm.control import ControlExchange
from lightning_elche.comm.interface import BoundaryResult, FlatExchange, NeedsConsensus, Share
from lightning_elche.comm.link import Transfer


@dataclass
class _InFlight:
    work: Transfer
    total_weight: float
    movers: float
    finite: bool  # this rank's parameters were finite at launch (otherwise it contributed nothing)


class OverlappedAverager:
    """Wraps a flat averager (a :class:`FlatExchange`): same buffer and layout, the parameter reduce overlapped."""

    def __init__(self, flat: FlatExchange, alpha: float = 1.0) -> None:
        self.flat = flat
        self.alpha = alpha
        self._exchange_control = ControlExchange(flat.layout, flat.rank, flat.buffer.device, flat.wire)
        self._snapshot = flat.buffer.empty_snapshot()
        self._in_flight: Optional[_InFlight] = None

    @property
    def nbytes(self) -> int:
        snapshot = self._snapshot.params.numel() + self._snapshot.float_buffers.numel()
        return self.flat.nbytes + snapshot * self._snapshot.params.element_size() + self._exchange_control.nbytes

    @property
    def payload_bytes(self) -> int:
        return self._exchange_control.nbytes  # what the boundary waits for: the parameters travel meanwhile

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def average_now(self, report: LocalReport) -> BoundaryResult:
        """An exact, synchronous average of every rank (a reduce in flight is dropped: the average of the
        current parameters leaves every rank the same)."""
        self._in_flight = None
        return self.flat.exchange(report)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Nothing to resume: the checkpoint holds a consensus."""

    @torch.no_grad()
    def exchange(self, report: LocalReport, needs_consensus: NeedsConsensus = None) -> BoundaryResult:
        """One boundary: control now; the previous window's average applied; this one launched or,
        where ``needs_consensus(control)``, a full synchronous average."""
        share = self.flat.share(report.steps)
        control = self._exchange_control(share.control_fields(report), report.flags)
        divergence = self._collect()
        if needs_consensus is not None and needs_consensus(control):
            result = self.flat.average(report, share.weight, share.moved)
            return replace(result, control=control)  # the control exchanged above
        self._launch(share, control)
        return BoundaryResult(control=control, divergence=divergence, averaged=True, sent_bytes=self.flat.wire.take_sent_bytes())

    def _launch(self, share: Share, control: CohortControl) -> None:
        buffer = self.flat.buffer
        buffer.contribute(share.weight, share.moved, share.finite, snapshot=self._snapshot)
        buffer.control_region.zero_()
        self._in_flight = _InFlight(
            work=self.flat.wire.all_reduce_async(buffer.flat), total_weight=control.total_weight, movers=control.movers, finite=share.finite
        )

    def _collect(self) -> float:
        """Wait for the reduce launched at the previous boundary and move this rank toward its average.

        Returns this rank's drift from that average at launch time.
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return 0.0
        flight.work.wait()
        buffer = self.flat.buffer
        if flight.finite:
            return buffer.settle(
                flight.total_weight, flight.movers, self.flat.outer, start=self._snapshot, alpha=self.alpha
            )
        # its own parameters were not finite at launch: take the average outright
        buffer.settle(flight.total_weight, flight.movers, self.flat.outer)
        return 0.0
