"""The fault matrix: a rank killed, stalled or failing at the worst moments, on real processes.

Every rank is started on its own, as ``srun`` does (``conftest.start_srun_style``): no launcher
kills the survivors for us, so the strategy's own process-group timeout and roll call must end
them. Each fault must end in a clear error on every survivor, within the timeout plus a margin,
naming the rank that was lost (or the write that failed) and the last consensus checkpoint; that
checkpoint must be on disk, the newest one there, and resumable. Nothing may be left running.

The faults strike through hooks of ``tests/scenario.py``: ``collective_fault`` SIGKILLs a rank
before (or inside) its n-th matching collective, ``kill_at`` sends a signal after a batch,
``raise_at`` raises in ``training_step``, ``checkpoint_io`` makes rank 0's n-th write fail with
ENOSPC (a read-only directory stops nobody when the tests run as root) or slow.
"""

from __future__ import annotations

import contextlib

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from conftest import SCENARIO_TIMEOUT_S, coverage_report, kill_group, run_scenario, start_srun_style
from fake_clock import FakeClock

from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.comm import liveness as liveness_module
from lightning_elche.comm.liveness import FailurePlace, Liveness, describe_failure

TIMEOUT_S = 15  # the strategy's process-group timeout in these runs
MARGIN_S = 30  # the roll call's grace (at most 10 s), interpreter exit, a loaded machine
SAMPLES = 128
# Fixed equal shares and two steps per window: on both ranks, boundaries 0-3 close batches 1, 3, 5
# and 7 at cohort steps 2, 4, 6, 8, and checkpoints follow boundaries 1 (step 4) and 3 (step 8).
BASE = {
    "epochs": 1, "samples": SAMPLES, "validate": False, "checkpoint_every_n_steps": 4,
    "elche": {"timeout": TIMEOUT_S, "anchor": 2, "max_anchor": 2, "partition_ratios": [1, 1]},
}
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?([\w.]+: ElChe: .*)$", re.MULTILINE)
NAMED = re.compile(r"Last consensus checkpoint: (\S+\.ckpt) - restart the job")


@dataclass
class FaultRun:
    ranks: dict[int, subprocess.CompletedProcess]
    fault: dict[str, Any]  # what the hook did and when (time.time())
    survivors_s: float  # from the fault until the last survivor had exited
    checkpoints: Path

    def error(self, rank: int) -> str:
        """The ElChe error a rank ended with: the first line of its exception, as a user reads it."""
        errors = ERROR_LINE.findall(self.ranks[rank].stderr)
        assert errors, f"rank {rank} ended without an ElChe error:\n{self.ranks[rank].stderr[-4000:]}"
        return errors[-1]


def run_fault(
    tmp_path: Path,
    doomed: Optional[int],
    world: int = 2,
    elche: Optional[dict] = None,
    doomed_exits_within_s: float = 0.0,
    **config: Any,
):
    """Run ``BASE`` with ``config`` on ``world`` srun-style ranks; wait for every rank but ``doomed``
    (and for ``doomed`` too, up to ``doomed_exits_within_s``, when it is to exit by itself).

    Then every process group is killed (a stalled rank is SIGKILLed here), and the test fails if a
    survivor left a process behind.
    """
    config = {**BASE, **config, "elche": {**BASE["elche"], **(elche or {})}}
    processes = start_srun_style(tmp_path, world, config, {"SLURM_JOB_ID": "1414"})
    ranks: dict[int, subprocess.CompletedProcess] = {}
    ended = 0.0
    try:
        deadline = time.monotonic() + SCENARIO_TIMEOUT_S
        for rank, process in enumerate(processes):
            if rank == doomed:
                continue
            try:
                stdout, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} hung for more than {SCENARIO_TIMEOUT_S} s after the fault")
            ended = time.time()
            ranks[rank] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        left = [rank for rank in ranks if _group_alive(processes[rank].pid)]
        assert not left, f"ranks {left} exited but left processes running"
    finally:
        if doomed_exits_within_s and doomed is not None:  # it exits by itself, only later than the survivors
            with contextlib.suppress(subprocess.TimeoutExpired):
                processes[doomed].wait(timeout=doomed_exits_within_s)
        for process in processes:
            kill_group(process)
    if doomed is not None:
        stdout, stderr = processes[doomed].communicate(timeout=30)
        ranks[doomed] = subprocess.CompletedProcess(processes[doomed].args, processes[doomed].returncode, stdout, stderr)
    assert not [p.pid for p in processes if _group_alive(p.pid)], "a process outlived the test"
    out = tmp_path / "out"
    fault_file = out / "fault.json"
    assert fault_file.exists(), f"the fault never struck:\n{ranks[0].stderr[-4000:]}"
    fault = json.loads(fault_file.read_text())
    return FaultRun(ranks=ranks, fault=fault, survivors_s=ended - fault["time"], checkpoints=out / "checkpoints")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_survivors_name(run: FaultRun, survivors: list[int], *needles: str) -> Path:
    """Each survivor exited non-zero in time, its error says ``needles`` and names the last consensus
    checkpoint, which is the newest on disk and holds ElChe's state. Returns that checkpoint."""
    assert run.survivors_s < TIMEOUT_S + MARGIN_S, f"the survivors took {run.survivors_s:.0f} s after the fault"
    named = set()
    for rank in survivors:
        assert run.ranks[rank].returncode not in (0, None), f"rank {rank} exited with 0 after the fault"
        error = run.error(rank)
        for needle in needles:
            assert needle in error, f"rank {rank}: {needle!r} not in {error!r}"
        found = NAMED.search(error)
        assert found, f"rank {rank} names no checkpoint: {error!r}"
        named.add(found.group(1))
    assert len(named) == 1, f"the survivors name different checkpoints: {named}"
    checkpoint = Path(named.pop())
    on_disk = sorted(run.checkpoints.glob("*.ckpt"), key=lambda path: path.stat().st_mtime)
    assert on_disk and on_disk[-1] == checkpoint, f"{checkpoint} named, {[p.name for p in on_disk]} on disk"
    state = torch.load(checkpoint, weights_only=True)
    assert "ElCheCallback" in state["callbacks"] and state["global_step"] > 0
    print(f"\n[{run.fault['what']}] survivors exited {run.survivors_s:.1f} s after the fault: {run.error(survivors[0])}")
    return checkpoint


