"""Every averaging mode with every other: one boundary made of parts chosen once, by ``make_averager``.

A composed averager's boundary is always the same four steps:

1. collect what the previous boundary launched in the background, if anything (``overlap.py``);
2. the tail: control data, float and integer buffers, all-reduced exactly over every rank
   (``control.py``'s :class:`~lightning_elche.comm.control.TailExchange`), so every rank decides the
   same thing: whether this boundary must be a consensus (``needs_consensus``, or a rank not
   finite) and its level (:class:`~lightning_elche.comm.hierarchy.Levels`);
3. the parameter reduces of that level: at a global boundary the cross-node reduce (exact,
   ``averaging.py``'s :class:`~lightning_elche.comm.averaging.ExactCross`, or compressed and
   streamed, ``compressed.py``) on the fragments due, and, with hierarchy, a node-level average
   (``hierarchy.py``) of what does not cross nodes; at a node boundary the node-level one;
4. now (the average into the module) or, under ``policy="async"`` and short of a consensus, in
   the background, applied one window late as ``theta += alpha * (average - snapshot)``.

Every consensus boundary is synchronous, global and averages every fragment, so it leaves every
rank bit-identical: exact reduces all-reduce the same sums, compressed ones decode the same bytes.

Memory: each part adds its own, in copies of the parameters beside the model (F fragments, W
ranks; b the bytes a codec spends on a value, 2 for bf16, 1.016 for int8 and fp8):

=====================================  =====================================================
the flat buffer (every averager)       1
hierarchy                              0 (node-level reduces use the flat buffer)
``policy="async"``                     1: the launch snapshot
fragments or a codec                   1/F: a fragment's values
a codec                                1 + 1/W + 1/(FW) + b/(2F): the error feedback, the chunk
                                       owner's, its scratch, the payloads sent and received
fragments or a codec, with hierarchy   1: the reference, the last global consensus
a codec, with ``policy="async"``       1/F + 1/(FW): the new errors, kept aside in flight
an outer optimizer                     2 (its own): its global model and momentum
=====================================  =====================================================

So int8 on 2 ranks with 4 fragments holds about 3 copies, with hierarchy and ``policy="async"``
about 5.4; ``tests/test_composition.py`` checks each combination's ``nbytes`` against this table.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightning_elche.cohort.control import CohortControl, LocalReport
from lightning_elche.comm.buffer import merge_spans
from lightning_elche.comm.control import TailExchange
from lightning_elche.comm.hierarchy import Levels, NodeReduce
from lightning_elche.comm.interface import BoundaryResult, CrossReduce, FlatExchange, NeedsConsensus, Pending, Share
from lightning_elche.comm.link import Wire
from lightning_elche.comm.overlap import Overlap


class ComposedAverager:
    """A boundary of parts: the flat averager's buffer and layout, the tail, levels, a cross-node
    reduce, optionally a node-level reduce and the overlap of ``policy="async"``."""

    def __init__(
        self,
        flat: FlatExchange,
        cross: CrossReduce,
        levels: Levels,
        node: Optional[NodeReduce] = None,
        overlap: Optional[Overlap] = None,
    ) -> None:
        self.flat = flat
        self.cross = cross
        self.levels = levels
        self.node = node
        self.overlap = overlap
        self.tail = TailExchange(flat.buffer, flat.layout, flat.rank, flat.wire)

    @property
    def wire(self) -> Wire:
        """Every byte this averager sends across nodes is counted here (``benchmarks/slow_link.py``)."""
        return self.flat.wire

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes + self.cross.nbytes + (self.overlap.nbytes if self.overlap is not None else 0)

    @property
    def payload_bytes(self) -> int:
        """What a boundary waits for across nodes, on average: the tail, and the parameters' share of a
        global boundary unless they travel in the background."""
        if self.overlap is not None:
            return self.tail.payload_bytes
        return self.tail.payload_bytes + self.cross.payload_bytes // self.levels.every

    def exchange(self, report: LocalReport, needs_consensus: NeedsConsensus = None) -> BoundaryResult:
        share = self.flat.share(report.steps)
        divergence = self.overlap.collect() if self.overlap is not None else 0.0
        control = self.tail(share.control_fields(report), report.flags, share.finite and share.moved)
        self.cross.count(control)
        if self.flat.outer is not None:
            self.flat.outer.observe(control.per_rank["steps"])
        nonfinite = [flag > 0 for flag in control.per_rank["nonfinite"]]
        consensus = any(nonfinite) or (needs_consensus is not None and needs_consensus(control))
        level = self.levels.next(consensus)
        crossing = self.cross.due(everything=consensus) if level == "global" else []
        averaged = True
        if self.overlap is not None and not consensus:
            self.overlap.launch(lambda: self._start(crossing, control, share, nonfinite, background=True))
        else:
            divergence, averaged = self._now(self._start(crossing, control, share, nonfinite, background=False))
        return BoundaryResult(
            control=control, divergence=divergence, averaged=averaged, level="global" if crossing else "node",
            sent_bytes=self.flat.wire.take_sent_bytes(),
        )  # fmt: skip

    def _start(
        self, crossing: Sequence[int], control: CohortControl, share: Share, nonfinite: list[bool], background: bool
    ) -> list[Pending]:
        """The boundary's reduces, in the order they complete: inside the node what does not cross
        nodes (there, all of it: the fragment that crosses takes its place after), then across."""
        reduces = []
        if self.node is not None and len(crossing) < len(self.cross.fragments):
            reduces.append(self.node.start(control, share.finite, background))
        if crossing:
            reduces.append(self.cross.start(crossing, nonfinite, share.finite, background))
        return reduces

    def _now(self, reduces: list[Pending]) -> tuple[float, bool]:
        """Complete ``reduces`` and unpack their averages: this rank's drift, whether any averaged."""
        spans, averaged = [], False
        for pending in reduces:
            averaged = pending.wait() or averaged
            spans.extend(pending.spans)
        return self.flat.buffer.unpack_spans(merge_spans(spans)), averaged

    def average_now(self, report: LocalReport) -> BoundaryResult:
        """See :class:`~lightning_elche.comm.interface.Averager`: the flat averager's exact boundary
        of the whole buffer, after dropping what was in flight; then every part restarts from it."""
        if self.overlap is not None:
            self.overlap.drop()
        result = self.flat.average_now(report)
        self.cross.restart()
        self.levels.restart()
        return result

    def state_dict(self) -> dict[str, Any]:
        """The flat averager's (world size, rank 0's outer momentum), the levels' count, the cross reduce's."""
        return {**self.flat.state_dict(), **self.levels.state_dict(), **self.cross.state_dict()}

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        if not states:
            return
        self.flat.load_state_dicts(states)
        same_world = len(states) == self.flat.world_size
        self.levels.load(states[self.flat.rank] if same_world else None)
        self.cross.load_state_dicts(states)
