"""Validation split by speed (issue 33): two ranks, rank 1 three times slower (in validation too), 4,096
validation samples. After a first validation with equal batch counts (which finds no collective between
validation steps), the fast rank validates several times the slow one's samples; every sample is validated
once per validation, and the logged ``val_loss`` is that of a single-process evaluation of the same weights.
A metric synced on every validation step keeps the batch counts equal, so the ranks still pair its reduces."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_consensus, run_scenario
from scenario import IndexedDataset, make_model

from lightning_elche.cohort.limits import ddp_batches_per_rank
from lightning_elche.cohort.validation import even_batches, speed_counts

VAL_SAMPLES = 4096
CONFIG = {"samples": 512, "epochs": 3, "slow": {"1": 3.0}, "slow_clock": "wall", "val_samples": VAL_SAMPLES}


def single_process_loss(final: list[list[float]]) -> float:
    """The validation set's mean cross-entropy under the fit's final weights, in this process."""
    model = make_model("mlp")
    with torch.no_grad():
        for parameter, values in zip(model.parameters(), final):
            parameter.copy_(torch.tensor(values).reshape(parameter.shape))
        data = IndexedDataset(VAL_SAMPLES, seed=99)
        return float(torch.nn.functional.cross_entropy(model(data.x), data.y, reduction="mean"))


def test_validation_is_split_by_speed_and_its_metrics_are_those_of_one_process(tmp_path):
    results = run_scenario(tmp_path, strategy="elche", **CONFIG)
    assert all(result["exception"] is None for result in results), [r["exception_message"] for r in results]
    assert_consensus(results)
    fast, slow = ([v["indices"] for v in result["validations"]] for result in results)
    assert len(fast) == len(slow) == CONFIG["epochs"]
    for run, (mine, theirs) in enumerate(zip(fast, slow)):
        assert sorted(mine + theirs) == list(range(VAL_SAMPLES)), run  # every sample once, no padding
    assert len(fast[0]) == len(slow[0]) == VAL_SAMPLES // 2  # the probe: equal shares
    assert len(fast[-1]) > 2 * len(slow[-1]), (len(fast[-1]), len(slow[-1]))  # then by speed (3x slower)
    final = results[0]["final"]
    for result in results:  # the last validation saw the final weights (nothing trains after it): the same
        # mean up to float32 rounding, its sums taken in another order (a few units in the last place of ~3.4)
        assert result["validations"][-1]["val_loss"] == pytest.approx(single_process_loss(final), rel=1e-6, abs=0)


def test_a_metric_synced_on_every_validation_step_keeps_the_batch_counts_equal(tmp_path):
    results = run_scenario(tmp_path, strategy="elche", **CONFIG, val_step_sync=True)
    assert all(result["exception"] is None for result in results), [r["exception_message"] for r in results]
    for validation in zip(*(result["validations"] for result in results)):
        assert [len(v["indices"]) for v in validation] == [VAL_SAMPLES // 2] * 2


def test_shares_follow_speed_and_the_probe_has_ddps_batch_count():
    assert speed_counts(4096, 2, [None, 30.0]) == [2048, 2048]  # a speed unknown: equal shares
    assert speed_counts(4096, 2, [10.0, 30.0]) == [3072, 1024]
    assert speed_counts(10, 3, [1.0, 1000.0, 1000.0]) == [8, 1, 1]  # every rank validates a batch
    assert ddp_batches_per_rank(100, 2, 16, drop_last=False) == 4  # the probe: 50 samples a rank in DDP's 4 batches
    assert even_batches(50, 4) == [13, 13, 12, 12]
