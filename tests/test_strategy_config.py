"""ElCheStrategy's constructor: every argument is validated with a message that names it,
good values are stored, and the registry names build the right strategy."""

from __future__ import annotations

import importlib
import math
from datetime import timedelta

import pytest

import lightning_elche
from lightning_elche import Averaging, ElCheStrategy, OuterNesterov
from lightning_elche.lightning.settings import GROUP_OF

NAN = float("nan")
INF = float("inf")

# (argument, bad value, extra kwargs needed to reach the check)
BAD_VALUES = [
    # policy
    ("policy", "foo", {}),
    ("policy", "Cadence", {}),
    ("policy", 1, {}),
    # reduce_on (and backend, its deprecated name)
    ("reduce_on", "gpu", {}),
    ("reduce_on", "nccl", {}),
    ("reduce_on", 0, {}),
    ("reduce_on", None, {}),
    ("backend", "nccl", {}),
    ("backend", "gloo", {}),
    # micro_batch_sizes
    ("micro_batch_sizes", [], {}),
    ("micro_batch_sizes", [64, 0], {}),
    ("micro_batch_sizes", [64, 32.0], {}),
    ("micro_batch_sizes", {1: True}, {}),
    ("micro_batch_sizes", {-1: 32}, {}),
    ("micro_batch_sizes", "32", {}),
    ("micro_batch_sizes", 32, {}),
    # anchor
    ("anchor", 0, {}),
    ("anchor", -3, {}),
    ("anchor", True, {}),
    ("anchor", 2.0, {}),
    ("anchor", 2.5, {}),
    ("anchor", "4", {}),
    ("anchor", NAN, {}),
    ("anchor", 1001, {}),  # above the default max_anchor
    ("anchor", 20, {"max_anchor": 10}),
    # min_anchor
    ("min_anchor", 0, {}),
    ("min_anchor", -1, {}),
    ("min_anchor", True, {}),
    ("min_anchor", 2.0, {}),
    ("min_anchor", NAN, {}),
    ("min_anchor", "1", {}),
    ("min_anchor", 11, {}),  # above the default anchor (10)
    ("min_anchor", 5, {"anchor": 4}),
    # max_anchor
    ("max_anchor", 0, {}),
    ("max_anchor", -1, {}),
    ("max_anchor", True, {}),
    ("max_anchor", 10.0, {}),
    ("max_anchor", NAN, {}),
    ("max_anchor", None, {}),
    ("max_anchor", "100", {}),
    ("max_anchor", 1_000_001, {}),
    # overhead_target
    ("overhead_target", 0.0, {}),
    ("overhead_target", 0.005, {}),
    ("overhead_target", 0.51, {}),
    ("overhead_target", 1, {}),
    ("overhead_target", -0.1, {}),
    ("overhead_target", NAN, {}),
    ("overhead_target", INF, {}),
    ("overhead_target", True, {}),
    ("overhead_target", "0.1", {}),
    # max_batch_diff
    ("max_batch_diff", -1, {}),
    ("max_batch_diff", True, {}),
    ("max_batch_diff", False, {}),
    ("max_batch_diff", 1.5, {}),
    ("max_batch_diff", 2.0, {}),
    ("max_batch_diff", NAN, {}),
    ("max_batch_diff", "2", {}),
    # partition_ratios
    ("partition_ratios", [], {}),
    ("partition_ratios", [0, 1], {}),
    ("partition_ratios", [1.0, -1.0], {}),
    ("partition_ratios", [NAN, 1.0], {}),
    ("partition_ratios", [INF, 1.0], {}),
    ("partition_ratios", [True, 1.0], {}),
    ("partition_ratios", ["1", "2"], {}),
    ("partition_ratios", [None, 1.0], {}),
    ("partition_ratios", "12", {}),
    ("partition_ratios", 2.0, {}),  # not a sequence at all
    ("partition_ratios", 3, {}),
    # gamma
    ("gamma", NAN, {}),
    ("gamma", INF, {}),
    ("gamma", -INF, {}),
    ("gamma", 4.5, {}),
    ("gamma", -5, {}),
    ("gamma", True, {}),
    ("gamma", "1", {}),
    ("gamma", None, {}),
    # seed
    ("seed", -1, {}),
    ("seed", True, {}),
    ("seed", 1.0, {}),
    ("seed", NAN, {}),
    ("seed", "0", {}),
    ("seed", 2**63, {}),
    # timeout
    ("timeout", 0, {}),
    ("timeout", -1, {}),
    ("timeout", 0.0, {}),
    ("timeout", NAN, {}),
    ("timeout", INF, {}),
    ("timeout", True, {}),
    ("timeout", "30", {}),
    ("timeout", timedelta(0), {}),
    ("timeout", timedelta(seconds=-5), {}),
    ("timeout", 1e15, {}),  # beyond what a timedelta can hold
    ("timeout", 0.5, {}),  # below a second: no collective could be expected to answer
    ("timeout", 8 * 24 * 3600, {}),  # beyond the 7-day bound
    # easgd_alpha (and only with policy="async")
    ("easgd_alpha", 0.0, {"policy": "async"}),
    ("easgd_alpha", 1.5, {"policy": "async"}),
    ("easgd_alpha", 0.5, {}),
    # outer_optimizer
    ("outer_optimizer", "nesterov", {}),
    ("outer_optimizer", {"lr": 0.7}, {}),
    # start_method
    ("start_method", "thread", {}),
    ("start_method", "Popen", {}),
    ("start_method", None, {}),
    ("start_method", 1, {}),
    # process_group_backend
    ("process_group_backend", 1, {}),
    ("process_group_backend", True, {}),
    ("process_group_backend", ["gloo"], {}),
    ("process_group_backend", b"gloo", {}),
    # dispatch (dynamic only where no setting fixes the shares)
    ("dispatch", "fast", {}),
    ("dispatch", "dynamic", {"policy": "sync"}),
    ("dispatch", "dynamic", {"partition_ratios": [2, 1]}),
    ("dispatch", "dynamic", {"max_batch_diff": 3}),
]


