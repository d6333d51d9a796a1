"""The elastic cohort's membership: generations, and real processes agreeing on the next one."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from conftest import TESTS, kill_group, run_command, start, wait_all

from lightning_elche.cohort.controller import ControllerConfig
from lightning_elche.cohort.core import Cohort
from lightning_elche.cohort.guards import NoGuard
from lightning_elche.cohort.control import Generation, gather_reports
from lightning_elche.cohort.controller import controller_state_for
from lightning_elche.cohort.membership import survivors_point
from lightning_elche.cohort.train_data import TrainData
from lightning_elche.comm.liveness import CohortFailure
from lightning_elche.comm.rendezvous import (
    MEMBER_IDS, MEMBER_IDS_RESERVED, connect_store, free_port, next_member_id, reserve_member_ids,
)
from lightning_elche.lightning.collectives import GuardedCollectives
from lightning_elche.lightning.elastic import ElasticWorld


def test_members_that_stay_keep_their_ranks_first_and_joiners_follow_so_a_state_holder_leads():
    first = Generation.first(3)
    assert first.members == (0, 1, 2) and first.world_size == 3
    shrunk = first.after(lost=[0])
    assert shrunk == Generation(1, (1, 2)) and shrunk.rank_of(1) == 0
    grown = shrunk.after(joined=[5, 3])
    assert grown == Generation(2, (1, 2, 3, 5)) and grown.rank_of(5) == 3
    # A spare started early (member 6) takes a place after a later replacement (member 7) became a member:
    # rank 0, which sends the joiners the cohort's state, is member 7 (the fault sweep's fit 3 at 0d0e1d6:
    # sorted ids made the spare rank 0, and it waited to receive the state from itself).
    assert Generation(5, (4, 7)).after(lost=[4], joined=[6]) == Generation(6, (7, 6))
    assert Generation.decode(grown.encode()) == grown
    with pytest.raises(ValueError, match="no member of generation 1 is left"):
        shrunk.after(lost=[1, 2])


class _WatchedStore:
    """A store connection that tells when ``wait`` is entered, and records every ``add`` together with
    whether the launch's reservation was in the store at that moment."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self.waiting = threading.Event()
        self.adds: list[tuple[str, bool]] = []

    def wait(self, keys: list[str]) -> None:
        self.waiting.set()
        self._store.wait(keys)

    def add(self, key: str, amount: int) -> int:
        self.adds.append((key, self._store.check([MEMBER_IDS_RESERVED])))
        return self._store.add(key, amount)


@pytest.mark.timeout(30)
def test_a_joiner_that_reaches_the_store_before_the_launch_reserves_its_ranks_takes_the_next_id():
    port = free_port("127.0.0.1")
    hosting = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=20))
    joiners_launcher = _WatchedStore(connect_store("127.0.0.1", port, timeout=timedelta(seconds=20)))
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(next_member_id, joiners_launcher)  # started with the fit, it asks first
        # It waits for the launch's two ranks to be reserved (it took id 0 once): it is inside the store's
        # wait for the reservation key, which is not set yet, and has taken no id.
        assert joiners_launcher.waiting.wait(timeout=15), "next_member_id never waited for the launch's reservation"
        assert not asked.done() and joiners_launcher.adds == [], joiners_launcher.adds
        assert int(hosting.add(MEMBER_IDS, 0)) == 0  # nobody took an id before the reservation
        reserve_member_ids(hosting, 2)
        assert asked.result(timeout=10) == 2
    assert joiners_launcher.adds == [(MEMBER_IDS, True)]  # its one id, taken after the reservation
    assert next_member_id(hosting) == 3  # a replacement's, later


def _launch_and_lose(tmp_path, victim: int) -> list[dict]:
    app = TESTS / "membership_app.py"
    command = [sys.executable, "-m", "lightning_elche.launch", "--nproc", "3", "--exit-grace", "5", str(app), str(tmp_path), str(victim)]
    proc = run_command(command, tmp_path, 60, what=f"three members, member {victim} killed")
    survivors = [member for member in range(3) if member != victim]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"member_{member}.json").read_text()) for member in survivors]


@pytest.mark.timeout(90)
def test_survivors_of_a_killed_member_agree_on_a_new_group_and_reduce_in_it(tmp_path):
    """No Lightning: the protocol alone (tests/test_elastic.py runs it inside fits, with the leader
    killed and a member stalled too)."""
    results = _launch_and_lose(tmp_path, 1)
    for rank, result in enumerate(results):
        assert result["generation"] == 1 and result["members"] == [0, 2]
        assert result["rank"] == rank and result["world_size"] == 2
        assert result["sum_of_member_ids"] == 2
        assert result["completed_vote"] is (False if rank == 0 else None)  # member 0 voted alone: it rolls back
        assert result["survivors_vote"] is True
        # Found out from the closed connection, not from the 10 s gloo timeout (told by the error, not by the
        # time it took: a loaded machine stretches both); the regroup waited on no timeout either, or the
        # new group's all-reduce above could not have gone through.
        assert "Timed out" not in result["failed"], result
        assert "Connection closed by peer" in result["failed"] or "Connection reset by peer" in result["failed"], result


