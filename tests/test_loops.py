"""The training loops people write, each beside the same run under DDP: validation every N steps with
``max_steps`` and no epochs (the LLM loop), at a fraction of the epoch, on a time interval;
``limit_train_batches``; step and time checkpoints; and a mid-epoch resume of each on another world size.

Rank 1 is three times slower in every run (wall clock), so ranks run different batch counts: the
cohort decides each of these settings at a boundary and every rank acts on it at the same one.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import assert_collectives_coherent, assert_consensus, local_steps, run_scenario

from lightning_elche.cohort.limits import FitLimits, ValidationSchedule
from lightning_elche.cohort.train_data import TrainData

PROJECT = {"samples": 512, "batch_size": 8, "slow": {"1": 3.0}, "slow_clock": "wall", "lr": 0.1}  # DDP: 32 steps/epoch
RUNS: dict[str, dict[str, Any]] = {
    # the LLM loop: max_steps, validation every 10 steps counted across epochs, a checkpoint every 10 steps
    "steps": {
        "epochs": 10, "step_lr": {"step_size": 10, "gamma": 0.8}, "checkpoint_every_n_steps": 10,
        "trainer": {"max_steps": 40, "val_check_interval": 10, "check_val_every_n_epoch": None},
    },
    # 12 DDP batches per epoch, validated at each half: batches 6 and 12 of each epoch
    "limit_fraction": {
        "epochs": 2, "checkpoint_every_n_steps": 5, "trainer": {"limit_train_batches": 12, "val_check_interval": 0.5},
    },
    # half of each epoch (16 DDP batches), validated every 5 batches of the epoch: not at its end
    "fraction_limit_int_interval": {
        "epochs": 2, "checkpoint_every_n_steps": 5, "trainer": {"limit_train_batches": 0.5, "val_check_interval": 5},
    },
}
EXPECTED = {  # what DDP does (asserted on the DDP run too)
    "steps": {"global_step": 40, "validated_at": [10, 20, 30, 40]},
    "limit_fraction": {"global_step": 24, "validated_at": [6, 12, 18, 24]},
    "fraction_limit_int_interval": {"global_step": 32, "validated_at": [5, 10, 15, 21, 26, 31]},
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def ddp_and_elche(request, tmp_path_factory) -> tuple[str, list[dict], list[dict], Any]:
    config = {**PROJECT, **RUNS[request.param]}
    ddp = run_scenario(tmp_path_factory.mktemp(f"ddp_{request.param}"), strategy="ddp", **config)
    out = tmp_path_factory.mktemp(f"elche_{request.param}")
    elche = run_scenario(out, strategy="elche", **config)
    return request.param, ddp, elche, out


@pytest.mark.timeout(300)
def test_validation_checkpoints_and_lr_land_where_ddp_puts_them(ddp_and_elche):
    name, ddp, elche, _ = ddp_and_elche
    assert all(result["exception"] is None for result in ddp + elche), [r["exception_message"] for r in ddp + elche]
    assert_consensus(elche)
    assert_collectives_coherent(elche)
    assert local_steps(elche[0]) > local_steps(elche[1])  # 3x slower in wall time: uneven ranks, a wide margin
    expected = EXPECTED[name]
    for result in ddp + elche:
        assert result["global_step"] == expected["global_step"], (result["rank"], result["global_step"])
        assert result["validated_at"] == expected["validated_at"], (result["rank"], result["validated_at"])
        assert result["checkpoints"] == ddp[0]["checkpoints"], (result["rank"], result["checkpoints"])
        assert result["final_lr"] == pytest.approx(ddp[0]["final_lr"], rel=1e-12)
        assert result["current_epoch"] == ddp[0]["current_epoch"]
    assert ddp[0]["checkpoints"], "the run wrote no step checkpoint: the comparison would be empty"


RESUMES = {  # from a checkpoint inside an epoch, on three ranks: (file, global step at the end, validations)
    # epoch 0 has 192 samples left: 8 steps of 24 samples on three ranks, so step 30 falls in epoch 1
    "steps": ("epoch=0-step=20.ckpt", 40, [30, 40]),
    # 3 ranks: 12 of their 22 DDP batches per epoch (288 samples, 12 steps of 24); epoch 0 has 128 samples
    # left after step 10 and ends at step 15, having validated at its half (6 batches: step 12)
    "limit_fraction": ("epoch=0-step=10.ckpt", 27, [12, 21, 27]),
    # 3 ranks: 11 DDP batches per rank per epoch (half of 22); epoch 1 began at step 16 and validates at 21, 26
    "fraction_limit_int_interval": ("epoch=1-step=20.ckpt", 28, [21, 26]),
}


@pytest.mark.timeout(300)
def test_a_mid_epoch_resume_on_another_world_size_keeps_the_schedule(ddp_and_elche, tmp_path):
    """Validation milestones count from where the resumed epoch began (the checkpoint records it), and
    ``limit_train_batches`` means the new world's DDP batches; the rest of each epoch is trained once."""
    name, ddp, _, out = ddp_and_elche
    checkpoint, global_step, validated_at = RESUMES[name]
    resumed = run_scenario(
        tmp_path, strategy="elche", devices=3, ckpt_path=str(out / "out" / "checkpoints" / checkpoint),
        **{**PROJECT, **RUNS[name]},
    )
    assert all(result["exception"] is None for result in resumed), [r["exception_message"] for r in resumed]
    assert_consensus(resumed, initial_step=int(checkpoint.split("step=")[1].split(".")[0]))
    for result in resumed:
        assert result["global_step"] == global_step and result["validated_at"] == validated_at, result["rank"]
    if name == "steps":  # the LR schedule follows the cohort step, whatever the world size
        assert all(result["final_lr"] == pytest.approx(ddp[0]["final_lr"], rel=1e-12) for result in resumed)


