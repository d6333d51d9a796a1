"""Failures of one rank or of all: non-finite parameters, checkpoints asked for inside a window."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    assert_consensus, coverage_report, flatten, load_results, run_command, run_scenario,
)


@pytest.mark.timeout(200)
def test_a_non_finite_rank_is_left_out_and_reset_to_the_consensus(tmp_path):
    results = run_scenario(tmp_path, epochs=1, samples=256, slow={"1": 2.0}, nan_at=[{"rank": 1, "batch": 5}])
    assert_consensus(results)
    warnings = [w for result in results for w in result["warnings"]]
    assert len(warnings) == 1 and "rank(s) [1] had non-finite parameters at step" in warnings[0], warnings
    for result in results:
        assert all(math.isfinite(x) for tensor in result["final"] for x in flatten(tensor))


@pytest.mark.timeout(200)
def test_every_rank_non_finite_stops_with_the_last_consensus_kept(tmp_path):
    """Both ranks go NaN in the same window: a clear error on both, parameters back to the last consensus."""
    proc = run_scenario(
        tmp_path, expect_failure=True, epochs=1, samples=256, nan_at=[{"rank": 0, "batch": 2}, {"rank": 1, "batch": 2}]
    )
    assert proc.returncode != 0
    assert proc.stderr.count("every rank has non-finite parameters at step 2") >= 2, proc.stderr[-3000:]
    results = load_results(tmp_path, world=2, stderr=proc.stderr)
    for result in results:
        assert result["exception"] == "FloatingPointError"
        assert result["final_digest"] == result["digests"][-1]  # the consensus of the boundary before
        assert all(math.isfinite(x) for tensor in result["final"] for x in flatten(tensor))


@pytest.mark.timeout(200)
def test_a_checkpoint_inside_a_window_is_refused_on_every_rank(tmp_path):
    """Each rank refuses on its own, and no file is written. Planned dispatch: under dynamic dispatch
    a rank that refuses first ends the process hosting the claim counter (rank 0), and the other rank
    then fails claiming its next step before it reaches the save (seen under the loaded CI suite)."""
    proc = run_scenario(
        tmp_path, expect_failure=True, epochs=1, samples=256, save_in_step=3,
        elche={"strict_collectives": False, "dispatch": "planned"},
    )
    assert proc.returncode != 0
    assert proc.stderr.count("ElChe checkpoints are taken at window boundaries") >= 2, proc.stderr[-3000:]
    assert "every_n_train_steps" in proc.stderr
    assert not (tmp_path / "out" / "inside_window.ckpt").exists()


@pytest.mark.timeout(300)
def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint_with_exact_coverage(tmp_path):
    """torchrun --max-restarts=1: rank 1 is SIGKILLed in the first attempt; the relaunched job resumes
    from last.ckpt and, with what the first attempt had checkpointed, trains every sample once per epoch."""
    app = Path(__file__).resolve().parent / "torchrun_app.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=1", "--monitor-interval=0.5", str(app), str(tmp_path), "--kill"]
    proc = run_command(torchrun, tmp_path, 240, what="torchrun")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "exitcode  : -9" in proc.stderr or "exitcode: -9" in proc.stderr  # the first attempt did lose rank 1
    checkpointed = [json.loads((tmp_path / f"at_checkpoint_a0_r{rank}.json").read_text()) for rank in range(2)]
    resumed = [json.loads((tmp_path / f"final_a1_r{rank}.json").read_text()) for rank in range(2)]
    assert checkpointed[0]["global_step"] > 0
    for epoch in range(2):
        report = coverage_report(checkpointed + resumed, 320, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)


@pytest.mark.timeout(200)
def test_under_lightnings_launcher_a_killed_rank_ends_the_whole_job_quickly(tmp_path):
    """With Lightning's own launcher, its process observer (rank 0) terminates every rank when a
    child dies; ElChe adds no wait of its own: the job ends well within the timeout + 30 s of the kill."""
    timeout_s = 20
    proc = run_scenario(
        tmp_path, expect_failure=True, epochs=2, samples=512, slow={"1": 2.0},
        # an early batch: on a loaded machine the slow rank's share of epoch 0 fell below ten batches once
        kill_at={"rank": 1, "epoch": 0, "batch": 3}, elche={"timeout": timeout_s},
    )
    assert (tmp_path / "out" / "fault.json").exists(), f"rank 1 never reached its kill point:\n{proc.stderr[-3000:]}"
    assert proc.returncode != 0
    killed_at = json.loads((tmp_path / "out" / "fault.json").read_text())["time"]
    assert time.time() - killed_at < timeout_s + 30
    # Lightning's observer names the lost rank (its "[rank: i+1]" prefix is the dead child's rank)
    assert "[rank: 1] Child process with PID" in proc.stderr and "terminated with code -9" in proc.stderr, (
        proc.stderr[-3000:]
    )
