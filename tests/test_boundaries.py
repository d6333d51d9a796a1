"""Boundaries on real processes: consensus, agreement, cohort step, cadence, stop conditions.

After every boundary, parameters and buffers are bit-identical on all ranks (digests recorded by
the scenario right after each boundary); every rank records the same boundary sequence; and
``trainer.global_step`` is the DDP-equivalent cohort step (total optimizer steps / world size).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import (  # noqa: E402
    SLOWED_CONFIG,
    assert_collectives_coherent,
    assert_consensus,
    assert_exact_coverage,
    boundary_sequence,
    collective_ops,
    flatten,
    local_steps,
    run_scenario,
)


@pytest.mark.timeout(200)
def test_slowed_run_boundaries_agree_and_step_counts_follow_speed(slowed_run):
    assert_consensus(slowed_run)
    r0, r1 = slowed_run
    assert boundary_sequence(r0) == boundary_sequence(r1)
    boundaries = r0["boundaries"]
    assert len(r0["digests"]) == len(boundaries) == len(r1["digests"])
    # every epoch ends on a boundary: the last boundary of each epoch closes it
    epochs = sorted({b["epoch"] for b in boundaries})
    assert epochs == list(range(SLOWED_CONFIG["epochs"]))
    # windows are numbered 0, 1, ... inside each epoch
    for epoch in epochs:
        windows = [b["window"] for b in boundaries if b["epoch"] == epoch]
        assert windows == list(range(len(windows)))
    # cohort step = total optimizer steps / world size, also the final trainer.global_step
    total = local_steps(r0) + local_steps(r1)
    assert r0["global_step"] == r1["global_step"] == total // 2
    # the cohort step never goes backwards
    steps = [b["cohort_step"] for b in boundaries]
    assert steps == sorted(steps)
    # once calibrated, the plans follow the measured speeds: each of the last three boundaries plans
    # rank 0 / rank 1 steps in the ratio of their pooled ms per step over the windows it measured
    # (SPEED_WINDOW = 5; rounding to whole steps and the anchor's cap bend it a little), and the 3x
    # slowdown shows
    last = boundaries[-3:]
    for at in range(len(boundaries) - 3, len(boundaries)):
        measured = boundaries[max(1, at - 4):at + 1]
        ms_per_step = [sum(b["window_ms"][r] for b in measured) / sum(b["steps"][r] for b in measured) for r in (0, 1)]
        speed_ratio = ms_per_step[1] / ms_per_step[0]
        planned_ratio = boundaries[at]["counts"][0] / boundaries[at]["counts"][1]
        # Margin: k = 3 (SLOWED_CONFIG: steps that sleep, slowed in wall time), 2.0 asserted; 3.04-3.10
        # measured with two CPU spinners on the two cores (a computing step measured 1.8 to 4.8 there:
        # see "Share margins" in tests/test_coverage.py).
        # The plan's ratio is asserted against this run's own measurement, which load cannot move apart.
        assert speed_ratio >= 2.0, (at, ms_per_step)
        assert speed_ratio / 1.5 <= planned_ratio <= speed_ratio * 1.5, (at, boundaries[at]["counts"], ms_per_step)
    assert all(b["counts"][0] > b["counts"][1] for b in last), [b["counts"] for b in last]
    # ... and it really ran more steps in those windows (the final window of an epoch is the remainder)
    closing = {b["epoch"]: b["window"] for b in boundaries}  # the last window of each epoch
    non_final = [b for b in boundaries if b["window"] != closing[b["epoch"]]]
    # Margin: k = 3, ratio 2 asserted; 3.0-3.3 measured under the load above.
    assert non_final[-1]["steps"][0] >= 2 * non_final[-1]["steps"][1], non_final[-1]
    # validation saw the consensus: same metrics on every rank
    assert r0["callback_metrics"]["val_loss"] == pytest.approx(r1["callback_metrics"]["val_loss"])


@pytest.mark.timeout(200)
def test_batchnorm_buffers_identical_after_every_boundary(tmp_path):
    """BatchNorm running stats (float buffers) and num_batches_tracked (int buffer) in the digests.

    Runs with reduce_on="cpu" (host-staged boundary), which must give the same consensus.
    """
    config = {
        "epochs": 2,
        "samples": 512,
        "model": "bn",
        # fixed shares 3:1 and a fixed anchor: a deterministic plan whose every batch has 8 samples
        # (a 1-sample batch would make BatchNorm raise in training)
        "elche": {"partition_ratios": [3, 1], "anchor": 2, "max_anchor": 2, "reduce_on": "cpu"},
        "slow": {"1": 3.0},
    }
    results = run_scenario(tmp_path, **config)
    assert_consensus(results)
    assert_collectives_coherent(results)
    assert_exact_coverage(results, config["samples"], config["epochs"])
    r0 = results[0]
    assert [b["counts"] for b in r0["boundaries"]] == [[6, 2]] * len(r0["boundaries"])
    # the ranks did unequal work, yet end identical (digest covers parameters and all buffers)
    assert local_steps(r0) == 3 * local_steps(results[1])


@pytest.mark.timeout(200)
def test_manual_optimization_trains_and_stays_identical(tmp_path):
    config = {
        "epochs": 2,
        "samples": 512,
        "manual": True,
        "slow": {"1": 3.0},
        "slow_clock": "wall",  # uneven steps asserted: rank 1 stays 3x slower on a loaded machine
        "elche": {"anchor": 4},
    }
    results = run_scenario(tmp_path, **config)
    assert_consensus(results)
    assert_collectives_coherent(results)
    assert_exact_coverage(results, config["samples"], config["epochs"])
    r0, r1 = results
    # manual opt.step() calls are counted as optimizer steps: one per batch
    assert local_steps(r0) == len(r0["step_batches"]) and local_steps(r1) == len(r1["step_batches"])
    assert local_steps(r0) > local_steps(r1)  # k = 3 in wall time against a ratio of 1: a wide margin
    assert r0["global_step"] == (local_steps(r0) + local_steps(r1)) // 2
    # and the model actually trained
    delta = max(
        abs(a - b)
        for init, final in zip(r0["initial"], r0["final"])
        for a, b in zip(flatten(init), flatten(final))
    )
    assert delta > 1e-3



@pytest.mark.timeout(200)
def test_sync_policy_averages_after_every_step(sync_sgd_shuffled_run):
    results = sync_sgd_shuffled_run
    assert_consensus(results)
    assert_collectives_coherent(results)
    assert_exact_coverage(results, 320, 1)
    r0 = results[0]
    assert len(r0["boundaries"]) == 20
    for b in r0["boundaries"]:
        assert b["counts"] == [1, 1], b
        assert b["steps"] == [1, 1], b
        assert b["anchor"] == 1
    assert [b["cohort_step"] for b in r0["boundaries"]] == list(range(1, 21))
    assert r0["global_step"] == 20


@pytest.mark.timeout(200)
def test_max_steps_stops_all_ranks_at_the_same_boundary(tmp_path):
    max_steps = 30
    config = {
        "epochs": 10,
        "samples": 1024,  # 64 cohort steps per epoch: max_steps falls inside epoch 0
        "slow": {"1": 3.0},
        "elche": {"anchor": 4},
        "trainer": {"max_steps": max_steps},
    }
    results = run_scenario(tmp_path, **config)
    assert_consensus(results)
    assert_collectives_coherent(results)
    r0 = results[0]
    boundaries = r0["boundaries"]
    last = boundaries[-1]
    final = r0["global_step"]
    assert all(r["global_step"] == final for r in results)
    # the windows before the stop were cut so that the cohort lands exactly on max_steps, as DDP does
    assert final == last["cohort_step"] == max_steps, [b["cohort_step"] for b in boundaries]
    assert len(boundaries) >= 2 and boundaries[-2]["cohort_step"] < max_steps
    # mid-epoch: epoch 0 was not completed and no rank started epoch 1
    for result in results:
        assert set(result["trained"]) == {"0"}
        assert result["max_steps"] == max_steps  # the user's setting is restored after fit
    assert sum(len(r["trained"]["0"]) for r in results) < config["samples"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "signalled", [1, pytest.param(0, id="rank0-forwards-to-children")], ids=str
)
def test_sigterm_on_one_rank_stops_all_ranks_at_the_next_boundary(tmp_path, signalled):
    """One rank is preempted mid-epoch (SIGTERM to itself); both ranks stop at the same boundary.

    Rank 1: only it knows, the boundary payload tells rank 0. Rank 0: Lightning's handler also
    forwards the signal to the child processes it launched.
    """
    batch = 5
    config = {
        "epochs": 2,
        "samples": 512,
        "elche": {"anchor": 4, "max_anchor": 4},
        "sigterm_at": {"rank": signalled, "batch": batch, "epoch": 0},
    }
    results = run_scenario(tmp_path, timeout=120, **config)  # a hang fails here, not in pytest-timeout
    r0, r1 = results
    sender = results[signalled]
    assert sender["sigterm_sent"] is not None and sender["sigterm_sent"]["batch"] == batch
    for result in results:
        assert result["exception"] == "SIGTERMException", (result["rank"], result["exception"], result["exception_message"])
        # stopped by the boundary, not by the 60 s process-group timeout
        assert result["elapsed_s"] < 45, result["elapsed_s"]
    assert_consensus(results)
    assert_collectives_coherent(results)
    sent_after = sender["sigterm_sent"]["boundaries_before"]
    # the signal arrived after `sent_after` boundaries; the very next boundary stops everybody
    assert len(r0["boundaries"]) == len(r1["boundaries"]) == sent_after + 1
    assert boundary_sequence(r0)[-1] == boundary_sequence(r1)[-1]
    last = r0["boundaries"][-1]
    assert last["epoch"] == 0
    # nobody trained past the stopping boundary, and the epoch was cut short
    for result in results:
        assert len(result["step_batches"]) == local_steps(result)
        assert result["boundary_batches"][-1][0] == 0
    assert sum(len(r["trained"]["0"]) for r in results) < config["samples"]
    assert r0["global_step"] == last["cohort_step"]
    # the signal travelled in the boundary payload: no SIGTERM broadcast (per batch or in the
    # signal handler), and both ranks issued the same collectives
    for result in results:
        assert not [c for c in result["calls"] if c["op"] == "broadcast" and c["phase"] != "setup"], result["rank"]
    assert collective_ops(r0) == collective_ops(r1)


@pytest.mark.timeout(200)
def test_batchnorm_model_never_gets_a_one_sample_batch_where_ddp_does_not(tmp_path):
    """A BatchNorm model that trains under DDP must train under ElChe (DESIGN section 2).

    204 samples, batch 8, 2 ranks: DDP gives each rank 102 samples (batches 8 x 12 + 6). ElChe's
    last window splits the remaining samples in proportion to the planned steps without regard
    to batch boundaries; with shares 3:1 the remainder 76 becomes [57, 19] and 57 = 7 x 8 + 1, a
    one-sample batch on which BatchNorm raises "Expected more than 1 value per channel when
    training". With measured speeds the split depends on timing, so such a fit crashes at random.
    Fixed shares make the plan deterministic here.
    """
    config = {
        "epochs": 1,
        "samples": 204,
        "model": "bn",
        "validate": False,
        "elche": {"partition_ratios": [3, 1], "anchor": 2, "max_anchor": 2},
    }
    results = run_scenario(tmp_path, **config)
    assert_consensus(results)
    assert_collectives_coherent(results)
    assert_exact_coverage(results, config["samples"], 1)
    for result in results:
        sizes = sorted({len(b) for b in result["step_batches"]})
        assert min(sizes) > 1, f"rank {result['rank']} trained a one-sample batch: sizes {sizes}"


@pytest.mark.timeout(200)
def test_cohort_divergence_is_every_ranks_drift_carried_to_the_next_boundary(slowed_run):
    """Each rank measures its own drift from the consensus; the next boundary's payload gives every
    rank the max and mean over ranks (no extra collective), the same numbers everywhere."""
    r0 = slowed_run[0]
    records = [result["boundaries"] for result in slowed_run]
    for index in range(1, len(r0["boundaries"])):
        drifts = [rank_records[index - 1]["divergence"] for rank_records in records]
        boundary = r0["boundaries"][index]
        assert boundary["cohort_divergence"] == pytest.approx(max(drifts), rel=1e-5, abs=1e-12)
        assert boundary["cohort_divergence_mean"] == pytest.approx(sum(drifts) / len(drifts), rel=1e-5, abs=1e-12)
    assert r0["boundaries"][0]["cohort_divergence"] == 0.0  # nothing before the first boundary
    assert max(b["cohort_divergence"] for b in r0["boundaries"]) > 1e-4  # local steps do drift apart