@pytest.mark.timeout(300)
def test_overfit_batches_trains_the_samples_ddp_overfits(tmp_path):
    """``overfit_batches=4``: Lightning turns shuffling off and limits each rank to 4 batches; under ElChe
    every epoch trains the same 64 samples as DDP's two ranks together (split by speed), validating at
    each epoch's end."""
    config = {**PROJECT, "epochs": 3, "trainer": {"overfit_batches": 4}}
    ddp = run_scenario(tmp_path / "ddp", strategy="ddp", **config)
    elche = run_scenario(tmp_path / "elche", strategy="elche", **config)
    assert all(result["exception"] is None for result in ddp + elche), [r["exception_message"] for r in ddp + elche]
    assert_consensus(elche)
    for epoch in ("0", "1", "2"):
        trained = [sorted(sum((result["trained"][epoch] for result in run), [])) for run in (ddp, elche)]
        assert trained[0] == trained[1] == list(range(64)), epoch
    for result in ddp + elche:
        assert result["global_step"] == 12 and result["validated_at"] == [4, 8, 12], result["rank"]


@pytest.mark.timeout(300)
def test_time_based_validation_and_checkpoints_at_the_same_boundaries_on_every_rank(tmp_path):
    """Rank 0's clock decides (as Lightning broadcasts rank 0's decision under DDP); every rank validates
    and saves at the same global steps. ``check_val_every_n_epoch=2``: epoch 0 does not validate however
    often the clock says so, and a decision that epoch drops is not carried into the next one (which
    would validate some rank after a batch that is no boundary). Training takes about 2 s on an idle 2-core
    machine, 20 intervals of 0.1 s and about 10 boundaries (a loaded machine only makes it longer), so a fit
    that saves fewer than two time checkpoints has lost rank 0's clock."""
    results = run_scenario(
        tmp_path, strategy="elche", **{**PROJECT, "samples": 2048, "epochs": 2}, checkpoint_every_s=0.1,
        trainer={"val_check_interval": {"seconds": 0.1}, "check_val_every_n_epoch": 2},
    )
    assert all(result["exception"] is None for result in results), [r["exception_message"] for r in results]
    assert_collectives_coherent(results)
    validated = {tuple(result["validated_at"]) for result in results}
    assert len(validated) == 1, validated
    steps = next(iter(validated))
    epoch_1 = {b["cohort_step"] for b in results[0]["boundaries"] if b["epoch"] == 1}
    assert steps and set(steps) <= epoch_1 and min(steps) > 64, steps  # epoch 0: 64 steps; validation waited
    saved = {tuple(result["timed_checkpoints"]) for result in results}
    assert len(saved) == 1 and len(next(iter(saved))) >= 2, saved


