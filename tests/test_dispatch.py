"""Dynamic dispatch without processes: ranks' cohorts, their real samplers and a real store counter.

Each simulated rank runs ElChe's own :class:`ElCheSampler` behind a ``BatchSampler`` with a
DataLoader-like prefetch (claims made ahead of training), claims from a :class:`TicketCounter` on a
real in-process ``HashStore``, and meets the others at boundaries as the callback does (another
boundary while ``boundary_due()``). Time is simulated: rank r's batch lasts ``ms(rank, step)``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from typing import Callable, Optional

import pytest
import torch.distributed as dist
from torch.utils.data import BatchSampler

from lightning_elche.cohort.controller import Controller, ControllerConfig, WindowReport
from lightning_elche.cohort.core import Cohort
from lightning_elche.cohort.limits import FitLimits
from lightning_elche.cohort.coverage import Spans
from lightning_elche.cohort.guards import NoGuard
from lightning_elche.cohort.plan import EpochPlan
from lightning_elche.cohort.train_data import TrainData
from lightning_elche.cohort.claims import Claiming, Claims, MAX_CHUNK, claim_chunk
from lightning_elche.cohort.pool import PoolEpoch
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.comm.claims import TicketCounter
from lightning_elche.lightning.data import ElCheSampler
from lightning_elche.sim.claims import claim_costs, split_pool
from lightning_elche.sim.simulator import simulate_cohort, spread_speeds

from test_cohort_core import exchange

BATCH = 4
BOUNDARY_MS = 2.0


class SimRank:
    """One rank: its cohort, its sampler and DataLoader-like prefetch, its clock."""

    def __init__(
        self, cohort: Cohort, counter: TicketCounter, prefetch: int, drop_last: bool, batch: int = BATCH, ahead: bool = False
    ) -> None:
        self.cohort = cohort
        self.counter = counter
        self.rank = cohort.rank
        self.sampler = ElCheSampler(
            cohort.begin_epoch, rank=self.rank, claiming=Claiming(counter, cohort.claim_chunk, ahead=ahead),
        )  # fmt: skip
        self.prefetch = prefetch
        self.drop_last = drop_last
        self.batch = batch  # a micro-batch: the rank accumulates BATCH // batch of them per optimizer step
        self.now = 0.0
        self.steps = 0
        self.batches_trained = 0
        self.trained: list[int] = []
        self.idle_ms = 0.0
        self.train_ms = 0.0

    def begin_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.batches = iter(BatchSampler(self.sampler, self.batch, self.drop_last))
        self.queue: deque[list[int]] = deque()
        self._fill()  # Lightning fetches the first batch before training starts
        self.finished = False
        self.ends_at: Optional[float] = None  # the batch in training ends then
        self.cohort.start_clock(self.now / 1000.0)

    def _fill(self) -> None:
        while len(self.queue) < self.prefetch:
            batch = next(self.batches, None)
            if batch is None:
                return
            self.queue.append(batch)

    def start_batch(self, ms: float) -> None:
        self.cohort.batch_started()
        batch = self.queue.popleft()
        self._fill()  # the fetcher pulls ahead (claims) before the batch trains
        self.finished = not self.queue
        self.trained.extend(batch)
        self.ends_at = self.now + ms

    def end_batch(self) -> bool:
        """The batch in training ends; True when it closes the window."""
        assert self.ends_at is not None
        self.batches_trained += 1
        if self.batches_trained % (BATCH // self.batch) == 0 or self.finished:  # Lightning's accumulation
            self.cohort.optimizer_stepped()
            self.steps += 1
        self.train_ms += self.ends_at - self.now
        self.now, self.ends_at = self.ends_at, None
        return self.cohort.batch_ended(self.now / 1000.0, self.finished, self.counter.peek)


def run(
    world: int,
    samples: int,
    ms: Callable[[int, int], float],
    *,
    dispatch: str = "dynamic",
    prefetch: int = 1,
    epochs: int = 1,
    drop_last: bool = False,
    max_steps: int = -1,
    checkpoint_at: Optional[int] = None,
    resume: Optional[ResumePoint] = None,
    store: Optional[dist.Store] = None,
    checkpoint_every: int = 0,
    max_anchor: int = 1000,
    data: Optional[TrainData] = None,
    micro_batches: Optional[tuple[int, ...]] = None,
    ahead: bool = False,
) -> dict:
    """Train ``epochs`` epochs; ``ms(rank, local_step)`` is a batch's duration. Returns what happened.
    ``ahead``: claims sent ahead (``Claiming.ahead``), answered on each counter's thread in real time, so
    which rank gets which ticket is no longer decided by the simulated clock alone."""
    config = ControllerConfig(world_size=world, anchor=min(4, max_anchor), max_anchor=max_anchor)
    store = store if store is not None else dist.HashStore()
    cohorts = [
        Cohort(config, NoGuard(), rank=rank, dispatch=dispatch, resume=resume,
               limits=FitLimits(max_steps=max_steps, step_checkpoint_every=(checkpoint_every,) if checkpoint_every else ()))
        for rank in range(world)
    ]
    micro_batches = micro_batches or (BATCH,) * world
    ranks = [SimRank(c, TicketCounter(store, world, answer_within_s=60), prefetch, drop_last, micro_batches[c.rank], ahead)
             for c in cohorts]
    data = data or TrainData(
        samples, seed=5, shuffle=True, batch_size=BATCH, samples_per_step=BATCH, drop_last=drop_last,
        rank_batch_sizes=micro_batches,
    )
    for cohort in cohorts:
        cohort.set_train_data(data, lookahead_batches=prefetch)
    boundaries = 0
    checkpoint, claims = None, []
    trained_at_checkpoint: list[list[int]] = []
    stopped, outcomes = False, []
    saves = [0] * world  # step checkpoints each rank's hooks would save (one per batch at most)
    for epoch in range(epochs):
        for rank in ranks:
            rank.begin_epoch(epoch)
        waiting: set[int] = set()
        done: set[int] = set()
        while len(done) < world and not stopped:
            training = [r for r in ranks if r.rank not in waiting and r.rank not in done]
            if training:  # the next event in time: a batch starts (and claims) or ends (and peeks)
                rank = min(training, key=lambda r: (r.now if r.ends_at is None else r.ends_at, r.rank))
                if rank.ends_at is None:
                    rank.start_batch(ms(rank.rank, rank.steps))
                elif rank.end_batch():
                    waiting.add(rank.rank)
                continue
            # every rank not done waits: the boundary all-reduce
            assert waiting == {r.rank for r in ranks} - done or not done, "a rank left the epoch with windows open"
            assert waiting == {r.rank for r in ranks}, f"ranks {set(range(world)) - waiting} skipped a boundary"
            meet = max(r.now for r in ranks)
            control = exchange([r.cohort.local_report() for r in ranks])
            outcomes = [r.cohort.boundary(control, divergence=0.0, averaged=True) for r in ranks]
            # the same decisions everywhere (the loggers' step differs by whether this rank's batch stepped)
            assert all(dataclasses.replace(o, logger_step=0) == dataclasses.replace(outcomes[0], logger_step=0)
                       for o in outcomes)
            # every batch steps, and Lightning adds it after the hook: also after an ended epoch's extra boundaries
            assert [o.logger_step for o in outcomes] == [r.cohort.logged_step - 1 for r in ranks], boundaries
            for r in ranks:
                wait, r.now = meet - r.now, meet + BOUNDARY_MS
                r.idle_ms += wait
                r.cohort.close_boundary(BOUNDARY_MS + wait)
            boundaries += 1
            if boundaries == checkpoint_at:
                claims = [r.cohort.plan.claims() for r in ranks if isinstance(r.cohort.plan, PoolEpoch)]
                checkpoint = ranks[0].cohort.resume_point(lambda: None, None, lambda mine: claims)
                trained_at_checkpoint = [list(r.trained) for r in ranks]
            if outcomes[0].stops:
                stopped = True
                break
            waiting = {r.rank for r in ranks if r.cohort.boundary_due()}
            for r, outcome in zip(ranks, outcomes):
                crossed = checkpoint_every and (
                    outcome.cohort_step // checkpoint_every > outcome.cohort_step_before // checkpoint_every
                )
                if r.rank not in waiting and crossed:  # its hook ends: ModelCheckpoint runs once
                    saves[r.rank] += 1
            for r in ranks:
                if r.rank not in waiting:
                    r.cohort.start_clock(r.now / 1000.0)
                    if r.finished:
                        done.add(r.rank)
        assert stopped or all(r.cohort.clock.window == r.cohort.plan.window_count for r in ranks)
    return {
        "ranks": ranks, "boundaries": boundaries, "checkpoint": checkpoint,
        "trained_at_checkpoint": trained_at_checkpoint, "claims": claims, "saves": saves, "cohort_step": cohorts[0].cohort_step,
        "history": cohorts[0].history, "wall_ms": max(r.now for r in ranks), "last_outcome": outcomes[0],
    }


def step_change(rank: int, step: int) -> float:
    """Rank 1 turns 4x slower at its 40th step."""
    return 4.0 if rank == 1 and step >= 40 else 1.0


def alternating(rank: int, step: int) -> float:
    return 4.0 if rank == 1 and (step // 25) % 2 else 1.0


def all_trained(result: dict) -> list[int]:
    return sorted(i for r in result["ranks"] for i in r.trained)


@pytest.mark.parametrize("prefetch, ahead", [(1, False), (5, False), (1, True)])
def test_every_sample_once_every_rank_the_same_boundaries(prefetch, ahead):
    result = run(3, 1003, lambda rank, step: [1.0, 2.5, 4.0][rank], prefetch=prefetch, epochs=2, ahead=ahead)
    per_epoch = all_trained(result)
    assert per_epoch == sorted(list(range(1003)) * 2)
    assert len({r.cohort.clock.window for r in result["ranks"]}) == 1
    history = result["history"]
    middle = history[len(history) // 2]
    assert middle.steps[0] > middle.steps[2]  # the fast rank claimed more
    assert sum(sum(r.samples) for r in history) == 2 * 1003  # the record of who trained what adds up
    assert sum(sum(r.steps) for r in history) == 2 * math.ceil(1003 / BATCH)


@pytest.mark.parametrize("dispatch", ["dynamic", "planned"])
def test_micro_batches_keep_steps_and_coverage_whole(dispatch):
    """Rank 1 trains batches of 1 and rank 2 of 2 (micro_batch_sizes), accumulating to BATCH samples a
    step: every sample once, windows close on whole steps, the record counts steps, not batches."""
    result = run(3, 1003, lambda rank, step: 1.0, dispatch=dispatch, prefetch=5, epochs=2, micro_batches=(BATCH, 1, 2))
    assert all_trained(result) == sorted(list(range(1003)) * 2)
    history = result["history"]
    assert sum(sum(r.samples) for r in history) == 2 * 1003
    assert sum(sum(r.steps) for r in history) == 2 * math.ceil(1003 / BATCH)
    assert [r.steps for r in result["ranks"]] == [sum(h.steps[rank] for h in history) for rank in range(3)]
    assert all(rank.batches_trained >= rank.steps * (BATCH // rank.batch) - 2 for rank in result["ranks"])


def test_drop_last_and_a_tail_shorter_than_a_batch():
    result = run(2, 1003, lambda rank, step: 1.0 + rank, drop_last=True)
    trained = all_trained(result)
    assert len(trained) == 1000 and len(set(trained)) == 1000
    result = run(2, 1003, lambda rank, step: 1.0 + rank)
    assert all_trained(result) == list(range(1003))


@pytest.mark.parametrize("dispatch", ["dynamic", "planned"])
def test_max_steps_lands_exactly_and_says_whether_the_epoch_had_data_left(dispatch):
    """Mid-epoch, a rank's loader may still run dry on the capped pool: Lightning must not take that
    for the epoch's end (it would validate where DDP does not). On the epoch's last step it is the end."""
    result = run(2, 4000, lambda rank, step: 1.0 + 2 * rank, max_steps=77, dispatch=dispatch)
    assert result["cohort_step"] == 77
    assert sum(r.steps for r in result["ranks"]) == 154
    assert result["last_outcome"].max_steps_reached and result["last_outcome"].data_left
    epoch_steps = 4000 // BATCH // 2
    result = run(2, 4000, lambda rank, step: 1.0 + 2 * rank, max_steps=epoch_steps, dispatch=dispatch)
    assert result["cohort_step"] == epoch_steps
    assert result["last_outcome"].max_steps_reached and not result["last_outcome"].data_left


@pytest.mark.parametrize("speeds", [step_change, alternating])
def test_the_fast_rank_barely_waits_when_speeds_change(speeds):
    planned = run(2, 6000, speeds, dispatch="planned")
    dynamic = run(2, 6000, speeds)
    assert all_trained(dynamic) == list(range(6000))
    idle = [r.idle_ms / r.now for r in dynamic["ranks"]]
    planned_idle = [r.idle_ms / r.now for r in planned["ranks"]]
    assert idle[0] < 0.05, idle
    assert planned_idle[0] > 2 * idle[0], (planned_idle, idle)
    assert dynamic["wall_ms"] < planned["wall_ms"]


@pytest.mark.parametrize("prefetch, ahead", [(5, False), (1, True)])
def test_a_checkpoint_mid_epoch_resumes_with_exactly_what_is_left(prefetch, ahead):
    """A checkpoint at the 6th boundary covers exactly what was trained: tickets claimed but not trained
    (the DataLoader's prefetch, a claim sent ahead and answered only for the checkpoint) are held, not covered."""
    first = run(2, 2003, lambda rank, step: 1.0 + 2 * rank, prefetch=prefetch, checkpoint_at=6, ahead=ahead)
    point = first["checkpoint"]
    before = sorted(i for trained in first["trained_at_checkpoint"] for i in trained)
    data = TrainData(2003, seed=5, shuffle=True, batch_size=BATCH, samples_per_step=BATCH, drop_last=False)
    assert sorted(data.samples_at(0, point.covered).tolist()) == before
    assert any(claims.held for claims in first["claims"])  # prefetched, not trained: not covered
    for world in (2, 3):
        resumed = run(world, 2003, lambda rank, step: 1.0 + rank, resume=ResumePoint.from_state(point.to_state()))
        assert sorted(before + all_trained(resumed)) == list(range(2003))


def test_claims_are_chunked_only_when_steps_are_short_next_to_a_round_trip():
    assert claim_chunk(0.2, 100.0, 1000.0) == 1
    assert claim_chunk(0.2, 2.0, 2000.0) == 10
    assert claim_chunk(0.2, 2.0, 200.0) == 2  # a chunk's steps stay short next to the window
    assert claim_chunk(5.0, 0.1, 10_000.0) == MAX_CHUNK
    assert claim_chunk(0.2, None, None) == 1
    counter = TicketCounter(dist.HashStore(), world_size=3, answer_within_s=60)
    assert [counter.claim(0, 1), counter.claim(0, 4), counter.claim(1, 1)] == [3, 4, 3]
    assert counter.round_trip_ms > 0


@pytest.mark.parametrize("ahead", [False, True])
def test_a_claim_sent_ahead_goes_out_as_the_last_ticket_held_is_handed_out(ahead):
    """With ``Claiming.ahead`` the next claim is on its way while the step trains (the counter's thread
    runs its operations in order, so a peek queued after it sees it), from the second ticket on (Lightning
    may drop an iterator after its first batch); a checkpoint taken before the sampler asks for that
    ticket reads the answer: the ticket is held, never counted as trained."""
    pool = TrainData(40, seed=0, shuffle=False, batch_size=4, samples_per_step=4, drop_last=False).plan(
        0, world_size=2, dynamic=True
    )
    counter = TicketCounter(dist.HashStore(), world_size=2, answer_within_s=60)
    indices = pool.serve(0, Claiming(counter, ahead=ahead))
    assert [next(indices) for _ in range(4)] == pool.ticket_indices(0).tolist()  # the reserved ticket, handed out
    assert counter.peek(0) == 2  # nothing claimed yet: Lightning may drop an iterator after its first batch
    assert [next(indices) for _ in range(4)] == pool.ticket_indices(2).tolist()  # claimed as the sampler asked
    claimed = 4 if ahead else 3  # two reserved tickets, ticket 2, and ticket 3 claimed ahead
    assert counter.peek(0) == claimed
    assert pool.claims() == Claims(claimed_end=claimed, held=(0, 2, 3) if ahead else (0, 2))
    assert pool.covered([pool.claims(), Claims(claimed_end=2, held=())]) == Spans([(4, 8)])  # ticket 1, rank 1's
    assert [next(indices) for _ in range(4)] == pool.ticket_indices(3).tolist()
    assert counter.peek(0) == claimed + 1  # ticket 4 on its way (ahead); ticket 3 claimed as the sampler asked


def test_a_pool_covers_only_the_tickets_trained_by_someone():
    pool = TrainData(40, seed=0, shuffle=False, batch_size=4, samples_per_step=4, drop_last=False).plan(
        0, world_size=2, dynamic=True
    )
    assert isinstance(pool, PoolEpoch) and pool.tickets == 10
    covered = pool.covered([Claims(claimed_end=7, held=(5,)), Claims(claimed_end=6, held=(6, 1))])
    assert covered == Spans([(0, 4), (8, 20)])  # tickets 0, 2, 3, 4 (1, 5, 6 held; none claimed from 7 on)
    # an epoch with fewer steps than ranks is planned
    tiny = TrainData(6, seed=0, shuffle=False, batch_size=4, samples_per_step=4, drop_last=False)
    assert isinstance(tiny.plan(0, world_size=3, dynamic=True), EpochPlan)


def noisy_speeds(base_ms: list[float], seed: int = 0) -> Callable[[int, int], float]:
    """Each rank's batch time: its base times a mean-one lognormal factor (sigma 0.3) drawn every 10 steps."""
    rng = random.Random(seed)
    factors: dict[tuple[int, int], float] = {}

    def ms(rank: int, step: int) -> float:
        key = (rank, step // 10)
        if key not in factors:
            factors[key] = math.exp(rng.gauss(0.0, 0.3) - 0.045)
        return base_ms[rank] * factors[key]

    return ms


def test_per_window_noise_keeps_the_cohort_near_the_ideal():
    dynamic = run(2, 8000, noisy_speeds([1.0, 2.0]))
    busy = [r.train_ms / r.now for r in dynamic["ranks"]]
    assert min(busy) > 0.9, busy


def test_a_slow_rank_leaves_the_last_tickets_of_each_pool_to_the_faster_one(monkeypatch):
    """Training one step more at the end of a pool keeps the fast rank waiting for most of a slow
    step; leaving the last tickets to it costs the slow rank less than that, counted in tickets."""

    def run_and_lost(rule_on: bool) -> tuple[float, dict]:
        if not rule_on:
            monkeypatch.setattr("lightning_elche.cohort.pool.leaves_to_the_faster", lambda faster: 0.0)
        result = run(2, 6000, noisy_speeds([10.0, 40.0]))
        monkeypatch.undo()
        ranks = result["ranks"]
        return sum(r.idle_ms / (r.train_ms / r.steps) for r in ranks), result

    lost, leaving = run_and_lost(rule_on=True)
    lost_greedy, greedy = run_and_lost(rule_on=False)
    assert all_trained(leaving) == all_trained(greedy) == list(range(6000))
    fast_idle = [r["ranks"][0].idle_ms / r["ranks"][0].now for r in (leaving, greedy)]
    assert fast_idle[0] < 0.5 * fast_idle[1], fast_idle
    assert lost < 0.7 * lost_greedy, (lost, lost_greedy)
    # the simulator splits a pool by the same rule: the slow rank leaves the last ticket to the fast one
    assert split_pool(12, [1.0, 4.0]) == [10, 2]
    monkeypatch.setattr("lightning_elche.sim.claims.leaves_to_the_faster", lambda faster: 0.0)
    assert split_pool(12, [1.0, 4.0]) == [9, 3]


def test_the_simulator_predicts_dynamic_dispatch_with_the_same_core():
    noisy = dict(step_ms=100.0, noise=0.3, seconds=300, boundary_ms=50.0)
    speeds = spread_speeds(64, 4.0)
    planned = simulate_cohort(speeds, dispatch="planned", **noisy)
    dynamic = simulate_cohort(speeds, dispatch="dynamic", **noisy)
    default = simulate_cohort(speeds, **noisy)  # resolved as ElCheStrategy resolves it: dynamic
    assert default.fraction_of_ideal == dynamic.fraction_of_ideal and default.claim_fraction == dynamic.claim_fraction
    assert dynamic.fraction_of_ideal > 0.9 > planned.fraction_of_ideal
    assert max(dynamic.claim_fraction) < 0.01  # 0.2 ms per claim next to 100 ms steps
    assert split_pool(10, [1.0, 4.0]) == [8, 2] and split_pool(3, [1.0, 1.0, 1.0]) == [1, 1, 1]


def test_store_contention_grows_with_the_ranks_and_a_slow_store_falls_back_to_planned():
    loads = [claim_costs([5.0] * n, 400.0, 0.05, 0.02).utilisation for n in (64, 256, 1024)]
    assert loads[0] < loads[1] < loads[2]
    saturated = claim_costs([5.0] * 4096, 4000.0, 0.05, 0.02)
    assert saturated.utilisation > 1 and min(saturated.chunks) > 1  # chunks grow where windows allow
    with pytest.warns(UserWarning, match="dispatch is planned from now on"):
        slow_store = simulate_cohort(
            [1.0, 0.5], step_ms=2.0, epochs=3, epoch_samples=4000, dispatch="dynamic", claim_ms=5.0, boundary_ms=1.0
        )  # a round trip longer than a step: claims sent ahead hide only a step of it
    assert slow_store.claim_fraction[0] > 0.05  # the first epoch's cost, before the fall-back


def test_step_checkpoints_match_across_ranks_when_an_ended_rank_closes_several_windows_at_once(monkeypatch):
    """A rank whose epoch ran out closes the windows left in one batch (here: the tail of a resumed
    epoch on three ranks, short windows); ModelCheckpoint runs once per batch, so step checkpoints
    wait for the epoch's final boundary and every rank saves as often (else a collective hangs)."""
    first = run(2, 300, lambda rank, step: 1.0 + rank, checkpoint_at=13, max_anchor=2)
    loops = []
    original = Cohort.boundary_due

    def boundary_due(cohort: Cohort) -> bool:
        due = original(cohort)
        loops.append(due)
        return due

    monkeypatch.setattr(Cohort, "boundary_due", boundary_due)  # a spy: counts, changes nothing
    resumed = run(3, 300, lambda rank, step: [1.0, 2.0, 1.0][rank], max_anchor=2, checkpoint_every=1,
                  resume=ResumePoint.from_state(first["checkpoint"].to_state()))
    assert any(loops), "no rank closed two windows in one batch: the scenario no longer tests that"
    assert len(set(resumed["saves"])) == 1 and resumed["saves"][0] >= 1, resumed["saves"]


def test_waiting_at_boundaries_counts_as_overhead_only_under_dynamic_dispatch():
    """Dynamic dispatch's wait for the last step in flight does not shrink with the window, so the
    anchor grows to amortize it; planned dispatch's waits come from shares, which it does not fix."""
    for amortize in (False, True):
        controller = Controller(ControllerConfig(world_size=2, anchor=4, amortize_waits=amortize))
        for _ in range(8):
            controller.observe(WindowReport(window_ms=[40.0, 40.0], steps=[10, 10], boundary_ms=[0.5, 20.0]))
        assert (controller.anchor > 4) == amortize, (amortize, controller.anchor)


@pytest.mark.parametrize("prefetch", [1, 5])
def test_every_sample_once_when_the_fastest_rank_becomes_the_slowest(prefetch):
    """Slow ranks stop claiming near an epoch's end (the fastest claims the rest); the fastest at the
    epoch's start keeps that role, even when it turns slowest, so nothing is left unclaimed."""
    flip = lambda rank, step: (1.0 if step < 30 else 6.0) if rank == 0 else 2.0  # noqa: E731
    result = run(3, 1203, flip, prefetch=prefetch, epochs=2)
    assert all_trained(result) == sorted(list(range(1203)) * 2)
