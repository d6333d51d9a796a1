"""The elastic launcher's command line and signals, as a scheduler and a torchrun user meet them.

- torchrun's flag names mean the same (``--nproc-per-node``, ``--nnodes``, ``--node-rank``,
  ``--rdzv-endpoint``), the short forms stay as aliases;
- every argument after the script reaches the script untouched (an abbreviation of one of the
  launcher's options, ``-h``), on a real launch;
- SIGTERM to the launcher (SLURM's, a container runtime's) reaches every rank, which stop together at
  the next boundary with the boundary's checkpoint, and the launcher exits as a process that
  SIGTERM ended (143) once they have.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCENARIO, coverage_report, kill_group, load_results, start, wait_all, wait_until
from scenario_config import ScenarioConfig

from lightning_elche.launch import parse

ARGUMENTS_APP = "import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))\n"


@pytest.mark.parametrize(
    "command_line",
    [
        ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29500", "train.py"],
        ["--nproc_per_node=2", "--nnodes=2", "--node_rank=1", "--rdzv_endpoint=h:29500", "train.py"],
        ["--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv", "h:29500", "train.py"],
    ],
    ids=["torchrun's-names", "torchrun's-underscore-forms", "the-short-aliases"],
)
def test_torchruns_flag_names_and_the_short_aliases_mean_the_same(command_line):
    args = parse(command_line)
    assert (args.nproc, args.nnodes, args.node_rank, args.rdzv, args.script) == (2, 2, 1, "h:29500", "train.py")
    assert args.script_args == []


@pytest.mark.parametrize(
    "script_args",
    [["--n", "5"], ["--r"], ["-h"], ["--nproc", "9", "--join"], ["--", "x"], ["positional", "--rdzv=a:1"]],
)
def test_everything_after_the_script_is_the_scripts(script_args):
    args = parse(["--nproc", "2", "--replace", "train.py", *script_args])
    assert (args.nproc, args.replace, args.join, args.script) == (2, True, False, "train.py")
    assert args.script_args == script_args


def test_an_abbreviated_launcher_option_is_refused_before_the_script():
    with pytest.raises(SystemExit):  # argparse's usage error: --n could mean --nproc or --nnodes
        parse(["--n", "2", "train.py"])


def test_the_store_timeout_defaults_to_30_s_and_must_be_positive(capsys):
    assert parse(["--nproc", "1", "train.py"]).store_timeout == 30.0
    assert parse(["--nproc", "1", "--store-timeout", "7.5", "train.py"]).store_timeout == 7.5
    with pytest.raises(SystemExit):
        parse(["--nproc", "1", "--store-timeout", "0", "train.py"])
    assert "--store-timeout must be more than 0 seconds, got 0" in capsys.readouterr().err


def test_elche_cold_start_in_the_environment_is_the_cold_start_flag(monkeypatch):
    assert not parse(["--nproc", "1", "train.py"]).cold_start
    monkeypatch.setenv("ELCHE_COLD_START", "1")
    assert parse(["--nproc", "1", "train.py"]).cold_start


@pytest.mark.timeout(120)
def test_arguments_after_the_script_reach_it_on_a_real_launch(tmp_path):
    app = tmp_path / "arguments_app.py"
    app.write_text(ARGUMENTS_APP)
    out = tmp_path / "argv.json"
    command = [sys.executable, "-m", "lightning_elche.launch", "--nproc-per-node", "1", "--cold-start",
               str(app), str(out), "--n", "5", "--r", "-h"]  # fmt: skip
    [run] = wait_all([start(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)],
                     90, what="a launch of a script that records its arguments")  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(out.read_text()) == [str(out), "--n", "5", "--r", "-h"]


@pytest.mark.timeout(240)
def test_sigterm_to_the_launcher_stops_every_rank_at_one_boundary_with_its_checkpoint(tmp_path):
    """Three elastic ranks; once every one has passed a boundary, SIGTERM goes to the launcher only.
    Every rank raises Lightning's SIGTERMException after the same boundary, one checkpoint holds what
    was trained, and the launcher exits 128 + SIGTERM once they have."""
    config = ScenarioConfig.from_dict({
        "out": str(tmp_path / "out"), "epochs": 4, "samples": 768, "batch_size": 8, "devices": 3,
        # a slow step: after the first boundary at least 7 s of the fit's sleeping steps remain, so the signal
        # (sent within a poll of 50 ms) cannot come after the last boundary
        "step_sleep_ms": 60,
        "elche": {"elastic": True, "timeout": 30, "anchor": 4},
    })  # fmt: skip
    command = [sys.executable, "-m", "lightning_elche.launch", "--nproc-per-node", "3", str(SCENARIO), config.to_json()]
    launcher = start(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        passed = [tmp_path / "out" / f"member{member}_at_boundary.json" for member in range(3)]
        wait_until(lambda: all(path.exists() for path in passed), "every rank past its first boundary", 150, 0.05)
        launcher.send_signal(signal.SIGTERM)
        [run] = wait_all([launcher], 120, what="the launcher after SIGTERM")
    finally:
        kill_group(launcher)
    assert run.returncode == 128 + signal.SIGTERM, run.stderr[-6000:]
    results = load_results(tmp_path, 3, run.stderr)
    for result in results:
        assert result["exception"] == "SIGTERMException", (result["rank"], result["exception_message"])
        assert len(result["boundaries"]) == len(results[0]["boundaries"]), "the ranks stopped at other boundaries"
        assert result["final_digest"] == results[0]["final_digest"]
    checkpoints = sorted(p.name for p in Path(tmp_path).glob("hpc_ckpt_*.ckpt"))
    assert checkpoints == ["hpc_ckpt_1.ckpt"], checkpoints
    state = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)
    assert state["global_step"] == results[0]["global_step"]
    for epoch in range(results[0]["current_epoch"] + 1):
        report = coverage_report(results, config.samples, epoch)
        assert report["duplicates"] == [] and report["trained"] > 0, (epoch, report)