@pytest.mark.parametrize(
    ("name", "value", "extra"),
    BAD_VALUES,
    ids=[f"{name}={value!r}" + (f"+{extra}" if extra else "") for name, value, extra in BAD_VALUES],
)
def test_bad_value_raises_naming_the_argument(name, value, extra):
    with pytest.raises(ValueError) as info:
        ElCheStrategy(**{name: value, **extra})
    assert f"`{name}`" in str(info.value), f"message does not name `{name}`: {info.value}"


def test_async_policy_takes_an_easgd_blend():
    strategy = ElCheStrategy(policy="async", easgd_alpha=0.5)
    assert (strategy.settings.averaging.policy, strategy.settings.averaging.easgd_alpha) == ("async", 0.5)


def test_outer_optimizer_is_an_outer_nesterov():
    outer = OuterNesterov(lr=0.5)
    assert ElCheStrategy(outer_optimizer=outer).settings.averaging.outer_optimizer is outer


def test_default_outer_step_follows_speed_and_is_each_strategys_own():
    """The default (issue 35's time-to-accuracy benchmark): DiLoCo's step where speeds differ 1.5x."""
    first, second = ElCheStrategy().settings.outer_optimizer, ElCheStrategy(averaging=Averaging()).settings.outer_optimizer
    assert isinstance(first, OuterNesterov) and isinstance(second, OuterNesterov) and first is not second
    assert (first.lr, first.momentum, first.nesterov, first.min_speed_ratio) == (0.7, 0.9, True, 1.5)


@pytest.mark.parametrize("plain", [{"outer_optimizer": "none"}, {"averaging": Averaging(outer_optimizer=None)}])
def test_plain_averaging_is_asked_for_by_name(plain):
    assert ElCheStrategy(**plain).settings.outer_optimizer is None


@pytest.mark.parametrize(
    "kwargs",
    [{"anchor": 5}, {"anchor": 2}, {"min_anchor": 2}, {"anchor": 5, "min_anchor": 1}, {"partition_ratios": [1.0, 2.0]}],
    ids=["anchor=5", "anchor=2", "min_anchor=2", "anchor=5,min_anchor=1", "partition_ratios"],
)
def test_sync_policy_refuses_cadence_settings(kwargs):
    with pytest.raises(ValueError) as info:
        ElCheStrategy(policy="sync", **kwargs)
    message = str(info.value)
    assert "sync" in message
    assert any(f"`{name}`" in message for name in kwargs), message


