"""Boundaries for slow links: the change since the last global consensus, compressed, one fragment at a time.

The reduce keeps a *reference*, the last global consensus ``c``, so a rank's contribution can be
its change ``d_r = θ_r - c`` (the pseudo-gradient) instead of its parameters: the new consensus
``c + Σ w_r d_r / Σ w_r`` is the same work-weighted average, and a change is what compresses well.
The reference is the flat buffer's parameter region where nothing else writes there, storage of
its own (one more copy of the parameters) where a node-level average does (``hierarchy.py``).
:class:`StreamedCross` is the cross-node reduce of a composed averager (``composed.py``), which
first all-reduces the tail (float buffers, integer buffers, control data) exactly, so the work
weights, the plan and every decision stay exact. Then:

1. The parameters go in :class:`~lightning_elche.comm.buffer.Fragment` s of whole tensors: with
   ``fragments=F`` one fragment per global boundary, in turn (Streaming DiLoCo), each weighted by
   the work done since it was last averaged; a boundary that needs one model on every rank (the
   epoch's last, a checkpoint, a stop, a non-finite rank) averages every fragment.
2. A fragment is reduced in two stages of equal bytes, the shape of a ring all-reduce: each rank
   encodes ``d_r + e_r`` (``quantize.py``) in W chunks and sends chunk k to rank k (all-to-all);
   rank k decodes and weights what it received, encodes its chunk of the average with an error of
   its own, and every rank receives every chunk (all-gather). Every rank decodes the same bytes,
   so the consensus is the same on every rank, bit for bit.
3. Under ``policy="async"`` the fragment's stages run on a thread and a process group of their own
   (``link.py``'s :class:`~lightning_elche.comm.link.Lane`) while the next window trains: this
   rank's change is encoded at the launch, the two collectives and the chunk owner's stage in the
   background, and the next boundary adds the average to the reference and moves each rank one
   window late (``overlap.py``). The new errors are kept aside until then, so a reduce dropped in
   flight leaves the error feedback as it was.

Error feedback: what encoding rounds away is kept (``e_r`` per rank, one per chunk owner) and added
to the next window's change, so nothing is dropped, only sent later: over windows, the sum of what
was sent equals the sum of the changes minus the error still held. Both errors are checkpointed.
A rank lost from an elastic cohort loses its error with its window: what it had not sent was its
own unsent change, and its window goes back to the epoch. Without a codec (``fragments > 1``
alone) a fragment's weighted change is all-reduced exactly.

Memory beside the flat buffer (``composed.py`` has the table): with a codec the error (one float per
parameter) and the chunk owners' (1/W); for the largest fragment a float per parameter of values
plus twice its encoded size (what is sent and what is received); with hierarchy the reference (one
copy); under ``policy="async"`` with a codec a fragment's new errors, kept aside.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from lightning_elche.cohort.control import CohortControl
from lightning_elche.comm.buffer import Fragment, split_into_fragments
from lightning_elche.comm.composed import ComposedAverager
from lightning_elche.comm.interface import FlatExchange, Pending, WorkSince
from lightning_elche.comm.link import Lane, Wire
from lightning_elche.comm.quantize import Codec


class StreamedCross:
    """The cross-node reduce of the change since the last global consensus: ``codec`` (None: exact),
    ``fragments`` in turn; ``own_reference`` where a node-level average writes the parameter region;
    ``lane`` (``policy="async"``) to run in the background."""

    def __init__(
        self, flat: FlatExchange, codec: Optional[Codec], fragments: int, own_reference: bool, lane: Optional[Lane]
    ) -> None:
        self.flat = flat
        self.codec = codec
        self.lane = lane
        buffer = flat.buffer
        self.fragments = split_into_fragments(buffer.params, fragments)
        self.reference = buffer.param_region.clone() if own_reference else buffer.param_region
        self.own_reference = own_reference
        world = flat.world_size
        block = codec.block if codec is not None else 1
        # a fragment of n values travels as W chunks of `chunk` values (zero padded), whole codec blocks
        self._chunks = [max(1, math.ceil(f.size / (world * block))) * block for f in self.fragments]
        largest = max(self._chunks)
        device, dtype = buffer.device, buffer.flat.dtype
        self._values = torch.zeros(world * largest, dtype=dtype, device=device)
        self.error: Optional[torch.Tensor] = None  # e_r: what this rank's encoding has not sent yet
        self.owner_error: list[torch.Tensor] = []  # per fragment, what this rank's chunk of the average has not
        self._aside: list[torch.Tensor] = []  # a background reduce's new errors (this rank's, the owner's)
        if codec is not None:
            self.error = torch.zeros_like(buffer.param_region)
            self.owner_error = [torch.zeros(chunk, dtype=dtype, device=device) for chunk in self._chunks]
            self._scratch = torch.zeros(largest, dtype=dtype, device=device)
            payload = codec.payload_bytes(largest)
            self._send = torch.zeros(world * payload, dtype=torch.uint8, device=device)
            self._received = torch.zeros(world * payload, dtype=torch.uint8, device=device)
            if lane is not None:
                biggest = max(f.size for f in self.fragments)
                self._aside = [torch.zeros(biggest, dtype=dtype, device=device), torch.zeros_like(self._scratch)]
        self.next_fragment = 0
        self.work = WorkSince(len(self.fragments), world, flat.gamma)

    @property
    def nbytes(self) -> int:
        tensors: list[Optional[torch.Tensor]] = [self._values, *self.owner_error, *self._aside]
        if self.own_reference:
            tensors.append(self.reference)
        if self.codec is not None:
            tensors += [self.error, self._scratch, self._send, self._received]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def payload_bytes(self) -> int:
        """What one reduce sends, on average over the fragments' turns (the link's cost model,
        ``cohort/link.py``)."""
        return sum(self.fragment_payload_bytes(index) for index in range(len(self.fragments))) // len(self.fragments)

    def fragment_payload_bytes(self, index: int) -> int:
        """The bytes one rank puts into fragment ``index``'s reduce (W padded chunks when encoded)."""
        if self.codec is None:
            return self.fragments[index].size * self._values.element_size()
        return self.flat.world_size * self.codec.payload_bytes(self._chunks[index])

    def count(self, control: CohortControl) -> None:
        self.work.count(control)

    def due(self, everything: bool) -> list[int]:
        """Every fragment for a consensus; otherwise the next one's turn."""
        if everything or len(self.fragments) == 1:
            return list(range(len(self.fragments)))
        index, self.next_fragment = self.next_fragment, (self.next_fragment + 1) % len(self.fragments)
        return [index]

    @torch.no_grad()
    def start(self, indices: Sequence[int], nonfinite: Sequence[bool], finite: bool, background: bool) -> Pending:
        """Average ``indices``: now, every fragment in turn (its span then takes the reference, the
        last consensus where nobody contributed); or in the background, one fragment."""
        if background:
            (index,) = indices  # a consensus, which averages every fragment, is synchronous
            return self._start_in_background(index, nonfinite, finite)
        averaged = False
        for index in indices:
            shares = self._shares(index, nonfinite)
            if shares is None:
                continue
            fragment = self.fragments[index]
            error = None if self.error is None else self.error[fragment.start : fragment.end]
            self._encode(index, shares, finite, error)
            self._communicate(index, shares, self.flat.wire, self.owner_error[index] if self.codec else None)
            self._advance(index)
            averaged = True
        spans = [self.fragments[index] for index in indices]

        def finish() -> bool:
            self._publish(spans)
            return averaged

        return Pending(spans, finish)

    def _start_in_background(self, index: int, nonfinite: Sequence[bool], finite: bool) -> Pending:
        assert self.lane is not None
        lane, shares = self.lane, self._shares(index, nonfinite)
        if shares is None:
            return Pending([], lambda: False)
        fragment = self.fragments[index]
        own_aside = self._aside[0][: fragment.size] if self.codec else None
        owner_aside = self._aside[1][: self._chunks[index]] if self.codec else None
        self._encode(index, shares, finite, own_aside)
        task = lane.run(lambda: self._communicate(index, shares, lane.wire, owner_aside))

        def finish() -> bool:
            self.flat.wire.count(lane.wire.take_sent_bytes())  # the bytes count at the boundary that applies them
            if self.error is not None and own_aside is not None and owner_aside is not None:
                if finite:
                    self.error[fragment.start : fragment.end].copy_(own_aside)
                self.owner_error[index].copy_(owner_aside)
            self._advance(index)
            self._publish([fragment])
            return True

        return Pending([fragment], finish, task)

    def _shares(self, index: int, nonfinite: Sequence[bool]) -> Optional[list[float]]:
        """Every rank's share of fragment ``index``'s average (None: nobody contributes), its work reset."""
        weights = self.work.weights(index, nonfinite)
        total = math.fsum(weights)
        if total == 0:
            return None
        self.work.reset(index)
        return [w / total for w in weights]

    def _encode(self, index: int, shares: list[float], finite: bool, error_out: Optional[torch.Tensor]) -> None:
        """This rank's change (with its error) into the values (exact: weighted) and, with a codec,
        encoded into what it sends; the encoding's new error into ``error_out`` (the fragment's size;
        a finite rank's only)."""
        buffer, fragment, chunk = self.flat.buffer, self.fragments[index], self._chunks[index]
        world = self.flat.world_size
        values = self._values[: world * chunk]
        change = values[: fragment.size]
        values.zero_()
        if finite:  # a rank that is not finite sends zeros and keeps its error for later
            buffer.pack(change, buffer.params[fragment.first_tensor : fragment.end_tensor])
            change.sub_(self.reference[fragment.start : fragment.end])
        if self.codec is None:
            change.mul_(shares[self.flat.rank])
            return
        assert self.error is not None and error_out is not None
        if finite:
            change.add_(self.error[fragment.start : fragment.end])
        payload = self.codec.payload_bytes(chunk)
        scratch = self._scratch[:chunk]
        for k in range(world):  # values then holds what the encoding lost
            self.codec.encode(values[k * chunk : (k + 1) * chunk], self._send[k * payload : (k + 1) * payload], scratch)
            values[k * chunk : (k + 1) * chunk].copy_(scratch)
        if finite:
            error_out.copy_(change)

    def _communicate(self, index: int, shares: list[float], wire: Wire, owner_error_out: Optional[torch.Tensor]) -> None:
        """The collectives: the values then hold the weighted average of every rank's change."""
        fragment, chunk, world, codec = self.fragments[index], self._chunks[index], self.flat.world_size, self.codec
        values = self._values[: world * chunk]
        if codec is None:
            wire.all_reduce(values[: fragment.size])
            return
        assert owner_error_out is not None
        payload = codec.payload_bytes(chunk)
        send, received = self._send[: world * payload], self._received[: world * payload]
        wire.all_to_all(received, send)
        owned = self._scratch[:chunk]  # this rank's chunk of the average
        owned.zero_()
        for sender in range(world):
            codec.decode(received[sender * payload : (sender + 1) * payload], owned, shares[sender], accumulate=True)
        owned.add_(self.owner_error[index])
        codec.encode(owned, send[:payload], owner_error_out)
        wire.all_gather(received, send[:payload])
        for k in range(world):
            codec.decode(received[k * payload : (k + 1) * payload], values[k * chunk : (k + 1) * chunk])

    def _advance(self, index: int) -> None:
        """Move fragment ``index`` of the reference by the average change (and the outer step)."""
        fragment = self.fragments[index]
        consensus = self.reference[fragment.start : fragment.end]
        consensus.add_(self._values[: fragment.size])
        if self.flat.outer is not None:
            self.flat.outer.step(consensus, slice(fragment.start, fragment.end))

    def _publish(self, spans: Sequence[Fragment]) -> None:
        """The reference's ``spans`` into the parameter region (where it is not the region itself)."""
        if self.own_reference:
            for span in spans:
                self.flat.buffer.param_region[span.start : span.end].copy_(self.reference[span.start : span.end])

    def restart(self) -> None:
        """After an exact consensus of every rank: the reference is it, every fragment counts afresh."""
        if self.own_reference:
            self.reference.copy_(self.flat.buffer.param_region)
        self.work.reset()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint: its errors (each chunk owner's at its place in the
        parameters), the fragment due next, the steps since each fragment's last average. Not the
        reference: a checkpoint is taken at a consensus, which is the reference and the weights the
        resumed run starts from (and ``average_now`` makes it again after a regroup)."""
        owned = []
        for fragment, chunk, error in zip(self.fragments, self._chunks, self.owner_error):
            start = fragment.start + self.flat.rank * chunk
            length = max(0, min(chunk, fragment.end - start))
            owned.append([start, error[:length].cpu().clone()])
        return {
            "world_size": self.flat.world_size,
            "fragments": len(self.fragments),
            "compression": None if self.codec is None else self.codec.name,
            "error": None if self.error is None else self.error.cpu().clone(),
            "owner_error": owned,
            "next_fragment": self.next_fragment,
            "steps_since": [list(s) for s in self.work.steps],
        }

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Resume from every saved rank's :meth:`state_dict`.

        With the same world size and fragments each rank takes its own state back: the resumed
        run continues exactly. Otherwise the errors are kept, not their layout: rank r takes the
        errors of the saved ranks r, r + W, ... (their sum is what they had not sent), every rank
        adds the owners' errors (already an average, and an average of equal additions is that
        addition), and every fragment counts its work from the resume. The fragment due next is
        kept whenever the fragments are the same (it is the same on every rank).
        """
        if not states:
            return
        world, rank = self.flat.world_size, self.flat.rank
        fragments_kept = all(s.get("fragments") == len(self.fragments) for s in states)
        same = fragments_kept and len(states) == world and all(s.get("world_size") == world for s in states)
        if fragments_kept:
            self.next_fragment = int(states[0].get("next_fragment", 0))
        self.work.load(states[rank].get("steps_since", []) if same else [], same)
        if self.error is None or any(s.get("error") is None for s in states):
            return  # no codec now or then: no error to carry
        if same:
            self.error.copy_(states[rank]["error"])
            for error, (_, values) in zip(self.owner_error, states[rank]["owner_error"]):
                error.zero_()
                error[: values.numel()].copy_(values)
            return
        self.error.zero_()
        for error in self.owner_error:
            error.zero_()
        for saved, state in enumerate(states):
            if saved % world == rank:
                self.error.add_(state["error"].to(self.error))
            for start, values in state["owner_error"]:
                self.error[start : start + values.numel()].add_(values.to(self.error))


class CompressedAverager(ComposedAverager):
    """A composed averager whose cross-node reduce is a :class:`StreamedCross` (compression or fragments).

    A name only: ``lightning/`` tests for it before it saves and loads an averager's state; every
    averager answers the state methods now, so it goes once ``lightning/`` calls the protocol.
    """
