"""Integrity: the plan fingerprints ranks compare at every boundary, and what a checkpoint may load.

The fingerprints are checked without processes first (which field a difference lands in, that it
survives the float32 control region, what the error says), then with real ranks whose train
data really differ: every rank must stop at the first boundary with the same clear error.
"""

from __future__ import annotations

import fractions
import io
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import load_results, run_scenario

from lightning_elche.cohort.control import PER_RANK_FIELDS, gather_reports
from lightning_elche.cohort.fingerprint import CAP, FINGERPRINT_FIELDS, check_fingerprints, data_fields
from lightning_elche.cohort.plan import EpochPlan
from lightning_elche.cohort.train_data import TrainData
from lightning_elche.cohort.resume import ResumePoint
from lightning_elche.comm.control import ControlLayout
from lightning_elche.lightning.checkpoints import load_error


def train_data(**overrides) -> TrainData:
    fields = dict(num_samples=96, seed=0, shuffle=True, batch_size=8, samples_per_step=8, drop_last=False)
    fields.update(overrides)
    return TrainData(**fields)


def planned(data: TrainData, windows=((1, 2), (2, 2)), epoch: int = 0, covered=None) -> EpochPlan:
    plan = data.plan(epoch, 2, covered)
    for steps in windows:
        plan.freeze(list(steps))
    return plan


def differing_fields(a: EpochPlan, b: EpochPlan) -> set[str]:
    fa, fb = a.fingerprints(), b.fingerprints()
    return {name for name in FINGERPRINT_FIELDS if fa[name] != fb[name]}


# --------------------------------------------------------------------------- which field a difference lands in


def test_identical_train_data_gives_identical_fingerprints():
    assert planned(train_data()).fingerprints() == planned(train_data()).fingerprints()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"seed": 1}, {"plan_seed", "plan_data"}),
        ({"num_samples": 97}, {"plan_samples", "plan_data"}),
        ({"batch_size": 4, "samples_per_step": 4}, {"plan_data"}),
        ({"samples_per_step": 16}, {"plan_data"}),  # accumulate_grad_batches=2
        ({"drop_last": True}, {"plan_data"}),
        ({"shuffle": False}, {"plan_data"}),
        ({"seed": 1 << 40}, {"plan_seed", "plan_data"}),  # capped, but still different from 0
    ],
)
def test_what_the_plan_is_built_from_is_covered(overrides, expected):
    assert differing_fields(planned(train_data()), planned(train_data(**overrides))) >= expected


def test_seeds_and_lengths_past_the_cap_still_differ_in_the_hash():
    a, b = planned(train_data(seed=1 << 40)), planned(train_data(seed=(1 << 40) + 1))
    assert a.fingerprints()["plan_seed"] == b.fingerprints()["plan_seed"] == CAP
    assert "plan_data" in differing_fields(a, b)
    common = dict(seed=0, shuffle=True, batch_size=8, samples_per_step=8, drop_last=False, order=None)
    c, d = data_fields(num_samples=CAP + 5, **common), data_fields(num_samples=CAP + 6, **common)
    assert c["plan_samples"] == d["plan_samples"] == CAP and c["plan_data"] != d["plan_data"]


def test_the_epochs_order_itself_is_covered():
    """Same settings, another order (ranks resumed from different checkpoints: other samples left)."""
    covered = torch.zeros(96, dtype=torch.bool)
    other = covered.clone()
    other[5] = True
    a, b = planned(train_data(), covered=covered), planned(train_data(), covered=other)
    assert "plan_data" in differing_fields(a, b)


def test_every_frozen_window_counts_not_only_the_last_four():
    data = train_data(num_samples=10_000)
    windows = [(1, 2)] * 10
    changed = [(2, 1)] + windows[1:]  # the first of ten windows, same cursor
    assert differing_fields(planned(data, windows), planned(data, changed)) == {"fingerprint"}
    assert differing_fields(planned(data, windows), planned(data, windows, epoch=1)) >= {"fingerprint"}