def test_sync_policy_forces_a_one_step_window():
    strategy = ElCheStrategy(policy="sync")
    assert (strategy.settings.averaging.policy, strategy.settings.window.anchor, strategy.settings.window.min_anchor) == ("sync", 1, 1)
    strategy = ElCheStrategy(policy="sync", anchor=1, min_anchor=1)
    assert (strategy.settings.window.anchor, strategy.settings.window.min_anchor) == (1, 1)


def test_backend_is_reduce_on_deprecated():
    with pytest.warns(DeprecationWarning, match="reduce_on='cpu'"):
        strategy = ElCheStrategy(backend="cpu")
    assert strategy.settings.averaging.reduce_on == "cpu"


def test_backend_nccl_points_to_process_group_backend():
    with pytest.raises(ValueError, match="process_group_backend`='nccl'"):
        ElCheStrategy(backend="nccl")
    with pytest.raises(ValueError, match="give `reduce_on` only"):
        ElCheStrategy(reduce_on="cpu", backend="cpu")


@pytest.mark.parametrize("sizes", [[64, 32], (8, 8, 4), {1: 16}, {0: 2, 3: 1}])
def test_micro_batch_sizes_are_stored_as_given(sizes):
    assert ElCheStrategy(micro_batch_sizes=sizes).settings.data.micro_batch_sizes == sizes


def test_defaults():
    strategy = ElCheStrategy()
    assert strategy.settings.averaging.policy == "cadence"
    assert strategy.settings.averaging.reduce_on == "device"
    assert strategy.settings.data.micro_batch_sizes is None
    assert strategy.settings.window.anchor == 10
    assert strategy.settings.window.min_anchor == 10  # defaults to anchor
    assert strategy.settings.window.max_anchor == 1000
    assert strategy.settings.window.overhead_target == 0.05
    assert strategy.settings.window.max_batch_diff is None
    assert strategy.settings.data.partition_ratios is None
    assert strategy.settings.averaging.gamma == 1.0
    assert strategy.settings.data.seed is None
    assert strategy._start_method == "popen"
    assert strategy._process_group_backend is None
    assert strategy.strategy_name == "elche"


@pytest.mark.parametrize(
    ("kwargs", "mode"),
    [
        ({}, "dynamic"),
        ({"policy": "async"}, "dynamic"),
        ({"dispatch": "planned"}, "planned"),
        ({"policy": "sync"}, "planned"),
        ({"partition_ratios": [2, 1]}, "planned"),
        ({"max_batch_diff": 3}, "planned"),
    ],
)
def test_auto_dispatch_is_dynamic_unless_a_setting_fixes_the_shares(kwargs, mode):
    strategy = ElCheStrategy(**kwargs)
    assert strategy.settings.data.dispatch == kwargs.get("dispatch", "auto")
    assert strategy.settings.cohort.dispatch_mode(2) == mode
    assert strategy.settings.cohort.dispatch_mode(1) == "planned"  # nobody to share a pool with


def test_default_timeout_is_five_minutes_far_below_torch():
    from torch.distributed.constants import default_pg_timeout

    strategy = ElCheStrategy()
    assert strategy._timeout == timedelta(minutes=5)
    assert default_pg_timeout == timedelta(minutes=30)
    assert strategy._timeout < default_pg_timeout / 4
    # None means "the default", not torch's.
    assert ElCheStrategy(timeout=None)._timeout == timedelta(minutes=5)


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        (timedelta(seconds=42), timedelta(seconds=42)),
        (timedelta(minutes=2), timedelta(minutes=2)),
        (30, timedelta(seconds=30)),
        (1.5, timedelta(milliseconds=1500)),
        (90.25, timedelta(seconds=90.25)),
    ],
)
def test_timeout_accepts_timedelta_or_seconds(timeout, expected):
    strategy = ElCheStrategy(timeout=timeout)
    assert isinstance(strategy._timeout, timedelta)
    assert strategy._timeout == expected


