"""The boundary collective: one all-reduce carrying weighted parameters, buffers and control data.

A boundary packs, into one persistent flat buffer (``buffer.py``, allocated once, reused every
window):

    [ w_r * params_r | moved_r * float buffers_r | (r == 0) * integer buffers | control_r ]

and SUM-reduces it. Dividing by the summed weights gives the work-weighted consensus; float
buffers (BatchNorm statistics) are averaged over the ranks that stepped; integer buffers take
rank 0's values; the control region returns every rank's timings and flags in its own slots,
from which every rank derives the same next plan without a second round trip.

:func:`make_averager` picks the averager for a strategy's settings: this flat one, the
overlapped one (``overlap.py``), the hierarchical one (``hierarchy.py``) or the compressed and
streamed one (``compressed.py``); all answer :class:`Averager`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_elche.cohort.control import LocalReport
from lightning_elche.comm.buffer import FlatBuffer
from lightning_elche.comm.compressed import CompressedAverager
from lightning_elche.comm.control import ControlLayout
from lightning_elche.comm.hierarchy import HierarchicalAverager
from lightning_elche.comm.interface import Averager, BoundaryResult, NeedsConsensus, Share, work_weight
from lightning_elche.comm.link import Delay, Wire
from lightning_elche.comm.outer import OuterNesterov
from lightning_elche.comm.overlap import OverlappedAverager
from lightning_elche.comm.quantize import Codec

__all__ = ["Averager", "BoundaryResult", "FlatAverager", "Share", "make_averager", "work_weight"]


class FlatAverager:
    """Work-weighted parameter averaging through one persistent flat buffer.

    ``group`` is the process group of the reduce (None: the default group); ``device`` is where
    the flat buffer lives (see :class:`~lightning_elche.comm.buffer.FlatBuffer`). Rank r's weight
    is ``steps_r ** gamma`` (:func:`work_weight`).
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
        gamma: float = 1.0,
        wire: Optional[Wire] = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.wire = Wire(world_size, group) if wire is None else wire
        self.outer = outer
        self.gamma = gamma
        self.layout = ControlLayout(world_size, extra_fields)
        self.buffer = FlatBuffer(module, device, rank, self.layout.size)
        if outer is not None:
            outer.bind(self.buffer.param_region)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def payload_bytes(self) -> int:
        return self.buffer.nbytes  # the whole buffer is reduced

    def share(self, steps: int) -> Share:
        """This rank's share of a boundary after ``steps`` optimizer steps: nothing if it is not finite."""
        if not self.buffer.is_finite():
            return Share(weight=0.0, moved=False, finite=False)
        return Share(weight=work_weight(steps, self.gamma), moved=steps > 0, finite=True)

    def exchange(self, report: LocalReport, needs_consensus: NeedsConsensus = None) -> BoundaryResult:
        """Run one boundary: pack, all-reduce, unpack the consensus into the module in place.

        Every boundary here is a consensus, so ``needs_consensus`` (the overlapped averager's
        question) is not asked.
        """
        return self.average(report, work_weight(report.steps, self.gamma), report.steps > 0)

    def average_now(self, report: LocalReport) -> BoundaryResult:
        """Every boundary here is an exact consensus."""
        return self.exchange(report)

    def state_dict(self) -> dict[str, Any]:
        """Nothing: between boundaries the consensus is in the module."""
        return {}

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Nothing to resume."""

    @torch.no_grad()
    def average(self, report: LocalReport, weight: float, moved: bool) -> BoundaryResult:
        """The all-reduce over ``group`` with this rank's ``weight`` (0 if its parameters are not
        finite) and float buffers if ``moved``; the control region carries ``report``.

        A rank whose parameters are not finite contributes nothing; if no rank is finite, every
        rank goes back to the last consensus, which the regions still hold until packed over.
        """
        buffer = self.buffer
        finite = buffer.is_finite()
        share = Share(weight, moved, finite) if finite else Share(0.0, False, False)
        last_consensus = None if finite else buffer.snapshot()
        buffer.contribute(share.weight, share.moved, finite)
        buffer.control_region.copy_(self.layout.encode(self.rank, share.control_fields(report), report.flags))

        self.wire.all_reduce(buffer.flat)

        control = self.layout.decode(buffer.control_region.tolist())
        total_weight = control.total_weight
        divergence = buffer.settle(total_weight, control.movers, self.outer)
        if total_weight == 0 and last_consensus is not None:
            buffer.restore(last_consensus)
        return BoundaryResult(
            control=control, divergence=divergence, averaged=total_weight > 0, sent_bytes=self.wire.take_sent_bytes()
        )


def make_averager(
    module: nn.Module,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    group: Optional[dist.ProcessGroup],
    policy: str,
    gamma: float,
    outer: Optional[OuterNesterov],
    easgd_alpha: float,
    node_sync_every: int,
    ranks_per_node: int,
    extra_fields: Sequence[str] = (),
    compression: Optional[str] = None,
    fragments: int = 1,
    link_delay: Optional[Delay] = None,
) -> Union[FlatAverager, OverlappedAverager, HierarchicalAverager, CompressedAverager]:
    """The averager for these settings: compressed and streamed when ``compression`` or
    ``fragments > 1`` ask for it, overlapped for ``policy="async"``, hierarchical when
    ``node_sync_every > 1`` and a node is smaller than the world, flat otherwise (the settings
    refuse the combinations). ``link_delay``: every boundary collective then waits as on that link."""
    wire = Wire(world_size, group, link_delay)
    flat = FlatAverager(module, rank, world_size, device, group, outer, extra_fields, gamma, wire)
    if compression is not None or fragments > 1:
        return CompressedAverager(flat, wire, None if compression is None else Codec(compression), fragments)
    if policy == "async":
        return OverlappedAverager(flat, easgd_alpha)
    if node_sync_every > 1 and ranks_per_node < world_size:
        return HierarchicalAverager(flat, ranks_per_node, node_sync_every)
    return flat
