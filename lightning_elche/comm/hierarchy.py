"""Hierarchical averaging: ranks of a node average every window, the nodes every m windows.

Links inside a node (NVLink, PCIe, shared memory) are fast; links between nodes are not. With
``node_sync_every=m`` (:class:`Levels`) a boundary's parameters are averaged inside each node
(:class:`NodeReduce`, weighted by the window's work, exact, over the node's group, never on the
simulated slow link) at m-1 of every m boundaries, and across nodes at the m-th by the composed
averager's cross-node reduce, weighted by the work done since the last global average, so both
levels stay work-weighted. The tail (control data, float and integer buffers) is still reduced
over every rank at every boundary, so plans, stops and checkpoints stay coherent; where Lightning
needs one model on every rank (the last window of an epoch, a checkpoint, a stop) and wherever a
rank is not finite the boundary is global whatever the count.

With the other settings (``composed.py``):

- compression or fragments: a global boundary sends the fragment due (every fragment at a
  consensus) compressed across nodes; the other fragments are averaged inside the node at that
  boundary too, so every parameter is averaged at every boundary at least inside its node. The
  compressed reduce's reference, the last *global* consensus, is then kept in storage of its own
  (the node average overwrites the flat buffer's parameter region).
- ``policy="async"``: node-level and global reduces alike are launched in the background and
  applied one window late; a consensus is synchronous.

Nodes are consecutive ranks (``ranks_per_node``, as launchers number them) or given rank by rank
(``nodes``: the node id of each rank, for a cohort whose ranks changed). With m = 1, or a single
node, every boundary is the flat, global one. Memory: nothing beyond the flat buffer.
"""

from __future__ import annotations

import math
from datetime import timedelta
from numbers import Integral
from typing import Any, Literal, Optional, Sequence

import torch

from lightning_elche.cohort.control import CohortControl
from lightning_elche.comm.groups import new_node_groups
from lightning_elche.comm.interface import FlatExchange, Pending, work_weight
from lightning_elche.comm.link import Wire
from lightning_elche.comm.overlap import reduce_in_background


def node_groups(world_size: int, ranks_per_node: int) -> tuple[list[list[int]], int]:
    """The ranks of each node, consecutive as launchers number them, and how many nodes."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(
            f"ElCheStrategy: `ranks_per_node` must divide the world size {world_size}, got {ranks_per_node}"
        )
    nodes = [list(range(start, start + ranks_per_node)) for start in range(0, world_size, ranks_per_node)]
    return nodes, len(nodes)


def groups_of_nodes(nodes: Sequence[Any], world_size: int) -> list[list[int]]:
    """The ranks of each node from the node id of each rank (``nodes[r]``: rank r's node), the nodes in
    the order their first rank comes; the same on every rank given the same list."""
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence) or len(nodes) != world_size:
        raise ValueError(
            f"ElChe: `nodes` must list the node id of each of the {world_size} ranks (rank r's node at "
            f"index r), got {nodes!r}"
        )
    bad = [node for node in nodes if isinstance(node, bool) or not isinstance(node, Integral) or node < 0]
    if bad:
        raise ValueError(f"ElChe: the node ids in `nodes` must be integers >= 0, got {bad[0]!r} in {list(nodes)!r}")
    groups: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(int(node), []).append(rank)
    return list(groups.values())


class Levels:
    """Which level a boundary averages at: "global" every ``every``-th boundary and at a consensus,
    "node" otherwise (``every=1``: always global, one level)."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.windows_since_global = 0

    def next(self, consensus: bool) -> Literal["global", "node"]:
        self.windows_since_global += 1
        if consensus or self.windows_since_global >= self.every:
            self.windows_since_global = 0
            return "global"
        return "node"

    def restart(self) -> None:
        self.windows_since_global = 0

    def state_dict(self) -> dict[str, Any]:
        return {"windows_since_global": self.windows_since_global}

    def load(self, state: Optional[dict[str, Any]]) -> None:
        """This rank's saved count (the same on every rank); a fresh count without one."""
        self.windows_since_global = int(state.get("windows_since_global", 0)) if state else 0


class NodeReduce:
    """The node's work-weighted average of the parameters, exact, over the node's group.

    Every rank creates every node's group at construction, in the same order (a collective), with
    ``timeout`` (see ``groups.new_node_groups``).
    """

    def __init__(self, flat: FlatExchange, nodes: Sequence[Sequence[int]], timeout: Optional[timedelta] = None) -> None:
        self.flat = flat
        groups = new_node_groups(nodes, timeout)
        index = next(index for index, ranks in enumerate(nodes) if flat.rank in ranks)
        self.ranks = list(nodes[index])
        # inside the node, on its fast link: not the flat wire, whose simulated link is between nodes
        self.wire = Wire(len(self.ranks), groups[index])

    @torch.no_grad()
    def start(self, control: CohortControl, finite: bool, background: bool) -> Pending:
        """Weighted by this window's work (the control's steps; 0 for a rank not finite)."""
        steps, nonfinite = control.ints("steps"), control.ints("nonfinite")
        weights = {r: 0.0 if nonfinite[r] else work_weight(steps[r], self.flat.gamma) for r in self.ranks}
        total = math.fsum(weights.values())
        buffer = self.flat.buffer
        if total == 0:  # nobody in the node contributes: every rank of it knows, none reduces
            return Pending([], lambda: False)
        buffer.contribute_params(weights[self.flat.rank], finite)
        region = buffer.param_region
        transfer = None
        if background:
            transfer = reduce_in_background(self.wire, region)
        else:
            self.wire.all_reduce(region)

        def settle() -> bool:
            region.div_(total)
            return True

        return Pending([buffer.whole], settle, transfer)
