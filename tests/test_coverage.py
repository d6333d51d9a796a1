"""Exact coverage on real processes: every sample of every epoch is trained once across ranks.

The scenario's dataset returns each sample's index with it, and every rank records the indices
it trained per epoch (``trained``). Shares are uneven (a slowed rank), change inside an epoch (a
rank that slows down mid-run), and the DataLoader prefetches from worker processes.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import (  # noqa: E402
    SLOWED_CONFIG,
    assert_consensus,
    assert_exact_coverage,
    coverage_report,
    run_scenario,
)


def _shares(result: dict, epoch: int) -> list[list[int]]:
    return [b["samples"] for b in result["boundaries"] if b["epoch"] == epoch]


# Share margins. The tests below assert that shares follow speed, which is real timing by design, so
# each states its margin: the slowdown k, the ratio r asserted, and what was measured under load (two
# CPU spinners and two xdist workers on two cores). The slowed rank is slowed in wall time: it sleeps
# (k - 1) times its own step as the load stretched it, so a load that slows both ranks alike keeps the
# gap. No k is proof against any load: with four spinners and three workers (load average 8 on the two
# cores) the scheduler ran the often-sleeping slowed rank as soon as it woke and starved the busy one,
# and a rank slowed 3x measured faster per step than the unslowed rank (tests/test_streaming.py's dynamic
# case: 456 samples to the fast rank, 744 to the slowed one). Steps that sleep rather than compute
# (SLOWED_CONFIG) take the scheduler out of it: both ranks sleep most of a step, so neither is favoured.


@pytest.mark.timeout(200)
def test_exact_coverage_uneven_shares_in_process_loading(slowed_run):
    """num_workers=0, rank 1 three times slower: uneven shares, still every sample exactly once."""
    assert_exact_coverage(slowed_run, SLOWED_CONFIG["samples"], SLOWED_CONFIG["epochs"])
    assert_consensus(slowed_run)
    # the shares really were uneven: once calibrated, rank 0 trains more samples per window
    last_epoch = SLOWED_CONFIG["epochs"] - 1
    trained = [len(r["trained"][str(last_epoch)]) for r in slowed_run]
    # Margin (see "Share margins" above): k = 3, r = 1.5; rank 0 / rank 1 samples of 3.0-3.2 measured with
    # two CPU spinners in this run's configuration (SLOWED_CONFIG, steps that sleep), 2x the bound.
    assert trained[0] > 1.5 * trained[1], f"shares of epoch {last_epoch} not uneven: {trained}"


@pytest.mark.timeout(200)
def test_exact_coverage_with_persistent_workers(tmp_path):
    """num_workers=2, persistent: the sampler is iterated ahead of training by the workers' prefetch."""
    config = {
        "epochs": 2,
        "samples": 512,
        "slow": {"1": 3.0},
        "slow_clock": "wall",  # shares asserted: rank 1 stays 3x slower on a loaded machine
        "num_workers": 2,
        "persistent_workers": True,
        "elche": {"anchor": 2},
    }
    results = run_scenario(tmp_path, **config)
    assert_exact_coverage(results, config["samples"], config["epochs"])
    assert_consensus(results)
    trained = [len(r["trained"]["1"]) for r in results]
    # Margin (see "Share margins" above): k = 3, r = 1.5; rank 0 trained 7-8x rank 1's samples under load.
    assert trained[0] > 1.5 * trained[1], f"shares of epoch 1 not uneven: {trained}"


