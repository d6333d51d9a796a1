"""The promise of the coherence work: swap ``strategy="ddp"`` for ``"elche"`` and nothing else changes.

One ordinary Lightning project (torchmetrics accuracy and a synced loss logged per epoch, a
per-step LR schedule, ModelCheckpoint on the validation metric, EarlyStopping, ``max_steps``, a
logger and LearningRateMonitor) runs under "ddp" and under "elche", rank 1 two times slower in
both. The step-denominated results must read the same: ``global_step``, the final learning rate,
the checkpoint file names, the steps at which validation and epoch metrics are logged.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import assert_collectives_coherent, assert_consensus, local_steps, run_scenario

STEPS_PER_EPOCH = 512 // 8 // 2  # DDP: 512 samples, batch 8, 2 ranks
PROJECT = {
    "samples": 512,
    "batch_size": 8,
    "slow": {"1": 3.0},  # clearly uneven, also when a loaded CI machine starves the fast rank:
    "slow_clock": "wall",  # 3x in wall time (in CPU time a starved rank 0 once trained no more than rank 1)
    "lr": 0.1,
    "step_lr": {"step_size": 10, "gamma": 0.8},
    "checkpoint_monitor": {"monitor": "val_acc", "mode": "max", "save_top_k": -1},
    "record_logs": True,
    "lr_monitor": True,
    "log_every_n_steps": 5,
}
RUNS = {
    # max_steps ends the fit inside the fourth epoch; EarlyStopping watches but does not fire
    "max_steps": {"epochs": 5, "trainer": {"max_steps": 3 * STEPS_PER_EPOCH + 4}, "early_stopping": {"monitor": "val_loss", "patience": 10}},
    # EarlyStopping fires at the second validation (no improvement of 10 is ever possible)
    "early_stopping": {"epochs": 5, "early_stopping": {"monitor": "val_loss", "min_delta": 10.0, "patience": 1}},
}


def logged_steps(result: dict[str, Any], key: str) -> list[int]:
    return [step for name, step in result["logged"] if name == key]


@pytest.fixture(scope="module", params=sorted(RUNS))
def ddp_and_elche(request, tmp_path_factory) -> tuple[str, list[dict], list[dict]]:
    config = {**PROJECT, **RUNS[request.param]}
    ddp = run_scenario(tmp_path_factory.mktemp(f"ddp_{request.param}"), strategy="ddp", **config)
    elche = run_scenario(tmp_path_factory.mktemp(f"elche_{request.param}"), strategy="elche", **config)
    return request.param, ddp, elche


@pytest.mark.timeout(300)
def test_both_finish_with_a_consistent_cohort(ddp_and_elche):
    _, ddp, elche = ddp_and_elche
    assert all(result["exception"] is None for result in ddp + elche)
    assert_consensus(elche)
    assert_collectives_coherent(elche)
    # uneven speeds did make uneven ranks (k = 3 in wall time against a ratio of 1: a wide margin)
    assert local_steps(elche[0]) > local_steps(elche[1])


@pytest.mark.timeout(300)
def test_global_step_and_epoch_match_ddp(ddp_and_elche):
    name, ddp, elche = ddp_and_elche
    expected = {"max_steps": 3 * STEPS_PER_EPOCH + 4, "early_stopping": 2 * STEPS_PER_EPOCH}[name]
    for result in ddp + elche:
        assert result["global_step"] == expected, (result["rank"], result["global_step"])
        assert result["current_epoch"] == ddp[0]["current_epoch"]


@pytest.mark.timeout(300)
def test_final_learning_rate_matches_ddp(ddp_and_elche):
    _, ddp, elche = ddp_and_elche
    for result in elche:
        assert result["final_lr"] == pytest.approx(ddp[0]["final_lr"], rel=1e-12)


@pytest.mark.timeout(300)
def test_checkpoint_names_match_ddp(ddp_and_elche):
    _, ddp, elche = ddp_and_elche
    names = ddp[0]["checkpoints"]
    assert names and all(result["checkpoints"] == names for result in ddp + elche), [r["checkpoints"] for r in elche]
    best = {result["best_checkpoint"] for result in elche}
    assert len(best) == 1 and best <= set(names)  # every rank agrees on which file is best


@pytest.mark.timeout(300)
def test_logger_step_axis_matches_ddp(ddp_and_elche):
    """Validation and epoch metrics land on DDP's steps on every rank; per-step points stay in
    DDP's range and never go backwards."""
    _, ddp, elche = ddp_and_elche
    last_step = ddp[0]["global_step"]
    for key in ("val_acc", "val_loss"):
        expected = logged_steps(ddp[0], key)
        actual = [logged_steps(result, key) for result in elche]
        assert expected and all(steps == expected for steps in actual), (key, expected, actual)
    for result in elche:
        for key in ("train_loss", "lr-SGD", "epoch"):
            steps = logged_steps(result, key)
            assert steps == sorted(steps), (result["rank"], key, steps)
            assert steps and 0 <= steps[0] and steps[-1] < last_step
        multiples = [s for s in logged_steps(result, "train_loss") if (s + 1) % PROJECT["log_every_n_steps"]]
        assert not multiples, f"rank {result['rank']} logged outside log_every_n_steps: {multiples}"