# --------------------------------------------------------------------------- 1. inside the boundary all-reduce


@pytest.mark.timeout(200)
def test_a_rank_killed_inside_the_boundary_all_reduce_is_named(tmp_path):
    """Rank 1 waits inside the third boundary all-reduce and is SIGKILLed there (rank 0 enters it only
    once rank 1's process is dead)."""
    run = run_fault(tmp_path, doomed=1, collective_fault={
        "rank": 1, "nth": 3, "op": "all_reduce", "origin": "elche:averaging", "when": "inside",
    })
    assert run.ranks[1].returncode == -9
    checkpoint = assert_survivors_name(run, [0], "ElChe: rank 1 stopped answering at boundary 2 ")
    assert checkpoint.name == "epoch=0-step=4.ckpt"


# --------------------------------------------------------------------------- 2. between the control and the parameter reduce


@pytest.mark.timeout(200)
def test_async_a_rank_killed_between_the_control_reduce_and_the_background_reduce(tmp_path):
    """policy="async": rank 1 has exchanged boundary 2's control region and dies before launching the
    background parameter reduce; rank 0 launched its own, trains on, and fails at boundary 3."""
    run = run_fault(tmp_path, doomed=1, elche={"policy": "async"}, collective_fault={
        "rank": 1, "nth": 2, "op": "all_reduce", "origin": "elche:overlap", "when": "before",
    })
    assert run.ranks[1].returncode == -9
    checkpoint = assert_survivors_name(
        run, [0], "ElChe: rank 1 stopped answering at boundary 3 ", "(rank 1: the last boundary it reached was 2)"
    )
    assert checkpoint.name == "epoch=0-step=4.ckpt"


@pytest.mark.timeout(200)
def test_hierarchical_a_rank_killed_between_the_control_reduce_and_the_node_reduce(tmp_path):
    """node_sync_every=2, one rank per node: rank 1 dies after boundary 2's global control reduce, before
    its node's parameter reduce; rank 0's node reduce (its own node) succeeds, boundary 3 fails."""
    run = run_fault(tmp_path, doomed=1, elche={"node_sync_every": 2, "ranks_per_node": 1}, collective_fault={
        "rank": 1, "nth": 2, "op": "all_reduce", "origin": "elche:hierarchy", "when": "before",
    })
    assert run.ranks[1].returncode == -9
    checkpoint = assert_survivors_name(
        run, [0], "ElChe: rank 1 stopped answering at boundary 3 ", "(rank 1: the last boundary it reached was 2)"
    )
    assert checkpoint.name == "epoch=0-step=4.ckpt"


# --------------------------------------------------------------------------- 3. during a checkpoint


