"""The outer optimizer on its own: DiLoCo's Nesterov step on the pseudo-gradient."""

from __future__ import annotations

import pytest
import torch
from conftest import SYNC_SGD_CONFIG, assert_consensus, run_scenario

from lightning_elche import OuterNesterov


def test_lr_one_without_momentum_is_plain_averaging():
    outer = OuterNesterov(lr=1.0, momentum=0.0)
    outer.bind(torch.tensor([1.0, 2.0]))
    for consensus in ([0.5, 2.5], [0.0, 3.0]):
        result = torch.tensor(consensus)
        outer.step(result)
        assert torch.equal(result, torch.tensor(consensus))


def test_lr_above_one_without_momentum_scales_each_move_from_the_last_consensus():
    """The recipe docs/choosing.md gives a steps-bound AdamW task at equal speeds (``policy="sync"``,
    ``OuterNesterov(lr=sqrt(2), momentum=0)``): each boundary moves sqrt(2) times as far as the average did."""
    scale = 2**0.5
    outer = OuterNesterov(lr=scale, momentum=0.0)
    theta = torch.tensor([1.0, 2.0], dtype=torch.float64)
    outer.bind(theta.clone())
    for average in ([0.5, 2.5], [0.0, 3.0]):
        result = torch.tensor(average, dtype=torch.float64)
        outer.step(result)
        theta = theta + scale * (torch.tensor(average, dtype=torch.float64) - theta)
        torch.testing.assert_close(result, theta)


def test_two_steps_follow_nesterovs_formula():
    lr, mu = 0.7, 0.9
    outer = OuterNesterov(lr=lr, momentum=mu)
    theta = torch.tensor([1.0, -2.0], dtype=torch.float64)
    outer.bind(theta)
    velocity = torch.zeros(2, dtype=torch.float64)
    for consensus in ([0.8, -1.5], [0.1, -1.0]):
        g = theta - torch.tensor(consensus, dtype=torch.float64)
        velocity = mu * velocity + g
        theta = theta - lr * (g + mu * velocity)
        result = torch.tensor(consensus, dtype=torch.float64)
        outer.step(result)
        torch.testing.assert_close(result, theta)


def test_heavy_ball_without_nesterov():
    outer = OuterNesterov(lr=0.5, momentum=0.5, nesterov=False)
    outer.bind(torch.tensor([2.0]))
    first = torch.tensor([1.0])
    outer.step(first)  # g = 1, v = 1: 2 - 0.5
    second = torch.tensor([1.0])
    outer.step(second)  # g = 0.5, v = 1.0: 1.5 - 0.5
    assert first.item() == 1.5 and second.item() == 1.0


def test_momentum_survives_a_state_round_trip():
    original, restored = OuterNesterov(), OuterNesterov()
    original.bind(torch.zeros(3))
    original.step(torch.tensor([0.1, 0.2, 0.3]))
    restored.bind(original._global.clone())
    restored.load_state_dict(original.state_dict())
    a, b = torch.tensor([0.3, 0.1, 0.0]), torch.tensor([0.3, 0.1, 0.0])
    original.step(a)
    restored.step(b)
    assert torch.equal(a, b)


def test_state_of_another_model_is_refused():
    outer = OuterNesterov()
    outer.bind(torch.zeros(4))
    with pytest.raises(ValueError, match="3 values, the model 4"):
        outer.load_state_dict({"velocity": torch.zeros(3)})


@pytest.mark.parametrize(("kwargs", "name"), [({"lr": 0.0}, "lr"), ({"lr": True}, "lr"), ({"momentum": 1.0}, "momentum")])
def test_bad_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        OuterNesterov(**kwargs)


@pytest.mark.timeout(200)
def test_outer_step_runs_at_every_boundary_on_every_rank(tmp_path, sync_sgd_shuffled_run):
    """Same run as the plain sync one but with DiLoCo's outer step: replicas still agree after every
    boundary, and the outer momentum takes the model elsewhere than the plain average did."""
    results = run_scenario(tmp_path, shuffle=True, outer={"lr": 0.7, "momentum": 0.9}, **SYNC_SGD_CONFIG)
    assert_consensus(results)
    assert results[0]["final_digest"] != sync_sgd_shuffled_run[0]["final_digest"]
    assert [b["cohort_step"] for b in results[0]["boundaries"]] == [
        b["cohort_step"] for b in sync_sgd_shuffled_run[0]["boundaries"]
    ]


