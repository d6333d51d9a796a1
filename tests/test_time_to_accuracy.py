"""The time-to-accuracy benchmark (``benchmarks/time_to_accuracy.py``): its copies of the consensus
model at a fixed sample interval, the async consensus averaged from every rank's copies, the ratios
paired with the fast device alone of the same repeat, and the quick run end to end (every task and
configuration, the whole-fit part, tables, plots, and the tables read again at another target from
the JSON alone)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import run_python

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # ``benchmarks`` is a folder of the repository, not of the installed package

from benchmarks.time_to_accuracy import CONFIGS, QUICK, WHOLE_FIT_CONFIGS, parse  # noqa: E402
from benchmarks.tta_copies import ConsensusAtSamples, SampleCopies, consensus_points  # noqa: E402
from benchmarks.tta_summary import at_target, headline, summarize, tables, whole_fit_table  # noqa: E402
from benchmarks.tta_tasks import TASKS  # noqa: E402
from lightning_elche import BoundaryRecord  # noqa: E402

QUICK_TIMEOUT_S = 600  # about 2 minutes on an idle machine; fresh interpreters (DiLoCo, the whole fit) take far longer under load


def record(steps: list[int], samples: list[int]) -> BoundaryRecord:
    return BoundaryRecord(epoch=0, window=0, steps=steps, samples=samples, window_ms=[1.0, 1.0], boundary_ms=1.0, anchor=1,
                          counts=steps, cohort_step=sum(steps) // 2, divergence=0.0, cohort_divergence=0.0,
                          cohort_divergence_mean=0.0, verdict="stable")


def test_copies_are_taken_at_the_first_consensus_at_or_after_each_multiple_of_the_interval(tmp_path):
    net = torch.nn.Linear(2, 1)
    copies = SampleCopies(every=100)
    for samples in (64, 128, 192, 256, 320, 384, 448):  # one consensus per 64 samples
        copies.offer(net, seconds=samples / 64, samples=samples)
    assert [p["samples"] for p in copies.points] == [128, 256, 320, 448]  # first >= 100, 200, 300, 400
    copies.offer(net, 8.0, 1000)  # a long window: one copy, the next multiple after it is 1100
    copies.offer(net, 9.0, 1050)
    assert [p["samples"] for p in copies.points][-1] == 1000
    copies.finish(net, 9.5, 1050, tmp_path / "rank0.pt")
    saved = torch.load(tmp_path / "rank0.pt")
    assert [p["samples"] for p in saved["points"]][-2:] == [1000, 1050]  # the final model is always the last point
    assert saved["copy_s"] >= 0 and set(saved["points"][0]["state"]) == {"weight", "bias"}
    copies.finish(net, 9.5, 1050, tmp_path / "again.pt")  # a final model already copied is not copied twice
    assert len(torch.load(tmp_path / "again.pt")["points"]) == len(saved["points"])
    with pytest.raises(ValueError, match="at least one sample"):
        SampleCopies(every=0)


def test_the_async_consensus_is_the_work_weighted_average_of_every_ranks_copy_of_a_boundary():
    def point(value: float, weight: float, boundary: int) -> dict:
        state = {"weight": torch.full((2,), value), "count": torch.tensor(boundary)}  # an integer buffer: rank 0's
        return {"seconds": 1.0, "samples": 100 * boundary, "weight": weight, "boundary": boundary, "state": state}

    merged = consensus_points([[point(1.0, 3, 1), point(2.0, 3, 2)], [point(5.0, 1, 1), point(6.0, 1, 2)]])
    assert [p["boundary"] for p in merged] == [1, 2]
    assert torch.allclose(merged[0]["state"]["weight"], torch.full((2,), (3 * 1.0 + 5.0) / 4))
    assert torch.allclose(merged[1]["state"]["weight"], torch.full((2,), (3 * 2.0 + 6.0) / 4))
    assert merged[1]["state"]["count"].item() == 2
    alone = [point(1.0, 1, 1)]
    assert consensus_points([alone]) is alone
    with pytest.raises(ValueError, match="different boundaries"):
        consensus_points([[point(1.0, 1, 1)], [point(1.0, 1, 2)]])


def fake_trainer(rank: int, world: int, boundaries: list | None = None) -> SimpleNamespace:
    strategy = SimpleNamespace() if boundaries is None else SimpleNamespace(boundaries=boundaries)
    return SimpleNamespace(strategy=strategy, global_rank=rank, world_size=world)


def test_the_callback_copies_at_elche_boundaries_with_the_cohorts_samples_and_this_ranks_weight():
    module = SimpleNamespace(net=torch.nn.Linear(2, 1))
    boundaries: list[BoundaryRecord] = []
    trainer = fake_trainer(rank=1, world=2, boundaries=boundaries)
    clock = ConsensusAtSamples(SampleCopies(every=300), every_rank=True, gamma=1.0)
    clock.on_train_start(trainer, module)
    batch = (torch.zeros(64, 2), torch.zeros(64))
    for step in range(1, 9):
        if step % 4 == 0:  # a boundary every 4 of this rank's steps; the other rank ran 12 steps of 64
            boundaries.append(record(steps=[12, 4], samples=[768, 256]))
        clock.on_train_batch_end(trainer, module, None, batch, step)
    assert clock.samples == 8 * 64 and clock.cohort_samples == 2 * 1024 and clock.boundaries_seen == 2
    assert [(p["samples"], p["boundary"], p["weight"]) for p in clock.copies.points] == [(1024, 1, 4.0), (2048, 2, 4.0)]

    not_every = ConsensusAtSamples(SampleCopies(every=1), every_rank=False)
    not_every.on_train_batch_end(fake_trainer(rank=1, world=2, boundaries=[record([1, 1], [64, 64])]), module, None, batch, 0)
    assert not_every.copies.points == []  # only rank 0 copies where the ranks hold one model


def test_the_callback_copies_after_any_step_where_every_step_ends_on_one_model():
    module = SimpleNamespace(net=torch.nn.Linear(2, 1))
    clock = ConsensusAtSamples(SampleCopies(every=200))
    trainer = fake_trainer(rank=0, world=2)  # DDP: equal shards, the cohort's samples are this rank's x 2
    for step in range(4):
        clock.on_train_batch_end(trainer, module, None, (torch.zeros(64, 2), torch.zeros(64)), step)
    assert [p["samples"] for p in clock.copies.points] == [256, 512]  # the first step at or after 200, then 400


def run(curve: list[tuple[float, int, float]], rate: float = 100.0) -> dict:
    return {"curve": curve, "samples_per_s": rate, "final_metric": curve[-1][2], "evaluations": len(curve),
            "largest_gap_samples": 100, "eval_s": 0.1 * len(curve), "copy_s": 0.001, "load_after": 1.0}


def test_the_whole_fit_table_pairs_each_fit_with_the_fast_device_alone_of_its_repeat_and_judges_the_bar():
    """The quick run fits ElChe alone (a fresh command costs seconds): the pairing and the bar are checked here."""

    def fit(whole: float, loop: float) -> dict:
        return {"whole_fit_s": whole, "training_loop_s": loop, "launch_s": 1.0, "teardown_s": 0.5, "final_metric": 0.9}

    fits = {"k": 3, "samples": 1024, "runs": {"fast-alone": [fit(10.0, 8.0), fit(20.0, 16.0)],
                                              "elche": [fit(7.0, 6.0), fit(16.0, 12.0)], "elche-async": [None, None]}}  # fmt: skip
    table = whole_fit_table(fits)
    assert "| **ElChe defaults** | 11.5 (7.0-16.0) | 0.75 (0.70-0.80) | 9.0 (6.0-12.0) | 0.75 |" in table, table  # 7/10, 16/20
    assert "| ElChe async | failed |" in table and ": met (0.75x, 0.75x)." in table, table
    slower = whole_fit_table(dict(fits, runs=dict(fits["runs"], elche=[fit(9.0, 6.0), fit(18.0, 12.0)])))
    assert ": not met (0.90x, 0.75x)." in slower, slower
    assert "Issue 35's bar" not in whole_fit_table(dict(fits, runs={"elche": fits["runs"]["elche"]}))  # nothing to pair with


def test_ratios_are_paired_with_the_fast_device_alone_of_the_same_repeat_and_failures_stay_in_the_tables():
    runs = {
        "fast-alone": [run([(1.0, 100, 0.5), (4.0, 400, 0.9)]), run([(2.0, 100, 0.5), (8.0, 400, 0.9)])],
        "elche": [run([(1.0, 200, 0.6), (2.0, 400, 0.91)]), run([(6.0, 600, 0.92)])],
        "ddp": [run([(3.0, 300, 0.7)]), None],
        "torchft-diloco": [None, None],
    }
    summary = summarize(runs, target=0.9, higher_is_better=True)
    assert summary["elche"]["time_vs_alone"]["median"] == pytest.approx((2.0 / 4.0 + 6.0 / 8.0) / 2)
    assert summary["elche"]["samples_vs_alone"]["min"] == pytest.approx(1.0) and summary["elche"]["samples_vs_alone"]["max"] == 1.5
    assert summary["ddp"]["reached"] == 0 and summary["ddp"]["failed"] == 1 and summary["ddp"]["time_vs_alone"] is None
    assert summary["torchft-diloco"] == {"runs": 0, "failed": 2}
    assert at_target(run([(1.0, 10, 2.5), (2.0, 20, 1.9)]), 2.0, higher_is_better=False) == (2.0, 20)  # a loss: lower is better

    entry = {"metric": "test accuracy", "higher_is_better": True, "target": 0.9, "every_samples": 100, "by_k": {"2": {"runs": runs}}}
    rendered = tables({"results": {"tasks": {"fashion": entry}, "whole_fit": None}})
    assert set(rendered) == {"fashion k=2", "headline", "readme"}
    assert "ElChe async" not in rendered["readme"] and "**ElChe defaults**" in rendered["readme"]  # README's short one
    assert "| torchft DiLoCo | failed (2 of 2 runs) |" in rendered["fashion k=2"]
    assert "| Lightning DDP (1 failed) | 0/1 |" in rendered["fashion k=2"]
    shown = headline({"fashion": entry})
    assert "| 0.62x (0.50-0.75) |" in shown and "1 missed" in shown
    assert shown.rstrip().endswith("| met |")  # 0.62x <= 0.85x at k = 2, and a peer that missed or failed is behind

    # ElChe 3.6 and 7.2 s against the fast device alone's 4 and 8 s (0.9x) and DDP's 3 and 5 s
    slower = dict(runs, elche=[run([(3.6, 400, 0.9)]), run([(7.2, 400, 0.9)])], ddp=[run([(3.0, 300, 0.95)]), run([(5.0, 300, 0.95)])])
    rows = headline({"fashion": dict(entry, by_k={"2": {"runs": slower}, "1": {"runs": slower}})}).splitlines()
    assert rows[2].endswith("| not met: 0.90x the fast device alone (bar 0.85x); not ahead of Lightning DDP |"), rows[2]
    assert rows[3].endswith("| not met: slower than Lightning DDP |"), rows[3]  # k = 1: DDP is the bar


def test_per_task_settings_are_read_and_a_bad_one_is_refused_naming_the_option():
    args = parse(["--target", "charlm=1.9", "fashion=0.9", "--epochs", "mlp=4", "--json", "/tmp/unused.json"])
    assert args.target == {"charlm": 1.9, "fashion": 0.9} and args.epochs == {"mlp": 4} and args.every_samples == {}
    with pytest.raises(SystemExit, match="--target: expected TASK=VALUE with TASK one of fashion, mlp, charlm, got 'cifar=0.9'"):
        parse(["--target", "cifar=0.9"])
    with pytest.raises(SystemExit, match="--epochs mlp=four: 'four' is not an integer"):
        parse(["--epochs", "mlp=four"])
    quick = parse(["--quick", "--target", "mlp=0.5"])
    assert quick.target["mlp"] == 0.5 and quick.target["fashion"] == QUICK["target"]["fashion"]  # the command line wins
    assert quick.json.name == "elche-time_to_accuracy-smoke.json"  # a quick run never writes over the kept results


@pytest.mark.timeout(QUICK_TIMEOUT_S + 120)
def test_quick_run_measures_every_task_and_configuration_and_its_tables_can_be_read_again_at_another_target(tmp_path):
    out = tmp_path / "tta.json"
    proc = run_python(["-m", "benchmarks.time_to_accuracy", "--quick", "--json", str(out)], REPO, QUICK_TIMEOUT_S,
                      what="benchmarks/time_to_accuracy.py --quick")
    assert proc.returncode == 0, f"--quick failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    record = json.loads(out.read_text())
    assert record["benchmark"] == "time_to_accuracy" and record["failures"] == [] and record["results"]["complete"]
    assert len(record["provenance"]["commit"]) == 40 and {"torch", "lightning", "torchft"} <= set(record["provenance"]["versions"])
    tasks = record["results"]["tasks"]
    assert set(tasks) == {"fashion", "mlp", "charlm"}
    for name, entry in tasks.items():
        runs = entry["by_k"]["2"]["runs"]
        assert set(runs) == set(CONFIGS), name
        every = QUICK["every_samples"][name]
        for config, (result,) in runs.items():
            samples = [p[1] for p in result["curve"]]
            seconds = [p[0] for p in result["curve"]]
            assert samples == sorted(set(samples)) and seconds == sorted(seconds), (name, config, result["curve"])
            assert samples[-1] == result["samples"], (name, config)  # the last evaluation is the final model
            # one evaluation per interval at most (the final model aside): the copies follow the samples, not the clock
            assert len(samples) - 1 <= result["samples"] // every, (name, config, samples)
            assert result["eval_s"] > 0 and result["copy_s"] >= 0 and result["samples_per_s"] > 0
        alone = [p[1] for p in runs["fast-alone"][0]["curve"]]
        assert all(s % every < TASKS[name].batch_size for s in alone[:-1]), alone  # alone, every step ends on the one model
        summary = entry["by_k"]["2"]["summary"]
        assert summary["fast-alone"]["reached"] == 1 and summary["fast-alone"]["time_vs_alone"]["median"] == 1.0, summary
    fits = record["results"]["whole_fit"]["runs"]
    assert set(fits) == set(QUICK["whole_fit_configs"]) and set(fits) <= set(WHOLE_FIT_CONFIGS)
    for config, (fit,) in fits.items():
        assert fit["whole_fit_s"] > fit["launch_s"] + fit["training_loop_s"] > fit["training_loop_s"] > 0, (config, fit)
        assert fit["samples"] == QUICK["whole_fit_samples"], (config, fit)
    for name, table in tables(record).items():
        assert table.strip() in proc.stdout, f"the run did not print its table {name!r}"
    assert {p.name for p in (tmp_path / "tta_plots").iterdir()} == {"tta_fashion.png", "tta_mlp.png", "tta_charlm.png"}

    plots = tmp_path / "again"
    proc = run_python(["-m", "benchmarks.time_to_accuracy", "--report", "--json", str(out), "--target", "charlm=10", "--plots", str(plots)],
                      REPO, 120, what="benchmarks/time_to_accuracy.py --report")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    again = json.loads(out.read_text())
    assert again["retargeted"][0]["task"] == "charlm" and again["retargeted"][0]["to"] == 10.0
    assert again["results"]["tasks"]["charlm"]["by_k"]["2"]["summary"]["ddp"]["reached"] == 1  # every loss is below 10
    assert again["results"]["tasks"]["fashion"] == tasks["fashion"]  # the other tasks are as measured
    assert "at most 10.000" in proc.stdout and len(list(plots.iterdir())) == 3

    # --resume runs only what the stopped run had not: here MLP's DDP job, removed from the record
    record = json.loads(out.read_text())
    record["results"]["tasks"]["mlp"]["by_k"]["2"]["runs"]["ddp"] = []
    record["results"]["complete"] = False
    out.write_text(json.dumps(record))
    proc = run_python(["-m", "benchmarks.time_to_accuracy", "--quick", "--resume", "--parts", "tasks", "--json", str(out), "--plots", str(plots)],
                      REPO, QUICK_TIMEOUT_S, what="benchmarks/time_to_accuracy.py --quick --resume")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(ran) == 1 and ran[0].startswith("[1/1,") and "mlp k=2 ddp repeat 1" in ran[0], ran
    resumed = json.loads(out.read_text())
    assert resumed["results"]["complete"] and resumed["resumed_from"] == [record["provenance"]]
    assert len(resumed["results"]["tasks"]["mlp"]["by_k"]["2"]["runs"]["ddp"]) == 1
    assert resumed["results"]["tasks"]["fashion"]["by_k"]["2"]["runs"] == tasks["fashion"]["by_k"]["2"]["runs"]
