"""Hierarchical averaging: ranks of a node average every window, the nodes every m windows.

Links inside a node (NVLink, PCIe, shared memory) are fast; links between nodes are not. With
``node_sync_every=m`` the boundary's parameter all-reduce runs on the node's group at m-1 of every
m boundaries and on all ranks at the m-th, weighted by the work done since the last global
average, so both levels stay work-weighted. The small control region is still all-reduced over
every rank at every boundary, so plans, stops and checkpoints stay coherent; where Lightning
needs one model on every rank (the last window of an epoch, a checkpoint, a stop) the boundary is
global whatever the count. With m = 1 every boundary is the flat, global one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from lightning_elche.cohort.control import CohortControl, LocalReport
from lightning_elche.comm.control import ControlExchange
from lightning_elche.comm.groups import new_node_groups
from lightning_elche.comm.interface import BoundaryResult, FlatExchange, NeedsConsensus, Share, work_weight


def node_groups(world_size: int, ranks_per_node: int) -> tuple[list[list[int]], int]:
    """The ranks of each node, consecutive as launchers number them, and how many nodes."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(
            f"ElCheStrategy: `ranks_per_node` must divide the world size {world_size}, got {ranks_per_node}"
        )
    nodes = [list(range(start, start + ranks_per_node)) for start in range(0, world_size, ranks_per_node)]
    return nodes, len(nodes)


class HierarchicalAverager:
    """Wraps a flat averager (a :class:`FlatExchange`): node-level averages between global ones, its gamma for both."""

    def __init__(self, flat: FlatExchange, ranks_per_node: int, node_sync_every: int) -> None:
        self.flat = flat
        self.node_sync_every = node_sync_every
        nodes, _ = node_groups(flat.world_size, ranks_per_node)
        groups = new_node_groups(nodes)
        self.node = next(index for index, ranks in enumerate(nodes) if flat.rank in ranks)
        self.node_ranks = nodes[self.node]
        self.node_group = groups[self.node]
        self._exchange_control = ControlExchange(flat.layout, flat.rank, flat.buffer.device, flat.wire)
        self._steps_since_global = 0
        self._windows_since_global = 0

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes + self._exchange_control.nbytes

    @property
    def payload_bytes(self) -> int:
        """Between nodes, the control at every boundary and the buffer at one in ``node_sync_every``."""
        return self._exchange_control.nbytes + self.flat.payload_bytes // self.node_sync_every

    def average_now(self, report: LocalReport) -> BoundaryResult:
        """An exact, synchronous average of every rank (a reduce in flight is dropped: the average of the
        current parameters leaves every rank the same)."""
        self._steps_since_global, self._windows_since_global = 0, 0
        return self.flat.exchange(report)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Nothing to resume: the checkpoint holds a consensus."""

    @torch.no_grad()
    def exchange(self, report: LocalReport, needs_consensus: NeedsConsensus = None) -> BoundaryResult:
        self._steps_since_global += report.steps
        self._windows_since_global += 1
        share = self.flat.share(report.steps)
        control = self._exchange_control(share.control_fields(report), report.flags)
        go_global = self._windows_since_global >= self.node_sync_every or (
            needs_consensus is not None and needs_consensus(control)
        )
        if go_global:  # weighted by the work since the last global average
            work = work_weight(self._steps_since_global, self.flat.gamma)
            self._steps_since_global, self._windows_since_global = 0, 0
            result = self.flat.average(report, work, share.moved)
            return dataclasses.replace(result, control=control)  # the control exchanged above
        divergence = self._node_average(share, control)
        sent = self.flat.wire.take_sent_bytes()  # the control's: the node's reduce stays inside the node
        return BoundaryResult(control=control, divergence=divergence, averaged=True, level="node", sent_bytes=sent)

    def _node_average(self, share: Share, control: CohortControl) -> float:
        """The node's work-weighted average, over the node's group only (integer buffers stay)."""
        node_weight = math.fsum(control.per_rank["weight"][r] for r in self.node_ranks)
        node_movers = math.fsum(control.per_rank["moved"][r] for r in self.node_ranks)
        buffer = self.flat.buffer
        buffer.contribute(share.weight, share.moved, share.finite, ints=False)
        # inside the node, on its fast link: not through the wire, whose simulated link is between nodes
        dist.all_reduce(buffer.averaged_region, op=dist.ReduceOp.SUM, group=self.node_group)
        return buffer.settle(node_weight, node_movers, ints=False)
