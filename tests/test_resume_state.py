"""The checkpoint state on its own: coverage spans (schema 2), bit packing (schema 1), what a resume takes from it."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_elche.cohort.coverage import Spans
from lightning_elche.cohort.resume import SCHEMA_VERSION, ResumePoint, pack_bits, unpack_bits

COVERED = Spans([(0, 1), (3, 4), (7, 9), (20, 21)])  # positions 0, 3, 7, 8, 20 of the epoch's order


def schema_1_mask() -> torch.Tensor:
    covered = torch.zeros(21, dtype=torch.bool)
    covered[[0, 3, 7, 8, 20]] = True
    return covered


def make_point(world_size: int = 2, **overrides) -> ResumePoint:
    fields = dict(
        epoch=4, num_samples=21, covered=COVERED, seed=7, world_size=world_size, cohort_steps_total=41, logged_steps_total=39,
        controller={"anchor": 5, "counts": [5, 9], "anchor_rank": 0, "calibrations": 3, "speeds": [[[1.0, 2]], []]},
        optimizer_states=[[{"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}]]
        * world_size,
    )
    fields.update(overrides)
    return ResumePoint(**fields)


@given(st.lists(st.booleans(), max_size=70))
def test_bits_round_trip(values):
    mask = torch.tensor(values, dtype=torch.bool)
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-len(values) // 8)
    assert torch.equal(unpack_bits(packed, len(values)), mask)


def test_state_survives_a_weights_only_load():
    """Lightning loads local checkpoints with weights_only=True: only tensors, numbers, lists and dicts."""
    point = make_point()
    buffer = io.BytesIO()
    torch.save({"callbacks": {"ElCheCallback": point.to_state()}}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["callbacks"]["ElCheCallback"]
    restored = ResumePoint.from_state(state)
    assert restored.covered == point.covered and restored.num_samples == 21
    assert (restored.epoch, restored.seed, restored.world_size) == (4, 7, 2)
    assert restored.cohort_step == 20 and restored.controller == point.controller
    assert torch.equal(restored.optimizer_states_for(1)[0]["state"][0]["exp_avg"], torch.ones(3))


def test_same_world_size_keeps_the_exact_step_totals():
    assert make_point().totals_for(2) == (41, 39)


def test_another_world_size_keeps_the_ddp_equivalent_steps():
    cohort_total, logged_total = make_point().totals_for(3)
    assert (cohort_total // 3, logged_total // 3) == (20, 19)


def test_optimizer_states_map_ranks_around_the_saved_ones():
    point = make_point(world_size=2, optimizer_states=[["rank0"], ["rank1"]])
    assert [point.optimizer_states_for(rank) for rank in range(3)] == [["rank0"], ["rank1"], ["rank0"]]
    assert make_point(optimizer_states=None).optimizer_states_for(0) is None


def test_unknown_schema_version_is_a_clear_error():
    state = make_point().to_state()
    state["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ValueError, match=f"schema version {SCHEMA_VERSION + 1}.*release that wrote it"):
        ResumePoint.from_state(state)


def test_incomplete_state_names_what_is_missing():
    state = make_point().to_state()
    del state["covered"], state["seed"]
    with pytest.raises(ValueError, match=r"missing \['covered', 'seed'\]"):
        ResumePoint.from_state(state)


# --------------------------------------------------------------------------- the checksum


def reloaded(state: dict) -> dict:
    """``state`` after a save and a weights-only load, as a resume sees it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_the_state_carries_a_checksum_that_survives_a_weights_only_load():
    state = reloaded(make_point().to_state())
    assert state["checksum"].startswith("sha256:")
    assert ResumePoint.from_state(state).covered == COVERED


@pytest.mark.parametrize(
    "tamper",
    [
        lambda s: s["covered"].__setitem__((2, 1), 8),  # position 8 no longer covered
        lambda s: s["covered"].__setitem__((0, 1), 2),  # position 1 now covered
        lambda s: s.__setitem__("cohort_steps_total", s["cohort_steps_total"] + 1),
        lambda s: s.__setitem__("logged_steps_total", 0),
        lambda s: s.__setitem__("epoch", 5),
        lambda s: s.__setitem__("seed", 8),
        lambda s: s["controller"].__setitem__("anchor", 6),
    ],
    ids=["coverage-span-shortened", "coverage-span-extended", "cohort-steps", "logged-steps", "epoch", "seed", "anchor"],
)
def test_a_state_changed_after_it_was_written_is_refused(tamper):
    state = reloaded(make_point().to_state())
    tamper(state)
    with pytest.raises(ValueError, match="does not match its checksum.*twice and others never.*another checkpoint"):
        ResumePoint.from_state(state)


def test_a_schema_1_state_still_loads_with_or_without_its_checksum():
    """lightning-elche 0.1 wrote a bit per sample over dataset indices; those checkpoints resume."""
    state = reloaded(make_point(covered=schema_1_mask()).to_state())
    assert state["schema_version"] == 1 and state["covered"].dtype == torch.uint8
    assert torch.equal(ResumePoint.from_state(state).covered, schema_1_mask())
    del state["checksum"]  # written before the checksum existed
    restored = ResumePoint.from_state(state)
    assert torch.equal(restored.covered, schema_1_mask()) and restored.cohort_steps_total == 41


@pytest.mark.parametrize(
    "covered, expected",
    [
        (lambda s: s["covered"][:, :1], "sorted, disjoint int64 .start, end. pairs within 21 positions"),
        (lambda s: torch.tensor([[3, 5], [0, 2]]), "sorted, disjoint"),  # out of order
        (lambda s: torch.tensor([[0, 30]]), "within 21 positions"),
        (lambda s: s["covered"].to(torch.float32), "int64"),
    ],
    ids=["one-column", "unsorted", "past-the-end", "float"],
)
def test_malformed_coverage_is_refused_before_it_is_read(covered, expected):
    state = reloaded(make_point().to_state())
    state["covered"] = covered(state)
    with pytest.raises(ValueError, match=f"coverage is malformed .*{expected}"):
        ResumePoint.from_state(state)


def test_malformed_schema_1_coverage_is_refused_before_it_is_unpacked():
    state = reloaded(make_point(covered=schema_1_mask()).to_state())
    state["covered"] = state["covered"][:-1]  # 21 samples need 3 bytes
    with pytest.raises(ValueError, match="coverage is malformed .*3 uint8 bytes for 21 samples"):
        ResumePoint.from_state(state)
