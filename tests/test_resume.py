"""Coverage-exact checkpoints and resume, on real processes.

A run checkpoints at every boundary (``ModelCheckpoint(every_n_train_steps=1)``, which ElChe moves
to boundaries) and is killed right after its k-th checkpoint; a second run resumes from
``last.ckpt``, possibly with another number of ranks. What the first run had trained when the
checkpoint was written, plus everything the second run trains, must cover every sample of every
epoch exactly once.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_collectives_coherent, assert_consensus, coverage_report, run_scenario
from saved_checkpoints import saved_optimizer_states

from lightning_elche.cohort.resume import ResumePoint

SAMPLES = 300  # 37.5 batches of 8: every epoch ends on a partial batch
EPOCHS = 3
CRASH_EXIT_CODE = 17
RESUMABLE = {
    "epochs": EPOCHS,
    "samples": SAMPLES,
    "batch_size": 8,
    "slow": {"1": 2.0},
    "elche": {"anchor": 2, "max_anchor": 2},  # short windows: about six boundaries per epoch
    "checkpoint_every_n_steps": 1,
    "checkpoint_save_last": True,
}


def crash_and_resume(tmp_path: Path, devices: int, resumed_devices: int, crash_after: int, **config: Any):
    """Run ``devices`` ranks until the ``crash_after``-th checkpoint, kill them all, resume on ``resumed_devices``."""
    config = {**RESUMABLE, **config}
    crashed = run_scenario(
        tmp_path / "crashed", expect_failure=True, devices=devices, crash_after_checkpoints=crash_after, **config
    )
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-4000:]
    out = tmp_path / "crashed" / "out"
    snapshots = [json.loads((out / f"crash_rank{rank}.json").read_text()) for rank in range(devices)]
    resumed = run_scenario(
        tmp_path / "resumed", devices=resumed_devices, ckpt_path=str(out / "checkpoints" / "last.ckpt"), **config
    )
    return snapshots, resumed


def assert_every_sample_once(snapshots: list[dict], resumed: list[dict], epochs: int = EPOCHS) -> None:
    for epoch in range(epochs):
        report = coverage_report(snapshots + resumed, SAMPLES, epoch)
        assert report["duplicates"] == [], f"epoch {epoch}: trained twice: {report['duplicates'][:20]}"
        assert report["missing"] == [], f"epoch {epoch}: never trained: {report['missing'][:20]}"
        assert report["trained"] == SAMPLES


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("devices", "resumed_devices", "seed"),
    [(2, 2, 1), (2, 3, 2), (3, 2, 3), (2, 2, 4)],
)
def test_crash_at_a_random_boundary_then_resume_trains_every_sample_once(tmp_path, devices, resumed_devices, seed):
    crash_after = random.Random(seed).randint(2, 16)  # 18+ boundaries in all: any epoch, any window
    snapshots, resumed = crash_and_resume(tmp_path, devices, resumed_devices, crash_after)
    assert_every_sample_once(snapshots, resumed)
    assert_consensus(resumed, initial_step=snapshots[0]["global_step"])
    assert_collectives_coherent(resumed)
    # the resumed run continued the DDP-equivalent step count of the checkpoint
    first = resumed[0]["boundaries"][0]
    crashed_step = snapshots[0]["global_step"]
    assert first["cohort_step"] > crashed_step and resumed[0]["global_step"] > crashed_step, crash_after
    assert all(s["digest"] == snapshots[0]["digest"] for s in snapshots)  # the checkpoint was a consensus


@pytest.mark.timeout(300)
def test_dynamic_dispatch_resumes_what_no_rank_trained_on_more_ranks(tmp_path):
    """dispatch="dynamic": the checkpoint gathers every rank's claims; steps claimed (prefetched) but
    not trained at the boundary are not covered, and the resumed run on three ranks trains them."""
    snapshots, resumed = crash_and_resume(
        tmp_path, 2, 3, crash_after=9, elche={**RESUMABLE["elche"], "dispatch": "dynamic"}
    )
    assert_every_sample_once(snapshots, resumed)
    assert_consensus(resumed, initial_step=snapshots[0]["global_step"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("outer", "compression"),
    [(None, None), ({"lr": 0.7, "momentum": 0.9}, None), (None, "int8")],
    ids=["average", "outer_nesterov", "int8_error_feedback"],
)
def test_sync_policy_resume_continues_the_same_trajectory(tmp_path, outer, compression):
    """policy="sync", Adam (per-rank moments), with or without the outer optimizer (its momentum is
    checkpointed) or int8 boundaries (every rank's error feedback is checkpointed): interrupted +
    resumed ends where the uninterrupted run does."""
    config = {
        "slow": {}, "elche": {"policy": "sync", "compression": compression}, "optimizer": "adam", "lr": 0.01,
        "epochs": 2, "validate": False, "outer": outer,
    }
    uninterrupted = run_scenario(tmp_path / "whole", **{**RESUMABLE, **config})
    snapshots, resumed = crash_and_resume(tmp_path, 2, 2, crash_after=23, **config)
    assert_every_sample_once(snapshots, resumed, epochs=2)
    assert resumed[0]["global_step"] == uninterrupted[0]["global_step"]
    for got, expected in zip(resumed[0]["final"], uninterrupted[0]["final"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.timeout(300)
def test_sigterm_on_rank_1_checkpoints_at_the_boundary_and_resumes_exactly(tmp_path):
    """SIGTERM on one rank: all ranks stop at the next boundary, a checkpoint is written there
    (``hpc_ckpt_1.ckpt`` in ``default_root_dir``), and resuming from it trains every sample once.

    Fixed shares (rank 1 a third, ~12 batches per epoch) keep the notice at batch 4 mid-epoch
    whatever speeds a loaded machine measures.
    """
    elche = {**RESUMABLE["elche"], "partition_ratios": [2, 1]}
    config = {**RESUMABLE, "elche": elche, "checkpoint_every_n_steps": None, "checkpoint_save_last": False}
    stopped = run_scenario(tmp_path / "stopped", sigterm_at={"rank": 1, "epoch": 1, "batch": 4}, **config)
    notice = stopped[1]["sigterm_sent"]
    for result in stopped:
        assert result["exception"] == "SIGTERMException"
        assert len(result["boundaries"]) == notice["boundaries_before"] + 1  # the next boundary, on every rank
    checkpoint = tmp_path / "stopped" / "hpc_ckpt_1.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in (tmp_path / "stopped").iterdir())
    state = torch.load(checkpoint, weights_only=True)["callbacks"]["ElCheCallback"]  # weights_only-safe
    assert state["epoch"] == 1 and state["world_size"] == 2
    assert len(saved_optimizer_states(checkpoint)) == 2  # each rank's own: rank 0's in the file, rank 1's in its part
    assert torch.load(checkpoint, weights_only=True)["global_step"] == stopped[0]["global_step"]
    resumed = run_scenario(tmp_path / "resumed", ckpt_path=str(checkpoint), **config)
    assert_every_sample_once(stopped, resumed)
    assert_consensus(resumed, initial_step=stopped[0]["global_step"])


@pytest.fixture(scope="module")
def one_epoch_checkpoint(tmp_path_factory) -> Path:
    """``last.ckpt`` of a one-epoch run killed after its third checkpoint."""
    tmp_path = tmp_path_factory.mktemp("one_epoch")
    crashed = run_scenario(
        tmp_path, expect_failure=True, crash_after_checkpoints=3, **{**RESUMABLE, "epochs": 1}
    )
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-4000:]
    return tmp_path / "out" / "checkpoints" / "last.ckpt"


@pytest.mark.timeout(200)
def test_a_truncated_checkpoint_is_a_clear_error_on_every_rank(tmp_path, one_epoch_checkpoint):
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(one_epoch_checkpoint.read_bytes()[: one_epoch_checkpoint.stat().st_size // 2])
    started = time.monotonic()
    proc = run_scenario(tmp_path, expect_failure=True, ckpt_path=str(broken), **{**RESUMABLE, "epochs": 1})
    assert proc.returncode != 0
    assert proc.stderr.count("ElChe cannot read the checkpoint") >= 2, proc.stderr[-3000:]
    assert "resume from an earlier checkpoint" in proc.stderr
    assert time.monotonic() - started < 60


@pytest.mark.timeout(200)
def test_a_checkpoint_of_another_training_set_is_refused(tmp_path, one_epoch_checkpoint):
    proc = run_scenario(
        tmp_path, expect_failure=True, ckpt_path=str(one_epoch_checkpoint), **{**RESUMABLE, "epochs": 1, "samples": 280}
    )
    assert proc.returncode != 0
    assert proc.stderr.count(f"training on {SAMPLES} samples, but this train DataLoader has 280") >= 2, proc.stderr[-3000:]


@pytest.mark.timeout(200)
def test_another_seed_resumes_the_samples_left_in_the_new_order(tmp_path, one_epoch_checkpoint):
    """Coverage is kept by sample index, so a changed seed still trains each remaining sample once (with a warning)."""
    resumed = run_scenario(
        tmp_path, ckpt_path=str(one_epoch_checkpoint), **{**RESUMABLE, "epochs": 1, "elche": {**RESUMABLE["elche"], "seed": 1234}}
    )
    assert any("sampler seed" in w for w in resumed[0]["warnings"]), resumed[0]["warnings"]
    state = torch.load(one_epoch_checkpoint, weights_only=True)["callbacks"]["ElCheCallback"]
    covered = set(ResumePoint.from_state(state).covered_samples(shuffle=True).tolist())  # in seed 0's order
    trained = sorted(i for result in resumed for i in result["trained"]["0"])
    assert trained == sorted(set(range(SAMPLES)) - covered)


@pytest.mark.timeout(200)
def test_a_ddp_checkpoint_resumes_with_weights_and_step_and_says_so(tmp_path):
    """A mid-epoch checkpoint written by strategy="ddp": weights, optimizer and global_step carry over;
    the interrupted epoch restarts from its first sample (as under DDP), with a warning that says so."""
    ddp_config = {**RESUMABLE, "strategy": "ddp", "slow": {}, "epochs": 1, "checkpoint_every_n_steps": 5}
    run_scenario(tmp_path / "ddp", **ddp_config)
    checkpoint = tmp_path / "ddp" / "out" / "checkpoints" / "last.ckpt"
    saved_step = torch.load(checkpoint, weights_only=True)["global_step"]
    resumed = run_scenario(tmp_path / "elche", ckpt_path=str(checkpoint), **{**RESUMABLE, "epochs": 2})
    assert_consensus(resumed, initial_step=saved_step)
    assert any("has no ElChe state" in w for w in resumed[0]["warnings"]), resumed[0]["warnings"]
    assert resumed[0]["boundaries"][0]["cohort_step"] > saved_step
