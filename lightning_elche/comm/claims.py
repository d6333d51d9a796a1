"""Dynamic dispatch's shared counter: the rendezvous store's atomic add hands out one-step tickets.

Every rank already has a connection to the store behind the default process group (a TCPStore
that rank 0 hosts under Lightning's launcher, the agent under torchrun), and ``store.add`` is
atomic on the server, so a claim is one round trip and no new service: no coordinator process,
no extra port. Each epoch of each fit has its own key; the reserved tickets ``0 .. world_size - 1``
are not counted there (``cohort/pool.py``).

A claim costs one round trip (about 0.1-0.3 ms on one host, the network's latency across hosts).
It runs on the store connection's own thread: the pool claims its next ticket as it hands out the
last one it holds (``claim_later``), so the round trip overlaps the step being trained and the
thread that feeds the DataLoader waits only for what is left of it; ``cohort.pool.claim_chunk``
takes several tickets per claim when steps are short even next to that. A claim
gives up after ``answer_within_s`` (the fit's timeout): TCPStore's ``add`` has no timeout of its own,
so a rank cut off from the store by a partition while it claimed would otherwise wait for TCP to
give up, a quarter of an hour later, instead of failing like a collective would.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch.distributed as dist

from lightning_elche.comm.store import (
    BoundedStore,
    StoreCall,
    StoreUnreachable,
    default_store,
    first_line,
    private_connection,
)

DEFAULT_PREFIX = "elche/claims"


class TicketCounter:
    """One fit's claims in the store: ``claim(epoch, count)`` returns the first of ``count`` tickets.

    ``prefix`` must name the fit (every rank the same), so that a second fit in the same processes
    starts from zero; a claim the store does not answer within ``answer_within_s`` raises
    :class:`StoreUnreachable`.
    """

    def __init__(self, store: dist.Store, world_size: int, answer_within_s: float, prefix: str = DEFAULT_PREFIX) -> None:
        # a connection of its own, never behind a process-group read, each claim bounded in time
        self._store = BoundedStore(dist.PrefixStore(prefix, private_connection(store)), answer_within_s)
        self.world_size = world_size
        self.round_trip_ms = 0.0  # smoothed over the claims
        self.last_ms = 0.0  # the latest claim's

    @classmethod
    def from_default_group(cls, world_size: int, answer_within_s: float, prefix: str = DEFAULT_PREFIX) -> Optional["TicketCounter"]:
        """The counter over the default process group's store, or None without one."""
        store = default_store()
        return None if store is None else cls(store, world_size, answer_within_s, prefix)

    def claim(self, epoch: int, count: int) -> int:
        return self.claim_later(epoch, count).first()

    def claim_later(self, epoch: int, count: int) -> "PendingClaim":
        """Claim ``count`` tickets on the store's thread; the caller trains meanwhile and reads them later."""
        with _as_unreachable():
            return PendingClaim(self, self._store.add_later(f"epoch_{epoch}", count), count)

    def answer(self, call: StoreCall[int]) -> int:
        """The counter's value after the claim ``call``, waited for here (at most the bound): records the
        claim's round trip on the store's thread and the time its caller waited (``last_ms``)."""
        started = time.perf_counter()
        with _as_unreachable():
            end = self._store.answer(call)
        self.last_ms = (time.perf_counter() - started) * 1000.0
        rtt = call.round_trip_ms
        self.round_trip_ms = rtt if self.round_trip_ms == 0.0 else 0.8 * self.round_trip_ms + 0.2 * rtt
        return end

    def peek(self, epoch: int) -> int:
        """How many tickets the cohort has claimed in ``epoch`` (the reserved ones included)."""
        return self.world_size + self._add(f"epoch_{epoch}", 0)

    def _add(self, key: str, amount: int) -> int:
        with _as_unreachable():
            return self._store.add(key, amount)


class PendingClaim:
    """A claim handed to the store's thread: :meth:`first` waits for its answer (at most the counter's bound)."""

    def __init__(self, counter: TicketCounter, call: StoreCall[int], count: int) -> None:
        self._counter, self._call, self._count = counter, call, count

    def first(self) -> int:
        """The first of the claimed tickets."""
        return self._counter.world_size + self._counter.answer(self._call) - self._count


@contextmanager
def _as_unreachable() -> Iterator[None]:
    """A store that stopped answering (DistNetworkError, DistStoreError: its host is gone or silent) raises
    :class:`StoreUnreachable`, as one that did not answer within the bound does."""
    try:
        yield
    except StoreUnreachable:
        raise
    except RuntimeError as error:
        raise StoreUnreachable(first_line(error)) from error
