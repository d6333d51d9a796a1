"""Preemption wherever the signal lands, and resume of every kind of run, on real processes.

The rule under test (docs/resume.md): a SIGTERM is recorded where it lands and carried in the next
boundary's all-reduce, so every rank stops at that boundary with a preemption checkpoint
(``hpc_ckpt_N.ckpt``) and resuming from it trains each remaining sample exactly once. A signal
during the sanity check or a validation therefore stops the cohort at the next boundary of
training; one in the fit's final window at its last boundary; one that comes after the last
boundary finds training complete, and the fit finishes with a warning.

Runs are chained where a real job would chain them (preempted, requeued, preempted again), so
each scenario serves several assertions: chain A is one job preempted in its sanity check, in a
validation and in its final window; chain B is preempted on every rank at once (SLURM's usual
case, ranks started as srun starts them) on 2 ranks, resumed on 3 with Adam, preempted again by
two SIGTERMs on rank 0, and resumed on 2. The async and hierarchical (+ outer optimizer) runs are
killed after a checkpoint and resumed; with fixed shares and a fixed anchor the windows do not
depend on measured speeds, so the resumed run must end exactly where an uninterrupted one does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import saved_checkpoints
import torch
from conftest import assert_consensus, coverage_report, load_results, run_scenario, run_srun_style

from lightning_elche.cohort.resume import ResumePoint

SAMPLES = 96  # 12 batches of 8 per epoch
CRASH_EXIT_CODE = 17
# Fixed shares 2:1 and anchor 1: windows of [2, 1] steps (3 batches, 24 samples), four per epoch,
# the same on every run whatever speeds a loaded machine measures.
TWO_RANKS = {"anchor": 1, "max_anchor": 1, "partition_ratios": [2, 1]}
BASE = {"epochs": 2, "samples": SAMPLES, "batch_size": 8, "elche": TWO_RANKS}
ADAM = {"optimizer": "adam", "lr": 0.01, "record_optimizer_state": True}
STOP_MESSAGE = "ElChe: SIGTERM: every rank stops at step"


def elche_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint, weights_only=True)["callbacks"]["ElCheCallback"]


def covered_in(checkpoint: Path) -> int:
    return len(ResumePoint.from_state(elche_state(checkpoint)).covered_samples(shuffle=True))


def trained_in(results: list[dict[str, Any]], epoch: int) -> int:
    return sum(len(result["trained"].get(str(epoch), [])) for result in results)


def assert_every_sample_once(runs: list[list[dict[str, Any]]], epochs: int) -> None:
    results = [result for run in runs for result in run]
    for epoch in range(epochs):
        report = coverage_report(results, SAMPLES, epoch)
        assert report["duplicates"] == [], f"epoch {epoch}: trained twice: {report['duplicates'][:20]}"
        assert report["missing"] == [], f"epoch {epoch}: never trained: {report['missing'][:20]}"
        assert report["trained"] == SAMPLES, report


def assert_stopped_together(results: list[dict[str, Any]], at_boundary: int, initial_step: int = 0) -> None:
    """Every rank raised Lightning's SIGTERMException after the same boundary, ``at_boundary`` of this
    run (which resumed at ``initial_step``), holding the same consensus."""
    for result in results:
        assert result["exception"] == "SIGTERMException", (result["rank"], result["exception_message"])
        assert len(result["boundaries"]) == at_boundary, (result["rank"], len(result["boundaries"]), at_boundary)
    assert_consensus(results, initial_step=initial_step)


def saved_optimizer_states(checkpoint: Path) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Each saved rank's (only) optimizer's per-parameter state (rank 0's in the checkpoint, the others' in their parts)."""
    return [per_rank[0]["state"] for per_rank in saved_checkpoints.saved_optimizer_states(checkpoint)]


def assert_optimizer_state_equal(recorded: dict[str, dict[str, Any]], saved: dict[Any, dict[str, Any]]) -> None:
    assert sorted(recorded) == sorted(str(key) for key in saved)
    for key, values in saved.items():
        for name, value in values.items():
            expected = torch.as_tensor(value)
            got = torch.tensor(recorded[str(key)][name], dtype=expected.dtype)
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"parameter {key}, {name}")


