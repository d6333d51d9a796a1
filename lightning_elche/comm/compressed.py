"""Boundaries for slow links: the change since the last consensus, compressed, one fragment at a time.

Between boundaries the flat buffer's parameter region holds the last consensus ``c``, so a rank's
contribution can be its change ``d_r = θ_r - c`` (the pseudo-gradient) instead of its parameters:
the new consensus ``c + Σ w_r d_r / Σ w_r`` is the same work-weighted average, and a change is
what compresses well. Each boundary:

1. The tail (float buffers, integer buffers, control data) is all-reduced exactly, so the work
   weights, the plan and every decision stay exact.
2. The parameters go in :class:`~lightning_elche.comm.buffer.Fragment` s of whole tensors: with
   ``fragments=F`` one fragment per boundary, in turn (Streaming DiLoCo), each weighted by the
   work done since it was last averaged; a boundary that needs one model on every rank (the
   epoch's last, a checkpoint, a stop, a non-finite rank) averages every fragment.
3. A fragment is reduced in two stages of equal bytes, the shape of a ring all-reduce: each rank
   encodes ``d_r + e_r`` (``quantize.py``) in W chunks and sends chunk k to rank k (all-to-all);
   rank k decodes and weights what it received, encodes its chunk of the average with an error of
   its own, and every rank receives every chunk (all-gather). Every rank decodes the same bytes,
   so the consensus is the same on every rank, bit for bit.

Error feedback: what encoding rounds away is kept (``e_r`` per rank, one per chunk owner) and added
to the next window's change, so nothing is dropped, only sent later: over windows, the sum of what
was sent equals the sum of the changes minus the error still held. Both errors are checkpointed.
Without a codec (``fragments > 1`` alone) a fragment's weighted change is all-reduced exactly.

Cost beside the flat buffer: the error (one float per parameter) and, for the largest fragment, a
float per parameter of scratch plus twice its encoded size (what is sent and what is received).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from lightning_elche.cohort.control import LocalReport
from lightning_elche.comm.buffer import Fragment, split_into_fragments
from lightning_elche.comm.interface import BoundaryResult, FlatExchange, NeedsConsensus, work_weight
from lightning_elche.comm.link import Wire
from lightning_elche.comm.quantize import Codec


class CompressedAverager:
    """Wraps a flat averager (a :class:`FlatExchange`): its buffer and layout, the parameters compressed and streamed."""

    def __init__(self, flat: FlatExchange, wire: Wire, codec: Optional[Codec], fragments: int = 1) -> None:
        self.flat = flat
        self.wire = wire
        self.codec = codec
        buffer = flat.buffer
        self.fragments = split_into_fragments(buffer.params, fragments)
        world = flat.world_size
        block = codec.block if codec is not None else 1
        # a fragment of n values travels as W chunks of `chunk` values (zero padded), whole codec blocks
        self._chunks = [max(1, math.ceil(f.size / (world * block))) * block for f in self.fragments]
        largest = max(self._chunks)
        device, dtype = buffer.device, buffer.flat.dtype
        self._values = torch.zeros(world * largest, dtype=dtype, device=device)
        self.error: Optional[torch.Tensor] = None  # e_r: what this rank's encoding has not sent yet
        self.owner_error: list[torch.Tensor] = []  # per fragment, what this rank's chunk of the average has not
        if codec is not None:
            self.error = torch.zeros_like(buffer.param_region)
            self.owner_error = [torch.zeros(chunk, dtype=dtype, device=device) for chunk in self._chunks]
            self._scratch = torch.zeros(largest, dtype=dtype, device=device)
            payload = codec.payload_bytes(largest)
            self._send = torch.zeros(world * payload, dtype=torch.uint8, device=device)
            self._received = torch.zeros(world * payload, dtype=torch.uint8, device=device)
        self.next_fragment = 0
        self.steps_since = [[0.0] * world for _ in self.fragments]  # each rank's steps since a fragment's last average

    @property
    def nbytes(self) -> int:
        tensors: list[Optional[torch.Tensor]] = [self.flat.buffer.flat, self._values, *self.owner_error]
        if self.codec is not None:
            tensors += [self.error, self._scratch, self._send, self._received]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def payload_bytes(self) -> int:
        """What a boundary reduces, on average over the fragments' turns: the tail, exact, and one
        fragment's payload (the link's cost model, ``cohort/link.py``)."""
        tail = self.flat.buffer.tail_region
        fragments = [self.fragment_payload_bytes(index) for index in range(len(self.fragments))]
        return tail.numel() * tail.element_size() + sum(fragments) // len(fragments)

    def fragment_payload_bytes(self, index: int) -> int:
        """The bytes one rank puts into fragment ``index``'s reduce (W padded chunks when encoded)."""
        if self.codec is None:
            return self.fragments[index].size * self._values.element_size()
        return self.flat.world_size * self.codec.payload_bytes(self._chunks[index])

    def average_now(self, report: LocalReport) -> BoundaryResult:
        """An exact average of every rank's parameters, which becomes the consensus the next changes are
        measured from."""
        return self.flat.average(report, work_weight(report.steps, self.flat.gamma), report.steps > 0)

    @torch.no_grad()
    def exchange(self, report: LocalReport, needs_consensus: NeedsConsensus = None) -> BoundaryResult:
        flat, buffer = self.flat, self.flat.buffer
        share = flat.share(report.steps)
        buffer.contribute_buffers(share.finite and share.moved)
        buffer.control_region.copy_(flat.layout.encode(flat.rank, share.control_fields(report), report.flags))
        self.wire.all_reduce(buffer.tail_region)
        control = flat.layout.decode(buffer.control_region.tolist())
        nonfinite = [flag > 0 for flag in control.per_rank["nonfinite"]]
        for steps_since in self.steps_since:
            for rank, steps in enumerate(control.per_rank["steps"]):
                steps_since[rank] += steps
        everything = len(self.fragments) == 1 or any(nonfinite) or (needs_consensus is not None and needs_consensus(control))
        chosen = range(len(self.fragments)) if everything else [self.next_fragment]
        if not everything:
            self.next_fragment = (self.next_fragment + 1) % len(self.fragments)
        averaged, drift_sq, norm_sq = False, 0.0, 0.0
        for index in chosen:
            weights = [0.0 if bad else work_weight(round(s), flat.gamma) for s, bad in zip(self.steps_since[index], nonfinite)]
            if sum(weights) > 0:
                self._average(index, weights, finite=share.finite)
                self.steps_since[index] = [0.0] * flat.world_size
                averaged = True
            fragment = self.fragments[index]
            drift = buffer.unpack_params(fragment)  # the consensus (or, if nobody contributed, the last one)
            fragment_norm_sq = float(buffer.param_region[fragment.start : fragment.end].square().sum())
            drift_sq += (drift**2) * fragment_norm_sq
            norm_sq += fragment_norm_sq
        buffer.settle(0.0, control.movers)  # the float and integer buffers
        divergence = math.sqrt(drift_sq / norm_sq) if norm_sq > 0 else 0.0
        return BoundaryResult(control=control, divergence=divergence, averaged=averaged, sent_bytes=self.wire.take_sent_bytes())

    def _average(self, index: int, weights: Sequence[float], finite: bool) -> None:
        """Move fragment ``index`` of the consensus by the weighted average of the ranks' changes."""
        flat, buffer = self.flat, self.flat.buffer
        fragment, chunk, world = self.fragments[index], self._chunks[index], flat.world_size
        consensus = buffer.param_region[fragment.start : fragment.end]
        values = self._values[: world * chunk]
        change = values[: fragment.size]
        values.zero_()
        if finite:  # a rank that is not finite sends zeros and keeps its error for later
            buffer.pack(change, buffer.params[fragment.first_tensor : fragment.end_tensor])
            change.sub_(consensus)
        total = math.fsum(weights)
        if self.codec is None:
            change.mul_(weights[flat.rank] / total)
            self.wire.all_reduce(change)
        else:
            self._reduce_compressed(fragment, chunk, values, [w / total for w in weights], finite, index)
        consensus.add_(change)
        if flat.outer is not None:
            flat.outer.step(consensus, slice(fragment.start, fragment.end))

    def _reduce_compressed(
        self, fragment: Fragment, chunk: int, values: torch.Tensor, shares: list[float], finite: bool, index: int
    ) -> None:
        """``values`` (this rank's change, padded to W chunks) in, the weighted average of every rank's out."""
        codec, world = self.codec, self.flat.world_size
        assert codec is not None and self.error is not None
        payload = codec.payload_bytes(chunk)
        error = self.error[fragment.start : fragment.end]
        if finite:
            values[: fragment.size].add_(error)
        send, received = self._send[: world * payload], self._received[: world * payload]
        scratch = self._scratch[:chunk]
        for k in range(world):  # values then holds what the encoding lost
            codec.encode(values[k * chunk : (k + 1) * chunk], send[k * payload : (k + 1) * payload], scratch)
            values[k * chunk : (k + 1) * chunk].copy_(scratch)
        if finite:
            error.copy_(values[: fragment.size])
        self.wire.all_to_all(received, send)
        owned = scratch  # this rank's chunk of the average
        owned.zero_()
        for sender in range(world):
            codec.decode(received[sender * payload : (sender + 1) * payload], owned, shares[sender], accumulate=True)
        owned.add_(self.owner_error[index])
        codec.encode(owned, send[:payload], self.owner_error[index])
        self.wire.all_gather(received, send[:payload])
        for k in range(world):
            codec.decode(received[k * payload : (k + 1) * payload], values[k * chunk : (k + 1) * chunk])

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint: its errors (each chunk owner's at its place in the
        parameters), the fragment due next, the steps since each fragment's last average."""
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
            "steps_since": [list(s) for s in self.steps_since],
        }

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Resume from every saved rank's :meth:`state_dict`.

        With the same world size and fragments each rank takes its own state back: the resumed
        run continues exactly. Otherwise the errors are kept, not their layout: rank r takes the
        errors of the saved ranks r, r + W, ... (their sum is what they had not sent), every rank
        adds the owners' errors (already an average, and an average of equal additions is that
        addition), and every fragment counts its work from the resume.
        """
        if not states:
            return
        world, rank = self.flat.world_size, self.flat.rank
        same = len(states) == world and all(s["world_size"] == world and s["fragments"] == len(self.fragments) for s in states)
        if same:
            own = states[rank]
            self.next_fragment = int(own["next_fragment"])
            self.steps_since = [list(map(float, s)) for s in own["steps_since"]]
        if self.error is None or any(s.get("error") is None for s in states):
            return  # no codec now or then: no error to carry
        if same:
            self.error.copy_(own["error"])
            for error, (_, values) in zip(self.owner_error, own["owner_error"]):
                error.zero_()
                error[: values.numel()].copy_(values)
            return
        self.error.zero_()
        for saved, state in enumerate(states):
            if saved % world == rank:
                self.error.add_(state["error"].to(self.error))
            for start, values in state["owner_error"]:
                self.error[start : start + values.numel()].add_(values.to(self.error))
