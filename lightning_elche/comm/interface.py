"""What every averager answers, the one weight rule, and what the wrappers use of the flat averager.

The flat averager (``averaging.py``) and the two that wrap it (``overlap.py``, ``hierarchy.py``)
all return a :class:`BoundaryResult` from ``exchange(report, needs_consensus)``. The wrappers see
the flat averager through :class:`FlatExchange`, so that ``averaging.py`` can choose among all
three (``make_averager``) without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Protocol, Sequence

import torch.distributed as dist

from lightning_elche.cohort.control import CohortControl, LocalReport
from lightning_elche.comm.buffer import FlatBuffer
from lightning_elche.comm.control import ControlLayout
from lightning_elche.comm.link import Wire
from lightning_elche.comm.outer import OuterNesterov

NeedsConsensus = Optional[Callable[[CohortControl], bool]]


def work_weight(steps: int, gamma: float) -> float:
    """A rank's averaging weight: ``steps ** gamma``, 0 for a rank that took no step."""
    return float(steps) ** gamma if steps > 0 else 0.0


@dataclass(frozen=True)
class BoundaryResult:
    control: CohortControl
    divergence: float  # ||theta_before - theta_after|| / ||theta_after|| on this rank
    averaged: bool  # False when no rank contributed (nobody stepped, or every rank non-finite)
    level: Literal["global", "node"] = "global"  # "node": averaged inside each node only
    sent_bytes: int = 0  # what this rank sent for the boundary (``link.py``'s count)


@dataclass(frozen=True)
class Share:
    """What this rank puts into a reduce: its weight, whether its float buffers count, whether it is finite."""

    weight: float
    moved: bool
    finite: bool

    def control_fields(self, report: LocalReport) -> dict[str, float]:
        """The report's fields plus the four every averager's decode relies on."""
        return dict(
            report.fields,
            steps=float(report.steps),
            weight=self.weight,
            moved=1.0 if self.moved else 0.0,
            nonfinite=0.0 if self.finite else 1.0,
        )


class Averager(Protocol):
    """What the strategy and the callback use of an averager."""

    @property
    def nbytes(self) -> int: ...

    @property
    def payload_bytes(self) -> int: ...  # what one boundary reduces across the slowest link, on average

    def exchange(self, report: LocalReport, needs_consensus: NeedsConsensus = None) -> BoundaryResult: ...

    def average_now(self, report: LocalReport) -> BoundaryResult:
        """A synchronous, exact consensus of the current group: every rank ends with the same parameters
        (what the survivors of a lost rank run before they go on)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state for a checkpoint (empty where the averager keeps none between boundaries)."""

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Resume from every saved rank's :meth:`state_dict` (the same or another world size)."""


class FlatExchange(Averager, Protocol):
    """What the overlapped and hierarchical averagers use of the flat one they wrap."""

    rank: int
    world_size: int
    group: Optional[dist.ProcessGroup]  # the group of its reduce (None: the default group)
    wire: Wire  # its collectives, counted (and slowed to a simulated link)
    gamma: float
    outer: Optional[OuterNesterov]
    layout: ControlLayout
    buffer: FlatBuffer

    def share(self, steps: int) -> Share: ...

    def average(self, report: LocalReport, weight: float, moved: bool) -> BoundaryResult: ...