def assert_same_final_state(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Parameters, each rank's Adam moments and the outer momentum as an uninterrupted run ends them."""
    assert [r["global_step"] for r in got] == [r["global_step"] for r in expected]
    for mine, theirs in zip(got, expected):
        for a, b in zip(mine["final"], theirs["final"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)
        for key, state in theirs["final_optimizer_state"].items():
            for name, value in state.items():
                torch.testing.assert_close(
                    torch.tensor(mine["final_optimizer_state"][key][name]), torch.tensor(value), rtol=0, atol=1e-6
                )
        assert (mine["final_outer_velocity"] is None) == (theirs["final_outer_velocity"] is None)
        if theirs["final_outer_velocity"] is not None:
            velocities = torch.tensor(mine["final_outer_velocity"]), torch.tensor(theirs["final_outer_velocity"])
            torch.testing.assert_close(*velocities, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- chain A: one job, three preemptions


@pytest.fixture(scope="module")
def preempted_thrice(tmp_path_factory) -> dict[str, Any]:
    """SIGTERM on rank 1 in the sanity check; resumed, SIGTERM on rank 1 in epoch 0's validation;
    resumed, SIGTERM on rank 0 (forwarded to rank 1 by Lightning's launcher) in the final window;
    resumed once more with nothing left to train."""
    root = tmp_path_factory.mktemp("preempted_thrice")
    runs: dict[str, Any] = {}
    runs["sanity"] = run_scenario(
        root / "sanity", sanity=2, signals=[{"rank": 1, "phase": "sanity", "batch": 0}], **BASE
    )
    runs["validation"] = run_scenario(
        root / "validation", ckpt_path=str(root / "sanity" / "hpc_ckpt_1.ckpt"),
        signals=[{"rank": 1, "phase": "validation", "epoch": 0, "batch": 0}], **BASE,
    )  # fmt: skip
    runs["final_window"] = run_scenario(
        root / "final_window", ckpt_path=str(root / "validation" / "hpc_ckpt_1.ckpt"),
        signals=[{"rank": 0, "phase": "final_window"}], **BASE,
    )  # fmt: skip
    runs["requeued"] = run_scenario(root / "requeued", ckpt_path=str(root / "final_window" / "hpc_ckpt_1.ckpt"), **BASE)
    runs["root"] = root
    return runs


@pytest.mark.timeout(700)
def test_sigterm_in_the_sanity_check_stops_every_rank_at_the_first_boundary(preempted_thrice):
    """Nothing is trained yet and Lightning's sanity check has no boundary: the signal is held, the
    cohort trains its first window and stops there, with a checkpoint of that window."""
    stopped = preempted_thrice["sanity"]
    assert stopped[1]["signals_sent"][0]["phase"] == "sanity"
    assert_stopped_together(stopped, at_boundary=1)
    assert STOP_MESSAGE in stopped[0]["output_tail"]
    checkpoint = preempted_thrice["root"] / "sanity" / "hpc_ckpt_1.ckpt"
    assert covered_in(checkpoint) == trained_in(stopped, 0) == 24  # exactly the first window


@pytest.mark.timeout(700)
def test_sigterm_during_validation_stops_every_rank_at_the_next_boundary_of_training(preempted_thrice):
    """A signal on rank 1 during epoch 0's validation: validation completes on every rank (its
    collectives pair up), and the cohort stops at the first boundary of epoch 1."""
    stopped = preempted_thrice["validation"]
    notice = stopped[1]["signals_sent"][0]
    assert notice["phase"] == "validation" and notice["boundaries_before"] == 3  # epoch 0's remaining windows
    assert_stopped_together(stopped, at_boundary=4, initial_step=preempted_thrice["sanity"][0]["global_step"])
    assert [b["epoch"] for b in stopped[0]["boundaries"]] == [0, 0, 0, 1]
    assert "val_loss" in stopped[0]["callback_metrics"]  # epoch 0's validation ran to its end
    state = elche_state(preempted_thrice["root"] / "validation" / "hpc_ckpt_1.ckpt")
    assert state["epoch"] == 1 and state["world_size"] == 2


@pytest.mark.timeout(700)
def test_sigterm_in_the_final_window_stops_at_the_last_boundary_and_the_requeue_ends_at_once(preempted_thrice):
    """The last boundary carries the signal: every rank stops there (Lightning cuts the final
    validation, as under DDP) with a checkpoint that covers the whole fit; the requeued fit finds
    nothing left to train and ends normally at the same global_step."""
    stopped, requeued = preempted_thrice["final_window"], preempted_thrice["requeued"]
    notice = stopped[0]["signals_sent"][0]
    assert notice["phase"] == "final_window" and notice["epoch"] == 1
    initial_step = preempted_thrice["validation"][0]["global_step"]
    assert_stopped_together(stopped, at_boundary=notice["boundaries_before"] + 1, initial_step=initial_step)
    assert stopped[0]["boundaries"][-1]["epoch"] == 1  # the fit's last boundary: the checkpoint covers it all
    checkpoint = preempted_thrice["root"] / "final_window" / "hpc_ckpt_1.ckpt"
    assert covered_in(checkpoint) == SAMPLES and elche_state(checkpoint)["epoch"] == 1
    for result in requeued:
        assert result["exception"] is None and result["boundaries"] == [] and result["trained"] == {}
        assert result["global_step"] == stopped[0]["global_step"]


@pytest.mark.timeout(700)
def test_three_preemptions_and_requeues_train_every_sample_once(preempted_thrice):
    runs = [preempted_thrice[name] for name in ("sanity", "validation", "final_window", "requeued")]
    assert_every_sample_once(runs, epochs=2)
    steps = [run[0]["global_step"] for run in runs]
    assert steps[0] < steps[1] < steps[2] == steps[3] == 2 * SAMPLES // 8 // 2  # DDP's 12 steps in all
    for before, after in zip(runs, runs[1:3]):  # each resumed run continues the step count
        assert after[0]["boundaries"][0]["cohort_step"] > before[0]["global_step"]


# --------------------------------------------------------------------------- chain B: world-size changes with Adam


@pytest.fixture(scope="module")
def adam_across_world_sizes(tmp_path_factory) -> dict[str, Any]:
    """2 ranks started srun-style, SIGTERM to every rank at once -> resumed on 3 ranks, two
    SIGTERMs on rank 0 in one window -> resumed on 2 ranks to the end, where rank 1 gets SIGTERM
    during the final validation. Adam, per-rank moments."""
    root = tmp_path_factory.mktemp("adam_world_sizes")
    runs: dict[str, Any] = {"root": root}
    config = {**BASE, **ADAM, "signals": [{"rank": 0, "epoch": 0, "batch": 2, "to": "all"}]}
    ranks = run_srun_style(root / "srun", 2, config, {"SLURM_JOB_ID": "4243"})
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-4000:]  # SIGTERMException is a SystemExit without a code
    runs["srun"] = load_results(root / "srun", world=2)
    runs["srun_stderr"] = ranks[0].stderr
    three = {"anchor": 1, "max_anchor": 1, "partition_ratios": [3, 1, 1]}  # rank 0: 3 batches a window
    runs["three"] = run_scenario(
        root / "three", devices=3, ckpt_path=str(root / "srun" / "hpc_ckpt_1.ckpt"),
        **{**BASE, **ADAM, "elche": three},
        signals=[{"rank": 0, "epoch": 1, "batch": 0}, {"rank": 0, "epoch": 1, "batch": 1}],
    )  # fmt: skip
    runs["two"] = run_scenario(
        root / "two", ckpt_path=str(root / "three" / "hpc_ckpt_1.ckpt"),
        signals=[{"rank": 1, "phase": "validation", "epoch": 1, "batch": 0}], **BASE, **ADAM,
    )  # fmt: skip
    return runs


@pytest.mark.timeout(700)
def test_sigterm_on_every_rank_at_once_stops_them_at_one_boundary(adam_across_world_sizes):
    """SLURM's usual preemption: each rank started by srun gets its own SIGTERM at the same moment
    (no launcher forwards anything). One boundary, one checkpoint, exit status 0 on every rank."""
    stopped, root = adam_across_world_sizes["srun"], adam_across_world_sizes["root"]
    notice = stopped[0]["signals_sent"][0]
    assert_stopped_together(stopped, at_boundary=notice["boundaries_before"] + 1)
    assert STOP_MESSAGE in adam_across_world_sizes["srun_stderr"]
    assert sorted(p.name for p in (root / "srun").glob("hpc_ckpt_*.ckpt")) == ["hpc_ckpt_1.ckpt"]
    assert covered_in(root / "srun" / "hpc_ckpt_1.ckpt") == trained_in(stopped, 0)


@pytest.mark.timeout(700)
def test_two_sigterms_in_one_window_stop_the_cohort_once(adam_across_world_sizes):
    """Rank 0 gets SIGTERM after two consecutive batches of the same window (Lightning's launcher
    forwards both to ranks 1 and 2): one stop at that window's boundary, one checkpoint."""
    stopped, root = adam_across_world_sizes["three"], adam_across_world_sizes["root"]
    first, second = stopped[0]["signals_sent"]
    assert (first["batch"], second["batch"]) == (0, 1)
    assert first["boundaries_before"] == second["boundaries_before"]  # the second came before the boundary
    initial_step = adam_across_world_sizes["srun"][0]["global_step"]
    assert_stopped_together(stopped, at_boundary=first["boundaries_before"] + 1, initial_step=initial_step)
    assert sorted(p.name for p in (root / "three").glob("hpc_ckpt_*.ckpt")) == ["hpc_ckpt_1.ckpt"]


@pytest.mark.timeout(700)
def test_adam_resume_2_to_3_to_2_ranks_carries_each_ranks_state_and_trains_every_sample_once(adam_across_world_sizes):
    """Rank r of the resumed run starts from saved rank r mod W's Adam state; coverage is exact
    over the three runs and global_step continues through both world-size changes."""
    root = adam_across_world_sizes["root"]
    runs = [adam_across_world_sizes[name] for name in ("srun", "three", "two")]
    assert_every_sample_once(runs, epochs=2)
    checkpoints = [root / name / "hpc_ckpt_1.ckpt" for name in ("srun", "three")]
    for checkpoint, resumed in zip(checkpoints, runs[1:]):
        saved = saved_optimizer_states(checkpoint)
        assert not torch.equal(saved[0][0]["exp_avg"], saved[1][0]["exp_avg"])  # the ranks' moments differ
        for result in resumed:
            assert_optimizer_state_equal(result["optimizer_state_at_start"], saved[result["rank"] % len(saved)])
    # global_step continues: each run adds its own DDP-equivalent steps (its optimizer steps over
    # its world size; a DDP step on 3 ranks takes 3 batches), from the checkpoint's step
    for before, after in zip(runs, runs[1:]):
        assert_consensus(after, initial_step=before[0]["global_step"])
        assert after[0]["boundaries"][0]["cohort_step"] > before[0]["global_step"]


@pytest.mark.timeout(700)
def test_sigterm_after_the_last_boundary_lets_the_fit_finish_and_says_so(adam_across_world_sizes):
    """A signal on rank 1 during the final validation: no boundary is left to tell the other ranks,
    and training is complete, so the fit finishes (validation, exit status 0) and the rank warns."""
    results, root = adam_across_world_sizes["two"], adam_across_world_sizes["root"]
    assert results[1]["signals_sent"][0]["boundaries_before"] == len(results[1]["boundaries"])  # after the last
    for result in results:
        assert result["exception"] is None, result["exception_message"]
        assert "val_loss" in result["callback_metrics"]  # the final validation ran to its end
    warned = results[1]["warnings"]
    assert any("received SIGTERM after the fit's last boundary" in w for w in warned), warned
    assert not list((root / "two").glob("hpc_ckpt_*.ckpt"))


# --------------------------------------------------------------------------- async, hierarchical + outer


def crash_resume_and_whole(root: Path, crash_after: int, **config: Any) -> dict[str, Any]:
    """An uninterrupted run; the same run killed after its ``crash_after``-th checkpoint save; the resume."""
    whole = run_scenario(root / "whole", **config)
    crashed = run_scenario(root / "crashed", expect_failure=True, crash_after_checkpoints=crash_after, **config)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-4000:]
    out = root / "crashed" / "out"
    snapshots = [json.loads((out / f"crash_rank{rank}.json").read_text()) for rank in range(config["devices"])]
    checkpoint = out / "checkpoints" / "last.ckpt"
    resumed = run_scenario(root / "resumed", ckpt_path=str(checkpoint), **config)
    return {"whole": whole, "snapshots": snapshots, "resumed": resumed, "checkpoint": checkpoint}


RESUMABLE = {**BASE, **ADAM, "validate": False, "checkpoint_every_n_steps": 3, "checkpoint_save_last": True}


@pytest.mark.timeout(600)
def test_async_resume_continues_the_same_trajectory(tmp_path):
    """policy="async" with Adam, killed after the checkpoint at step 3 (each checkpoint is a
    consensus; in between the average is applied one window late): the resumed run ends with the
    uninterrupted run's parameters and each rank's Adam moments."""
    config = {**RESUMABLE, "devices": 2, "elche": {**TWO_RANKS, "policy": "async"}}
    runs = crash_resume_and_whole(tmp_path, crash_after=2, **config)  # step file + last.ckpt: two saves
    resumed = runs["resumed"]
    assert_every_sample_once([runs["snapshots"], resumed], epochs=2)
    saved = saved_optimizer_states(runs["checkpoint"])
    for result in resumed:
        assert_optimizer_state_equal(result["optimizer_state_at_start"], saved[result["rank"]])
        overlapped = [c for c in result["calls"] if c["origin"] == "elche:overlap" and c["phase"] == "train"]
        assert overlapped, "no boundary of the resumed run was overlapped"
    assert_same_final_state(resumed, runs["whole"])


@pytest.mark.timeout(900)
def test_hierarchical_resume_with_an_outer_optimizer_continues_the_same_trajectory(tmp_path):
    """4 ranks in 2 nodes, node_sync_every=2, DiLoCo's outer Nesterov step at the global averages,
    Adam: the outer momentum and every rank's moments are carried, node-level boundaries follow
    the resume, and the run ends where the uninterrupted one does."""
    config = {
        **RESUMABLE, "devices": 4, "samples": 2 * SAMPLES, "outer": {"lr": 0.7, "momentum": 0.9},
        "elche": {"anchor": 1, "max_anchor": 1, "partition_ratios": [2, 1, 2, 1], "node_sync_every": 2,
                  "ranks_per_node": 2, "timeout": 120},
    }  # fmt: skip
    runs = crash_resume_and_whole(tmp_path, crash_after=2, **config)
    resumed, snapshots = runs["resumed"], runs["snapshots"]
    for epoch in range(2):
        report = coverage_report(snapshots + resumed, 2 * SAMPLES, epoch)
        assert report["duplicates"] == [] and report["missing"] == [] and report["trained"] == 2 * SAMPLES, report
    state = elche_state(runs["checkpoint"])
    velocity = state["outer"]["velocity"]
    assert velocity.abs().sum() > 0
    saved = saved_optimizer_states(runs["checkpoint"])
    for result in resumed:
        torch.testing.assert_close(torch.tensor(result["outer_velocity_at_start"]), velocity, rtol=0, atol=0)
        assert_optimizer_state_equal(result["optimizer_state_at_start"], saved[result["rank"]])
        assert "node" in [b["level"] for b in result["boundaries"]]
    assert_same_final_state(resumed, runs["whole"])
