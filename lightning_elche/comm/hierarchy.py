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

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_elche.comm.averaging import BoundaryResult, CohortControl, ControlExchange, FlatAverager


def node_groups(world_size: int, ranks_per_node: int) -> tuple[list[list[int]], int]:
    """The ranks of each node, consecutive as launchers number them, and how many nodes."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(
            f"ElCheStrategy: `ranks_per_node` must divide the world size {world_size}, got {ranks_per_node}"
        )
    nodes = [list(range(start, start + ranks_per_node)) for start in range(0, world_size, ranks_per_node)]
    return nodes, len(nodes)


class HierarchicalAverager:
    """Wraps a :class:`FlatAverager`: node-level averages between global ones."""

    def __init__(self, averager: FlatAverager, ranks_per_node: int, node_sync_every: int, gamma: float) -> None:
        self.averager = averager
        self.node_sync_every = node_sync_every
        self.gamma = gamma
        nodes, _ = node_groups(averager.world_size, ranks_per_node)
        # every rank creates every node's group, in the same order (torch requires it)
        groups = [dist.new_group(ranks) for ranks in nodes]
        self.node = next(index for index, ranks in enumerate(nodes) if averager.rank in ranks)
        self.node_ranks = nodes[self.node]
        self.node_group = groups[self.node]
        self._exchange_control = ControlExchange(averager)
        self._steps_since_global = 0.0
        self._windows_since_global = 0
        self.last_was_global = True

    @torch.no_grad()
    def exchange(
        self,
        weight: float,
        moved: bool,
        fields: dict[str, float],
        flags: dict[str, bool],
        needs_consensus: Optional[Callable[[CohortControl], bool]] = None,
    ) -> BoundaryResult:
        self._steps_since_global += float(fields.get("steps", 0.0))
        self._windows_since_global += 1
        round_ = self._exchange_control(weight, moved, fields, flags)
        control, finite = round_.control, round_.finite
        go_global = self._windows_since_global >= self.node_sync_every or (
            needs_consensus is not None and needs_consensus(control)
        )
        self.last_was_global = go_global
        if go_global:  # weighted by the work since the last global average
            work = self._steps_since_global**self.gamma if finite and self._steps_since_global > 0 else 0.0
            self._steps_since_global, self._windows_since_global = 0.0, 0
            result = self.averager.exchange(work, round_.moved, round_.fields, flags)
            return BoundaryResult(control=control, divergence=result.divergence, averaged=result.averaged)
        divergence = self._node_average(round_.weight, round_.moved, finite, control)
        return BoundaryResult(control=control, divergence=divergence, averaged=True)

    def _node_average(self, weight: float, moved: bool, finite: bool, control: CohortControl) -> float:
        """The node's work-weighted average, over the node's group only."""
        averager = self.averager
        node_weight = math.fsum(control.per_rank["weight"][r] for r in self.node_ranks)
        node_movers = math.fsum(control.per_rank["moved"][r] for r in self.node_ranks)
        params, floats = averager._param_region, averager._float_region
        if finite:
            averager._pack(params, averager.params)
            params.mul_(weight)
        else:
            params.zero_()
        if moved:
            averager._pack(floats, averager.float_buffers)
        else:
            floats.zero_()
        dist.all_reduce(averager.flat[: params.numel() + floats.numel()], op=dist.ReduceOp.SUM, group=self.node_group)
        divergence = 0.0
        if node_weight > 0:
            params.div_(node_weight)
            divergence = averager._unpack_params()
        if node_movers > 0:
            floats.div_(node_movers)
            averager._unpack(floats, averager.float_buffers)
        return divergence