def gated(**kwargs) -> OuterNesterov:
    """The strategy's default: an outer step only where the window's speeds differ 1.5x or more."""
    outer = OuterNesterov.following_speed() if not kwargs else OuterNesterov(**kwargs)
    outer.bind(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    return outer


def test_following_speed_holds_no_copies_and_averages_plainly_at_equal_speeds():
    outer = gated()
    for consensus in ([0.9, -1.8, 2.5, 0.4], [0.8, -1.7, 2.4, 0.3]):
        outer.observe([10, 9])  # 1.11x: under the 1.5x default
        result = torch.tensor(consensus)
        outer.step(result)
        assert torch.equal(result, torch.tensor(consensus))
    assert outer.carry() is None and outer.state_dict()["velocity"] is None


def test_following_speed_steps_from_the_second_boundary_with_a_spread():
    """The first boundary with a spread makes the global model (the plain average); the next steps
    Nesterov's formula from it; a boundary at equal speeds again averages plainly, its momentum kept."""
    lr, mu = 0.7, 0.9
    outer = gated()
    outer.observe([20, 10])
    first = torch.tensor([0.9, -1.8, 2.5, 0.4])
    outer.step(first)
    assert torch.equal(first, torch.tensor([0.9, -1.8, 2.5, 0.4]))
    outer.observe([20, 0, 5])  # a member that did not move does not count: 4x
    second = torch.tensor([0.7, -1.5, 2.0, 0.3])
    g = torch.tensor([0.9, -1.8, 2.5, 0.4]) - second
    expected = torch.tensor([0.9, -1.8, 2.5, 0.4]) - lr * (g + mu * g)
    outer.step(second)
    torch.testing.assert_close(second, expected)
    outer.observe([10, 10])
    third = torch.tensor([0.0, 0.0, 0.0, 0.0])
    outer.step(third)
    assert torch.equal(third, torch.zeros(4))
    _, velocity, _ = outer.carry()
    torch.testing.assert_close(velocity, g)  # kept for the next boundary with a spread


def test_streamed_fragments_begin_one_at_a_time():
    """Each fragment's global model is set at its own first engaged boundary, never from another's."""
    outer = gated()
    outer.observe([30, 10])
    head = torch.tensor([0.5, 0.5])
    outer.step(head, slice(0, 2))
    tail = torch.tensor([2.0, 0.0])
    outer.step(tail, slice(2, 4))  # its first: plain
    assert torch.equal(tail, torch.tensor([2.0, 0.0]))
    tail_again = torch.tensor([1.0, 0.0])
    outer.step(tail_again, slice(2, 4))  # g = (1, 0): 2 - 0.7 * 1.9
    torch.testing.assert_close(tail_again, torch.tensor([2.0 - 0.7 * 1.9, 0.0]))
    assert outer.state_dict()["started"] == [(0, 2), (2, 4)]


def test_following_speed_state_round_trips_with_the_spans_begun():
    original = gated()
    original.observe([30, 10])
    original.step(torch.tensor([0.5, 0.5]), slice(0, 2))
    original.step(torch.tensor([0.4, 0.2]), slice(0, 2))
    restored = OuterNesterov.following_speed()
    restored.bind(torch.tensor([0.0, 0.0, 3.0, 0.5]))
    restored._region.copy_(original._global)  # the checkpoint's consensus
    restored.load_state_dict(original.state_dict())
    restored.observe([30, 10])
    a, b = torch.tensor([2.5, 0.1]), torch.tensor([2.5, 0.1])
    original.step(a, slice(2, 4))
    restored.step(b, slice(2, 4))  # not begun in either: plain in both
    c, d = torch.tensor([0.3, 0.1]), torch.tensor([0.3, 0.1])
    original.step(c, slice(0, 2))
    restored.step(d, slice(0, 2))
    assert torch.equal(a, b) and torch.equal(c, d)


def test_a_redone_boundary_forgets_copies_made_in_it():
    outer = gated()
    kept = outer.carry()
    outer.observe([30, 10])
    outer.step(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    outer.restore(kept)
    assert outer.carry() is None


@pytest.mark.parametrize("ratio", [0.5, float("inf"), True, "2"])
def test_bad_min_speed_ratio_names_the_argument(ratio):
    with pytest.raises(ValueError, match="`min_speed_ratio` must be a number >= 1"):
        OuterNesterov(min_speed_ratio=ratio)


@pytest.mark.timeout(300)
def test_default_steps_where_speeds_differ_and_averages_plainly_where_not(tmp_path, sync_sgd_shuffled_run):
    """The strategy's default outer step: at equal steps per window (policy "sync") the run is the plain
    average's to the bit, with no copies made; with rank 1 three times slower, every rank takes the
    outer step (momentum built) and the replicas still agree after every boundary."""
    plain = run_scenario(
        tmp_path / "plain", shuffle=True, **{**SYNC_SGD_CONFIG, "elche": {"policy": "sync", "outer_optimizer": "none"}}
    )
    assert [r["final_digest"] for r in plain] == [r["final_digest"] for r in sync_sgd_shuffled_run]
    default_equal = run_scenario(tmp_path / "equal", shuffle=True, record_optimizer_state=True, **SYNC_SGD_CONFIG)
    assert [r["final_outer_velocity"] for r in default_equal] == [None, None]
    slowed = run_scenario(
        tmp_path / "slowed", shuffle=True, record_optimizer_state=True, slow={1: 3.0},
        **{**SYNC_SGD_CONFIG, "elche": {"anchor": 2}},
    )  # fmt: skip
    assert_consensus(slowed)
    velocities = [torch.tensor(r["final_outer_velocity"]) for r in slowed]
    assert velocities[0].abs().sum() > 0
    torch.testing.assert_close(velocities[0], velocities[1], rtol=0, atol=0)


def test_an_outer_step_at_every_boundary_steps_each_fragment_from_the_start():
    """Given explicitly (``min_speed_ratio=1``) the global model exists from bind: a streamed fragment's
    first boundary is already an outer step."""
    outer = OuterNesterov(lr=0.5, momentum=0.0)
    outer.bind(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    tail = torch.tensor([0.0, 0.0])
    outer.step(tail, slice(2, 4))  # g = 1: 1 - 0.5
    assert torch.equal(tail, torch.tensor([0.5, 0.5]))
