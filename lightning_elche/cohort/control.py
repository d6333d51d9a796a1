"""What a rank tells the cohort at a boundary, what every rank knows after the exchange, and who is in it.

The vocabulary of the control data lives here, in the pure core: the cohort decides what each
rank reports and reads the result; ``comm/`` only lays these numbers out in the boundary's
all-reduce and back (``comm/control.py``). The simulator builds the same :class:`CohortControl`
from simulated ranks with :func:`gather_reports`, without any collective.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

PER_RANK_FIELDS = (
    "window_ms", "steps", "samples", "boundary_ms", "weight", "moved", "fingerprint", "nonfinite", "train_s",
    "divergence",  # the rank's drift from the consensus at the previous boundary (known only after it)
    "claim_ms",  # dynamic dispatch: the rank's time spent claiming tickets in the window
    "lr",  # the rank's learning rate in its window's last batch (NaN without an optimizer)
    "clock_due",  # what the rank's clock says is due (validation, time checkpoints): rank 0's decides
    "validation_ms",  # ms per sample of the rank's last validation (0: none yet), for validation's split
    "plan_data", "plan_seed", "plan_samples",  # with "fingerprint": what the plans must agree on (fingerprint.py)
)
COHORT_FLAGS = ("sigterm", "stop", "requeue", "finished")  # finished: a rank's dynamic epoch ran out of batches


@dataclass(frozen=True)
class LocalReport:
    """One rank's contribution to a boundary: its optimizer steps in the window, its per-rank fields
    (any of :data:`PER_RANK_FIELDS` or extra fields the averager was built with) and its flags."""

    steps: int
    fields: dict[str, float] = field(default_factory=dict)
    flags: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class CohortControl:
    """Everybody's control data after the exchange: identical on every rank."""

    per_rank: dict[str, list[float]]
    flags: dict[str, bool]

    def ints(self, name: str) -> list[int]:
        return [int(round(v)) for v in self.per_rank[name]]

    @property
    def world_size(self) -> int:
        return len(self.per_rank["steps"])

    @property
    def total_weight(self) -> float:
        return math.fsum(self.per_rank["weight"])

    @property
    def movers(self) -> float:
        return math.fsum(self.per_rank["moved"])


def gather_reports(fields: Sequence[dict[str, float]], flags: Sequence[dict[str, bool]] = ()) -> CohortControl:
    """The control data an exchange would return for these ranks' fields and flags (one entry per rank)."""
    names = PER_RANK_FIELDS + tuple(sorted({name for rank in fields for name in rank} - set(PER_RANK_FIELDS)))
    per_rank = {name: [float(rank.get(name, 0.0)) for rank in fields] for name in names}
    return CohortControl(
        per_rank=per_rank, flags={name: any(rank.get(name, False) for rank in flags) for name in COHORT_FLAGS}
    )


@dataclass(frozen=True)
class Generation:
    """The members of an elastic cohort between two membership changes, as every member knows them once
    they agreed (``comm/membership.py``). Each member has a stable id (the launcher's); its rank is its
    place in the sorted member list, so the lowest surviving id leads (logs, writes checkpoints) and
    every member computes the same ranks from the same list."""

    number: int
    members: tuple[int, ...]  # member ids, those that stayed first, then joiners: rank r is members[r]
    tickets: int = 0  # join requests handled up to this generation (the store numbers them 0, 1, ...)

    @classmethod
    def first(cls, world_size: int) -> "Generation":
        """The launch: member ids are the launcher's ranks."""
        return cls(0, tuple(range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member: int) -> int:
        return self.members.index(member)

    def after(self, lost: Iterable[int] = (), joined: Iterable[int] = (), tickets: Optional[int] = None) -> "Generation":
        """The next generation: ``lost`` members out, ``joined`` ones in (the join requests up to ``tickets``).
        The members that stay keep their order and come first, the joiners after them: rank 0, which sends
        the joiners the cohort's state, is a member that holds it (a spare started early has a lower id
        than a replacement that became a member before it)."""
        gone = set(lost)
        staying = [m for m in self.members if m not in gone]
        members = staying + sorted(set(joined) - set(staying))
        if not members:
            raise ValueError(f"no member of generation {self.number} is left")
        return Generation(self.number + 1, tuple(members), self.tickets if tickets is None else tickets)

    def sources(self, previous: "Generation") -> list[Optional[int]]:
        """For each rank of this generation, its rank in ``previous`` (None for a member that joined)."""
        return [previous.rank_of(m) if m in previous.members else None for m in self.members]

    def encode(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members), "tickets": self.tickets})

    @classmethod
    def decode(cls, text: str) -> "Generation":
        value = json.loads(text)
        return cls(int(value["number"]), tuple(int(m) for m in value["members"]), int(value.get("tickets", 0)))
