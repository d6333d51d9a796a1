"""An elastic cohort (``elastic=True``): its membership mode, and what Lightning sees of it.

:class:`ElasticWorld` is the membership mode of ``lightning/world.py`` for a cohort whose members
change: one process group per generation of members (``comm/membership.py`` agrees on them in the
rendezvous store), the survivors of a lost member going on from the next boundary, joiners and
spares admitted at boundaries; the cohort core carries the fit from one generation to the next
(``Cohort.next_generation``).

After a membership change the cohort sets the rank and world size Lightning reads in
:class:`~lightning_elche.lightning.elastic_launch.ElasticEnvironment`, and the strategy re-derives
what depends on them (the rank-zero-only flag, the validation sampler).
"""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_elche.cohort.claims import Claims
from lightning_elche.cohort.control import CohortControl, Generation, LocalReport, gather_reports
from lightning_elche.cohort.membership import closed_its_epoch, covers_its_epoch, membership_record, survivors_point
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.comm.groups import from_rank0, gather_to_all, receive_from_rank0, send_from_rank0
from lightning_elche.comm.interface import BoundaryResult, NeedsConsensus
from lightning_elche.comm.liveness import CohortFailure
from lightning_elche.comm.membership import Heartbeat, Membership, MembersLost, naming_silent_members
from lightning_elche.comm.rendezvous import agent_store
from lightning_elche.lightning import _lightning, elastic_launch
from lightning_elche.lightning.checkpoints import STATE_KEY
from lightning_elche.lightning.collectives import regrouping
from lightning_elche.lightning.elastic_launch import ElasticEnvironment, joining, launched_elastic, member_id, spare
from lightning_elche.lightning.rollback import KeptState
from lightning_elche.lightning.world import GroupHost, OutdatedDumps, ResumeHolder, place_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_elche.cohort.core import Cohort
    from lightning_elche.lightning.session import FitSession

LOGGER_VERSIONS = "elche_logger_versions"  # sent to a joiner beside the checkpoint
# sent beside it too: the generation the checkpoint was taken in (the one before the joiner's, unless members
# were lost as the joiner's generation formed, and the members agreed on one more)
SOURCE_GENERATION = "elche_source_generation"
REDONE_BOUNDARY = "redone"  # the vote on a boundary the survivors redo (continue_without): no boundary's (0, 1, ...)
JOIN_REQUESTS = "elastic:join_requests"  # a control field: the join requests rank 0 saw at the boundary