@pytest.mark.timeout(200)
def test_exact_coverage_when_lightning_reloads_the_loader_every_epoch_with_workers(tmp_path):
    """``reload_dataloaders_every_n_epochs=1`` and two workers, not persistent, under dynamic dispatch:
    Lightning's fit loop pulls a batch from each epoch's new loader, then drops that iterator for
    another. The tickets the dropped one claimed (its workers' prefetch, a claim sent ahead) are served
    by the next one first, not lost: every sample of every epoch is trained once. Steps sleep 12 ms (a
    real step's length, not the tiny model's 1 ms, next to which a loaded machine's claims passed the 5 %
    that turns dispatch planned, and the reloaded epochs would not have been dynamic)."""
    config = {"epochs": 3, "samples": 512, "num_workers": 2, "slow": {"1": 2.0}, "step_sleep_ms": 12,
              "trainer": {"reload_dataloaders_every_n_epochs": 1}, "elche": {"dispatch": "dynamic"}}
    results = run_scenario(tmp_path, **config)
    assert_exact_coverage(results, config["samples"], config["epochs"])
    assert_consensus(results)
    assert not any("planned from now on" in w for r in results for w in r["warnings"]), results[0]["warnings"]


MID_EPOCH_CONFIG = {
    "epochs": 1,
    "samples": 2000,
    "batch_size": 8,
    "validate": False,
    # anchor 2 and a cap of 4 keep the windows short: many boundaries inside the one epoch
    "elche": {"anchor": 2, "max_anchor": 4},
    # rank 1 runs at full speed for its first 40 optimizer steps, then eight times slower: a single
    # window's share is asserted (2x), and two DataLoader workers' prefetch claims tickets ahead of the
    # speed; at 4x one window under load measured only 2.5x (see "Share margins" above), at 8x 9-13x
    "slow_switch": {"rank": 1, "after": 40, "before_k": 1.0, "after_k": 8.0},
    "slow_clock": "wall",  # shares asserted: slowed in wall time, its sleep grows with its loaded step
}


def _check_mid_epoch_change(results: list[dict]) -> None:
    samples = MID_EPOCH_CONFIG["samples"]
    assert_exact_coverage(results, samples, 1)
    assert_consensus(results)
    shares = _shares(results[0], 0)
    assert len(shares) >= 8, f"too few windows in the epoch to see shares move: {shares}"
    # the first window is planned before any speed is known: equal shares
    assert shares[0][0] == shares[0][1], shares
    # after rank 1 slowed down, inside the same epoch, rank 0 gets at least twice its share
    # (the final window is the epoch's remainder, so look at the one before it). Margin (see "Share
    # margins" above): k = 8, r = 2; 9-13x measured under load with workers' prefetch, 5x or more without.
    before_last = shares[-2]
    assert before_last[0] >= 2 * before_last[1], f"shares did not follow the slowdown within the epoch: {shares}"
    assert len({tuple(s) for s in shares[:-1]}) >= 2, f"shares never changed inside the epoch: {shares}"


@pytest.mark.timeout(200)
def test_exact_coverage_when_shares_change_mid_epoch(tmp_path):
    results = run_scenario(tmp_path, **MID_EPOCH_CONFIG)
    _check_mid_epoch_change(results)


@pytest.mark.timeout(250)
def test_exact_coverage_when_shares_change_mid_epoch_with_workers(tmp_path):
    """The hardest case: shares move while two workers per rank prefetch ahead."""
    results = run_scenario(tmp_path, num_workers=2, persistent_workers=True, **MID_EPOCH_CONFIG)
    _check_mid_epoch_change(results)


@pytest.mark.timeout(200)
def test_drop_last_trains_no_sample_twice_and_drops_only_a_tail(tmp_path):
    """drop_last=True: whole batches only, no duplicates, and less than world*batch samples dropped.

    Uses the BatchNorm model: with drop_last every batch is full, so BatchNorm always has more
    than one value per channel; its running statistics must be identical on all ranks after
    every boundary (digests cover buffers).
    """
    world, batch = 2, 8
    config = {
        "epochs": 2,
        "samples": 1003,  # not a multiple of anything: there is a tail to drop
        "batch_size": batch,
        "drop_last": True,
        "model": "bn",
        "slow": {"1": 3.0},
        "elche": {"anchor": 4},
    }
    results = run_scenario(tmp_path, **config)
    assert_consensus(results)
    for epoch in range(config["epochs"]):
        report = coverage_report(results, config["samples"], epoch)
        assert report["duplicates"] == [], f"epoch {epoch}: trained twice: {report['duplicates'][:20]}"
        assert report["foreign"] == []
        dropped = len(report["missing"])
        assert dropped < world * batch, f"epoch {epoch}: dropped {dropped} samples, more than a tail"
        assert report["trained"] + dropped == config["samples"]
        for result in results:
            sizes = [len(b) for b in result["step_batches"]]
            assert set(sizes) == {batch}, f"rank {result['rank']}: partial batches with drop_last: {sorted(set(sizes))}"


