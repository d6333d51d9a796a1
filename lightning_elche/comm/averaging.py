"""The boundary collective: one all-reduce carrying weighted parameters, buffers and control data.

A boundary packs, into one persistent flat buffer (``buffer.py``, allocated once, reused every
window):

    [ w_r * params_r | moved_r * float buffers_r | (r == 0) * integer buffers | control_r ]

and SUM-reduces it. Dividing by the summed weights gives the work-weighted consensus; float
buffers (BatchNorm statistics) are averaged over the ranks that stepped; integer buffers take
rank 0's values; the control region returns every rank's timings and flags in its own slots,
from which every rank derives the same next plan without a second round trip.

:func:`make_averager` picks the averager for a strategy's settings, any combination of them: this
flat one where every boundary is that one all-reduce (``policy`` "sync" or "cadence", full
precision, one level), otherwise a composed one (``composed.py``) of the parts the settings ask
for, chosen here once: the cross-node reduce (:class:`ExactCross`, or ``compressed.py``'s
compressed and streamed one), hierarchy's node level (``hierarchy.py``), the overlap of
``policy="async"`` (``overlap.py``). All answer :class:`Averager`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_elche.cohort.control import CohortControl, LocalReport
from lightning_elche.comm.buffer import FlatBuffer
from lightning_elche.comm.composed import ComposedAverager
from lightning_elche.comm.compressed import CompressedAverager, StreamedCross
from lightning_elche.comm.control import ControlLayout
from lightning_elche.comm.groups import gather_to_all, new_group_like
from lightning_elche.comm.hierarchy import Levels, NodeReduce, groups_of_nodes, node_groups
from lightning_elche.comm.interface import (
    Averager,
    BoundaryResult,
    CrossReduce,
    FlatExchange,
    NeedsConsensus,
    Pending,
    Share,
    WorkSince,
    work_weight,
)
from lightning_elche.comm.link import Delay, Lane, Wire
from lightning_elche.comm.outer import OuterNesterov
from lightning_elche.comm.overlap import Overlap, reduce_in_background
from lightning_elche.comm.quantize import Codec

__all__ = ["Averager", "AveragingSpec", "BoundaryResult", "FlatAverager", "Share", "make_averager", "work_weight"]


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

    @torch.no_grad()
    def average(self, report: LocalReport, weight: float, moved: bool) -> BoundaryResult:
        """The all-reduce over ``group`` with this rank's ``weight`` (0 if its parameters are not
        finite) and float buffers if ``moved``; the control region carries ``report``."""
        return self._average(report, weight, moved, self.outer)

    def average_now(self, report: LocalReport) -> BoundaryResult:
        """An exact consensus weighted by ``report.steps``, without an outer step (the outer optimizer
        restarts from it: see :class:`Averager`). Where nobody stepped the ranks' parameters are
        averaged with equal weights instead, so that they still agree afterwards."""
        result = self._average(report, work_weight(report.steps, self.gamma), report.steps > 0, None)
        if not result.averaged:  # every rank knows: the same control data
            result = self._average(report, 1.0, report.steps > 0, None)
        if self.outer is not None and result.averaged:
            self.outer.restart_from(self.buffer.param_region)
        return result

    @torch.no_grad()
    def _average(
        self, report: LocalReport, weight: float, moved: bool, outer: Optional[OuterNesterov]
    ) -> BoundaryResult:
        """A rank whose parameters are not finite contributes nothing; if no rank is finite, every
        rank goes back to what the regions held, between boundaries the last consensus."""
        buffer = self.buffer
        finite = buffer.is_finite()
        share = Share(weight, moved, finite) if finite else Share(0.0, False, False)
        last_consensus = None if finite else buffer.snapshot()
        buffer.contribute(share.weight, share.moved, finite)
        buffer.control_region.copy_(self.layout.encode(self.rank, share.control_fields(report), report.flags))

        self.wire.all_reduce(buffer.flat)

        control = self.layout.decode(buffer.control_region.tolist())
        if outer is not None:
            outer.observe(control.per_rank["steps"])
        total_weight = control.total_weight
        divergence = buffer.settle(total_weight, control.movers, outer)
        if total_weight == 0 and last_consensus is not None:
            buffer.restore(last_consensus)
        return BoundaryResult(
            control=control, divergence=divergence, averaged=total_weight > 0, sent_bytes=self.wire.take_sent_bytes()
        )

    def state_dict(self) -> dict[str, Any]:
        """The world size and, on rank 0, the outer optimizer's momentum (replicated: one copy is enough)."""
        state: dict[str, Any] = {"world_size": self.world_size}
        if self.outer is not None and self.rank == 0:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """The outer optimizer's momentum from the saved state that has it, at any world size."""
        saved = next((state["outer"] for state in states if state.get("outer") is not None), None)
        if self.outer is not None and saved is not None:
            self.outer.load_state_dict(saved)