class ElasticWorld:
    """``elastic=True``: one process group per generation of members, and the change from one
    generation to the next (survivors of a lost member, or the members with joiners)."""

    control_fields = [JOIN_REQUESTS]

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.membership: Optional[Membership] = None
        self._heartbeat: Optional[Heartbeat] = None
        self._host: Optional[GroupHost] = None
        self._kept: Optional[KeptState] = None  # what this rank had before the boundary in progress
        self._boundary = 0  # boundaries of the current generation so far: the same count on every member
        self._between = 0  # steps of work between boundaries this generation voted on (:meth:`confirm_done`)
        self._joining = False  # a joiner until it has the cohort's state: its collectives have no partner yet
        self._trained = False  # whether this process trained a batch yet (its launcher holds spares back until then)

    @property
    def joining(self) -> bool:
        return self._joining

    @property
    def generation(self) -> Optional[int]:
        return None if self.membership is None else self.membership.current.number

    def cluster_environment(self, given: Optional[ClusterEnvironment]) -> Optional[ClusterEnvironment]:
        return ElasticEnvironment() if given is None else given

    def members(self, world_size: int) -> Sequence[int]:
        assert self.membership is not None
        return self.membership.current.members

    def nodes(self, world_size: int) -> Optional[list[int]]:
        """Each rank's node for hierarchical averaging: the machine its launcher runs on (the ranks
        change with the members, so consecutive ranks no longer tell)."""
        assert self.membership is not None
        machines = self.membership.nodes()
        return [list(dict.fromkeys(machines)).index(machine) for machine in machines]

    def needs_consensus(self, control: CohortControl) -> bool:
        """A boundary that will admit joiners (rank 0 saw requests) leaves every member with the consensus
        (whatever the policy, hierarchy or fragments would do), which the joiners receive."""
        assert self.membership is not None
        return int(max(control.per_rank[JOIN_REQUESTS])) > self.membership.current.tickets

    def setup_distributed(self, host: GroupHost) -> None:
        """DDP's ``setup_distributed`` for an elastic fit: the first generation's group, over the launcher's store."""
        if not launched_elastic():
            raise RuntimeError(elastic_launch.NOT_LAUNCHED_ELASTIC)
        if self.membership is not None:  # a later stage (validate, test) of the same processes: the group stands
            return
        reset_seed()
        self._host = host
        store = agent_store(self.timeout)
        self._heartbeat = Heartbeat(store, member_id())
        answer_within_s = self.timeout.total_seconds()
        if joining():
            self.membership = Membership(store, member_id(), None, answer_within_s)
            self.membership.place(os.environ["ELCHE_LAUNCHER"])
            if not spare():
                self.membership.request_join()
            elif self.membership.wait_for_a_place():
                slot = self.membership.take_freed_slot(os.environ["ELCHE_LAUNCHER"])
                if slot is not None:  # the place it takes left one of its launcher's devices free
                    host.move_to_slot(slot)
            else:
                self._heartbeat.stop()
                print(f"ElChe: spare member {member_id()} was not needed: the fit is over", file=sys.stderr, flush=True)
                raise SystemExit(0)  # the rest of the script (test, export) is the members' to run
            self.membership.wait_for_admission()
            self._joining = True
        else:
            self.membership = Membership(
                store, member_id(), Generation.first(int(os.environ["WORLD_SIZE"])), answer_within_s
            )
            self.membership.place(os.environ["ELCHE_LAUNCHER"])
            self.membership.record()
        self._enter_generation()

    def _enter_generation(self) -> None:
        """Join the current generation's process group and tell Lightning this rank's new place; members lost
        before they joined it leave too (the others agree on the generation without them, and join that)."""
        membership, host = self.membership, self._host
        assert membership is not None and host is not None
        while True:
            try:
                membership.join_process_group(host.backend(), self.timeout, host.device_id)
                break
            except MembersLost as lost:
                membership.agree(lost=lost.lost)
        host.place_rank(membership.rank, membership.world_size)
        self._boundary, self._between = 0, 0

    def sampler_kwargs(self, launched: dict[str, int], rank: int, world_size: int) -> dict[str, int]:
        """Validation's DistributedSampler splits over the cohort as it is now (DDP's: over the devices launched)."""
        return {"num_replicas": world_size, "rank": rank}

    def validation_loader(self, dataloader: object, session: "FitSession", whole_set: bool) -> object:
        """Lightning's split: Lightning makes the validation loaders once per fit, and a split by speed fixed
        to one generation's ranks would leave a later generation's samples unvalidated or twice."""
        return dataloader

    def before_fit(self, trainer: "pl.Trainer", checkpoints: ResumeHolder) -> None:
        """A joiner loads the checkpoint rank 0 sent, as a resume loads a file (the cohort state among the
        rest; the loops and optimizers right after setup); a member shares rank 0's logger versions, so
        that a new leader continues them."""
        membership = self.membership
        assert membership is not None
        if not self._joining:
            mine = _lightning.logger_versions(trainer)
            versions = regrouping(self, None, "sharing rank 0's logger versions",
                                  lambda: from_rank0(mine, membership.rank, membership.world_size, None))  # fmt: skip
            _lightning.pin_logger_versions(trainer, versions)
            return
        checkpoint = receive_from_rank0()
        _lightning.pin_logger_versions(trainer, checkpoint.pop(LOGGER_VERSIONS))
        source = membership.read(checkpoint.pop(SOURCE_GENERATION))
        _lightning.restore_modules_and_callbacks(trainer, checkpoint)
        assert checkpoints.resume is not None
        checkpoints.resume = checkpoints.resume.for_members(membership.current.sources(source))

    def before_exchange(self, session: "FitSession", report: LocalReport) -> None:
        """Rank 0 reads how many ranks asked to join so far (one store read per boundary); the boundary
        tells every member, so all of them admit the joiners at the same boundary. Under dynamic dispatch
        every member records its claims as it enters the boundary (one store write), which the survivors
        read if it is lost in the next window."""
        membership, cohort = self.membership, session.cohort
        assert membership is not None and cohort.plan is not None
        report.fields[JOIN_REQUESTS] = float(membership.join_requests() if cohort.rank == 0 else 0)
        claims = cohort.plan.claims()
        if claims is not None:  # the boundary about to be exchanged is this generation's self._boundary
            membership.record_claims(self._boundary, cohort.rank, claims.encode(cohort.plan.epoch))

    def _claims_at_last_boundary(self, cohort: "Cohort", generation: int, in_progress: bool) -> list[Claims]:
        """Every rank's claims as it entered the cohort's last committed boundary (nothing where that
        boundary was in another generation or epoch); none under planned dispatch, whose pieces every rank
        knows. ``in_progress``: a boundary of this generation was being exchanged, and did not commit."""
        assert self.membership is not None
        if cohort.plan is None or cohort.plan.claims() is None:  # nothing claimed before the first plan
            return []
        boundary, epoch = self._boundary - (2 if in_progress else 1), cohort.plan.epoch
        if boundary < 0:  # no boundary of this generation committed: nothing of its epoch claimed before
            return [Claims.decode(None, epoch)] * cohort.world_size
        texts = [self.membership.claims_at(generation, boundary, rank) for rank in range(cohort.world_size)]
        return [Claims.decode(text, epoch) for text in texts]

    def exchange(self, session: "FitSession", report: LocalReport, needs_consensus: NeedsConsensus) -> BoundaryResult:
        """A boundary that commits or rolls back as one: this rank keeps what it had before the exchange
        (``rollback.py``), exchanges, and votes (``Membership.commit``); if a member is lost at any point of
        it (control, parameters, compressed parts, fragments, a hierarchy level, async's background reduce)
        every survivor restores what it kept, and the survivors redo the boundary in the next generation
        (:meth:`continue_without`), so they always agree."""
        membership = self.membership
        assert membership is not None
        boundary, outer = self._boundary, session.settings.outer_optimizer
        self._boundary += 1
        self._kept = kept = KeptState.of(session.module, session.averager, outer)
        try:
            with self.naming_lost_ranks(session, None):
                result = session.averager.exchange(report, needs_consensus=needs_consensus)
        except CohortFailure:
            membership.roll_back(str(boundary))
            kept.restore(session.module, outer)
            raise
        try:
            with self.naming_lost_ranks(session, None):  # a store lost while voting is named as in the exchange
                membership.confirm(str(boundary), self.timeout.total_seconds(), f"in boundary {boundary}'s exchange")
        except CohortFailure:
            kept.restore(session.module, outer)  # every survivor undoes the boundary and redoes it without them
            raise
        return result

    def naming_lost_ranks(self, session: Optional["FitSession"], during: Optional[str]) -> AbstractContextManager[None]:
        """The heartbeats tell who is lost, however long the others' windows are."""
        assert self.membership is not None
        return naming_silent_members(self.membership, self.timeout.total_seconds(), lambda: place_of(session, during))

    def continues_without(self, failure: CohortFailure, world_size: int) -> bool:
        """Whether this fit goes on without the ranks ``failure`` found lost (some rank is left)."""
        return bool(failure.lost) and len(failure.lost) < world_size

    def continue_without(self, session: "FitSession", lost: Sequence[int], report: LocalReport, checkpoints: OutdatedDumps) -> None:
        """The survivors of a lost rank agree on the next generation, average the window they just
        finished among themselves, and resume the epoch in memory from there: the lost ranks' pieces
        of the window go back to the epoch, every sample is still trained once.

        A spare asks for the lost member's place once the survivors agreed, so rank 0 reads the join requests
        again as they redo the boundary, and spares come in right after it, not a window later (nor where it
        closes the epoch). That redone boundary commits or rolls back as one too: a member lost while the survivors redo it
        (in the new group's gathers or its average) makes every survivor restore what it kept as the
        failed boundary began, and they redo it again without that member, from the same cohort, so its
        window goes back to the epoch as well; as often as members are lost, while one is left."""
        membership = self.membership
        assert membership is not None and self._kept is not None  # kept as the failed boundary began
        old, previous, kept = session.cohort, membership.current, self._kept
        at_boundary = self._claims_at_last_boundary(old, previous.number, in_progress=True)

        def without_their_window(old: "Cohort", survivors: list[int]) -> ResumePoint:
            assert old.plan is not None
            logged = report.steps if old.automatic_optimization else old.clock.batches
            everyone = gather_to_all((report.steps, logged, old.plan.trained_in_window()), len(survivors), None)
            steps, logged = sum(entry[0] for entry in everyone), sum(entry[1] for entry in everyone)
            trained_since = [ticket for entry in everyone for ticket in entry[2]]
            return survivors_point(old, survivors, steps, logged, at_boundary, trained_since)

        while True:
            try:
                with self.naming_lost_ranks(session, "while the survivors redid a boundary"):
                    generation = self._regroup_without(session, old, previous, lost, without_their_window, False)
                    session.carry_averager_state(kept.averager_state)  # what each had not sent as the boundary began
                    report.fields[JOIN_REQUESTS] = float(membership.join_requests() if membership.rank == 0 else 0)
                    averaged = session.averager.average_now(report)
                membership.confirm(REDONE_BOUNDARY, self.timeout.total_seconds(), "as the survivors redid a boundary")
                break
            except CohortFailure as raised:
                membership.roll_back(REDONE_BOUNDARY)
                regrouped = membership.current.number != previous.number  # else those lost first are still in it
                failure, lost = raised, raised.lost if regrouped else sorted({*lost, *raised.lost})
            kept.restore(session.module, session.settings.outer_optimizer)
            if not self.continues_without(failure, membership.current.world_size):
                raise failure
        record = membership_record(old, averaged.control, averaged.divergence, session.cohort.cohort_step, generation)
        session.cohort.note_membership_change(record)
        if old.plan is None or not old.plan.is_final(old.clock.window):
            self.after_boundary(session, averaged.control, checkpoints)

    def confirm_done(self, session: Optional["FitSession"], during: str) -> None:
        """Every member did the work just done between boundaries (``during``: a save, one of Lightning's collectives),
        or every survivor does it again: a vote, as at a boundary, so that none whose part completed goes on alone."""
        assert self.membership is not None
        step, self._between = f"between/{self._between}", self._between + 1
        with self.naming_lost_ranks(session, during):
            self.membership.confirm(step, self.timeout.total_seconds(), during)

    def continues_at_boundary(self, session: Optional["FitSession"], failure: CohortFailure) -> bool:
        """Whether a fit goes on without the ranks lost in one of Lightning's collectives: every rank holding
        the consensus (no window of theirs to give back), or none trained yet (set-up, ``session`` None)."""
        if session is None:
            assert self.membership is not None
            return self.continues_without(failure, self.membership.current.world_size)
        return self.continues_without(failure, session.ranks.world_size) and session.cohort.at_boundary()

    def continue_at_boundary(self, session: Optional["FitSession"], lost: Sequence[int]) -> None:
        """Members lost in one of Lightning's collectives (validation, a checkpoint, an epoch's end, the set-up),
        while every member holds the consensus: the survivors agree on the next generation and resume from the
        cohort's state as it is; no window goes back, every sample trained so far is in the consensus. Lost
        before the fit's session exists, they only agree on the generation: the session starts in it."""
        membership = self.membership
        assert membership is not None
        if session is None:
            left, generation = self._agree_without(lost)
            rank_zero_warn(f"ElChe: member(s) {left} left the cohort before the fit started; generation "
                           f"{generation.number} trains with {generation.world_size} rank(s)")  # fmt: skip
            return
        at_boundary = self._claims_at_last_boundary(session.cohort, membership.current.number, in_progress=False)

        def as_it_is(old: "Cohort", survivors: list[int]) -> Optional[ResumePoint]:
            # every rank's claims as it entered the last boundary, whose consensus everyone holds (a regrouped
            # cohort that has not planned yet resumes where it resumed; one that never trained starts afresh)
            point = old.resume_point(lambda: None, None, lambda mine: at_boundary)
            return None if point is None else point.for_members(survivors)

        old = session.cohort
        generation = self._regroup_without(session, old, membership.current, lost, as_it_is, between_boundaries=True)
        if old.plan is not None:  # the membership boundary of the history; none before the first window
            nothing = gather_reports([{} for _ in range(generation.world_size)])
            record = membership_record(old, nothing, 0.0, session.cohort.cohort_step, generation)
            session.cohort.note_membership_change(record)

    def _regroup_without(
        self, session: "FitSession", old: "Cohort", previous: Generation, lost: Sequence[int],
        resume_point: Callable[["Cohort", list[int]], Optional[ResumePoint]], between_boundaries: bool,
    ) -> Generation:
        """The survivors of ``lost`` (ranks of the current generation) agree on the next generation, enter
        its group and resume in memory from ``resume_point(old, survivors' ranks in previous)``: ``old`` is
        the cohort of the ``previous`` generation, where the failure began (a redone boundary's retries
        regroup from it again). Returns the generation entered."""
        lost_members, generation = self._agree_without(lost)
        survivors = [previous.rank_of(member) for member in generation.members]
        cohort = self._resume_in_memory(session, resume_point(old, survivors))
        rank_zero_warn(
            f"ElChe: member(s) {lost_members} left the cohort at step {cohort.cohort_step}"
            + (", between boundaries" if between_boundaries else "")
            + f"; generation {generation.number} trains on with {generation.world_size} rank(s)"
            + ("" if between_boundaries else ", the lost ranks' last window goes back to the epoch")
        )
        return generation

    def _agree_without(self, lost: Sequence[int]) -> tuple[list[int], Generation]:
        """The survivors of ``lost`` (ranks) agree on the next generation and enter its group: the members
        that left (more may be lost on the way: the generation entered is the one that counts) and it."""
        membership = self.membership
        assert membership is not None
        previous = membership.current
        membership.agree(lost=membership.members_of(lost))
        self._enter_generation()
        generation = membership.current
        return [member for member in previous.members if member not in generation.members], generation

    def after_boundary(self, session: "FitSession", control: CohortControl, checkpoints: OutdatedDumps) -> None:
        """After a boundary, if rank 0 saw join requests: every member takes the checkpoint it would
        write now (in memory), the cohort agrees on the next generation with the joiners in it, rank 0
        sends them the checkpoint, and every member resumes the epoch from it for the larger world."""
        membership, old, trainer = self.membership, session.cohort, session.trainer
        assert membership is not None
        requests = int(max(control.per_rank[JOIN_REQUESTS]))
        if requests <= membership.current.tickets or closed_its_epoch(old):
            return
        checkpoint = _lightning.dump_checkpoint(trainer)  # a collective of the members, as for a saved checkpoint
        if checkpoints.take_outdated():  # a member was lost while it was taken: the survivors regrouped, joiners wait
            return
        try:  # every member took it, or every survivor regroups (a member whose part completed would admit alone)
            self.confirm_done(session, "as the members took the checkpoint for the joiners")
        except CohortFailure as failure:
            if not self.continues_at_boundary(session, failure):
                raise
            self.continue_at_boundary(session, failure.lost)  # the joiners wait for the next boundary
            return
        previous = membership.current
        joined = membership.joiners(requests)
        membership.admit(membership.agree(joined=joined, tickets=requests), joined)
        self._enter_generation()  # a joiner lost before it joined the group is left out of the generation entered
        generation = membership.current
        joined = [member for member in joined if member in generation.members]
        if membership.rank == 0:
            checkpoint[LOGGER_VERSIONS] = _lightning.logger_versions(trainer)
            checkpoint[SOURCE_GENERATION] = previous.number
            self._send_to_joiners(session, checkpoint, joined)
            del checkpoint[LOGGER_VERSIONS], checkpoint[SOURCE_GENERATION]
        point = ResumePoint.from_state(checkpoint["callbacks"][STATE_KEY]).for_members(generation.sources(previous))
        cohort = self._resume_in_memory(session, point)
        rank_zero_info(
            f"ElChe: member(s) {joined or 'none (every joiner was lost on its way in)'} joined the cohort at step "
            f"{cohort.cohort_step}; generation {generation.number} trains with {generation.world_size} ranks"
        )

    def _send_to_joiners(self, session: "FitSession", checkpoint: dict[str, Any], joined: Sequence[int]) -> None:
        """Rank 0 sends each joiner the cohort's state. A joiner lost on the way (it died as it was being
        admitted) is a member of the new generation that stopped answering: the next boundary finds it
        silent and the others regroup without it, as for any member lost in a window. It trained nothing,
        so only the pieces planned for it go back to the epoch; the other joiners are still sent theirs."""
        membership = self.membership
        assert membership is not None
        for member in joined:
            try:
                with self.naming_lost_ranks(session, f"sending the cohort's state to joining member {member}"):
                    send_from_rank0(checkpoint, [membership.current.rank_of(member)])
            except CohortFailure as failure:  # who else it names (a member slow to beat, under load) the next boundary checks
                if membership.current.rank_of(member) not in failure.lost:
                    raise
                rank_zero_warn(
                    f"ElChe: joining member {member} was lost as it was admitted; the cohort trains on and "
                    "regroups without it at the next boundary"
                )

    def training_starts(self, trainer: "pl.Trainer") -> bool:
        """A batch begins: a joiner's set-up (Lightning's barriers and checks, which the members ran at their
        own start) is behind it, and its collectives pair up from now on. Its validation loaders are set up
        again at the next validation, with the members', whose sampler changed with the world size.
        True when this is a joiner's first batch."""
        if self.membership is not None and not self._trained:
            self._trained = True
            self.membership.note_training()
        if not self._joining:
            return False
        self._joining = False
        _lightning.forget_val_dataloaders(trainer)
        return True

    def fit_ends(self, rank: int) -> None:
        """The fit is over: ranks still waiting to join stop waiting (rank 0 tells them)."""
        if self.membership is not None and rank == 0:
            self.membership.finish()

    def _resume_in_memory(self, session: "FitSession", point: Optional[ResumePoint]) -> "Cohort":
        """A member's cohort for the generation it just entered, resumed from ``point`` as a checkpoint
        resume would be, in memory: the rest of the epoch is planned again for the new world, and the
        train iterator starts again from that plan (batches fetched ahead are dropped). No ``point``:
        nothing trained yet (the fit's set-up), the cohort starts as the fit's first would."""
        cohort = session.next_generation(point)
        trainer = session.trainer
        _lightning.set_global_step(trainer, cohort.cohort_step)
        _lightning.set_logged_step(trainer, cohort.logged_step)
        session.takeover.follow_schedules(cohort.cohort_step)
        if point is not None and not covers_its_epoch(point):  # (no point: no train iterator yet)
            _lightning.restart_train_iterator(trainer)
        _lightning.forget_val_dataloaders(trainer)
        return cohort