@pytest.mark.timeout(200)
def test_a_rank_killed_as_the_ranks_write_their_parts_is_named(tmp_path):
    """Rank 1 writes its part of the second checkpoint and dies before the ranks tell each other how their
    writes went: rank 0 never writes that checkpoint (it comes after every part), and the first is named."""
    run = run_fault(tmp_path, doomed=1, collective_fault={
        "rank": 1, "nth": 2, "op": "all_gather_object", "origin": "elche:groups", "when": "before",
    })
    second = run.checkpoints / "epoch=0-step=8.ckpt"
    checkpoint = assert_survivors_name(
        run, [0], f"ElChe: rank 1 stopped answering while the ranks wrote their parts of the checkpoint {second}, "
        "after boundary 3 "
    )
    assert checkpoint.name == "epoch=0-step=4.ckpt"
    assert len(list(run.checkpoints.glob("*.ckpt"))) == 1  # the second was never written
    assert [p.name for p in (run.checkpoints / "epoch=0-step=8.ckpt.parts").iterdir()][0].startswith("rank1-")


@pytest.mark.timeout(200)
def test_a_rank_killed_while_rank_0_writes_a_checkpoint_leaves_that_checkpoint_named(tmp_path):
    """Rank 0's writes take 2 s; rank 1 dies waiting for the outcome of the second (each save broadcasts
    where it goes, then that outcome). The file rank 0 finished is complete, and it is the one named."""
    run = run_fault(tmp_path, doomed=1, checkpoint_io={"delay_s": 2.0}, collective_fault={
        "rank": 1, "nth": 4, "op": "broadcast_object_list", "origin": "elche:groups", "when": "before",
    })
    checkpoint = assert_survivors_name(run, [0], "ElChe: rank 1 stopped answering while rank 0 wrote the checkpoint ")
    assert f"wrote the checkpoint {checkpoint}, after boundary 3 " in run.error(0)
    assert checkpoint.name == "epoch=0-step=8.ckpt" and len(list(run.checkpoints.glob("*.ckpt"))) == 2


# --------------------------------------------------------------------------- 4. rank 0's write fails


@pytest.mark.timeout(300)
def test_a_failed_checkpoint_write_stops_every_rank_saying_so_and_the_last_checkpoint_resumes(tmp_path):
    """Rank 0's second write fails with ENOSPC. Every rank stops at once with the same error, naming the
    write and the checkpoint before it, which is intact: a resume from it trains exactly the rest of the epoch."""
    run = run_fault(tmp_path / "failed", doomed=None, checkpoint_io={"fail_at": 2})
    checkpoint = assert_survivors_name(
        run, [0, 1], "ElChe: rank 0 could not write the checkpoint ", "[Errno 28] No space left on device"
    )
    assert run.error(0) == run.error(1)
    assert "could not write the checkpoint " + str(run.checkpoints / "epoch=0-step=8.ckpt") in run.error(0)
    assert checkpoint.name == "epoch=0-step=4.ckpt"
    assert "stopped answering" not in run.ranks[1].stderr  # not mistaken for a lost rank
    state = torch.load(checkpoint, weights_only=True)["callbacks"]["ElCheCallback"]
    covered = set(ResumePoint.from_state(state).covered_samples(shuffle=True).tolist())
    resumed = run_scenario(
        tmp_path / "resumed", **{**BASE, "checkpoint_every_n_steps": 0, "elche": {**BASE["elche"], "timeout": 60}},
        ckpt_path=str(checkpoint),
    )
    trained = sorted(i for result in resumed for i in result["trained"]["0"])
    assert trained == sorted(set(range(SAMPLES)) - covered)
    report = coverage_report(resumed, SAMPLES, 0)
    assert report["duplicates"] == [] and report["trained"] + len(covered) == SAMPLES


# --------------------------------------------------------------------------- 5. a stalled rank, a failing rank


@pytest.mark.timeout(200)
def test_a_stalled_rank_is_named_once_the_timeout_expires(tmp_path):
    """Rank 1 is SIGSTOPped mid-window (after batch 4) and never continued: rank 0 waits out the
    process-group timeout at boundary 2, holds the roll call, names it and exits; the stalled rank is
    SIGKILLed at the end."""
    run = run_fault(tmp_path, doomed=1, kill_at={"rank": 1, "batch": 4, "signal": "SIGSTOP"})
    assert run.ranks[1].returncode == -9  # still stopped when the test killed it
    assert run.survivors_s >= TIMEOUT_S  # the survivor did wait for it: a stall is told from a death only by time
    checkpoint = assert_survivors_name(
        run, [0], "ElChe: rank 1 stopped answering at boundary 2 ", "(rank 1: the last boundary it reached was 1)"
    )
    assert checkpoint.name == "epoch=0-step=4.ckpt"


