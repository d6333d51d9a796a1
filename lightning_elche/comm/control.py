"""The control region: every rank's report laid out in slots of one tensor, and the tail's all-reduce.

A boundary's control data rides at the end of the parameter all-reduce (``averaging.py``); a
composed averager (``composed.py``) reduces it first, over every rank, with the float and integer
buffers (:class:`TailExchange`), and only then its parameters, at the level and time it chooses
from what the control data says. What the fields and flags mean is the cohort's business
(:mod:`lightning_elche.cohort.control`); here they are only numbers in slots.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_elche.cohort.control import COHORT_FLAGS, PER_RANK_FIELDS, CohortControl
from lightning_elche.comm.buffer import FlatBuffer
from lightning_elche.comm.link import Wire


class ControlLayout:
    """Slots of the control region: one per rank for each field, one summed slot per flag.

    ``extra_fields`` are more per-rank slots (the users' scalars rolled up across ranks).
    """

    def __init__(self, world_size: int, extra_fields: Sequence[str] = ()) -> None:
        self.world_size = world_size
        self.fields = PER_RANK_FIELDS + tuple(extra_fields)
        self.size = len(self.fields) * world_size + len(COHORT_FLAGS)

    def field_slice(self, name: str) -> slice:
        start = self.fields.index(name) * self.world_size
        return slice(start, start + self.world_size)

    def flag_index(self, name: str) -> int:
        return len(self.fields) * self.world_size + COHORT_FLAGS.index(name)

    def encode(self, rank: int, fields: dict[str, float], flags: dict[str, bool]) -> torch.Tensor:
        control = torch.zeros(self.size, dtype=torch.float64)
        for name in self.fields:
            control[self.field_slice(name).start + rank] = float(fields.get(name, 0.0))
        for name in COHORT_FLAGS:
            control[self.flag_index(name)] = 1.0 if flags.get(name) else 0.0
        return control

    def decode(self, control: list[float]) -> CohortControl:
        per_rank = {name: control[self.field_slice(name)] for name in self.fields}
        flags = {name: control[self.flag_index(name)] > 0 for name in COHORT_FLAGS}
        return CohortControl(per_rank=per_rank, flags=flags)


class TailExchange:
    """The flat buffer's tail (float buffers, integer buffers, control data), all-reduced in full
    precision over every rank of the ``wire`` at every boundary of a composed averager.

    So the plan, every decision and the BatchNorm statistics are those of a flat boundary whatever
    happens to the parameters: compressed, streamed, averaged inside a node or in the background.
    Float buffers are averaged over the ranks that moved, integer buffers take rank 0's, both at once.
    """

    def __init__(self, buffer: FlatBuffer, layout: ControlLayout, rank: int, wire: Wire) -> None:
        self.buffer = buffer
        self.layout = layout
        self.rank = rank
        self.wire = wire

    @property
    def payload_bytes(self) -> int:
        tail = self.buffer.tail_region
        return tail.numel() * tail.element_size()

    @torch.no_grad()
    def __call__(self, fields: dict[str, float], flags: dict[str, bool], moved: bool) -> CohortControl:
        """This rank's fields and flags, and its buffers if it ``moved``, in; everybody's control data out."""
        buffer = self.buffer
        buffer.contribute_buffers(moved)
        buffer.control_region.copy_(self.layout.encode(self.rank, fields, flags))
        self.wire.all_reduce(buffer.tail_region)
        control = self.layout.decode(buffer.control_region.tolist())
        buffer.settle_buffers(control.movers)
        return control
