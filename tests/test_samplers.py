"""A custom train sampler under ElChe: the epoch's order is the sampler's draw, trained once across ranks.

A ``WeightedRandomSampler`` (imbalanced classes: the second half of the set three times as likely as
the first, drawn with replacement) on two ranks, rank 1 three times slower: each epoch's draws are
trained exactly once across the ranks, whatever their shares (a sample drawn twice is trained twice,
as under DDP), and a mid-epoch checkpoint resumes on three ranks with the rest of that draw.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from conftest import CRASH_EXIT_CODE, assert_consensus, local_steps, run_scenario
from scenario import weighted_sampler

from lightning_elche.lightning.data import SamplerDraws

SAMPLES, EPOCHS = 512, 2
CONFIG: dict[str, Any] = {
    "samples": SAMPLES, "batch_size": 8, "epochs": EPOCHS, "sampler": "weighted", "slow": {"1": 3.0},
    "slow_clock": "wall",
}  # fmt: skip


def drawn(epoch: int) -> Counter:
    """The sampler's draw of ``epoch`` as ElChe replays it (seed 0: the scenario's seed_everything)."""
    return Counter(SamplerDraws(weighted_sampler(SAMPLES))(epoch, 0).tolist())


def trained(results: list[dict[str, Any]], epoch: int) -> Counter:
    return Counter(index for result in results for index in result["trained"].get(str(epoch), []))


@pytest.mark.timeout(300)
def test_each_draw_of_a_weighted_sampler_is_trained_once_across_ranks(tmp_path):
    ddp = run_scenario(tmp_path / "ddp", strategy="ddp", **CONFIG)
    elche = run_scenario(tmp_path / "elche", **CONFIG)
    assert all(result["exception"] is None for result in ddp + elche), [r["exception_message"] for r in ddp + elche]
    assert_consensus(elche)
    assert local_steps(elche[0]) > local_steps(elche[1])  # 3x slower in wall time: uneven shares, a wide margin
    for epoch in range(EPOCHS):
        assert trained(elche, epoch) == drawn(epoch), epoch
        for run in (ddp, elche):  # the weighting holds: about 3 draws of the second half to 1 of the first
            counts = trained(run, epoch)
            first = sum(c for index, c in counts.items() if index < SAMPLES // 2)
            assert sum(counts.values()) == SAMPLES and SAMPLES - first > 2 * first, (epoch, first)
    assert drawn(0) != drawn(1)  # a new draw each epoch, as DDP's sampler makes
    assert elche[0]["global_step"] == ddp[0]["global_step"] == EPOCHS * SAMPLES // 16


@pytest.mark.timeout(300)
def test_a_mid_epoch_resume_on_three_ranks_trains_the_rest_of_the_draw(tmp_path):
    config = {**CONFIG, "checkpoint_every_n_steps": 5, "checkpoint_save_last": True}
    crashed = run_scenario(tmp_path / "crashed", expect_failure=True, crash_after_checkpoints=4, **config)
    assert crashed.returncode == CRASH_EXIT_CODE, crashed.stderr[-4000:]
    out = tmp_path / "crashed" / "out"
    snapshots = [json.loads((out / f"crash_rank{rank}.json").read_text()) for rank in range(2)]
    assert {snapshot["global_step"] for snapshot in snapshots} == {10}  # inside epoch 0 (32 steps; save_last counts)
    resumed = run_scenario(tmp_path / "resumed", devices=3, ckpt_path=str(out / "checkpoints" / "last.ckpt"), **config)
    assert all(result["exception"] is None for result in resumed), [r["exception_message"] for r in resumed]
    assert_consensus(resumed, initial_step=10)
    for epoch in range(EPOCHS):
        assert trained(snapshots + resumed, epoch) == drawn(epoch), epoch