@pytest.mark.timeout(90)
def test_a_fit_whose_members_all_failed_fails_though_its_unneeded_spare_exited_cleanly(tmp_path):
    app = TESTS / "membership_app.py"
    command = [sys.executable, "-m", "lightning_elche.launch", "--nproc", "2", "--replace", "--spares", "1",
               "--max-replacements", "0", "--exit-grace", "5", str(app), str(tmp_path), "fail"]
    proc = run_command(command, tmp_path, 60, what="two members that fail, one spare")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "spare member 2 starts on local rank 0" in proc.stderr


@pytest.mark.timeout(90)
def test_the_hosting_launcher_keeps_the_store_until_the_other_launchers_are_done(tmp_path):
    """The hosting launcher's rank ends first; the other machine's rank still uses the store afterwards
    (as a joiner being admitted, or a launcher recording an exit, does): both launches succeed."""
    app, port = TESTS / "membership_app.py", free_port("127.0.0.1")
    launch = [sys.executable, "-m", "lightning_elche.launch", "--nproc", "1", "--nnodes", "2", "--exit-grace", "5",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--cold-start"]  # fmt: skip
    launchers = [start([*launch, "--node-rank", str(node), str(app), str(tmp_path), "outlive"], cwd=tmp_path,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]  # fmt: skip
    try:
        finished = wait_all(launchers, 60, what="two launchers, the hosting one's rank done first")
    finally:
        for launcher in launchers:
            kill_group(launcher)
    assert [proc.returncode for proc in finished] == [0, 0], "\n".join(proc.stderr[-2000:] for proc in finished)


@pytest.mark.timeout(90)
def test_each_failure_is_replaced_once(tmp_path):
    """A replacement that fails too is replaced once, by the next member id (it was once watched twice)."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(1)\n")
    command = [sys.executable, "-m", "lightning_elche.launch", "--nproc", "1", "--replace", "--max-replacements", "3",
               "--cold-start", str(script)]  # fresh interpreters: the script imports nothing
    proc = run_command(command, tmp_path, 60, what="a rank that fails, and its replacements")
    assert proc.returncode == 1, proc.stderr[-3000:]
    replacements = [line for line in proc.stderr.splitlines() if "replaces it" in line]
    assert replacements == [f"lightning_elche.launch: member {m} exited with 1; member {m + 1} replaces it on local rank 0"
                            for m in range(3)], proc.stderr[-3000:]


def _planned_cohort_inside_its_third_window(world: int = 3):
    """A planned cohort of ``world`` ranks, seen from rank 0, after two boundaries, training window 2."""
    cohort = Cohort(ControllerConfig(world_size=world, anchor=2), NoGuard(), rank=0, dispatch="planned")
    cohort.set_train_data(TrainData(num_samples=240, seed=3, shuffle=True, batch_size=4, samples_per_step=4,
                                    drop_last=False), lookahead_batches=1)
    plan = cohort.begin_epoch(0)
    for _ in range(2):
        window = cohort.clock.window
        steps = [plan.steps(window, rank) for rank in range(world)]
        control = gather_reports([{"window_ms": 10.0 * n * (rank + 1), "steps": n, "samples": 4 * n}
                                  for rank, n in enumerate(steps)])
        cohort.local_report()
        cohort.boundary(control, 0.0, True)
        cohort.close_boundary(1.0)
    return cohort, plan


def test_the_survivors_resume_the_epoch_without_the_lost_ranks_window_and_nothing_else():
    """Rank 1 is lost in window 2: its piece of that window goes back to the epoch, the survivors'
    pieces and every earlier window stay trained; the two-rank epoch then plans exactly the rest."""
    cohort, plan = _planned_cohort_inside_its_third_window()
    steps_before = cohort.cohort_steps_total
    survivors_steps = plan.steps(2, 0) + plan.steps(2, 2)
    point = survivors_point(cohort, [0, 2], steps=survivors_steps, logged=survivors_steps)
    order = plan.order.base
    trained_before = set(order[: sum(sum(sizes) for sizes in plan.sizes[:2])].tolist())
    survivors_window = set(plan.indices(2, 0).tolist()) | set(plan.indices(2, 2).tolist())
    lost_window = set(plan.indices(2, 1).tolist())
    covered = set(point.covered_samples(shuffle=True).tolist())
    assert covered == trained_before | survivors_window and not covered & lost_window
    assert point.cohort_steps_total == steps_before + survivors_steps and point.world_size == 3

    resumed = Cohort(ControllerConfig(world_size=2, anchor=2), NoGuard(), rank=0, resume=point, dispatch="planned")
    resumed.set_train_data(cohort.data, lookahead_batches=1)
    rest = resumed.begin_epoch(0)
    while not rest.complete:
        rest.freeze([1, 1])
    planned = [i for window in range(rest.window_count) for rank in range(2) for i in rest.indices(window, rank).tolist()]
    assert len(planned) == len(set(planned))
    assert set(planned) == set(range(240)) - covered  # the lost window and every later sample, once
    assert lost_window <= set(planned)
    # the survivors' speed readings carried over: no probe windows for them
    assert resumed.controller.calibrated
    assert resumed.cohort_step == point.cohort_steps_total // 3


def test_a_joiner_starts_with_a_probe_window_while_the_members_keep_their_speeds():
    state = {"anchor": 8, "counts": [6, 2], "anchor_rank": 1, "calibrations": 4,
             "speeds": [[[10.0, 6]], [[30.0, 2]]]}
    grown = controller_state_for(state, Generation(1, (0, 1)).after(joined=[5]).sources(Generation(1, (0, 1))))
    assert grown["counts"] == [6, 2, 1] and grown["speeds"] == [[[10.0, 6]], [[30.0, 2]], []]
    assert grown["anchor_rank"] == 1
    shrunk = controller_state_for(state, [0])
    assert shrunk["counts"] == [6] and shrunk["anchor_rank"] == -1  # the anchor rank left: elect again


def _session(at_boundary: bool) -> SimpleNamespace:
    """A fit's session as far as deciding on a loss in one of Lightning's collectives goes."""
    return SimpleNamespace(ranks=SimpleNamespace(world_size=3), cohort=SimpleNamespace(at_boundary=lambda: at_boundary))


@pytest.mark.parametrize(
    "at_boundary, lost, goes_on",
    [(True, [1], True), (False, [1], False), (True, [], False), (True, [0, 1, 2], False)],
    ids=["fitting-at-a-boundary", "inside-a-window", "nobody-named", "nobody-left"],
)
def test_a_loss_in_lightnings_collectives_is_survived_only_at_a_boundary_with_someone_left(at_boundary, lost, goes_on):
    """Inside a window the lost ranks' window would have to go back to the epoch, which only a boundary's
    exchange knows; with nobody named, or nobody left, there is nobody to go on with."""
    failure = CohortFailure("lost", lost=lost)
    assert ElasticWorld(timedelta(seconds=10)).continues_at_boundary(_session(at_boundary), failure) is goes_on  # type: ignore[arg-type]


class _AnyLossSurvived:
    """A membership mode that would survive any loss, and notes each regroup."""

    joining = False

    def __init__(self) -> None:
        self.regrouped: list[Sequence[int]] = []

    def naming_lost_ranks(self, session: object, during: object) -> AbstractContextManager[None]:
        return nullcontext()

    def continues_at_boundary(self, session: object, failure: CohortFailure) -> bool:
        return True

    def continue_at_boundary(self, session: object, lost: Sequence[int]) -> None:
        self.regrouped.append(lost)

    def confirm_done(self, session: object, during: str) -> None:
        """Every member did it (the collective raised where a member was lost)."""


def test_a_loss_outside_a_fit_is_raised_not_survived():
    """``trainer.validate`` after the fit: there is no train loop to resume, so a loss in one of Lightning's
    collectives is raised, named, instead of an assertion deep in a regroup; in a fit (its set-up, before
    the session exists, included) the same loss is survived and the collective run again."""
    calls = []

    def barrier_losing_rank_1_once() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise CohortFailure("lost", lost=[1])
        return "done"

    world = _AnyLossSurvived()
    validating = GuardedCollectives(SimpleNamespace(session=None, world=world, fitting=False), strict=True)  # type: ignore[arg-type]
    with pytest.raises(CohortFailure):
        validating.run("a barrier", barrier_losing_rank_1_once)
    assert world.regrouped == []
    calls.clear()
    setting_up = GuardedCollectives(SimpleNamespace(session=None, world=world, fitting=True), strict=True)  # type: ignore[arg-type]
    assert setting_up.run("a barrier", barrier_losing_rank_1_once) == "done"
    assert world.regrouped == [[1]] and len(calls) == 2
