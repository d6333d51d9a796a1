"""The control region: every rank's report laid out in slots of one tensor, and its own all-reduce.

A boundary's control data rides at the end of the parameter all-reduce (``averaging.py``); the
overlapped and hierarchical averagers reduce it on its own, over every rank, with
:class:`ControlExchange`. What the fields and flags mean is the cohort's business
(:mod:`lightning_elche.cohort.control`); here they are only numbers in slots.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_elche.cohort.control import COHORT_FLAGS, PER_RANK_FIELDS, CohortControl
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


class ControlExchange:
    """The control region alone, all-reduced in float64 on every rank of the ``wire``'s group.

    For boundaries whose parameter reduce runs in the background (``policy="async"``) or on a
    node's group (hierarchical averaging): the decisions still come from every rank's numbers.
    """

    def __init__(self, layout: ControlLayout, rank: int, device: torch.device, wire: Wire) -> None:
        self.layout = layout
        self.rank = rank
        self.wire = wire
        self.buffer = torch.zeros(layout.size, dtype=torch.float64, device=device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @torch.no_grad()
    def __call__(self, fields: dict[str, float], flags: dict[str, bool]) -> CohortControl:
        """This rank's fields and flags in, everybody's control data out."""
        self.buffer.copy_(self.layout.encode(self.rank, fields, flags))
        self.wire.all_reduce(self.buffer)
        return self.layout.decode(self.buffer.tolist())