class ExactCross:
    """The cross-node reduce in full precision: every rank's parameters, weighted by its work since
    their last global average, all-reduced over every rank in the flat buffer's parameter region.

    Under ``policy="async"`` the all-reduce runs in the background (``overlap.py``). Nothing beside
    the flat buffer; the work counts are its state.
    """

    def __init__(self, flat: FlatExchange) -> None:
        self.flat = flat
        self.fragments = [flat.buffer.whole]
        self.work = WorkSince(1, flat.world_size, flat.gamma)

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def payload_bytes(self) -> int:
        region = self.flat.buffer.param_region
        return region.numel() * region.element_size()

    def count(self, control: CohortControl) -> None:
        self.work.count(control)

    def due(self, everything: bool) -> list[int]:
        return [0]

    @torch.no_grad()
    def start(self, indices: Sequence[int], nonfinite: Sequence[bool], finite: bool, background: bool) -> Pending:
        weights = self.work.weights(0, nonfinite)
        total = math.fsum(weights)
        if total == 0:  # nobody contributes (every rank knows): no reduce
            return Pending([], lambda: False)
        self.work.reset()
        flat, buffer = self.flat, self.flat.buffer
        buffer.contribute_params(weights[flat.rank], finite)
        region = buffer.param_region
        transfer = None
        if background:
            transfer = reduce_in_background(flat.wire, region)
        else:
            flat.wire.all_reduce(region)

        def settle() -> bool:
            region.div_(total)
            if flat.outer is not None:
                flat.outer.step(region)
            return True

        return Pending([buffer.whole], settle, transfer)

    def restart(self) -> None:
        self.work.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"fragments": 1, "steps_since": [list(s) for s in self.work.steps]}

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        world, rank = self.flat.world_size, self.flat.rank
        same = len(states) == world and all(s.get("world_size") == world and s.get("fragments") == 1 for s in states)
        self.work.load(states[rank].get("steps_since", []) if same else [], same)


@dataclass(frozen=True)
class AveragingSpec:
    """What a boundary does, as the averager needs it: the ``policy`` ("sync", "cadence" or "async", with
    ``easgd_alpha``), the weights' ``gamma``, the ``outer`` optimizer, hierarchy (``node_sync_every``
    boundaries per global one, nodes of ``ranks_per_node`` consecutive ranks or given per rank as
    ``nodes``), ``compression`` and ``fragments``, the simulated ``link_delay`` of collectives between
    nodes, and the ``timeout`` of the groups it creates (the boundary group's; None: torch's 30 minutes)."""

    policy: str = "cadence"
    gamma: float = 1.0
    outer: Optional[OuterNesterov] = None
    easgd_alpha: float = 1.0
    node_sync_every: int = 1
    ranks_per_node: int = 1
    nodes: Optional[Sequence[int]] = None
    compression: Optional[str] = None
    fragments: int = 1
    link_delay: Optional[Delay] = None
    timeout: Optional[timedelta] = None


def make_averager(
    module: nn.Module,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    group: Optional[dist.ProcessGroup],
    spec: AveragingSpec,
    extra_fields: Sequence[str] = (),
) -> Averager:
    """The averager for ``spec``, any combination of its settings.

    Hierarchical where ``node_sync_every > 1`` and there is more than one node: ``nodes`` (the node
    id of each rank) when given, consecutive ``ranks_per_node`` otherwise. Compressed and streamed
    where ``compression`` or ``fragments > 1`` ask for it, overlapped for ``policy="async"``; the
    flat averager where none of them. ``link_delay``: every collective between nodes then waits
    as on that link. Every rank calls it at the same point: the groups it creates (the nodes', a
    background reduce's) are collectives, made with ``timeout``, which should be the boundary
    group's, so a rank lost in one of their reduces fails the others as soon as in any boundary collective.
    """
    policy, gamma, outer, easgd_alpha = spec.policy, spec.gamma, spec.outer, spec.easgd_alpha
    node_sync_every, ranks_per_node, nodes = spec.node_sync_every, spec.ranks_per_node, spec.nodes
    compression, fragments, link_delay, timeout = spec.compression, spec.fragments, spec.link_delay, spec.timeout
    wire = Wire(world_size, group, link_delay)
    flat = FlatAverager(module, rank, world_size, device, group, outer, extra_fields, gamma, wire)
    if node_sync_every > 1:
        layout = _node_layout(world_size, ranks_per_node, nodes, group)
    else:  # one level: no groups to form, but a list that could not form them is still refused
        layout = [] if nodes is None else groups_of_nodes(nodes, world_size)
    hierarchical = node_sync_every > 1 and len(layout) > 1
    streamed = compression is not None or fragments > 1
    overlapped = policy == "async"
    if not (hierarchical or streamed or overlapped):
        return flat
    node = NodeReduce(flat, layout, timeout) if hierarchical else None
    cross: CrossReduce = ExactCross(flat)
    if streamed:
        lane = Lane(Wire(world_size, new_group_like(group, timeout), link_delay), flat.buffer.device) if overlapped else None
        codec = None if compression is None else Codec(compression)
        cross = StreamedCross(flat, codec, fragments, own_reference=hierarchical, lane=lane)
    composed = CompressedAverager if streamed else ComposedAverager
    overlap = Overlap(flat.buffer, easgd_alpha) if overlapped else None
    return composed(flat, cross, Levels(node_sync_every if hierarchical else 1), node, overlap)


def _node_layout(
    world_size: int, ranks_per_node: int, nodes: Optional[Sequence[int]], group: Optional[dist.ProcessGroup]
) -> list[list[int]]:
    """The ranks of each node; given ``nodes``, checked to be the same list on every rank first (a
    collective), since ranks that disagree would wait for each other's groups forever."""
    if nodes is None:
        return node_groups(world_size, ranks_per_node)[0]
    layout = groups_of_nodes(nodes, world_size)
    seen = gather_to_all(list(nodes), world_size, group)
    if any(other != list(nodes) for other in seen):
        raise ValueError(
            "ElChe: the ranks were given different `nodes` (the node id of each rank); every rank must pass "
            f"the same list: {', '.join(f'rank {r}: {other}' for r, other in enumerate(seen))}"
        )
    return layout
