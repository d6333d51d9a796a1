"""The scenario's typed configuration (``tests/scenario_config.py``), without starting any process:
unknown keys and invalid values are refused naming them, the defaults are those the scenario always
had, and what the scenario's processes receive as JSON rebuilds the very same object."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json

import conftest
import pytest
import scenario_config
from scenario_config import (
    CheckpointIOFaults,
    CollectiveFault,
    KillAt,
    RaiseAt,
    RankBatch,
    ScenarioConfig,
    Signal,
    SigtermAt,
    thaw,
)

# every key's default as tests/scenario.py read it before the typed configuration (config.get(key, default))
OLD_DEFAULTS = {
    "out": None, "devices": 2, "strategy": "elche", "elche": {}, "trainer": {}, "per_rank": {}, "epochs": 2, "seed": 0,
    "samples": 256, "data_seed": 0, "batch_size": 8, "dataset": "map", "shard_lengths": True, "one_shot_shard": False,
    "litdata_dir": None, "litdata_remote": False, "litdata_combined": (), "combined_weights": None, "combined_batching": "stratified", "litdata_parallel": (), "parallel_length": None, "parallel_resume": True, "shuffle": True, "drop_last": False, "batch_sampler": None, "sampler": None, "num_workers": 0, "val_samples": 64, "val_step_sync": False,
    "persistent_workers": False, "validate": True, "validate_on_train": False, "sanity": 0, "model": "mlp",
    "optimizer": "sgd", "lr": 0.1, "one_cycle": False, "step_lr": None, "outer": None, "manual": False,
    "training_step": None, "metric_sync_on_step": False, "log_seen": False, "log_step_sync": False, "slow": {},
    "slow_switch": None, "slow_clock": "thread", "step_work_ms": 0, "step_sleep_ms": 0, "stop_at": None, "nan_at": (),
    "raise_at": None, "kill_at": None, "sigterm_at": None, "late_start": None, "joiner_dies_at_admission": False, "dies_joining_group": None, "signals": (),
    "collective_fault": None,
    "checkpoint_io": None, "crash_after_checkpoints": None, "checkpoint_every_n_steps": None,
    "checkpoint_save_last": False, "single_file_checkpoints": False, "checkpoint_monitor": None, "checkpoint_every_s": None, "early_stopping": None,
    "save_in_step": None,
    "ckpt_path": None, "weights_only": None, "trace": True, "record_params": True, "record_optimizer_state": False,
    "record_logs": False, "tensorboard": False, "tensorboard_version": "", "lr_monitor": False, "log_every_n_steps": 50,
    "progress_bar": False, "run_loggers": (),
}  # fmt: skip

# a config that sets (nearly) every structured key, in JSON's spelling (rank keys as strings, lists)
EVERYTHING = {
    "out": "/tmp/out", "devices": 3, "epochs": 4, "samples": 97, "lr": 1, "optimizer": "adam", "slow_clock": "wall",
    "elche": {"anchor": 4, "partition_ratios": [2, 1, 1], "compression": None, "micro_batch_sizes": {"1": 4}},
    "trainer": {"max_steps": 7, "max_time": "00:00:00:04"},
    "per_rank": {"1": {"samples": 98, "elche": {"anchor": 2}, "kill_at": {"batch": 5}}, "2": {"seed": 5}},
    "slow": {"1": 3.0, "2": 2}, "slow_switch": {"rank": 1, "after": 6, "before_k": 1.0, "after_k": 3.0},
    "stop_at": {"rank": 1, "batch": 3}, "nan_at": [{"rank": 0, "batch": 2}, {"rank": 1, "batch": 2}],
    "raise_at": {"rank": "all", "batch": 0}, "kill_at": {"rank": 1, "batch": 4, "signal": "SIGSTOP"},
    "sigterm_at": {"rank": 1, "epoch": 0, "batch": 6, "signal": "SIGUSR1"},
    "signals": [{"rank": 0, "phase": "final_window"}, {"rank": 0, "epoch": 1, "batch": 2, "to": "all", "count": 2}],
    "collective_fault": {"rank": 1, "nth": 3, "op": "all_reduce", "origin": "elche:averaging", "when": "inside"},
    "checkpoint_io": {"delay_s": 2.0}, "outer": {"lr": 0.5, "momentum": 0.0, "nesterov": False},
    "step_lr": {"step_size": 10, "gamma": 0.8}, "checkpoint_monitor": {"monitor": "val_acc", "mode": "max"},
    "early_stopping": {"monitor": "val_loss", "min_delta": 10.0, "patience": 1}, "tensorboard_version": None,
}  # fmt: skip


# --------------------------------------------------------------------------- unknown keys


def test_an_unknown_key_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"^unknown scenario key\(s\) 'epocs'; known keys: out, devices, ") as info:
        ScenarioConfig.from_dict({"epochs": 2, "epocs": 3})
    assert "epochs" in str(info.value) and "collective_fault" in str(info.value)
    with pytest.raises(ValueError, match=r"unknown scenario key\(s\) 'sampels', 'validat';"):
        ScenarioConfig.from_dict({"sampels": 3, "validat": False})


@pytest.mark.parametrize(
    ("config", "where", "known"),
    [
        ({"kill_at": {"rank": 1, "bach": 4}}, "kill_at", "rank, epoch, batch, window, phase, signal"),
        ({"signals": [{"rank": 0}, {"rank": 0, "phse": "sanity"}]}, "signals[1]", "rank, phase, epoch, batch"),
        ({"collective_fault": {"rank": 1, "nth": 1, "peer_delay_s": 2.0}}, "collective_fault", "rank, nth, op"),
        ({"nan_at": [{"rank": 1, "batch": 2, "epoch": 1}]}, "nan_at[0]", "rank, batch"),
        ({"early_stopping": {"monitor": "val_loss", "patients": 3}}, "early_stopping", "monitor, min_delta"),
    ],
)
def test_an_unknown_nested_key_is_refused_naming_where_it_is(config, where, known):
    with pytest.raises(ValueError, match=r"^unknown scenario key\(s\) '\w+' in ") as info:
        ScenarioConfig.from_dict(config)
    assert f" in {where}; known keys: {known}" in str(info.value)


def test_an_unknown_key_in_a_per_rank_override_is_refused_naming_the_rank():
    with pytest.raises(ValueError, match=r"unknown scenario key\(s\) 'sampels' in per_rank\[1\]; known keys: out, "):
        ScenarioConfig.from_dict({"per_rank": {"1": {"sampels": 97}}})
    with pytest.raises(ValueError, match=r"unknown scenario key\(s\) 'bach' in per_rank\[1\]\.kill_at; known keys"):
        ScenarioConfig.from_dict({"kill_at": {"rank": 1, "batch": 4}, "per_rank": {"1": {"kill_at": {"bach": 5}}}})
    with pytest.raises(ValueError, match=r"scenario key 'per_rank\[0\]\.dataset' must be one of"):
        ScenarioConfig.from_dict({"per_rank": {"0": {"dataset": "mapp"}}})
    with pytest.raises(ValueError, match=r"'out' cannot be overridden per rank"):
        ScenarioConfig.from_dict({"per_rank": {"0": {"out": "/elsewhere"}}})


def test_run_scenario_refuses_a_misspelt_key_before_starting_any_process(tmp_path, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(conftest, "run_python", started)
    monkeypatch.setattr(conftest, "start", started)
    with pytest.raises(ValueError, match=r"unknown scenario key\(s\) 'epocs'"):
        conftest.run_scenario(tmp_path, epocs=2)
    with pytest.raises(ValueError, match=r"unknown scenario key\(s\) 'bach' in kill_at"):
        conftest.start_srun_style(tmp_path, 2, {"kill_at": {"rank": 1, "bach": 4}}, {})


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"dataset": "mapp"}, "'dataset' must be one of 'map', 'iterable', 'shards', 'litdata'; got 'mapp'"),
        ({"slow_clock": "walll"}, "'slow_clock' must be one of 'thread', 'cpu', 'wall'; got 'walll'"),
        ({"strategy": "dpp"}, "'strategy' must be one of 'elche', 'ddp'; got 'dpp'"),
        ({"model": "resnet"}, "'model' must be one of 'mlp', 'bn', 'wide_ln'; got 'resnet'"),
        ({"optimizer": "Adam"}, "'optimizer' must be one of 'sgd', 'adam'; got 'Adam'"),
        ({"collective_fault": {"rank": 1, "nth": 1, "op": "allreduce"}}, "'collective_fault.op' must be one of"),
        ({"collective_fault": {"rank": 1, "nth": 1, "when": "during"}}, "'collective_fault.when' must be one of"),
        ({"signals": [{"rank": 0, "to": "everyone"}]}, "'signals[0].to' must be one of 'self', 'all'; got 'everyone'"),
        ({"kill_at": {"rank": 0, "batch": 1, "signal": "SIGTERM"}}, "'kill_at.signal' must be one of"),
        ({"raise_at": {"rank": "some", "batch": 0}}, "'raise_at.rank': 'some' fits none of its types"),
    ],
)
def test_an_invalid_literal_is_refused(config, needle):
    with pytest.raises(ValueError) as info:
        ScenarioConfig.from_dict(config)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"samples": "256"}, "'samples' must be of type int, got '256'"),
        ({"epochs": True}, "'epochs' must be of type int, got True"),
        ({"lr": "0.1"}, "'lr' must be of type float"),
        ({"slow": {"one": 2.0}}, "'slow': 'one' is not a rank"),
        ({"nan_at": {"rank": 0, "batch": 1}}, "'nan_at' must be a list"),
        ({"kill_at": 3}, "'kill_at' must be a mapping of keys"),
        ({"elche": {"anchor": object()}}, "is not JSON data"),
        ({"kill_at": {"rank": 1}}, "'kill_at' needs exactly one of 'batch', 'window', 'phase'; got []"),
        ({"kill_at": {"rank": 1, "batch": 2, "phase": "validation"}}, "needs exactly one of"),
        ({"kill_at": {"rank": 1, "phase": "validation", "signal": "SIGSTOP"}}, "'signal' is sent only with 'batch'"),
        ({"dataset": "litdata"}, "'litdata_dir' (or 'litdata_combined', 'litdata_parallel') is needed with dataset='litdata'"),
    ],
)
def test_an_invalid_value_is_refused(config, needle):
    with pytest.raises(ValueError) as info:
        ScenarioConfig.from_dict(config)
    assert needle in str(info.value)


def test_the_defaults_are_those_the_scenario_always_had():
    config = ScenarioConfig()
    assert {f.name: getattr(config, f.name) for f in dataclasses.fields(config)} == OLD_DEFAULTS
    assert KillAt(rank=1, batch=2) == KillAt.from_dict({"rank": 1, "batch": 2})
    assert (KillAt(rank=1, batch=2).epoch, KillAt(rank=1, batch=2).signal) == (0, "SIGKILL")
    assert (SigtermAt(rank=1, batch=2).epoch, SigtermAt(rank=1, batch=2).signal) == (0, "SIGTERM")
    assert dataclasses.astuple(Signal(rank=0)) == (0, "train", 0, 0, 1, "self")
    assert dataclasses.astuple(CollectiveFault(rank=1, nth=2)) == (1, 2, "all_reduce", "elche:", None, "before", 0.5)
    assert RaiseAt(rank="all", batch=3).epoch == 0
    assert dataclasses.astuple(CheckpointIOFaults()) == (0, 0.0)
    assert ScenarioConfig().to_dict() == {} and ScenarioConfig().to_json() == "{}"


def test_every_key_says_what_it_does():
    """One comment per field, in the dataclass that names it (the scenario's keys are documented there)."""
    for cls in [obj for obj in vars(scenario_config).values() if dataclasses.is_dataclass(obj)]:
        source = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            line = next(line for line in source.splitlines() if line.strip().startswith(f"{f.name}:"))
            assert "#" in line, f"{cls.__name__}.{f.name} has no comment"


def test_the_module_imports_neither_torch_nor_lightning():
    tree = ast.parse(inspect.getsource(scenario_config))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {name for name in imported if name.split(".")[0] in ("torch", "lightning", "lightning_elche")}


# --------------------------------------------------------------------------- the JSON the processes receive


def test_the_json_round_trip_is_exact():
    config = ScenarioConfig.from_dict(EVERYTHING)
    text = config.to_json()
    rebuilt = ScenarioConfig.from_json(text)
    assert rebuilt == config
    assert rebuilt.to_json() == text
    assert ScenarioConfig.from_dict(json.loads(text)) == config
    for name in EVERYTHING:  # nothing lost: every key given is in the JSON (none of them is its default)
        assert name in json.loads(text), name
    assert json.loads(text)["slow"] == {"1": 3.0, "2": 2}
    assert config.slow == {1: 3.0, 2: 2} and config.nan_at == (RankBatch(rank=0, batch=2), RankBatch(rank=1, batch=2))
    assert config.kill_at == KillAt(rank=1, batch=4, signal="SIGSTOP")
    # the typed spelling and JSON's are the same configuration
    typed = dataclasses.replace(ScenarioConfig.from_dict(EVERYTHING), kill_at=KillAt(rank=1, batch=4, signal="SIGSTOP"))
    assert typed == config and ScenarioConfig.from_dict({**EVERYTHING, "slow": {1: 3.0, 2: 2}}) == config


def test_the_free_form_mappings_are_frozen_and_thaw_into_plain_keyword_arguments():
    config = ScenarioConfig.from_dict(EVERYTHING)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.epochs = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.elche["anchor"] = 5  # type: ignore[index]
    elche = thaw(config.elche)
    assert elche == EVERYTHING["elche"] and type(elche) is dict and type(elche["partition_ratios"]) is list


def test_a_ranks_config_lays_its_override_over_the_base_one_level_deep():
    config = ScenarioConfig.from_dict(EVERYTHING)
    rank1 = config.for_rank(1)
    assert isinstance(rank1, ScenarioConfig) and rank1.per_rank == {}
    assert rank1.samples == 98 and rank1.devices == 3
    assert thaw(rank1.elche) == {**EVERYTHING["elche"], "anchor": 2}
    assert rank1.kill_at == KillAt(rank=1, batch=5, signal="SIGSTOP")
    assert config.for_rank(2).seed == 5 and config.for_rank(2).samples == 97
    assert config.for_rank(0) == dataclasses.replace(config, per_rank={})