@pytest.mark.timeout(250)
def test_exact_coverage_with_gradient_accumulation(tmp_path):
    config = {
        "epochs": 2,
        "samples": 600,
        "slow": {"1": 3.0},
        "elche": {"anchor": 2},
        "trainer": {"accumulate_grad_batches": 2},
    }
    results = run_scenario(tmp_path, **config)
    assert_exact_coverage(results, config["samples"], config["epochs"])
    assert_consensus(results, accumulate=2)
    # a window of n steps is 2n batches; an epoch's last window may end on a half-filled
    # accumulation, where Lightning steps on the epoch's last batch: steps = ceil(batches / 2)
    for b in results[0]["boundaries"]:
        for rank, (steps, samples) in enumerate(zip(b["steps"], b["samples"])):
            batches = math.ceil(samples / 8)
            assert steps == math.ceil(batches / 2), f"rank {rank} epoch {b['epoch']} window {b['window']}: {b}"
    for result in results:
        assert len(result["step_batches"]) == sum(math.ceil(s / 8) for b in result["boundaries"] for s in [b["samples"][result["rank"]]])


@pytest.mark.timeout(300)
def test_exact_coverage_three_processes(tmp_path):
    config = {
        "devices": 3,
        "epochs": 2,
        "samples": 600,
        "slow": {"2": 3.0},
        "slow_clock": "wall",  # shares asserted: rank 2 stays 3x slower on a loaded machine
        "elche": {"anchor": 2},
    }
    results = run_scenario(tmp_path, timeout=250, **config)
    assert len(results) == 3
    assert_exact_coverage(results, config["samples"], config["epochs"])
    assert_consensus(results)
    trained = [len(r["trained"]["1"]) for r in results]
    # Margin (see "Share margins" above): k = 3, r = 1.5; the slower fast rank trained 3.25-3.4x rank 2's
    # samples under load, three ranks on the two cores (2.2x the bound).
    windows = [(b["epoch"], b["steps"], b["level"]) for b in results[0]["boundaries"]]
    assert min(trained[0], trained[1]) > 1.5 * trained[2], (
        f"slow rank 2 not given a smaller share: {trained}; windows (epoch, steps, level): {windows}; "
        f"warnings: {results[0]['warnings']}"
    )


@pytest.mark.timeout(250)
def test_dynamic_dispatch_exact_coverage_when_speeds_change_with_workers(tmp_path):
    """dispatch="dynamic": ranks claim steps from each window's pool while two workers per rank
    prefetch (claims made ahead of training); rank 1 slows down 8x mid-epoch."""
    config = {**MID_EPOCH_CONFIG, "elche": {**MID_EPOCH_CONFIG["elche"], "dispatch": "dynamic"}}
    results = run_scenario(tmp_path, num_workers=2, persistent_workers=True, **config)
    assert_exact_coverage(results, config["samples"], 1)
    assert_consensus(results)
    steps = [b["steps"] for b in results[0]["boundaries"]]
    assert sum(map(sum, steps)) == math.ceil(config["samples"] / 8)  # one ticket, one step
    late = steps[len(steps) // 2 : -1]
    # Margin (see "Share margins" above): k = 8 (MID_EPOCH_CONFIG), r = 2; 3.8-7.5x measured under load with
    # the workers' prefetch claiming ahead (at k = 4 it was 2.8x, too close).
    assert sum(s[0] for s in late) >= 2 * sum(s[1] for s in late), f"claims did not follow the slowdown: {steps}"
