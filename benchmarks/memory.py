"""Peak memory per rank: ElChe's boundary buffer against DDP's gradient buckets.

    python benchmarks/memory.py                    # about a minute
    python benchmarks/memory.py --hidden 4096 --repeats 3
    python benchmarks/memory.py --smoke --json /tmp/memory.json   # a small MLP, once

ElChe keeps one persistent flat buffer of parameters and float buffers per rank and allocates
no parameter-sized temporaries at a boundary; DDP keeps gradient buckets of the same size. On a
model big enough for that buffer to matter (an MLP of ~21M parameters, 84 MB in float32),
two processes train a few dozen steps with Adam under each strategy, and every rank reports
its peak RSS (``getrusage``). On CUDA the same comparison would read
``torch.cuda.max_memory_allocated``; this machine has no GPU. The strategies of a repeat run in an
order rotated every repeat; results in ``benchmarks/results/memory.json``. A run that fails is
recorded as failed (JSON and table), the others go on, and the exit status is 1. (A smoke run forks
its ranks from the benchmark's interpreter: its peaks count the pages they share, so they are no
measurement.)
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

if __package__ in (None, ""):  # run as `python benchmarks/memory.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cell, conclude, failed, results_path, run_job
from benchmarks.provenance import Failures, rotated, spread

MODULE = "benchmarks.memory"
SMOKE = {"hidden": 64, "samples": 128, "repeats": 1, "timeout": 120.0}


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from lightning_elche import ElCheStrategy
    from lightning_elche._jobs import QUIET_TRAINER, Classifier, write_report

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    hidden = config["hidden"]

    g = torch.Generator().manual_seed(0)
    samples = config["samples"]
    data = TensorDataset(torch.randn(samples, 1024, generator=g), torch.randint(0, 10, (samples,), generator=g))
    net = nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    strategy: Any = ElCheStrategy(policy=config["policy"], timeout=120) if config["strategy"] == "elche" else "ddp"
    model = Classifier(net, data, batch_size=16, lr=1e-4)
    trainer = pl.Trainer(
        devices=2, strategy=strategy, max_epochs=1, limit_val_batches=0, **QUIET_TRAINER
    )
    trainer.fit(model)
    write_report(
        config["out"],
        trainer.global_rank,
        {
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "param_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        },
    )


RUNS = {"ddp": ("ddp", "sync"), "elche cadence": ("elche", "cadence"), "elche sync": ("elche", "sync")}


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, Any]:
    """Each strategy's peak RSS per rank (the larger rank's) in every repeat, in an order rotated every repeat."""
    peaks: dict[str, list[Optional[float]]] = {name: [None] * args.repeats for name in RUNS}
    param_mb = None
    for repeat in range(args.repeats):
        for name in rotated(list(RUNS), repeat):
            strategy, policy = RUNS[name]
            config = {"name": name, "strategy": strategy, "policy": policy, "hidden": args.hidden, "samples": args.samples}
            reports = failures.attempt(name, repeat, lambda: run_job(MODULE, worker, config, 2, args.timeout, warm=args.smoke))
            if reports is not None:
                peaks[name][repeat] = max(r["peak_rss_mb"] for r in reports)
                param_mb = reports[0]["param_mb"]
                print(f"{name}: peak RSS per rank {peaks[name][repeat]:.0f} MB", flush=True)
    summary: dict[str, Any] = {}
    for name, values in peaks.items():
        done = [v for v in values if v is not None]
        over_ddp = [v - d for v, d in zip(values, peaks["ddp"]) if v is not None and d is not None]
        if done:
            summary[name] = {"peak_rss_mb": spread(done), "over_ddp_mb": spread(over_ddp) if over_ddp else None}
    return {"param_mb": param_mb, "peaks": peaks, "summary": summary}


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``peaks``: peak RSS per rank, medians (min-max) of the repeats, and the difference to DDP paired within a repeat."""
    summary = record["results"]["summary"]
    lines = ["| strategy | peak RSS per rank (MB) | vs DDP |", "|---|---|---|"]
    for name in RUNS:
        row, lost = summary.get(name), failed(record, name)
        label = name.replace("ddp", "DDP").replace("elche", "ElChe")
        if row is None:
            lines.append(f"| {label} | failed ({lost} of {lost} runs) | |")
            continue
        lines.append(f"| {label}{f' ({lost} failed)' if lost else ''} | {cell(row['peak_rss_mb'], '.0f')} "
                     f"| {cell(row['over_ddp_mb'], '+.0f', unit=' MB')} |")
    return {"peaks": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=960, help="training samples (batch 16 per rank)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a job counts as hung")
    parser.add_argument("--smoke", action="store_true", help="a small MLP, once: does everything run?")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/memory.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.json = results_path("memory", args)
    failures = Failures()
    results = measure(args, failures)
    if results["param_mb"] is not None:
        print(f"\nmodel parameters: {results['param_mb']:.0f} MB (float32)")
    conclude("memory", args, results, failures, tables)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