def test_every_field_is_exact_in_the_float32_control_region():
    """The control region is all-reduced in the flat buffer's dtype: float32 for an fp32 model."""
    layout = ControlLayout(world_size=2)
    plans = [planned(train_data(seed=12345, num_samples=(1 << 24) + 5, shuffle=False)), planned(train_data())]
    region = torch.zeros(layout.size, dtype=torch.float32)
    for rank, plan in enumerate(plans):
        region += layout.encode(rank, plan.fingerprints(), {}).float()  # the SUM, each rank in its own slot
    control = layout.decode(region.tolist())
    for name in FINGERPRINT_FIELDS:
        assert name in PER_RANK_FIELDS
        assert control.per_rank[name] == [plan.fingerprints()[name] for plan in plans]
        assert all(0 <= value <= CAP for value in control.per_rank[name])


# --------------------------------------------------------------------------- the error


def control_of(plans: list[EpochPlan]):
    return gather_reports([plan.fingerprints() for plan in plans])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_samples": 97}, r"different lengths \(96 samples on rank 0; 97 samples on rank 1\).*same train dataset"),
        ({"seed": 5}, r"different sampler seeds \(0 on rank 0; 5 on rank 1\).*seed_everything\(seed\)`.*ElCheStrategy\(seed=\.\.\.\)"),
        ({"drop_last": True}, r"batch_size, accumulate_grad_batches, drop_last, shuffle"),
    ],
)
def test_the_error_names_what_differs_and_what_to_do(overrides, message):
    plans = [planned(train_data()), planned(train_data(**overrides))]
    with pytest.raises(RuntimeError, match=r"disagree on the plan of epoch 0 window 3: .*" + message):
        check_fingerprints(control_of(plans), epoch=0, window=3)


def test_different_windows_name_the_loaders_prefetch_settings():
    data = train_data(num_samples=1000)
    plans = [planned(data, [(1, 2), (2, 2)]), planned(data, [(1, 2), (2, 2), (1, 1)])]
    with pytest.raises(RuntimeError, match=r"froze different windows .*num_workers and prefetch_factor"):
        check_fingerprints(control_of(plans), epoch=0, window=1)
    check_fingerprints(control_of(plans[:1] * 3), epoch=0, window=1)  # agreement: no error


# --------------------------------------------------------------------------- real ranks, really different data

MISMATCH = {"samples": 96, "batch_size": 8, "epochs": 1, "validate": False}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "per_rank, message",
    [
        ({"1": {"seed": 5}}, r"different sampler seeds \(0 on rank 0; 5 on rank 1\)"),
        ({"1": {"samples": 97}}, r"different lengths \(96 samples on rank 0; 97 samples on rank 1\)"),
    ],
    ids=["seed", "dataset-length"],
)
def test_a_rank_with_other_train_data_stops_every_rank_at_the_first_boundary(tmp_path, per_rank, message):
    """Rank 1 calls seed_everything(5) / has one sample more: every rank raises the same error at
    the first boundary, before any average is applied, and the run ends well inside its timeout."""
    proc = run_scenario(tmp_path, expect_failure=True, timeout=90, per_rank=per_rank, **MISMATCH)
    assert proc.returncode != 0
    for result in load_results(tmp_path, 2, proc.stderr):
        assert result["exception"] == "RuntimeError", (result["rank"], result["exception_message"])
        assert "ElChe ranks disagree on the plan of epoch 0 window 0" in result["exception_message"]
        assert re.search(message, result["exception_message"]), result["exception_message"]
        assert result["boundaries"] == [], "no boundary completed: nothing was averaged across the mismatch"


# --------------------------------------------------------------------------- loading a checkpoint


def torch_load_error(blob: bytes) -> Exception:
    try:
        torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as error:  # noqa: BLE001 - the error under test
        return error
    raise AssertionError("the load succeeded")


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_a_weights_only_refusal_names_the_type_and_both_ways_to_allow_it():
    error = load_error("run.ckpt", torch_load_error(saved({"extra": fractions.Fraction(1, 3)})), weights_only=True)
    message = str(error)
    assert "run.ckpt weights-only (the default)" in message and "a pickled `fractions.Fraction`" in message
    assert "torch.serialization.add_safe_globals([fractions.Fraction])" in message
    assert "trainer.fit(model, ckpt_path=..., weights_only=False)" in message
    assert "corrupted" not in message


@pytest.mark.parametrize(
    "blob, expected",
    [
        (saved({"w": torch.ones(100)})[:300], r"cannot read the checkpoint c.ckpt \(RuntimeError: PytorchStreamReader"),
        (b"", r"cannot read the checkpoint c.ckpt \(EOFError"),
    ],
    ids=["truncated", "empty"],
)
def test_truncated_or_empty_files_are_called_corrupted(blob, expected):
    message = str(load_error("c.ckpt", torch_load_error(blob), weights_only=True))
    assert re.search(expected + r".*truncated or corrupted.*earlier checkpoint", message), message
    assert "add_safe_globals" not in message


