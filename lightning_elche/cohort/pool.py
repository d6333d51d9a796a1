"""Dynamic dispatch: the epoch's samples as a pool of one-step tickets that the ranks claim as they go.

Planned dispatch (``plan.py``) hands each rank its share of a window before the window starts,
from speeds measured over the previous windows; when a rank's speed changes, the shares lag and
the fast ranks wait at the boundaries. Here nothing is handed out ahead: the epoch's order is cut
into tickets of one optimizer step each (batch size x gradient-accumulation batches) and each rank
claims its next ticket as its DataLoader gets to it (sent a ticket ahead), from a counter the cohort
shares (the rendezvous store's atomic add, ``comm/claims.py``). The controller still sizes each window, as a
number of tickets (the window's pool); a rank closes its window after the first step it finishes
once the pool is claimed, so nobody waits much longer than one step of the others.

Tickets ``0 .. world_size - 1`` are reserved, one per rank, so every rank trains in every epoch
and takes part in its boundaries. A rank's tickets rise, so it trains them in claim order; tickets
claimed ahead of training (the DataLoader's prefetch, claims in chunks) stay held until trained
and carry over into the next window when the pool drains first. At a boundary the epoch's covered
samples are the tickets below the highest one claimed, minus those some rank still holds: a
checkpoint gathers every rank's :class:`~lightning_elche.cohort.claims.Claims` to know them exactly.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch

from lightning_elche.cohort.claims import ClaimAhead, Claiming, Claims, faster_per_own_step, leaves_to_the_faster
from lightning_elche.cohort.coverage import Spans
from lightning_elche.cohort.epoch import WindowCap
from lightning_elche.cohort.fingerprint import data_fields, digest, to_field
from lightning_elche.cohort.order import EpochOrder


def _chunk_units(chunk_starts: Sequence[int], samples_per_step: int, tickets: int) -> list[int]:
    """Claim units of whole chunks: each unit is the tickets that begin inside one chunk (a chunk
    shorter than a step shares a unit with the next), as a list of first tickets ending in ``tickets``.
    A ticket that runs past its chunk's end reads the next chunk's first items."""
    firsts = sorted({0, *(min(-(-start // samples_per_step), tickets) for start in chunk_starts)} - {tickets})
    return [*firsts, tickets]


def usable_samples(order_length: int, batch_size: int, drop_last: bool) -> int:
    """Samples of the order that are trained: with ``drop_last``, the tail short of a batch is dropped."""
    return order_length - (order_length % batch_size if drop_last else 0)


class Batching(Protocol):
    """How the train data is batched, as the plan's ``TrainData`` describes it."""

    @property
    def num_samples(self) -> Optional[int]: ...

    @property
    def seed(self) -> int: ...

    @property
    def shuffle(self) -> bool: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def samples_per_step(self) -> int: ...

    @property
    def drop_last(self) -> bool: ...

    @property
    def rank_batch_sizes(self) -> Optional[tuple[int, ...]]: ...