@pytest.mark.timeout(200)
def test_a_rank_of_three_killed_mid_window_is_named_by_both_survivors(tmp_path):
    """Rank 1 of 3 is SIGKILLed after batch 4, inside the window that boundary 2 closes: ranks 0 and 2
    do not hang; each names rank 1 and the same last consensus checkpoint."""
    run = run_fault(
        tmp_path, doomed=1, world=3, samples=3 * SAMPLES // 2, kill_at={"rank": 1, "batch": 4},
        elche={"partition_ratios": [1, 1, 1]},
    )
    assert run.ranks[1].returncode == -9
    checkpoint = assert_survivors_name(
        run, [0, 2], "ElChe: rank 1 stopped answering at boundary 2 ", "(rank 1: the last boundary it reached was 1)"
    )
    assert checkpoint.name == "epoch=0-step=4.ckpt"


@pytest.mark.timeout(200)
def test_dynamic_dispatch_losing_the_store_host_is_named(tmp_path):
    """Under dynamic dispatch every step claims from the rendezvous store, which rank 0 hosts here;
    rank 0 is SIGKILLed after batch 2 of the second epoch. Rank 1 finds the store gone, at its next
    claim or in a collective (whichever comes first: test_liveness.py covers the claim's message), and
    exits saying the store's host died and naming the last checkpoint.

    The kill follows a whole epoch (16 cohort steps, so a checkpoint at least at step 4): a kill at a
    batch of the first epoch raced the first checkpoint, as shares follow the measured speeds here. Under
    load rank 1 once measured 4x slower at the first boundaries, rank 0 was given 9 steps to its 2 in the
    third window and reached its batch 8 inside it, before any checkpoint ("No checkpoint was written yet")."""
    run = run_fault(
        tmp_path, doomed=0, samples=2 * SAMPLES, epochs=2, kill_at={"rank": 0, "epoch": 1, "batch": 2},
        elche={"partition_ratios": None},
    )
    assert run.ranks[0].returncode == -9
    checkpoint = assert_survivors_name(
        run, [1], "the rendezvous store did not answer either", "(rank 0 under Lightning's launcher"
    )
    assert re.fullmatch(r"epoch=[01]-step=\d+\.ckpt", checkpoint.name), checkpoint.name


@pytest.mark.timeout(200)
def test_a_rank_raising_in_training_step_is_named_with_its_error(tmp_path):
    """Rank 1's training_step raises a ValueError: it exits with it, and rank 0 names rank 1 and quotes it."""
    run = run_fault(tmp_path, doomed=1, doomed_exits_within_s=30, raise_at={"rank": 1, "batch": 4})
    assert run.ranks[1].returncode == 1
    assert "ValueError: scenario: rank 1 fails in training_step at batch 4" in run.ranks[1].stderr
    checkpoint = assert_survivors_name(
        run, [0], "ElChe: rank 1 stopped answering at boundary 2 ",
        "(rank 1: the last boundary it reached was 1; it raised ValueError: scenario: rank 1 fails in training_step "
        "at batch 4)",
    )
    assert checkpoint.name == "epoch=0-step=4.ckpt"


# --------------------------------------------------------------------------- the message's parts, without processes


def test_a_lost_ranks_own_error_is_read_back_from_the_store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ranks = [Liveness(store, rank, 3) for rank in range(3)]
    ranks[1].failed(ValueError("boom\n  a traceback line"))
    assert ranks[0].failures([1, 2]) == {1: "ValueError: boom"}  # rank 2 left nothing: it is only named


def test_a_rank_lost_outside_a_boundary_is_placed_after_the_last_one():
    during = "while the ranks wrote their parts of the checkpoint /x/b.ckpt"
    message = describe_failure(
        [1], {0: 3, 1: 3}, FailurePlace(4, 0, 4, 6, "/x/a.ckpt", during=during), 15, RuntimeError("closed"),
        reported={1: "ValueError: boom"},
    )
    assert message.startswith(
        f"ElChe: rank 1 stopped answering {during}, after boundary 3 (epoch 0, window 4, step 6) "
        "(rank 1: the last boundary it reached was 3; it raised ValueError: boom). Last consensus checkpoint: /x/a.ckpt"
    )
    early = describe_failure(
        [1], {}, FailurePlace(0, -1, 0, 0, None, during="in a barrier of Lightning's"), 15, RuntimeError("closed"))
    assert early.startswith("ElChe: rank 1 stopped answering in a barrier of Lightning's, before the first boundary")


def test_the_roll_call_does_not_wait_for_a_rank_that_left_its_error(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ranks = [Liveness(store, rank, 3) for rank in range(3)]
    ranks[1].failed(RuntimeError("out of memory"))
    ranks[2].silent(grace_s=0.0)  # rank 2 answers
    clock = FakeClock()  # the roll call's clock: time passes only in its polls' sleeps
    monkeypatch.setattr(liveness_module, "time", clock)
    assert ranks[0].silent(grace_s=5.0) == [1]
    assert clock.sleeps == []  # not a poll of the 5 s grace: rank 1 is known to have left
