"""Every benchmark script and the demo run at tiny sizes, so that none can rot unnoticed between the
full runs that are too long for the suite; the READMEs' tables match the results JSON they were
generated from; and a configuration that fails is recorded, shown as failed and fails the run.

A smoke run (``--smoke``) goes through every code path of its script once. It is started as
``python benchmarks/<name>.py`` (forked from the tests' pre-imported interpreter, see
``conftest.start``), and its jobs fork from it in turn (``benchmarks/harness.py``), so it costs its
fits, not the imports of a fresh interpreter per process; only the scripts whose subject is a
launcher (torchrun, ``lightning_elche.launch``) start fresh ranks, and take a minute or two.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import run_python

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # ``benchmarks`` is a folder of the repository, not of the installed package

# script -> seconds its smoke run may take on a loaded 2-core machine; measured here, forked as above: under 30 s, goodput
# 65-95 s and elastic_goodput 135-155 s (torchrun relaunches fresh interpreters after ElChe's 10 s roll call)
SMOKE_TIMEOUT_S = {
    "checkpoint": 120, "dispatch": 300, "dispatch_sim": 120, "streaming": 240, "guard_false_alarms": 120, "hierarchy": 240, "memory": 180,
    "overlap": 180, "goodput": 420, "elastic_goodput": 480, "slow_link": 300, "validation_wait": 120, "fault_sweep": 420,
    "alternation": 120, "step_cost": 180, "optimizer_averaging": 120,
}  # fmt: skip (the GPU check is the package's: tests/test_gpu_check.py)
DETERMINISTIC = {"dispatch_sim"}  # seeded, one run per case: no repeats, so no spreads


def spreads(value: Any) -> Iterator[dict[str, float]]:
    """Every ``{"median", "min", "max", ...}`` inside a results record."""
    if isinstance(value, dict):
        if {"median", "min", "max"} <= set(value):
            yield value
        for item in value.values():
            yield from spreads(item)
    elif isinstance(value, list):
        for item in value:
            yield from spreads(item)


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.timeout(timeout + 30)) for name, timeout in sorted(SMOKE_TIMEOUT_S.items())]
)
def test_benchmark_smoke_run_writes_its_results(name, tmp_path):
    out = tmp_path / f"{name}.json"
    script = f"benchmarks/{name}.py"
    proc = run_python([str(REPO / script), "--smoke", "--json", str(out)], REPO, SMOKE_TIMEOUT_S[name], what=f"{script} --smoke")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} --smoke failed (exit {proc.returncode}):\n{output[-6000:]}"
    record = json.loads(out.read_text())
    assert record["benchmark"] == name
    provenance = record["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}", provenance["commit"]), provenance
    assert provenance["date"] and provenance["machine"] and "torch" in provenance["versions"], provenance
    assert record["results"], "no results"
    assert record["failures"] == [], record["failures"]
    found = list(spreads(record["results"]))
    assert found or name in DETERMINISTIC, "no min / median / max in the results"
    for spread in found:
        assert spread["min"] <= spread["median"] <= spread["max"], spread
    rendered = importlib.import_module(f"benchmarks.{name}").tables(record)
    assert rendered, "tables() rendered nothing"
    for table in rendered.values():
        assert table.strip() in proc.stdout, f"{script} did not print the table its JSON renders:\n{table}"


@pytest.mark.timeout(330)
def test_demo_runs_at_its_smallest_size(tmp_path):
    proc = run_python(["-m", "lightning_elche.demo", "--epochs", "1", "--hidden", "16"], tmp_path, 300, what="python -m lightning_elche.demo")
    assert proc.returncode == 0, f"the demo failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    assert "speedup of ElChe over DDP" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.timeout(120)
def test_readme_tables_match_their_results_json():
    """What ``python -m benchmarks.tables --check`` checks, in this process."""
    from benchmarks.tables import differences

    diffs = differences()
    assert diffs == [], "tables differ from their JSON; run `python -m benchmarks.tables`:\n" + "\n".join(diffs)


@pytest.mark.timeout(60)
def test_a_failing_configuration_is_recorded_shown_as_failed_and_fails_the_run(tmp_path, monkeypatch, capsys):
    from benchmarks import memory
    from benchmarks.harness import conclude
    from benchmarks.provenance import Failures
    from lightning_elche._jobs import JobFailed

    def job(module: str, worker: Any, config: dict[str, Any], ranks: int, timeout: float, warm: bool) -> list[dict]:
        if config["name"] == "elche sync":
            raise JobFailed("elche sync failed (exit 1): rank 1 lost its process group")
        return [{"peak_rss_mb": 100.0 + rank, "param_mb": 1.0} for rank in range(ranks)]

    monkeypatch.setattr(memory, "run_job", job)
    args = argparse.Namespace(hidden=64, samples=128, repeats=2, timeout=1.0, smoke=True, json=tmp_path / "memory.json")
    failures = Failures()
    results = memory.measure(args, failures)
    with pytest.raises(SystemExit) as exit:
        conclude("memory", args, results, failures, memory.tables)
    assert exit.value.code == 1
    record = json.loads(args.json.read_text())
    assert [(f["configuration"], f["repeat"]) for f in record["failures"]] == [("elche sync", 0), ("elche sync", 1)]
    assert "rank 1 lost its process group" in record["failures"][0]["error"]
    printed = capsys.readouterr().out
    assert "| ElChe sync | failed (2 of 2 runs) | |" in printed, printed
    assert "| ElChe cadence | 101 | +0 MB |" in printed, printed  # the others are measured and shown


def test_rank_0s_wait_at_a_boundary_is_its_time_there_over_the_shortest_of_the_others():
    """``elastic_goodput --idle-slowdown``'s figure: each boundary carries every rank's time at the one before
    (``previous_boundary_ms``); rank 0 waited for the last arrival its time there less the shortest other's
    (the last to arrive waits least), never less than nothing."""
    from types import SimpleNamespace

    from benchmarks.elastic_goodput import waited_s

    records = [SimpleNamespace(previous_boundary_ms=[]), SimpleNamespace(previous_boundary_ms=[500.0, 100.0, 300.0]),
               SimpleNamespace(previous_boundary_ms=[50.0, 80.0, 90.0]), SimpleNamespace(previous_boundary_ms=[250.0, 300.0, 50.0])]
    assert waited_s(records) == pytest.approx(0.4 + 0.0 + 0.2)
    assert waited_s(records[:1]) == 0.0


def test_each_kill_is_paired_with_the_first_newcomer_after_it(tmp_path):
    """``elastic_goodput``'s kill-to-replacement delays: each kill takes the first newcomer's first batch after
    it that no earlier kill took; a kill no newcomer followed has none (at a kill every 15 s, pairing kills
    and newcomers in order gave a negative delay, and the simulator refused it)."""
    from benchmarks.elastic_goodput import replacement_delays

    launched = 1000.0
    # members 0-2 launched; the spare (3) and the first kill's replacement (4) both came in after the first kill
    for member, t in {0: 1.0, 1: 1.0, 2: 1.0, 3: 12.0, 4: 13.0, 5: 32.0}.items():
        (tmp_path / f"first_batch_m{member}.json").write_text(json.dumps({"t": launched + t}))
    kills = [{"after_s": 10.0}, {"after_s": 30.0}, {"after_s": 45.0}]
    assert replacement_delays(tmp_path, kills, 3, launched) == [2.0, 2.0]  # in order: 2, then 13 - 30 < 0