@pytest.mark.timeout(300)
def test_a_time_based_fit_resumed_mid_epoch_on_three_ranks_keeps_deciding_alike(tmp_path):
    """A time-based fit's timed checkpoint from inside epoch 0, resumed on three ranks: rank 0's clock still
    decides for every rank (the same validation steps and timed checkpoints on each), the cohort trains the
    rest of the epoch and the next one (global step = the checkpoint's + what it trains, on every rank)."""
    config = {**PROJECT, "samples": 2048, "epochs": 2, "checkpoint_every_s": 0.1,
              "trainer": {"val_check_interval": {"seconds": 0.1}}}  # fmt: skip
    first = run_scenario(tmp_path / "first", strategy="elche", **config)
    assert all(result["exception"] is None for result in first), [r["exception_message"] for r in first]
    timed = sorted(first[0]["timed_checkpoints"], key=lambda name: int(name.split("step=")[1].split(".")[0]))
    inside = [name for name in timed if name.startswith("epoch=0") and 0 < int(name.split("step=")[1].split(".")[0]) < 64]
    assert inside, timed  # epoch 0 has 64 DDP steps of two ranks: some timed checkpoint fell inside it
    checkpoint = tmp_path / "first" / "out" / "checkpoints" / "timed" / inside[0]
    resumed = run_scenario(tmp_path / "resumed", strategy="elche", devices=3, ckpt_path=str(checkpoint), **config)
    assert all(result["exception"] is None for result in resumed), [r["exception_message"] for r in resumed]
    assert_consensus(resumed, initial_step=int(inside[0].split("step=")[1].split(".")[0]))
    assert_collectives_coherent(resumed)
    assert len({tuple(result["validated_at"]) for result in resumed}) == 1
    assert len({tuple(result["timed_checkpoints"]) for result in resumed}) == 1


# ---------------------------------------------------------------------- the decisions, without processes


def test_validation_steps_follow_lightnings_val_check_batch():
    fraction = ValidationSchedule(epoch_fraction=0.25)
    assert fraction.epoch_steps(0, 0, 32, 1) == (8, 16, 24, 32)
    assert fraction.epoch_steps(1, 32, 30, 1) == (39, 46, 53, 60)  # int(30 * 0.25) = 7 batches
    per_epoch = ValidationSchedule(every_n_batches=5, every_n_epochs=2)
    assert per_epoch.epoch_steps(0, 0, 16, 1) == ()  # check_val_every_n_epoch=2: epoch 0 does not validate
    assert per_epoch.epoch_steps(1, 16, 16, 1) == (21, 26, 31)
    assert per_epoch.epoch_steps(1, 16, 16, 2) == (19, 21, 24)  # batches 5, 10, 15 with 2 batches a step
    across = ValidationSchedule(every_n_batches=10, every_n_epochs=None)
    assert across.epoch_steps(0, 0, 32, 1) == ()
    assert [across.next_across_epochs(s, 1) for s in (0, 9, 10, 31)] == [10, 10, 20, 40]
    assert across.next_across_epochs(0, 4) == 3  # batch 10 completes in the third step of 4 batches


def test_windows_are_cut_to_land_on_the_next_milestone():
    limits = FitLimits(max_steps=100, step_checkpoint_every=(7,))
    assert limits.steps_allowed(0, 2, 1, ()) == 14  # to step 7 with two ranks
    assert limits.steps_allowed(13, 2, 1, ()) == 1  # one step short: the cohort step lands on 7 after it
    assert limits.steps_allowed(14, 2, 1, (9,)) == 4  # a validation at 9 comes first
    assert limits.steps_allowed(196, 2, 1, ()) == 4  # max_steps before the checkpoint at 105
    assert FitLimits().steps_allowed(0, 2, 1, ()) is None
    across = FitLimits(validation=ValidationSchedule(every_n_batches=10, every_n_epochs=None))
    assert across.validation_due(9, 10, 1, (), False) and not across.validation_due(10, 19, 1, (), False)
    epoch = FitLimits(validation=ValidationSchedule(epoch_fraction=0.5))
    assert epoch.validation_due(20, 23, 1, (16, 32), epoch_ends=True)  # DDP's last batch: 32 falls at the end
    assert not epoch.validation_due(20, 23, 1, (16, 32), epoch_ends=False)


def test_limit_train_batches_trains_what_ddps_ranks_would_together():
    data = TrainData(num_samples=512, seed=0, shuffle=True, batch_size=8, samples_per_step=8, drop_last=False)
    assert data.ddp_batches(2) == 32 and data.epoch_samples(2) == 512
    assert TrainData(**{**data.__dict__, "batch_limit": 12}).epoch_samples(2) == 2 * 12 * 8
    assert TrainData(**{**data.__dict__, "batch_limit": 0.5}).epoch_samples(3) == 3 * 11 * 8  # int(22 * 0.5)
    assert TrainData(**{**data.__dict__, "batch_limit": 100}).epoch_samples(2) == 512  # capped at the epoch
    plan = TrainData(**{**data.__dict__, "batch_limit": 12}).plan(0, 2)
    assert plan.usable == 192 and plan.total_steps == 24
