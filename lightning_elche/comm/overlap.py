"""policy="async": a boundary's parameter reduce runs while the next window trains, applied one window late.

At a boundary the ranks exchange the tail (control data, float and integer buffers) synchronously,
so every decision (plans, stops, checkpoints) stays coherent. The parameter reduces the boundary
chose (``composed.py``: across nodes, exact or compressed and streamed, or inside the node) are
started in the background; the next boundary waits for them and moves each rank by
``alpha * (θ̄_b − θ_b)``, where ``θ_b`` is the rank's own parameters when they were launched: the
local progress made meanwhile is kept, the drift of boundary b is corrected one window late. With
``alpha < 1`` the correction is blended (EASGD's elastic pull). An exact reduce is a background
all-reduce (:func:`reduce_in_background`); a compressed one runs its stages on a thread and a
process group of its own (``link.py``'s :class:`~lightning_elche.comm.link.Lane`).

The ranks therefore never hold exactly the same parameters between such boundaries. Wherever
Lightning needs a consensus (the last window of an epoch, before validation; a checkpoint; a stop)
and wherever a rank is not finite, the boundary collects what was in flight and then averages
synchronously, decided from the control data on every rank alike.

A reduce in flight when the cohort regroups (``average_now``, an elastic cohort that lost a rank)
is dropped: waited for, its outcome and any failure discarded, and nothing it would have changed
(the late correction, a compressed reduce's new error feedback) is kept; the survivors' exact
average then makes them identical.

Cost: one more copy of the parameters (the launch snapshot, :attr:`Overlap.start`).
"""

from __future__ import annotations

from typing import Callable

import torch

from lightning_elche.comm.buffer import FlatBuffer, merge_spans
from lightning_elche.comm.interface import Pending
from lightning_elche.comm.link import Transfer, Wire


def reduce_in_background(wire: Wire, tensor: torch.Tensor) -> Transfer:
    """A SUM all-reduce of ``tensor`` over the ``wire``'s group, in the background."""
    return wire.all_reduce_async(tensor)


class Overlap:
    """The launch snapshot and what is in flight; ``alpha`` the share of the late correction taken."""

    def __init__(self, buffer: FlatBuffer, alpha: float = 1.0) -> None:
        self.buffer = buffer
        self.alpha = alpha
        self.start = torch.empty_like(buffer.param_region)  # this rank's parameters at the last launch
        self._in_flight: list[Pending] = []

    @property
    def nbytes(self) -> int:
        return self.start.numel() * self.start.element_size()

    @property
    def in_flight(self) -> bool:
        return bool(self._in_flight)

    @torch.no_grad()
    def launch(self, start_reduces: Callable[[], list[Pending]]) -> None:
        """Note this rank's parameters, then start the boundary's reduces in the background."""
        self.buffer.pack(self.start, self.buffer.params)
        self._in_flight = start_reduces()

    def collect(self) -> float:
        """Wait for what the previous boundary launched and move this rank toward its average.

        Returns this rank's drift from that average at launch time (0 if nothing was in flight).
        The reduces complete in launch order (a node-level average of every parameter before the
        fragment that crossed nodes, which takes its place), and the parameters move once.
        """
        flights, self._in_flight = self._in_flight, []
        spans = []
        for pending in flights:
            if pending.wait():
                spans.extend(pending.spans)
        return self.buffer.move_params(self.start, merge_spans(spans), self.alpha) if spans else 0.0

    def drop(self) -> None:
        """Drop what is in flight (see the module's docstring)."""
        flights, self._in_flight = self._in_flight, []
        for pending in flights:
            pending.drop()
