"""How much of the boundary all-reduce policy="async" hides behind the next window.

    python benchmarks/overlap.py                  # about 4 minutes
    python benchmarks/overlap.py --hidden 1024 --repeats 1
    python benchmarks/overlap.py --smoke --json /tmp/overlap.json   # a small MLP, once

Two processes, equal speeds, gloo, one thread each, on a model whose all-reduce takes a large
share of a short window: an MLP 1024-H-H-10 (H=2048: 6.3M parameters, 25 MB) trained with batch
16 and a fixed anchor of 4 steps. Three ElChe runs, interleaved and repeated:
  - blocking: policy="cadence", every boundary waits for its all-reduce;
  - overlapped: policy="async", the all-reduce runs while the next window trains;
  - rare: policy="cadence" with a 200-step window, where averaging costs next to nothing: the
    time the same samples take without communication.
Hidden fraction = (t_blocking - t_overlapped) / (t_blocking - t_rare), with t the training-clock
seconds per sample of the cohort (medians of the repeats; also per repeat, paired). The runs of a
repeat go in an order rotated every repeat; results in ``benchmarks/results/overlap.json``. A run
that fails is recorded as failed (JSON and table), the others go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

if __package__ in (None, ""):  # run as `python benchmarks/overlap.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cell, conclude, failed, results_path, run_job
from benchmarks.provenance import Failures, rotated, spread

MODULE = "benchmarks.overlap"
SMOKE = {"hidden": 64, "samples": 256, "repeats": 1, "timeout": 120.0}
RUNS = {
    "blocking": {"policy": "cadence", "anchor": 4, "max_anchor": 4},
    "overlapped": {"policy": "async", "anchor": 4, "max_anchor": 4},
    "rare": {"policy": "cadence", "anchor": 200, "max_anchor": 200},
}


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from lightning_elche import ElCheStrategy
    from lightning_elche._jobs import QUIET_TRAINER, Classifier, TrainClock, write_report

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(0, verbose=False)
    hidden, samples = config["hidden"], config["samples"]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 1024, generator=g), torch.randint(0, 10, (samples,), generator=g))
    net = nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    clock = TrainClock()
    trainer = pl.Trainer(
        devices=2, strategy=ElCheStrategy(timeout=120, guard="none", **config["elche"]),
        max_epochs=1, callbacks=[clock], limit_val_batches=0, **QUIET_TRAINER
    )
    trainer.fit(Classifier(net, data, batch_size=16, lr=1e-4))
    boundaries = trainer.strategy.boundaries
    write_report(
        config["out"],
        trainer.global_rank,
        {
            "seconds": clock.seconds,
            "samples": clock.samples,
            "boundaries": len(boundaries),
            "boundary_ms": statistics.median(b.boundary_ms for b in boundaries) if boundaries else 0.0,
        },
    )


def seconds_per_sample(reports: list[dict]) -> float:
    return max(r["seconds"] for r in reports) / sum(r["samples"] for r in reports)


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, list[Optional[dict[str, float]]]]:
    """The three runs in every repeat, in an order rotated every repeat."""
    rows: dict[str, list[Optional[dict[str, float]]]] = {name: [None] * args.repeats for name in RUNS}
    for repeat in range(args.repeats):
        for name in rotated(list(RUNS), repeat):
            config = {"name": name, "hidden": args.hidden, "samples": args.samples, "elche": RUNS[name]}
            reports = failures.attempt(name, repeat, lambda: run_job(MODULE, worker, config, 2, args.timeout, warm=args.smoke))
            if reports is None:
                continue
            rows[name][repeat] = row = {
                "seconds_per_sample": seconds_per_sample(reports),
                "boundary_ms": statistics.median(r["boundary_ms"] for r in reports), "boundaries": reports[0]["boundaries"],
            }  # fmt: skip
            print(f"  repeat {repeat + 1} {name:10s} {1 / row['seconds_per_sample']:8.0f} samples/s, "
                  f"boundary {row['boundary_ms']:6.1f} ms ({row['boundaries']} boundaries)", flush=True)
    return rows


def hidden_share(t: dict[str, float]) -> Optional[float]:
    """(t_blocking - t_overlapped) / (t_blocking - t_rare), t in seconds per sample; none when averaging cost nothing."""
    return (t["blocking"] - t["overlapped"]) / (t["blocking"] - t["rare"]) if t["blocking"] > t["rare"] else None


def summary(rows: dict[str, list[Optional[dict[str, float]]]]) -> dict[str, Any]:
    """Spreads per run; the hidden share from the medians, and per repeat (paired)."""
    out: dict[str, Any] = {}
    for name, runs in rows.items():
        done = [r for r in runs if r]
        if done:
            out[name] = {
                "samples_per_s": spread([1 / r["seconds_per_sample"] for r in done]),
                "boundary_ms": spread([r["boundary_ms"] for r in done]),
                "seconds_per_sample": spread([r["seconds_per_sample"] for r in done]),
            }
    if all(name in out for name in RUNS):
        out["hidden_share_of_medians"] = hidden_share({name: out[name]["seconds_per_sample"]["median"] for name in RUNS})
    repeats = [{name: rows[name][i]["seconds_per_sample"] for name in RUNS} for i in range(len(rows["rare"]))
               if all(rows[name][i] for name in RUNS)]  # fmt: skip
    shares = [s for s in map(hidden_share, repeats) if s is not None]
    out["hidden_share_paired"] = spread(shares) if shares else None
    return out


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``runs``: samples/s and boundary time per run, medians (min-max) of the repeats, and the share of
    the averaging cost ``policy="async"`` hid."""
    results = record["results"]["summary"]
    lines = ["| run | samples/s | boundary ms |", "|---|---|---|"]
    for name in RUNS:
        row, lost = results.get(name), failed(record, name)
        if row is None:
            lines.append(f"| {name} | failed ({lost} of {lost} runs) | |")
            continue
        lines.append(f"| {name}{f' ({lost} failed)' if lost else ''} | {cell(row['samples_per_s'], '.0f')} "
                     f"| {cell(row['boundary_ms'], '.1f')} |")
    share = results.get("hidden_share_of_medians")
    lines.append(f"\nShare of the averaging cost hidden by policy='async' (from the medians): "
                 f"{'-' if share is None else f'{share:.2f}'}; per repeat: {cell(results['hidden_share_paired'])}")
    return {"runs": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a job counts as hung")
    parser.add_argument("--smoke", action="store_true", help="a small MLP, once: does everything run?")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/overlap.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.json = results_path("overlap", args)
    params = 1024 * args.hidden + args.hidden * args.hidden + args.hidden * 10 + 2 * args.hidden + 10
    print(f"MLP 1024-{args.hidden}-{args.hidden}-10: {params / 1e6:.1f}M parameters, batch 16, 2 ranks, equal speeds")
    failures = Failures()
    rows = measure(args, failures)
    conclude("overlap", args, {"runs": rows, "summary": summary(rows)}, failures, tables)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