class PoolEpoch:
    """One epoch under dynamic dispatch, seen from one rank: the tickets, the windows' pools, its claims.

    The window thresholds are decided at boundaries (identical on every rank); what this rank
    claimed and trained is its own, and only a checkpoint brings the ranks' claims together.
    """

    def __init__(
        self, epoch: int, order: EpochOrder, world_size: int, data: Batching, chunk_starts: Optional[Sequence[int]] = None
    ) -> None:
        """``data``: how the train data is batched (the plan's ``TrainData``); ``chunk_starts``: where the
        chunks begin in ``order`` where they are claimed whole (a sharded iterable's, a remote dataset's), or None."""
        batch_size, samples_per_step, drop_last = data.batch_size, data.samples_per_step, data.drop_last
        self.epoch = epoch
        self.order = order
        self.world_size = world_size
        self.batch_size = batch_size
        self.rank_batch_sizes = tuple(data.rank_batch_sizes or (batch_size,) * world_size)
        self.samples_per_step = samples_per_step
        assert data.num_samples is not None  # an epoch without an end is planned, never pooled
        self.num_samples = data.num_samples
        self.usable = usable_samples(len(order), batch_size, drop_last)
        self.tickets = math.ceil(self.usable / samples_per_step)
        self.cap = self.tickets  # tickets trained this epoch; ``Trainer(max_steps)`` may lower it
        self.thresholds: list[int] = []  # per window: the claimed-ticket count at which its pool is drained
        self.complete = False  # the final window (whose pool reaches the cap) is open
        # Claims by whole chunks (``chunk_starts``: a sharded iterable, a remote dataset): claim unit u is
        # the tickets from ``_unit_tickets[u]`` to ``_unit_tickets[u + 1]``; else one ticket per unit.
        self._unit_tickets: Optional[list[int]] = None
        if chunk_starts is not None:
            self._unit_tickets = _chunk_units(chunk_starts, samples_per_step, self.tickets)
        self.seen = self._tickets_of(world_size)  # tickets claimed by the cohort as far as this rank knows
        self.held: deque[int] = deque()  # handed to the DataLoader, untrained, in the order it trains them
        self._waiting: set[int] = set()  # claimed, not handed to the DataLoader yet (a reading lane's next)
        self.finished = False  # this rank trained its last batch of the epoch
        self.window_samples = 0  # samples this rank trained in the current window
        self.window_tickets: list[int] = []  # the tickets it trained in the current window
        self.window_claim_ms = 0.0  # time this rank spent claiming in the current window
        self.chunk = 1  # tickets per claim (one under whole-chunk claims): it reads the store again after as many
        self._batches_into_ticket = 0
        self._trained_since_asking = 0
        self._cohort_per_own_step = float(world_size)  # tickets the cohort claims while this rank trains one
        self._faster_per_own_step = 0.0  # tickets the much faster ranks claim while this one trains one
        self._claims_to_the_end = True  # the fastest rank claims until the pool is empty (see leaves_the_rest)
        self._ahead: Optional[ClaimAhead] = None  # a claim sent ahead (``Claiming.ahead``), not answered yet
        self._answered_ahead: Optional[list[int]] = None  # its tickets, answered before the sampler asked for them
        self._served = False  # an iterator has served this epoch (Lightning may drop one and ask for another)
        self._data_fields = data_fields(
            seed=data.seed, num_samples=data.num_samples, shuffle=data.shuffle, batch_size=batch_size,
            samples_per_step=samples_per_step, drop_last=drop_last, order=order.digest(),
        )  # fmt: skip
        self._windows_digest = digest("pool", epoch)

    @staticmethod
    def serves(order_length: int, world_size: int, batch_size: int, samples_per_step: int, drop_last: bool) -> bool:
        """Whether an epoch of ``order_length`` samples has a ticket for every rank (else it is planned)."""
        return math.ceil(usable_samples(order_length, batch_size, drop_last) / samples_per_step) >= world_size

    @property
    def claim_units(self) -> int:
        """What the counter hands out this epoch: tickets, or whole chunks of them."""
        return self.tickets if self._unit_tickets is None else len(self._unit_tickets) - 1

    @property
    def claims_whole_chunks(self) -> bool:
        return self._unit_tickets is not None

    def heard(self, units: int) -> None:
        """The counter said the cohort has claimed ``units`` units (reserved ones included)."""
        self.seen = max(self.seen, self._tickets_of(units))

    def units_per_claim(self, tickets: int) -> int:
        """Units to claim at once when ``tickets`` would be: whole chunks are claimed one at a time."""
        return tickets if self._unit_tickets is None else 1

    def _tickets_of(self, units: int) -> int:
        """The tickets claimed once the cohort has claimed ``units`` units (reserved ones included)."""
        if self._unit_tickets is None:
            return units
        return self._unit_tickets[min(units, len(self._unit_tickets) - 1)]

    def _next_unit_tickets(self) -> int:
        """Tickets in the unit the counter hands out next, as far as this rank knows."""
        if self._unit_tickets is None:
            return 1
        unit = bisect_right(self._unit_tickets, self.seen) - 1
        return self._unit_tickets[min(unit + 1, len(self._unit_tickets) - 1)] - self.seen

    def limit(self, steps_left: Optional[int]) -> None:
        """Train at most ``steps_left`` tickets this epoch (what ``max_steps`` allows, every ticket one
        step; None: no limit), never fewer than one per rank."""
        if steps_left is not None:
            self.cap = max(self.world_size, min(self.cap, steps_left))

    @property
    def total_steps(self) -> int:
        return self.cap

    @property
    def window_count(self) -> int:
        return len(self.thresholds)

    def is_final(self, window: int) -> bool:
        return window < len(self.thresholds) and self.thresholds[window] >= self.cap

    def data_left_after(self, window: int) -> bool:
        """Whether the epoch has samples beyond ``window``: the cap that ``max_steps`` lowered leaves some."""
        return self.cap < self.tickets or not self.is_final(window)

    def open_windows(
        self, next_window: int, plan_steps: Callable[[], Sequence[int]], rank: int, lookahead_batches: int,
        window_cap: WindowCap,
    ) -> None:
        """Open windows until ``next_window`` is open; a pool is the controller's steps for all ranks
        (whose proportions also tell ``rank`` how fast the others claim next to it). Claims are made as
        batches are asked for, so nothing is decided ahead (``lookahead_batches``), and the cap set by
        :meth:`limit` already holds what ``max_steps`` allows. Tickets claimed ahead carry over from
        one window to the next, so a pool's boundary cannot land on a milestone (``window_cap``): a
        milestone falls on the first boundary at or past it."""
        while not self.complete and len(self.thresholds) <= next_window:
            start = self.thresholds[-1] if self.thresholds else 0
            steps = plan_steps()
            self._cohort_per_own_step = sum(steps) / max(1, steps[rank])
            self._faster_per_own_step = faster_per_own_step([float(max(1, s)) for s in steps])[rank]
            if not self.thresholds:  # decided once per epoch: a rank that stopped claiming cannot resume
                self._claims_to_the_end = rank == max(range(len(steps)), key=lambda r: (steps[r], -r))
            end = min(start + max(1, sum(steps)), self.cap)
            self.thresholds.append(end)
            self.complete = end >= self.cap
            self._windows_digest = digest(end, previous=self._windows_digest)

    # ------------------------------------------------------------------ this rank's claims

    def took(self, first: int, count: int, claim_ms: float = 0.0) -> list[int]:
        """This rank claimed ``count`` units from ``first`` on (its reserved unit: its rank, one) in
        ``claim_ms``: the tickets it will train, those below the cap."""
        start, end = self._tickets_of(first), self._tickets_of(first + count)
        self.seen = max(self.seen, end)
        self.window_claim_ms += claim_ms
        # a chunk of tickets paces the counter's reads as it paces the claims; a whole shard does not
        self.chunk, self._trained_since_asking = (count if self._unit_tickets is None else 1), 0
        mine = [ticket for ticket in range(start, end) if ticket < self.cap]
        self._waiting.update(mine)
        return mine

    def handed_out(self, ticket: int) -> None:
        """The sampler hands ``ticket`` (claimed) to the DataLoader now: it is trained after those before it."""
        self._waiting.remove(ticket)
        self.held.append(ticket)

    def leaves_the_rest(self) -> bool:
        """Whether this rank should stop claiming for the rest of the epoch: by the time it has trained
        what it holds and the next unit, so few tickets would be left that it leaves them to the faster
        ranks (the rule of :meth:`_leaves_to_the_others`, for a unit of one ticket or a whole chunk);
        a unit it took now would likely end the epoch last and keep everybody waiting. The rank
        fastest when the epoch began (the same on every rank) never stops, so every ticket is claimed."""
        faster_meanwhile = (len(self.held) + len(self._waiting)) * self._faster_per_own_step
        left = self.cap - self.seen
        leaves = leaves_to_the_faster(self._faster_per_own_step * self._next_unit_tickets())
        return not self._claims_to_the_end and left < faster_meanwhile + leaves

    def ticket_indices(self, ticket: int) -> torch.Tensor:
        start = ticket * self.samples_per_step
        return self.order[start : min(start + self.samples_per_step, self.usable)]

    def ticket_samples(self, ticket: int) -> int:
        return len(self.ticket_indices(ticket))

    def batch_trained(
        self, window: int, rank: int, batches: int, last_batch: bool, peek: Optional[Callable[[int], int]] = None
    ) -> bool:
        """A batch ended; True when it closes this rank's window (its step is whole and the pool drained).

        The tickets this rank holds were claimed before it trained them, so what it last heard of the
        pool may be a step old: ``peek(epoch)`` reads the counter again (one round trip), lest the
        rank train one more step while the others wait at the boundary. It does so only once the
        others may have drained the pool, judging by how fast they claim next to this rank.
        """
        if not self.held:
            raise RuntimeError(
                f"rank {rank} trained a batch of epoch {self.epoch} that ElChe never handed out: the train "
                "DataLoader must yield one batch per `batch_size` indices of its sampler"
            )
        ticket = self.held[0]
        self._batches_into_ticket += 1
        if self._batches_into_ticket < math.ceil(self.ticket_samples(ticket) / self.rank_batch_sizes[rank]):
            if last_batch:
                raise RuntimeError(
                    f"rank {rank}'s train DataLoader ended inside ticket {ticket} of epoch {self.epoch}: ElChe "
                    "cannot close the window. Does the dataset's length change during the epoch?"
                )
            return False
        self.held.popleft()
        self._batches_into_ticket = 0
        self.window_samples += self.ticket_samples(ticket)
        self.window_tickets.append(ticket)
        self._trained_since_asking += 1
        if last_batch:
            if self.held or self._waiting:
                untrained = len(self.held) + len(self._waiting)
                raise RuntimeError(
                    f"rank {rank}'s train DataLoader ended with {untrained} claimed steps of epoch "
                    f"{self.epoch} untrained; ElChe's coverage would lose them. Please report this with your "
                    "DataLoader settings."
                )
            self.finished = True
            return True
        if self.is_final(window):
            return False
        closes_at = self.thresholds[window] - self._leaves_to_the_others()
        if self.seen < closes_at and peek is not None and self._may_have_reached(closes_at):
            self.heard(peek(self.epoch))
            self._trained_since_asking = 0
        return self.seen >= closes_at

    def _leaves_to_the_others(self) -> float:
        """Unclaimed tickets of the pool this rank leaves to the faster ranks when it closes its window.

        Say the ranks much faster than this one (:func:`faster_per_own_step`) claim ``m`` tickets while
        it trains one step, and ``left`` are unclaimed. A step more (it claims a ticket as it starts)
        leaves them idle at the boundary for about ``m - left + 1/2`` of their tickets; closing now
        leaves this rank idle for about ``(left + 1/2) / m`` of its own. Closing loses less while ``left < m - 1/2``: a slow rank
        leaves the last tickets of each pool to the fast ones, and the fastest rank (``m = 0``) claims
        until the pool is empty, so every pool drains.
        """
        return leaves_to_the_faster(self._faster_per_own_step)

    def _may_have_reached(self, claimed: float) -> bool:
        """Whether the others may have claimed up to ``claimed`` since this rank last asked (with a
        step's margin); only every ``chunk`` tickets, the claims' own pace."""
        if self._trained_since_asking < self.chunk:
            return False
        claimed_since = (self._trained_since_asking + 1) * self._cohort_per_own_step
        return self.seen + claimed_since >= claimed

    def trained_samples(self, window: int, rank: int) -> int:
        return self.window_samples

    def boundary_due(self, next_window: int) -> bool:
        """After a boundary: this rank's epoch is over but windows remain open, so it closes them too (no steps)."""
        return self.finished and next_window < len(self.thresholds)

    def window_closed(self) -> None:
        self.window_tickets = []
        self.window_samples = 0
        self.window_claim_ms = 0.0

    def progress(self, window: int, rank: int, batches: int, units: int, share: float = 0.0) -> int:
        """Where ``batches`` into ``window`` stands on the window's ``units``, for a rank expected to train
        ``share`` of them: an estimate (who trained what is known at the boundary), kept inside the window."""
        share = share or 1.0 / self.world_size
        expected = max(1.0, units * share * self.samples_per_step / self.rank_batch_sizes[rank])
        return min(int(batches * units / expected), max(units - 1, 0))

    def logged_units(self, window: int, automatic_optimization: bool = True) -> int:
        """Tickets in ``window``'s pool: optimizer steps of all ranks (dynamic dispatch is automatic optimization)."""
        start = self.thresholds[window - 1] if window > 0 else 0
        return self.thresholds[window] - start

    def claims(self) -> Claims:
        self._answer_ahead()  # a claim on its way is counted in the store already: its tickets are held here
        return Claims(claimed_end=self.seen, held=(*self.held, *sorted(self._waiting)))

    def trained_in_window(self) -> list[int]:
        """The tickets this rank trained since the last boundary."""
        return list(self.window_tickets)

    def covered_after_loss(
        self, closed_windows: int, survivors: Sequence[int], at_boundary: Sequence[Claims], trained_since: Sequence[int]
    ) -> Spans:
        """The positions trained once the survivors of a lost rank average their window: what every rank
        had trained at the last boundary (``at_boundary``, every rank's claims then) and the tickets the
        survivors trained since (``trained_since``); the lost ranks' tickets of the window, and whatever
        anyone claimed but did not train, go back to the epoch."""
        step = self.samples_per_step
        since = Spans(sorted((t * step, min((t + 1) * step, self.usable)) for t in set(trained_since) if t < self.cap))
        return self.covered(at_boundary).union(self.order.covered(since))

    def covered_at(self, closed_windows: int, all_claims: Callable[[Claims], list[Claims]]) -> Spans:
        """The positions trained at a boundary: from every rank's claims (``all_claims(mine)``, a gather)."""
        return self.covered(all_claims(self.claims()))

    def covered(self, claims: Sequence[Claims]) -> Spans:
        """The positions of the epoch's order trained, from every rank's claims at a boundary: the
        tickets below the highest claimed, but those some rank still holds."""
        claimed = min(max(c.claimed_end for c in claims), self.cap)
        step = self.samples_per_step
        held = Spans((t * step, (t + 1) * step) for c in claims for t in c.held if t < claimed)
        return self.order.covered(Spans.prefix(min(claimed * step, self.usable)).minus(held))

    def fingerprint(self) -> int:
        return to_field(digest(len(self.thresholds), self.cap, previous=self._windows_digest))

    # ------------------------------------------------------------------ the sampler's claims

    def serve(self, rank: int, claiming: Claiming) -> Iterator[int]:
        """The sample indices this rank trains this epoch, claimed as its DataLoader asks for them, in
        reading lanes: each lane claims its own units (whole shards of a sharded iterable) and the lanes
        take turns, a ticket each, so that with one lane per DataLoader worker (which get batches in
        turn) each worker reads its own shards forward."""
        if claiming.source is None:
            raise RuntimeError("ElChe's dynamic dispatch needs the rendezvous store's counter, which was not set up")
        first = self._untrained_again() if self._served else self.took(rank, 1)  # the reserved ticket
        self._served = True
        lanes = [deque(first)] + [deque() for _ in range(max(1, claiming.lanes) - 1)]
        turn, handed_out = 0, 0
        while lanes:
            lane = lanes[turn]
            if not lane:
                lane.extend(self._take(claiming))
            if not lane:  # nothing left for this lane to claim (or left to the faster ranks)
                del lanes[turn]
                turn = turn % len(lanes) if lanes else 0
                continue
            ticket = lane.popleft()
            self.handed_out(ticket)
            handed_out += 1
            if claiming.ahead and handed_out > 1 and not lane and len(lanes) == 1 and not self.claims_whole_chunks:
                self._claim_ahead(claiming)
            yield from self.ticket_indices(ticket).tolist()
            turn = (turn + 1) % len(lanes)

    def _untrained_again(self) -> list[int]:
        """What a dropped iterator over this epoch claimed and nobody trained, for the next iterator to serve
        first (``Cohort.begin_epoch`` serves a plan again only before this rank trained from it)."""
        self._answer_ahead()  # a claim sent ahead: its tickets join ``_waiting``
        again = sorted({*self.held, *self._waiting})
        self.held.clear()
        self._waiting, self._answered_ahead, self._batches_into_ticket = set(again), None, 0
        return again

    def _take(self, claiming: Claiming) -> list[int]:
        """This rank's next claim: tickets, none once the rest is the faster ranks' or nothing is left."""
        if self._ahead is not None or self._answered_ahead is not None:
            self._answer_ahead()
            tickets, self._answered_ahead = self._answered_ahead or [], None
            return tickets
        source = claiming.source
        assert source is not None
        if self.claims_whole_chunks:  # a shard takes long to train: first hear what the others claimed meanwhile
            with claiming.guard():
                self.heard(source.peek(self.epoch))
        if self.leaves_the_rest():
            return []
        count = self.units_per_claim(claiming.chunk(source.round_trip_ms))
        with claiming.guard():
            first = source.claim(self.epoch, count)
        return self.took(first, count, source.last_ms)

    def _claim_ahead(self, claiming: Claiming) -> None:
        """Send the next claim now, as the last ticket held is handed out: the store answers while that
        step trains, and the sampler finds the answer waiting when the DataLoader asks for the next batch.
        Not yet as the first ticket is handed out: Lightning pulls one batch from an iterator it may then
        drop for a new one (its fit loop's ``setup_data`` under ``reload_dataloaders_every_n_epochs``), and
        a claim sent from the dropped one would be lost with it (counted in the store, held by nobody)."""
        source = claiming.source
        assert source is not None
        if self.leaves_the_rest():
            return
        count = self.units_per_claim(claiming.chunk(source.round_trip_ms))
        with claiming.guard():
            self._ahead = ClaimAhead(source.claim_later(self.epoch, count), count, claiming)

    def _answer_ahead(self) -> None:
        """Read the answer to the claim sent ahead, if one is on its way: its tickets are this rank's."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        source = ahead.claiming.source
        assert source is not None
        with ahead.claiming.guard():
            first = ahead.pending.first()
        self._answered_ahead = self.took(first, ahead.units, source.last_ms)

    def fingerprints(self) -> dict[str, float]:
        return {"fingerprint": float(self.fingerprint()), **self._data_fields}
