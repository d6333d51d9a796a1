"""What every averager answers, the one weight rule, and the parts a composed averager is made of.

:func:`~lightning_elche.comm.averaging.make_averager` returns an :class:`Averager` for every
combination of the settings: the flat one (``averaging.py``: one all-reduce per boundary), or a
composed one (``composed.py``) made, once, of a cross-node reduce (:class:`CrossReduce`: exact
in ``averaging.py``, compressed and streamed in ``compressed.py``), a node-level reduce and level
schedule (``hierarchy.py``) and the overlap of ``policy="async"`` (``overlap.py``). The parts see
the flat averager through :class:`FlatExchange` and hand back what they started as a
:class:`Pending`, so that nothing here imports them (no import cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Protocol, Sequence

import torch.distributed as dist

from lightning_elche.cohort.control import CohortControl, LocalReport
from lightning_elche.comm.buffer import FlatBuffer, Fragment
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
    """What the strategy and the callback use of an averager, whichever the settings chose.

    - ``exchange``: one boundary. Where ``needs_consensus(control)`` (and wherever a rank is not
      finite) it leaves every rank with the same parameters, bit for bit.
    - ``average_now``: a synchronous, exact consensus of the current group weighted by
      ``report.steps`` (equal weights where nobody stepped), whatever the averager and its state:
      what an elastic cohort's survivors run after a rank was lost mid-window. A background reduce
      still in flight is dropped (waited for, its outcome and failure discarded); no outer step is
      taken, the outer optimizer restarts from the consensus with its momentum. Its counters
      restart; its error feedback is kept (what it rounded away was never in anyone's parameters,
      so it is still owed); a lost rank's goes with its window, whose samples go back to the epoch.
    - ``state_dict``: this rank's state, tensors on the CPU (weights_only-safe); the outer
      optimizer's momentum, replicated, in rank 0's only. A checkpoint takes it at a consensus
      boundary, where nothing is in flight; a reduce in flight is never part of it (a regroup
      drops it): its work is not counted again, its new error feedback is not in it yet.
    - ``load_state_dicts``: resume from every saved rank's state, at the same world size exactly,
      at another with what can be carried (each part says what).
    """

    @property
    def nbytes(self) -> int: ...  # the memory its buffers hold on the reduce device

    @property
    def payload_bytes(self) -> int: ...  # what one boundary reduces across the slowest link, on average

    def exchange(self, report: LocalReport, needs_consensus: NeedsConsensus = None) -> BoundaryResult: ...

    def average_now(self, report: LocalReport) -> BoundaryResult: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None: ...


class FlatExchange(Averager, Protocol):
    """What the parts of a composed averager use of the flat one it is built on."""

    rank: int
    world_size: int
    group: Optional[dist.ProcessGroup]  # the group of its reduce (None: the default group)
    wire: Wire  # its collectives, counted (and slowed to a simulated link)
    gamma: float
    outer: Optional[OuterNesterov]
    layout: ControlLayout
    buffer: FlatBuffer

    def share(self, steps: int) -> Share: ...


class Waitable(Protocol):
    def wait(self) -> None: ...


class Pending:
    """A parameter reduce that was started, now or in the background.

    :meth:`wait` completes it: the average of its ``spans`` is then in the flat buffer's parameter
    region (False: nobody contributed, the region's spans hold what they held). :meth:`drop` ends
    it without using it.
    """

    def __init__(self, spans: Sequence[Fragment], finish: Callable[[], bool], transfer: Optional[Waitable] = None):
        self.spans = list(spans)
        self._finish = finish
        self._transfer = transfer

    def wait(self) -> bool:
        if self._transfer is not None:
            self._transfer.wait()
        return self._finish()

    def drop(self) -> None:
        """Wait for the transfer to end and forget it; a transfer that failed because a member was lost
        fails quietly here: that loss is what the caller is recovering from."""
        if self._transfer is not None:
            try:
                self._transfer.wait()
            except RuntimeError:  # torch.distributed's errors (DistBackendError, a closed connection)
                pass


class WorkSince:
    """Each rank's optimizer steps since each part of the parameters was last averaged across nodes.

    Counted from every boundary's control data, so the same on every rank: every rank knows every
    rank's weight in a reduce, and the divisor, without another collective.
    """

    def __init__(self, parts: int, world_size: int, gamma: float) -> None:
        self.gamma = gamma
        self.world_size = world_size
        self.steps = [[0.0] * world_size for _ in range(parts)]

    def count(self, control: CohortControl) -> None:
        for part in self.steps:
            for rank, steps in enumerate(control.per_rank["steps"]):
                part[rank] += steps

    def weights(self, part: int, nonfinite: Sequence[bool]) -> list[float]:
        """Every rank's weight for ``part`` (0 for a rank that is not finite)."""
        return [0.0 if bad else work_weight(round(s), self.gamma) for s, bad in zip(self.steps[part], nonfinite)]

    def reset(self, part: Optional[int] = None) -> None:
        for index in range(len(self.steps)) if part is None else [part]:
            self.steps[index] = [0.0] * self.world_size

    def load(self, saved: Sequence[Sequence[float]], same_world: bool) -> None:
        """The saved counts at the same world size and number of parts; a fresh count otherwise."""
        if same_world and len(saved) == len(self.steps):
            self.steps = [[float(s) for s in part] for part in saved]
        else:
            self.reset()


class CrossReduce(Protocol):
    """How the parameters are averaged over every rank (across nodes): exactly, or compressed and streamed.

    ``fragments`` are the parts it averages one at a time (one, the whole region, when exact).
    At every boundary it is told the control data (:meth:`count`); at a global boundary asked
    which fragments are due (:meth:`due`, all when ``everything``) and started on them.
    """

    fragments: list[Fragment]

    @property
    def nbytes(self) -> int: ...  # its own buffers, beside the flat buffer

    @property
    def payload_bytes(self) -> int: ...  # what one of its reduces sends, on average over the fragments

    def count(self, control: CohortControl) -> None: ...

    def due(self, everything: bool) -> list[int]: ...

    def start(self, indices: Sequence[int], nonfinite: Sequence[bool], finite: bool, background: bool) -> Pending: ...

    def restart(self) -> None: ...  # after an exact consensus of every rank (``average_now``)

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None: ...