def test_an_unreadable_pickle_under_weights_only_names_both_causes():
    message = str(load_error("g.ckpt", torch_load_error(b"\x80\x02garbage" * 10), weights_only=True))
    assert "could not read it" in message and "corrupted" in message and "weights_only=False" in message


# --------------------------------------------------------------------------- real ranks, a doctored checkpoint

SAVED = {"samples": 64, "batch_size": 8, "epochs": 1, "validate": False, "checkpoint_every_n_steps": 2}


@pytest.fixture(scope="module")
def a_checkpoint(tmp_path_factory) -> Path:
    """A mid-epoch ElChe checkpoint of a two-rank run (the first one it wrote)."""
    tmp = tmp_path_factory.mktemp("integrity_saved")
    results = run_scenario(tmp, **SAVED)
    names = results[0]["checkpoints"]
    assert names, "the run wrote no checkpoint"
    return tmp / "out" / "checkpoints" / names[0]


def doctored(source: Path, target: Path, change) -> Path:
    """``source`` changed by ``change`` and written at ``target``, its per-rank parts copied beside it (a
    checkpoint is the file and the folder it names)."""
    checkpoint = torch.load(source, weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, target)
    folder = checkpoint["callbacks"]["ElCheCallback"]["parts"]["folder"]
    shutil.copytree(source.parent / folder, target.parent / folder, dirs_exist_ok=True)
    return target


def flip_coverage(checkpoint: dict) -> None:
    state = checkpoint["callbacks"]["ElCheCallback"]
    state["covered"][0, 1] -= 3  # three trained samples would be trained again


@pytest.mark.timeout(120)
def test_a_checkpoint_with_flipped_coverage_bits_is_refused_on_every_rank(tmp_path, a_checkpoint):
    """Loadable (torch reads it) but its coverage was changed after it was written: every rank
    refuses to resume, naming the file and the checksum, before any collective of the fit."""
    path = doctored(a_checkpoint, tmp_path / "flipped.ckpt", flip_coverage)
    proc = run_scenario(tmp_path, expect_failure=True, timeout=90, ckpt_path=str(path), **SAVED)
    assert proc.returncode != 0
    for result in load_results(tmp_path, 2, proc.stderr):
        message = result["exception_message"]
        assert result["exception"] == "ValueError", (result["rank"], message)
        assert f"ElChe cannot resume from the checkpoint {path}" in message
        assert "does not match its checksum" in message and "Resume from another checkpoint" in message
        assert result["boundaries"] == []


@pytest.mark.timeout(180)
def test_a_checkpoint_holding_a_pickled_object_is_refused_until_the_user_allows_it(tmp_path, a_checkpoint):
    """A checkpoint that also holds a `fractions.Fraction` (any non-allowlisted pickled object): by
    default every rank refuses it, naming the type and the arguments that allow it; resumed with
    `trainer.fit(..., weights_only=False)`, the fit trains exactly the samples the checkpoint had left."""
    path = doctored(a_checkpoint, tmp_path / "pickled.ckpt", lambda c: c.update(user_extra=fractions.Fraction(1, 3)))
    proc = run_scenario(tmp_path / "default", expect_failure=True, timeout=90, ckpt_path=str(path), **SAVED)
    assert proc.returncode != 0
    for result in load_results(tmp_path / "default", 2, proc.stderr):
        message = result["exception_message"]
        assert result["exception"] == "RuntimeError", (result["rank"], message)
        assert f"checkpoint {path} weights-only (the default)" in message and "`fractions.Fraction`" in message
        assert "add_safe_globals([fractions.Fraction])" in message and "weights_only=False" in message

    allowed = run_scenario(tmp_path / "allowed", ckpt_path=str(path), weights_only=False, **SAVED)
    state = torch.load(a_checkpoint, weights_only=True)["callbacks"]["ElCheCallback"]
    left = set(range(SAVED["samples"])) - set(ResumePoint.from_state(state).covered_samples(shuffle=True).tolist())
    trained = [index for result in allowed for index in result["trained"].get("0", [])]
    assert sorted(trained) == sorted(left), "the resumed epoch trains each sample left exactly once"
