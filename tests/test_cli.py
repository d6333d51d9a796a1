"""ElCheStrategy through LightningCLI: YAML parsing, --print_config, validation errors, and one
real two-process ``fit`` launched from the command line."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import run_python

TESTS = Path(__file__).resolve().parent
CLI_APP = TESTS / "cli_app.py"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import cli_app  # noqa: E402

from lightning_elche import ElCheStrategy  # noqa: E402

E2E_TIMEOUT_S = 150

QUIET_TRAINER = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def write_config(path: Path, init_args: dict | None = None, trainer: dict | None = None, model: dict | None = None) -> Path:
    strategy: dict = {"class_path": "lightning_elche.ElCheStrategy"}
    if init_args is not None:
        strategy["init_args"] = init_args
    config = {"trainer": {**QUIET_TRAINER, **(trainer or {}), "strategy": strategy}}
    if model:
        config["model"] = model
    path.write_text(yaml.safe_dump(config))
    return path


def parse(config: Path, *extra: str):
    # LightningCLI warns when pytest's own argv is present alongside args=.
    with mock.patch.object(sys, "argv", [str(CLI_APP)]):
        return cli_app.make_cli(args=["--config", str(config), *extra], run=False)


def print_config(config: Path) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        parse(config, "--print_config")
    assert exit_info.value.code in (0, None)
    return out.getvalue()


SPEC_ARGS = {"policy": "cadence", "overhead_target": 0.1, "timeout": 30, "window": {"anchor": 4}}


def test_yaml_builds_the_configured_strategy(tmp_path):
    cli = parse(write_config(tmp_path / "run.yaml", SPEC_ARGS))
    strategy = cli.trainer.strategy
    assert type(strategy) is ElCheStrategy
    assert strategy.settings.averaging.policy == "cadence"
    assert strategy.settings.window.anchor == 4
    assert strategy.settings.window.min_anchor == 4
    assert strategy.settings.window.overhead_target == 0.1
    assert strategy._timeout == timedelta(seconds=30)
    assert strategy._start_method == "popen"


def test_yaml_all_elche_arguments(tmp_path):
    """The common settings flat, one setting or more of each group nested (docs/configuration.md)."""
    init_args = {
        "policy": "cadence",
        "overhead_target": 0.2,
        "timeout": "0:00:45",
        "window": {"anchor": 6, "min_anchor": 3, "max_anchor": 50, "max_batch_diff": 2},
        "averaging": {"reduce_on": "cpu", "gamma": 0.0},
        "data": {"micro_batch_sizes": [8, 4], "partition_ratios": [1, 3], "seed": 7},
        "faults": {"strict_collectives": False},
        "links": {"link_mbit_s": 100},
        "reporting": {"scalar_reductions": {"tokens": "sum"}},
        "start_method": "spawn",
        "process_group_backend": "gloo",
    }
    strategy = parse(write_config(tmp_path / "run.yaml", init_args)).trainer.strategy
    assert strategy.settings.faults.strict_collectives is False and strategy.settings.links.link_mbit_s == 100
    assert strategy.settings.reporting.scalar_reductions == {"tokens": "sum"}
    assert list(strategy.settings.data.micro_batch_sizes) == [8, 4]
    assert (strategy.settings.averaging.reduce_on, strategy.settings.window.anchor, strategy.settings.window.min_anchor, strategy.settings.window.max_anchor) == ("cpu", 6, 3, 50)
    assert (strategy.settings.window.overhead_target, strategy.settings.window.max_batch_diff, strategy.settings.averaging.gamma, strategy.settings.data.seed) == (0.2, 2, 0.0, 7)
    assert strategy.settings.data.partition_ratios == [1.0, 3.0]
    assert strategy._timeout == timedelta(seconds=45)
    assert strategy._start_method == "spawn"
    assert strategy._process_group_backend == "gloo"


def test_strategy_name_string_in_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"trainer": {**QUIET_TRAINER, "strategy": "elche_spawn"}}))
    strategy = parse(path).trainer.strategy
    assert type(strategy) is ElCheStrategy and strategy._start_method == "spawn"


def test_print_config_lists_elche_arguments_and_no_ddp_wrapper_kwargs(tmp_path):
    text = print_config(write_config(tmp_path / "run.yaml", SPEC_ARGS))
    printed = yaml.safe_load(text)
    init_args = printed["trainer"]["strategy"]["init_args"]
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_elche.ElCheStrategy"
    for name in (
        "policy", "overhead_target", "dispatch", "elastic", "compression", "outer_optimizer", "timeout",
        "window", "averaging", "data", "faults", "links", "reporting", "process_group_backend", "start_method",
    ):
        assert name in init_args, f"--print_config does not list `{name}`"
    assert init_args["window"]["anchor"] == 4 and init_args["overhead_target"] == 0.1
    # DDPStrategy forwards **kwargs to DistributedDataParallel; ElChe has no DDP wrapper and must
    # not advertise any of its options.
    for ddp_only in (
        "find_unused_parameters", "ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper",
        "model_averaging_period", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb",
        "broadcast_buffers", "kwargs",
    ):
        assert ddp_only not in init_args, f"--print_config lists DDP-only `{ddp_only}`"
        assert ddp_only not in text


def test_print_config_round_trips(tmp_path):
    """``--print_config > config.yaml`` must parse back into the same strategy (default timeout too)."""
    for name, init_args in (("given", SPEC_ARGS), ("defaults", None)):
        text = print_config(write_config(tmp_path / f"{name}.yaml", init_args))
        dumped = tmp_path / f"{name}-printed.yaml"
        dumped.write_text(text)
        strategy = parse(dumped).trainer.strategy
        assert type(strategy) is ElCheStrategy
        if init_args is None:
            assert strategy.settings.window.anchor == 10 and strategy._timeout == timedelta(minutes=5)
        else:
            assert strategy.settings.window.anchor == 4 and strategy._timeout == timedelta(seconds=30)


@pytest.mark.parametrize(
    ("name", "value", "group"),
    [("anchor", 0, "window"), ("overhead_target", 0.9, None), ("gamma", 10.0, "averaging"), ("timeout", -1, None),
     ("max_batch_diff", -2, "window")],
)
def test_bad_yaml_value_fails_naming_the_argument(tmp_path, capsys, name, value, group):
    bad = {name: value} if group is None else {group: {**SPEC_ARGS.get(group, {}), name: value}}
    config = write_config(tmp_path / "bad.yaml", {**SPEC_ARGS, **bad})
    with pytest.raises((ValueError, SystemExit)) as info:
        parse(config)
    captured = capsys.readouterr()
    message = str(info.value) + captured.err + captured.out
    assert f"`{name}`" in message, message[-3000:]


@pytest.mark.timeout(E2E_TIMEOUT_S + 50)
def test_cli_fit_on_two_processes(tmp_path):
    markers = tmp_path / "markers"
    samples, batch_size = 96, 8
    config = write_config(
        tmp_path / "fit.yaml",
        SPEC_ARGS,
        trainer={
            "devices": 2,
            "max_epochs": 1,
            "num_sanity_val_steps": 0,
            "default_root_dir": str(tmp_path / "root"),
        },
        model={"samples": samples, "batch_size": batch_size, "marker_dir": str(markers)},
    )
    proc = run_python([str(CLI_APP), "fit", "--config", str(config)], tmp_path, E2E_TIMEOUT_S, what="`cli_app.py fit`")
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{proc.stderr[-6000:]}"
    records = []
    for rank in range(2):
        path = markers / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no marker:\n{proc.stderr[-4000:]}"
        records.append(json.loads(path.read_text()))
    for rank, record in enumerate(records):
        assert record["rank"] == rank and record["world_size"] == 2
        assert record["strategy"] == "ElCheStrategy"
        assert (record["policy"], record["anchor"], record["timeout_s"]) == ("cadence", 4, 30.0)
        assert record["global_step"] > 0, record
        assert record["batches_trained"] > 0, record
        assert record["boundaries"] > 0, record
    # One epoch covers the data set once between the two ranks (uneven shares may end in a
    # partial batch on each rank, so count samples, not batches).
    assert sum(r["samples_trained"] for r in records) == samples
    # trainer.global_step is the DDP-equivalent (cohort) step: all ranks' steps / world size.
    total_steps = sum(r["batches_trained"] for r in records)
    assert all(r["global_step"] == total_steps // 2 for r in records), (records, total_steps)
    # The last boundary leaves both replicas with the same parameters.
    assert records[0]["params"] == records[1]["params"]