def test_good_values_are_stored():
    strategy = ElCheStrategy(
        policy="cadence",
        reduce_on="cpu",
        anchor=4,
        min_anchor=2,
        max_anchor=64,
        overhead_target=0.1,
        max_batch_diff=3,
        partition_ratios=(1, 2.5),
        gamma=0.5,
        seed=1234,
        timeout=12,
        start_method="spawn",
        process_group_backend="gloo",
    )
    assert strategy.settings.averaging.policy == "cadence"
    assert strategy.settings.averaging.reduce_on == "cpu"
    assert strategy.settings.window.anchor == 4
    assert strategy.settings.window.min_anchor == 2
    assert strategy.settings.window.max_anchor == 64
    assert strategy.settings.window.overhead_target == 0.1
    assert strategy.settings.window.max_batch_diff == 3
    assert strategy.settings.data.partition_ratios == [1.0, 2.5]
    assert all(type(r) is float for r in strategy.settings.data.partition_ratios)
    assert strategy.settings.averaging.gamma == 0.5
    assert strategy.settings.data.seed == 1234
    assert strategy._timeout == timedelta(seconds=12)
    assert strategy._start_method == "spawn"
    assert strategy._process_group_backend == "gloo"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"anchor": 1},
        {"anchor": 1000},
        {"anchor": 1_000_000, "max_anchor": 1_000_000},
        {"min_anchor": 1},
        {"anchor": 7, "min_anchor": 7},
        {"overhead_target": 0.01},
        {"overhead_target": 0.5},
        {"overhead_target": 1 / 3},
        {"max_batch_diff": 0},
        {"max_batch_diff": None},
        {"gamma": 0},
        {"gamma": 4},
        {"gamma": -4.0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"partition_ratios": [1e-6]},
        {"partition_ratios": [3, 1, 1, 1]},
        {"start_method": "fork"},
        {"start_method": "forkserver"},
        {"process_group_backend": "nccl"},
    ],
    ids=str,
)
def test_boundary_values_are_accepted(kwargs):
    strategy = ElCheStrategy(**kwargs)
    for name, value in kwargs.items():
        if name in ("start_method", "process_group_backend"):
            assert getattr(strategy, f"_{name}") == value
        elif name == "partition_ratios":
            assert strategy.settings.data.partition_ratios == [float(v) for v in value]
        else:
            stored = getattr(getattr(strategy.settings, GROUP_OF[name]), name)
            assert stored == value or (isinstance(value, float) and math.isclose(stored, value))


def test_int_overhead_and_gamma_are_stored_as_floats():
    strategy = ElCheStrategy(gamma=1, overhead_target=0.5)
    assert type(strategy.settings.averaging.gamma) is float and type(strategy.settings.window.overhead_target) is float


def test_a_smaller_max_anchor_alone_is_accepted():
    """Asking only for a smaller staleness bound must not fail on the default anchor (10)
    the user never passed: the starting anchor should fit under ``max_anchor``."""
    strategy = ElCheStrategy(max_anchor=5)
    assert strategy.settings.window.max_anchor == 5
    assert 1 <= strategy.settings.window.min_anchor <= strategy.settings.window.anchor <= 5


# ---------------------------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    ("name", "start_method"),
    [("elche", "popen"), ("elche_spawn", "spawn"), ("elche_fork", "fork"), ("elche_notebook", "fork")],
)
def test_registry_names_build_elche_strategies(name, start_method):
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry

    assert name in StrategyRegistry.available_strategies()
    trainer = Trainer(
        strategy=name,
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    strategy = trainer.strategy
    assert isinstance(strategy, ElCheStrategy)
    assert strategy._start_method == start_method
    assert strategy.num_processes == 2
    # The registered entries carry the constructor defaults.
    assert strategy.settings.averaging.policy == "cadence" and strategy.settings.window.anchor == 10
    assert strategy._timeout == timedelta(minutes=5)


def test_registry_builds_fresh_instances():
    from lightning.pytorch.strategies import StrategyRegistry

    first, second = StrategyRegistry.get("elche"), StrategyRegistry.get("elche")
    assert isinstance(first, ElCheStrategy) and first is not second


def test_reimport_and_reregister_do_not_fail():
    from lightning.pytorch.strategies import StrategyRegistry

    reloaded = importlib.reload(lightning_elche)
    reloaded.ElCheStrategy.register_strategies(StrategyRegistry)
    ElCheStrategy.register_strategies(StrategyRegistry)
    strategy = StrategyRegistry.get("elche_spawn")
    assert isinstance(strategy, ElCheStrategy)
    assert strategy._start_method == "spawn"


def test_sub_microsecond_timeout_never_becomes_zero():
    """timedelta has microsecond resolution: a positive timeout must not round to a zero one."""
    try:
        strategy = ElCheStrategy(timeout=1e-7)
    except ValueError as exc:
        assert "`timeout`" in str(exc)
    else:
        assert strategy._timeout > timedelta(0)
