"""Membership changes of an elastic cohort: agreeing on the next generation, and its process group.

Everything goes through the rendezvous store that the launcher hosts (``comm/rendezvous.py``), never
through a process group: the old group is broken when a member died, and the new one does not
exist yet. Agreement is first-writer-wins: every survivor proposes the generation it computed from
the members' heartbeats (:class:`Heartbeat`) with ``compare_set`` on the generation's key, and all of
them adopt what was stored first. A survivor whose heartbeat stalled past the probe finds itself
left out and leaves (a launcher started with ``--replace`` brings a joiner in its place).

Each generation's process group lives under a key prefix of its own, so the addresses of the ranks
of earlier generations (dead ones among them) are never read again (the same trap as torchrun's
restarts, pytorch/pytorch#167288).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_elche.cohort.control import Generation
from lightning_elche.comm.liveness import (
    CohortFailure,
    FailurePlace,
    describe_failure,
    resume_advice,
)
from lightning_elche.comm.store import BoundedStore, StoreUnreachable, first_line, private_connection

DEFAULT_PREFIX = "elche/elastic"
POLL_S = 0.05
PULSE_EVERY_S = 0.25  # a member's heartbeat period
PULSE_PROBE_S = 1.5  # how long a member's heartbeat is watched before it is declared lost


class Heartbeat:
    """A member's pulse in the store: a counter its own thread increments every ``PULSE_EVERY_S``.

    A member that died or stalled (``SIGSTOP``, a hung host) stops pulsing; one that is merely slow,
    still training its window, keeps pulsing. So survivors tell the two apart in a fixed, short time,
    instead of waiting for an answer that a slow member gives only when its window ends.
    """

    def __init__(self, store: dist.Store, member: int, prefix: str = DEFAULT_PREFIX) -> None:
        self._store = dist.PrefixStore(prefix, private_connection(store))
        self._key = f"pulse/{member}"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="elche-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.is_set():
            try:
                self._store.add(self._key, 1)
            except RuntimeError:  # the store is gone: the launcher ended, nothing left to tell
                return
            self._stopped.wait(PULSE_EVERY_S)

    def stop(self) -> None:
        self._stopped.set()


class MembersLost(RuntimeError):
    """Members of the generation being formed were lost before they joined its group (member ids)."""

    def __init__(self, lost: Sequence[int]) -> None:
        super().__init__(f"ElChe: member(s) {list(lost)} were lost before they joined the next generation's group")
        self.lost = list(lost)


class LeftOut(RuntimeError):
    """This member is not in the generation the others agreed on (its heartbeat stalled past their probe)."""


class Membership:
    """This member's view of the cohort's generations, kept in the rendezvous store."""

    def __init__(
        self, store: dist.Store, member: int, generation: Optional[Generation], answer_within_s: float,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        """``answer_within_s``: how long a read of the store may take before this member takes the store
        for lost (the fit's timeout): a member cut off from it by a partition then fails with an error
        naming the store, within that time, instead of blocking until TCP gives up."""
        self.member = member
        self.generation = generation
        self._answer_within_s = answer_within_s
        self._prefix = prefix
        self._base = store
        self._store = BoundedStore(dist.PrefixStore(prefix, private_connection(store)), answer_within_s)

    @property
    def current(self) -> Generation:
        if self.generation is None:
            raise RuntimeError("ElChe: this member has not been admitted to the cohort yet")
        return self.generation

    @property
    def rank(self) -> int:
        return self.current.rank_of(self.member)

    @property
    def world_size(self) -> int:
        return self.current.world_size

    def place(self, node: str) -> None:
        """Record which machine (its launcher) this member runs on, for every member to read (:meth:`nodes`)."""
        self._store.set(f"node/{self.member}", node)

    def nodes(self) -> list[str]:
        """The machine (launcher) of each rank of the current generation, in rank order."""
        return [self._store.get(f"node/{member}").decode() for member in self.current.members]

    def members_of(self, ranks: Sequence[int]) -> list[int]:
        """The member ids of ranks of the current generation."""
        return [self.current.members[rank] for rank in ranks]

    def silent(self, probe_s: float = PULSE_PROBE_S) -> list[int]:
        """The members of the current generation that are lost: those whose process a launcher saw end
        (at once, as soon as it says so), else those whose heartbeat did not move for ``probe_s`` (a
        stalled process, or a machine that went away with its launcher). Each poll reads one counter of
        exits, and each member's exit note only when it moved, so a failure costs the store a few reads
        per survivor at any size."""
        others = [m for m in self.current.members if m != self.member]
        try:
            before = {m: self._store.add(f"pulse/{m}", 0) for m in others}
            deadline, exits = time.monotonic() + probe_s, -1
            while time.monotonic() < deadline:
                count = self._store.add("exits", 0)
                if count != exits:
                    exits = count
                    ended = [m for m in others if self._store.check([f"exited/{m}"])]
                    if ended:
                        return ended
                time.sleep(POLL_S)
            return [m for m in others if self._store.add(f"pulse/{m}", 0) == before[m]]
        except RuntimeError as error:
            raise StoreUnreachable(first_line(error)) from error

    def silent_ranks(self) -> list[int]:
        """The ranks (in the current generation) of the :meth:`silent` members."""
        return [self.current.rank_of(member) for member in self.silent()]

    # ------------------------------------------------------------------ joining

    def request_join(self) -> None:
        """Ask to join at the cohort's next boundary (a joiner, before it waits for its admission); it
        fills a place a lost member left, if one is open (so that a spare does not join as well)."""
        self._store.add("places_filled", 1)
        self._ask_to_join()

    def _ask_to_join(self) -> None:
        ticket = self._store.add("join_tickets", 1) - 1
        self._store.set(f"joiner/{ticket}", str(self.member))

    def wait_for_a_place(self) -> bool:
        """A spare's wait until a member is lost and its place is open; then it asks to join. False when
        the fit ended first (the spare was not needed)."""
        while not self._has("finished"):
            if self._store.add("places_left", 0) > self._store.add("places_filled", 0):
                if self._store.add("places_filled", 1) <= self._store.add("places_left", 0):
                    self._ask_to_join()
                    return True
                self._store.add("places_filled", -1)  # another spare took it first
            time.sleep(POLL_S)
        return False

    def take_freed_slot(self, launcher: str) -> Optional[int]:
        """A local rank that a failed member of ``launcher`` left (``rendezvous.record_exit``), for a
        spare taking a place on that machine; None when none is left (the lost member ran elsewhere)."""
        taken = int(self._store.add(f"launcher/{launcher}/taken", 1))
        if taken <= int(self._store.add(f"launcher/{launcher}/freed", 0)):
            return int(self._store.get(f"launcher/{launcher}/freed/{taken - 1}"))
        self._store.add(f"launcher/{launcher}/taken", -1)
        return None

    def note_training(self) -> None:
        """This member trains its first batch (``rendezvous.ranks_trained`` reads the count)."""
        self._store.add("training", 1)

    def join_requests(self) -> int:
        """Join requests made so far (handled or not): compared with ``generation.tickets`` at boundaries."""
        return int(self._store.add("join_tickets", 0))

    def joiners(self, tickets: int) -> list[int]:
        """The member ids of the join requests after the current generation's, up to ``tickets``."""
        return [int(self._store.get(f"joiner/{t}").decode()) for t in range(self.current.tickets, tickets)]

    def admit(self, generation: Generation, joined: Sequence[int]) -> None:
        """Tell the members of ``joined`` which generation admitted them (every member may; the value is the same)."""
        for member in joined:
            self._store.set(f"admitted/{member}", str(generation.number))

    def wait_for_admission(self) -> Generation:
        """A joiner's wait until the cohort admits it at a boundary, however long its windows are; it
        gives up when the fit has ended or the store went away (its launcher ended with the fit)."""
        key = f"admitted/{self.member}"
        while not self._has(key):
            if self._has("finished"):
                raise RuntimeError(f"ElChe: member {self.member} asked to join, but the fit ended first")
            time.sleep(POLL_S)
        self.generation = self.read(int(self._store.get(key)))
        return self.generation

    def _has(self, key: str) -> bool:
        """Whether ``key`` is in the store; a store that went away (its launcher ended with the fit) says so."""
        try:
            return self._store.check([key])
        except RuntimeError as error:
            raise RuntimeError(
                f"ElChe: member {self.member} asked to join, but the rendezvous store went away (the fit ended and "
                f"its launcher with it?): {first_line(error)}"
            ) from error

    def read(self, number: int) -> Generation:
        """Generation ``number`` as agreed (it must have been)."""
        return Generation.decode(self._store.get(f"generation/{number}").decode())

    def record(self) -> None:
        """Store the current generation (the launch's, which nobody had to agree on), for joiners to read."""
        self._store.compare_set(f"generation/{self.current.number}", "", self.current.encode())

    def finish(self) -> None:
        """The fit is over: ranks still waiting to join stop waiting."""
        self._store.set("finished", "1")

    def gather(self, key: str) -> list[int]:
        """Count this member in at ``key`` and wait until every member of the current generation has; the
        members lost meanwhile (their process ended, or their heartbeat stopped), none when all came.

        A member whose heartbeat never started is still starting up (a launch's ranks start seconds apart
        on a loaded machine, a machine's launcher may start later than another's): it is waited for up to
        the fit's timeout, as a rendezvous waits for its nodes, unless its launcher saw it exit. Taking it
        for lost after the heartbeat's probe dropped a launch rank that was merely slow to start, and that
        rank then waited in a group the others had left."""
        self._store.add(key, 1)
        others = [m for m in self.current.members if m != self.member]
        began = since = time.monotonic()
        pulses = {m: self._store.add(f"pulse/{m}", 0) for m in others}
        while self._store.add(key, 0) < self.world_size:
            if time.monotonic() - since >= PULSE_PROBE_S:
                beats = {m: self._store.add(f"pulse/{m}", 0) for m in others}
                starting = time.monotonic() - began < self._answer_within_s
                stalled = [m for m in others if beats[m] == pulses[m] and not (beats[m] == 0 and starting)]
                lost = [m for m in others if m in stalled or self._store.check([f"exited/{m}"])]
                if lost:
                    return lost
                pulses, since = beats, time.monotonic()
            time.sleep(POLL_S)  # the store's answer is polled; a member's arrival ends the wait
        return []

    # ------------------------------------------------------------------ a boundary commits or rolls back

    def commit(self, step: str, within_s: float) -> bool:
        """This member has the outcome of ``step`` (a boundary's exchange, or a piece of work between boundaries
        every member does: a checkpoint's save, one of Lightning's collectives): it votes, and learns whether
        the step commits (every member of the generation voted) or rolls back (a member was lost before it
        did, here or in the step: every survivor then restores what it had before the step and the survivors
        redo it among themselves). The store decides, first writer wins, so every member learns the same;
        a member that failed in the step never votes, so no step commits that some member lacks.
        A member alive but silent for ``within_s`` (the fit's timeout) is taken for stalled: the step
        rolls back. Costs one add and one wait on the store (the last voter's write ends every wait)."""
        key = f"commits/{self.current.number}/{step}"
        if self._store.add(f"{key}/votes", 1) == self.world_size:
            self._store.compare_set(f"{key}/decision", "", "commit")
        deadline = time.monotonic() + within_s
        while not self._store.appears(f"{key}/decision", PULSE_PROBE_S):
            if self.silent() or time.monotonic() > deadline:  # nobody can commit without a member lost before its vote
                self._store.compare_set(f"{key}/decision", "", "rollback")
        return self._store.get(f"{key}/decision").decode() == "commit"

    def confirm(self, step: str, within_s: float, what: str) -> None:
        """:meth:`commit`, raising a CohortFailure that names the lost ranks where ``step`` rolls back."""
        if self.commit(step, within_s):
            return
        lost = self.silent_ranks()
        raise CohortFailure(f"ElChe: member(s) {self.members_of(lost)} were lost {what}, which this rank completed: "
                            "the survivors do it again without them", lost=lost)

    def roll_back(self, step: str) -> None:
        """This member failed in ``step``: it rolls back for every member (it cannot have committed, since
        this member never voted)."""
        self._store.compare_set(f"commits/{self.current.number}/{step}/decision", "", "rollback")

    # ------------------------------------------------------------------ dynamic dispatch's claims

    def record_claims(self, boundary: int, rank: int, claims: str) -> None:
        """What rank ``rank`` claimed and had not trained as it enters ``boundary`` (before the exchange):
        if a member is lost in the window after the last boundary, the survivors read its record of that
        boundary (:meth:`claims_at`) to know which of its samples the consensus holds. Two slots per rank
        take turns: a record for the boundary in progress never overwrites the last completed one's."""
        self._store.set(f"claims/{self.current.number}/{boundary % 2}/{rank}", claims)

    def claims_at(self, generation: int, boundary: int, rank: int) -> Optional[str]:
        """Rank ``rank``'s record of ``boundary`` in ``generation`` (None: it made none there)."""
        key = f"claims/{generation}/{boundary % 2}/{rank}"
        return self._store.get(key).decode() if self._store.check([key]) else None

    # ------------------------------------------------------------------ agreeing

    def agree(self, lost: Sequence[int] = (), joined: Sequence[int] = (), tickets: Optional[int] = None) -> Generation:
        """Propose the generation without ``lost`` and with ``joined`` (member ids); adopt the one
        stored first. Raises :class:`LeftOut` when this member is not in it."""
        proposal = self.current.after(lost, joined, tickets)
        key = f"generation/{proposal.number}"
        try:
            stored = self._store.compare_set(key, "", proposal.encode())
        except RuntimeError as error:
            raise StoreUnreachable(first_line(error)) from error
        decided = Generation.decode(stored.decode() if isinstance(stored, bytes) else stored)
        if lost and self._store.add(f"places_counted/{decided.number}", 1) == 1:  # once per generation
            self._store.add("places_left", len(set(self.current.members) - set(decided.members)))
        self.generation = decided
        if self.member not in decided.members:
            raise LeftOut(
                f"ElChe: member {self.member} was left out of generation {decided.number} (members "
                f"{list(decided.members)}): the others agreed without it, because its heartbeat stalled (the process "
                "was stopped or starved). It stops; a launcher started with --replace brings a new rank in its place."
            )
        return decided

    def join_process_group(self, backend: str, timeout: timedelta, device_id: Optional[torch.device] = None) -> None:
        """(Re)create the default process group for the current generation (a rendezvous of its members).

        The old group goes first: the members still blocked in one of its collectives then fail at once.
        Then every member waits, through the store, until every other has come (:meth:`gather`), so that a
        member that learns of the change late (a joiner still setting up, one that was training its window)
        is waited for as long as it is alive, whatever the process-group timeout; a member lost meanwhile
        raises :class:`MembersLost`, and the others agree on the next generation without it. One lost after
        that, as the group forms, leaves the others' group rendezvous to time out: that too raises
        :class:`MembersLost` when a member's process ended or its heartbeat stopped."""
        if dist.is_initialized():
            dist.destroy_process_group()
        lost = self.gather(f"ready/{self.current.number}")
        if lost:
            raise MembersLost(lost)
        store = dist.PrefixStore(f"{self._prefix}/group/{self.current.number}", self._base)
        try:
            dist.init_process_group(
                backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout, device_id=device_id
            )
        except RuntimeError as error:  # DistStoreError: a member never came to the group's rendezvous
            lost = self.silent()
            if not lost:
                raise
            raise MembersLost(lost) from error


@contextmanager
def naming_silent_members(membership: Membership, timeout_s: float, where: Callable[[], FailurePlace]) -> Iterator[None]:
    """An elastic cohort's :func:`~lightning_elche.comm.liveness.naming_lost_ranks`: a collective that
    failed because members stopped answering becomes a :class:`CohortFailure` whose ``lost`` are the
    ranks whose heartbeat stopped (found in ``PULSE_PROBE_S``, however long the others' windows are)."""
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, CohortFailure):
            raise
        place = where()
        try:
            silent = membership.silent()
        except StoreUnreachable as unreachable:
            raise CohortFailure(
                describe_failure(unreachable, {}, place, timeout_s, error)
            ) from error
        if not silent:
            raise
        ranks = [membership.current.rank_of(member) for member in silent]
        numbers = f"(epoch {place.epoch}, window {place.window}, step {place.cohort_step})"
        at = f"at boundary {place.boundary} {numbers}" if place.during is None else f"{place.during} {numbers}"
        raise CohortFailure(
            f"ElChe: member(s) {silent} (rank(s) {ranks} of generation {membership.current.number}) stopped "
            f"answering {at}: their heartbeat stopped. {resume_advice(place.last_checkpoint)} Process-group "
            f"timeout: {timeout_s:g} s. Underlying error: {first_line(error)}",
            lost=ranks,
        ) from error
