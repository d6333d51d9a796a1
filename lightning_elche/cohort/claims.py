"""Dynamic dispatch's claims: how a rank claims tickets from the rendezvous store's counter, how many at
a time, which of a pool's last tickets it leaves to faster ranks, and what a rank's claims are at a
boundary (what a checkpoint, or the survivors of a lost rank, know the consensus holds).

The pool itself, one epoch of tickets seen from one rank, is ``pool.py``.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Protocol, Sequence

CLAIM_BUDGET = 0.01  # the share of a step that claiming may cost before claims are taken in chunks


WAIT_BUDGET = 0.02  # a chunk is its rank's until trained: the others may wait that long at a boundary


MAX_CHUNK = 64


CLAIM_FALLBACK = 0.05  # claims costing more of an epoch's training time than this: planned dispatch from then on


def claim_chunk(round_trip_ms: float, step_ms: Optional[float], window_ms: Optional[float]) -> int:
    """Tickets per claim: one, unless a claim's round trip costs more than :data:`CLAIM_BUDGET` of a step;
    never so many that training a chunk takes more than :data:`WAIT_BUDGET` of a window."""
    if step_ms is None or window_ms is None or step_ms <= 0 or round_trip_ms <= 0:
        return 1
    wanted = math.ceil(round_trip_ms / (CLAIM_BUDGET * step_ms))
    return max(1, min(MAX_CHUNK, wanted, math.floor(WAIT_BUDGET * window_ms / step_ms)))


MUCH_FASTER = 1.5  # ranks at least this much faster than a rank take the last tickets of its pools


def leaves_to_the_faster(faster_per_own_step: float) -> float:
    """Unclaimed tickets of a pool a rank leaves to the ranks faster than it, who claim
    ``faster_per_own_step`` tickets while it trains one step (see ``PoolEpoch._leaves_to_the_others``)."""
    return max(0.0, faster_per_own_step - 0.5)


def faster_per_own_step(rates: Sequence[float]) -> list[float]:
    """Per rank, the tickets the ranks at least :data:`MUCH_FASTER` times faster claim while it trains one.

    Only those: ranks about as fast run their steps about in phase with it, so leaving them the last
    tickets would make it wait a whole step for what it could have trained in step with them.
    """
    descending = sorted(rates, reverse=True)
    cumulative = [0.0]
    for rate in descending:
        cumulative.append(cumulative[-1] + rate)
    negated = [-rate for rate in descending]  # ascending, for bisect
    return [cumulative[bisect_right(negated, -MUCH_FASTER * rate)] / rate if rate > 0 else 0.0 for rate in rates]


def claims_too_costly(claim_ms: float, train_ms: float, epoch: int) -> Optional[str]:
    """Why dispatch should be planned from ``epoch`` on, if claiming took over :data:`CLAIM_FALLBACK` of the
    training time before it (all ranks together); else None."""
    if train_ms <= 0 or claim_ms / train_ms <= CLAIM_FALLBACK:
        return None
    return (
        f"ElChe: claiming steps from the rendezvous store took {claim_ms / train_ms:.0%} of the training time "
        f"before epoch {epoch} (a slow or distant store, or very short steps); dispatch is planned from now on"
    )


class PendingTickets(Protocol):
    """A claim on its way: ``first()`` waits for the answer and returns the first of the tickets."""

    def first(self) -> int: ...


class TicketSource(Protocol):
    """Where a rank claims its tickets: the rendezvous store's atomic counter (``comm/claims.py``)."""

    @property
    def round_trip_ms(self) -> float: ...  # smoothed over the claims

    @property
    def last_ms(self) -> float: ...  # the latest claim's

    def claim(self, epoch: int, count: int) -> int: ...  # the first of ``count`` tickets

    def claim_later(self, epoch: int, count: int) -> PendingTickets: ...  # the same, answered while the caller trains

    def peek(self, epoch: int) -> int: ...  # tickets claimed so far (the reserved ones included)


@dataclass(frozen=True)
class Claiming:
    """How a rank's sampler claims under dynamic dispatch: the ``source``, ``chunk(round_trip_ms)``
    tickets at a time, each claim inside ``guard()`` (the adapter's: a store whose host died is named, not
    a bare socket error), in ``lanes`` reading lanes (one per DataLoader worker for sharded iterables).
    ``ahead``: the next claim is sent as the last ticket held is handed out, and answered while that
    step trains (one reading lane; the store's round trip off the training thread). Planned dispatch
    claims nothing: ``source`` None."""

    source: Optional[TicketSource] = None
    chunk: Callable[[float], int] = lambda round_trip_ms: 1
    guard: Callable[[], AbstractContextManager[None]] = field(default=nullcontext)
    lanes: int = 1
    ahead: bool = False


NO_CLAIMS = Claiming()  # planned dispatch: nothing to claim


class ClaimAhead(NamedTuple):
    """A claim sent before the sampler needs its tickets (``Claiming.ahead``)."""

    pending: PendingTickets
    units: int
    claiming: Claiming


@dataclass(frozen=True)
class Claims:
    """One rank's claims at a boundary: how far its claims reached, and the tickets it holds untrained."""

    claimed_end: int
    held: tuple[int, ...]

    def encode(self, epoch: int) -> str:
        return json.dumps({"epoch": epoch, "claimed_end": self.claimed_end, "held": list(self.held)})

    @classmethod
    def decode(cls, text: Optional[str], epoch: int) -> "Claims":
        """The claims of ``epoch`` recorded in ``text``; nothing claimed where there is no record of it
        (a generation or an epoch that has not closed a window yet)."""
        value = None if text is None else json.loads(text)
        if value is None or value["epoch"] != epoch:
            return NOTHING_CLAIMED
        return cls(int(value["claimed_end"]), tuple(int(t) for t in value["held"]))


NOTHING_CLAIMED = Claims(claimed_end=0, held=())
