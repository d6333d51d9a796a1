"""Settings that keep their DDP meaning under ElChe: step-interval LR schedules, fast_dev_run,
and per-batch collectives turned into a clear error instead of a deadlock."""

from __future__ import annotations

import time

import pytest
from conftest import assert_collectives_coherent, assert_consensus, local_steps, run_scenario


@pytest.mark.timeout(200)
def test_step_lr_schedule_follows_the_cohort_step_like_ddp(tmp_path):
    """StepLR(interval="step") ends with the LR DDP would have at the same global_step, on every rank.

    Without ElChe's take-over each rank steps the scheduler per local batch and the LRs diverge
    (the fast rank runs ~3x the steps here).
    """
    step_lr = {"step_size": 5, "gamma": 0.9}
    lr = 0.1
    results = run_scenario(
        tmp_path, epochs=2, samples=512, slow={"1": 3.0}, slow_clock="wall", lr=lr, step_lr=step_lr, elche={"anchor": 4}
    )
    assert_consensus(results)
    assert_collectives_coherent(results)
    r0, r1 = results
    assert local_steps(r0) > local_steps(r1)  # uneven ranks (k = 3 in wall time against a ratio of 1), yet ...
    global_step = r0["global_step"]
    expected = lr * step_lr["gamma"] ** (global_step // step_lr["step_size"])
    assert r0["final_lr"] == pytest.approx(expected) == pytest.approx(r1["final_lr"])
    # Between boundaries each rank follows its place in the window, in order, on DDP's staircase;
    # the cohort trains with every level of it (windows here span ~8 DDP steps, more than a stair,
    # so one LR per window would skip levels). Under dynamic dispatch a rank's place is an
    # estimate from its expected share, caught up at each boundary: a slow rank may train no batch
    # at a level the other ranks trained, as under DDP a level is trained by every rank.
    levels = [lr * step_lr["gamma"] ** k for k in range(global_step // step_lr["step_size"] + 1)]
    for result in results:
        assert result["step_lrs"] == sorted(result["step_lrs"], reverse=True), "the LR went back up"
        off = [v for v in result["step_lrs"] if not any(v == pytest.approx(level) for level in levels)]
        assert off == [], (off, levels)
    trained = sorted({round(v, 12) for result in results for v in result["step_lrs"]}, reverse=True)
    assert trained == pytest.approx(levels[: len(trained)]) and len(trained) >= len(levels) - 1, (trained, levels)


@pytest.mark.timeout(200)
def test_one_cycle_lr_over_estimated_stepping_batches_runs_its_ddp_course(tmp_path):
    """OneCycleLR(total_steps=trainer.estimated_stepping_batches), Lightning's usual set-up.

    The estimate is DDP's step count on every rank (ElChe's loader has no length, so Lightning
    alone would give -1), and the schedule, stepped with the cohort step, ends where DDP's does.
    """
    samples, batch_size, epochs = 512, 8, 2
    results = run_scenario(tmp_path, epochs=epochs, samples=samples, slow={"1": 3.0}, one_cycle=True, elche={"anchor": 4})
    assert_consensus(results)
    assert_collectives_coherent(results)
    ddp_steps = samples // 2 // batch_size * epochs
    for result in results:
        assert result["estimated_stepping_batches"] == ddp_steps
        assert result["global_step"] == ddp_steps
    trained = [sorted(i for r in results for i in r["trained"][str(epoch)]) for epoch in range(epochs)]
    assert trained == [list(range(samples))] * epochs
    assert results[0]["final_lr"] == pytest.approx(results[1]["final_lr"]) and results[0]["final_lr"] < 1e-3


@pytest.mark.timeout(200)
def test_fast_dev_run_stops_the_cohort_after_n_steps(tmp_path):
    """fast_dev_run=N runs exactly N DDP-equivalent steps on all ranks, then stops."""
    results = run_scenario(tmp_path, epochs=3, samples=512, trainer={"fast_dev_run": 2})
    assert_collectives_coherent(results)
    r0, r1 = results
    assert r0["global_step"] == r1["global_step"]
    assert r0["global_step"] == 2
    assert r0["final_digest"] == r1["final_digest"]


@pytest.mark.timeout(120)
def test_per_step_sync_dist_log_is_an_error_not_a_deadlock(tmp_path):
    """self.log(on_step=True, sync_dist=True) in training_step: every rank raises at its first batch."""
    started = time.monotonic()
    proc = run_scenario(tmp_path, expect_failure=True, timeout=90, epochs=1, samples=256, log_step_sync=True)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert proc.stderr.count("inside a training batch") >= 2, proc.stderr[-3000:]  # both ranks
    assert "strict_collectives=False" in proc.stderr
    assert elapsed < 45, f"took {elapsed:.0f} s: the process-group timeout fired instead of the check"


@pytest.mark.timeout(200)
def test_should_stop_on_one_rank_stops_all_at_the_next_boundary(tmp_path):
    """`trainer.should_stop = True` in training_step on rank 1 only: all ranks stop together."""
    results = run_scenario(tmp_path, epochs=3, samples=512, slow={"1": 2.0}, stop_at={"rank": 1, "batch": 3})
    assert_consensus(results)
    assert_collectives_coherent(results)
    r0, r1 = results
    assert r0["global_step"] == r1["global_step"]
    assert set(r0["trained"]) == {"0"}  # stopped inside the first epoch
    assert len(r0["boundaries"]) == len(r1["boundaries"])


@pytest.mark.timeout(200)
def test_min_steps_holds_a_stop_request_until_the_cohort_reaches_it(tmp_path):
    """A stop asked for early waits for min_steps (DDP-equivalent steps), then all ranks stop."""
    min_steps = 40
    results = run_scenario(
        tmp_path, epochs=5, samples=512, slow={"1": 2.0}, stop_at={"rank": 1, "batch": 2},
        trainer={"min_steps": min_steps}, elche={"anchor": 4},
    )
    assert_consensus(results)
    assert_collectives_coherent(results)
    r0, r1 = results
    cohort = [b["cohort_step"] for b in r0["boundaries"]]
    assert r0["global_step"] == r1["global_step"] == cohort[-1]
    assert cohort[-1] >= min_steps > cohort[-2]  # the first boundary at or past min_steps


@pytest.mark.timeout(200)
def test_every_n_train_steps_checkpoints_at_the_first_boundary_past_each_multiple(tmp_path):
    """ModelCheckpoint(every_n_train_steps=10): one file per multiple of 10 DDP-equivalent steps,
    named by the cohort step at the boundary that crossed it, the same list seen from every rank.
    (Dynamic dispatch: once a rank's epoch has run out it may close several windows in one batch,
    where ModelCheckpoint runs once, so a multiple crossed then is saved at the epoch's last boundary.)"""
    every_n = 10
    results = run_scenario(
        tmp_path, epochs=2, samples=512, slow={"1": 2.0}, checkpoint_every_n_steps=every_n, validate=False,
        elche={"anchor": 4, "max_anchor": 4},  # windows of a fixed length, however loaded the machine
    )
    assert_consensus(results)
    assert_collectives_coherent(results)
    r0, r1 = results
    boundaries = r0["boundaries"]
    cohort = [0] + [b["cohort_step"] for b in boundaries]
    epoch_end = {b["epoch"]: b["cohort_step"] for b in boundaries}  # each epoch's last boundary
    crossing = [
        boundary for before, boundary in zip(cohort, boundaries) if boundary["cohort_step"] // every_n > before // every_n
    ]
    names = r0["checkpoints"]
    assert names == r1["checkpoints"] and len(names) == len(crossing) > 2
    saved = sorted(int(name.split("step=")[1].split(".")[0]) for name in names)
    for step, boundary in zip(saved, crossing):
        assert step in (boundary["cohort_step"], epoch_end[boundary["epoch"]]), (saved, crossing)


@pytest.mark.timeout(200)
def test_max_time_stops_every_rank_at_the_same_boundary(tmp_path):
    """Trainer(max_time=...): decided at a boundary from rank 0's clock; all ranks stop together."""
    started = time.monotonic()
    results = run_scenario(
        tmp_path, epochs=1000, samples=512, slow={"1": 2.0}, step_work_ms=2, trainer={"max_time": "00:00:00:04"}
    )
    elapsed = time.monotonic() - started
    assert_consensus(results)
    assert_collectives_coherent(results)
    r0, r1 = results
    assert r0["global_step"] == r1["global_step"] > 0
    assert len(r0["boundaries"]) == len(r1["boundaries"])
    assert len(r0["trained"]) < 1000  # stopped long before max_epochs
    assert elapsed < 60
