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
