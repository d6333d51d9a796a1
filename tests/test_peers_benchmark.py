"""The peers benchmark, its simulator check and its plots run end to end at smoke size, and a
configuration that fails is shown as failed in the tables, never left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_python

from benchmarks.peers import CONFIGS, against_kept, summarize, tables

REPO = Path(__file__).resolve().parent.parent
SMOKE_TIMEOUT_S = 540


def run_module(module: str, tmp_path: Path, *args: str) -> None:
    proc = run_python(["-m", module, *args], REPO, SMOKE_TIMEOUT_S, what=f"python -m {module}")
    assert proc.returncode == 0, f"python -m {module} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"


# torchft's and Hivemind's runs have tests of their own (tests/test_peers_torchft.py, tests/test_peers_hivemind.py,
# the same functions the benchmark calls); the smoke run measures the others, which exercise every step of the
# driver (solo rates, summaries paired per repeat, tables, simulator check, plots)
TESTED_ON_THEIR_OWN = ("torchft-localsgd", "torchft-diloco", "hivemind")
SMOKE_CONFIGS = [name for name in CONFIGS if name not in TESTED_ON_THEIR_OWN]


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_peers_smoke_measures_every_configuration_and_feeds_the_simulator_check_and_plots(tmp_path):
    peers = tmp_path / "peers.json"
    run_module("benchmarks.peers", tmp_path, "--smoke", "--json", str(peers), "--configs", *SMOKE_CONFIGS)
    record = json.loads(peers.read_text())
    provenance = record["provenance"]
    assert len(provenance["commit"]) == 40 and provenance["date"] and provenance["machine"]
    assert {"torch", "lightning", "torchft"} <= set(provenance["versions"])
    assert record["failures"] == []
    summary = record["results"]["2"]["summary"]
    assert summary["ideal"]["median"] > summary["sync_bound"]["median"] / 2 > 0
    assert set(summary) == {"ideal", "sync_bound", "fast", "slow", *SMOKE_CONFIGS}, set(summary)
    for name in SMOKE_CONFIGS:
        row = summary[name]
        rate = row["samples_per_s"]
        assert row["failed"] == 0 and rate["min"] <= rate["median"] <= rate["max"] and rate["median"] > 0, (name, row)
        assert row["final_acc"]["median"] > 0.2, (name, row["final_acc"])  # 10 classes: it trained
    assert summary["ddp"]["over_ddp"]["median"] == pytest.approx(1.0)
    rendered = tables(record)
    assert set(rendered) == {"k=2", "headline"}
    assert all(label in rendered["k=2"] for label in ("Lightning post-local SGD", "Lightning DDP", "ElChe cadence"))

    check = tmp_path / "simulator_check.json"
    run_module("benchmarks.simulator_check", tmp_path, "--peers", str(peers), "--json", str(check), "--ranks", "2", "64")
    replay = json.loads(check.read_text())["results"]
    assert [row["k"] for row in replay["replay"]] == ["2"] and replay["replay"][0]["elche_predicted"] > 0
    assert {"ElChe, simulator", "ElChe, the ideal", "DDP, the synchronous bound"} <= set(replay["errors"])
    assert [row["ranks"] for row in replay["scale"]] == [2, 64]

    run_module("benchmarks.report", tmp_path, "--results", str(peers), "--out", str(tmp_path / "plots"))
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"throughput.png", "time_to_accuracy.png"}


def run(rate: float, to_target: float | None = 5.0) -> dict:
    return {"samples_per_s": rate, "to_target_s": to_target, "to_target_samples": 1000, "acc_at_budget": 0.8,
            "final_acc": 0.85, "boundary_ms": None}


def test_a_failed_configuration_stays_in_the_table_as_failed():
    solo = {"fast": 100.0, "slow": 50.0, "ideal": 150.0, "sync_bound": 100.0}
    runs = {"solo": [solo, solo], "ddp": [run(90.0), run(80.0)], "torchft-diloco": [None, None], "elche-cadence": [run(140.0), None]}
    summary = summarize(runs)
    assert summary["torchft-diloco"] == {"failed": 2}
    assert summary["elche-cadence"]["failed"] == 1 and summary["elche-cadence"]["runs"] == 1
    assert summary["elche-cadence"]["over_ddp"]["median"] == pytest.approx(140.0 / 90.0)  # paired with its own repeat only
    record = {"args": {"target": "0.84", "budget_s": "8"}, "results": {"4": {"summary": summary, "runs": runs}}}
    rendered = tables(record)
    assert "| torchft DiLoCo | failed (2 of 2 runs) |" in rendered["k=4"]
    assert "ElChe cadence** (1 failed)" in rendered["k=4"]


def test_a_quick_run_is_set_beside_the_kept_figures_at_the_same_k():
    """``--quick``'s last table: each configuration's ratios now and the kept run's, paired by k and name."""
    row = {"samples_per_s": {"median": 3000.0}, "over_ideal": {"median": 0.97, "min": 0.97, "max": 0.97, "n": 1},
           "over_ddp": {"median": 2.5, "min": 2.5, "max": 2.5, "n": 1}}
    kept_row = {**row, "over_ideal": {"median": 0.95, "min": 0.93, "max": 0.99, "n": 2}}
    now = {"results": {"4": {"summary": {"ideal": {"median": 3100.0}, "elche-cadence": row}}}}
    kept = {"results": {"4": {"summary": {"elche-cadence": kept_row}}, "2": {"summary": {"elche-cadence": row}}}}
    lines = against_kept(now, kept).splitlines()
    assert len(lines) == 3 and lines[2].startswith("| 4x **ElChe cadence** |")
    assert "0.97, 0.95 (0.93-0.99)" in lines[2] and "2.50, 2.50" in lines[2]
