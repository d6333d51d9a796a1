"""What a rank tells the cohort at a boundary, and what every rank knows after the exchange.

The vocabulary of the control data lives here, in the pure core: the cohort decides what each
rank reports and reads the result; ``comm/`` only lays these numbers out in the boundary's
all-reduce and back (``comm/control.py``). The simulator builds the same :class:`CohortControl`
from simulated ranks with :func:`gather_reports`, without any collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

PER_RANK_FIELDS = (
    "window_ms", "steps", "samples", "boundary_ms", "weight", "moved", "fingerprint", "nonfinite", "train_s",
    "divergence",  # the rank's drift from the consensus at the previous boundary (known only after it)
    "claim_ms",  # dynamic dispatch: the rank's time spent claiming tickets in the window
    "lr",  # the rank's learning rate in its window's last batch (NaN without an optimizer)
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
