"""How much of the boundary all-reduce policy="async" hides behind the next window.

    python benchmarks/overlap.py                  # about 4 minutes
    python benchmarks/overlap.py --hidden 1024 --repeats 1

Two processes, equal speeds, gloo, one thread each, on a model whose all-reduce takes a large
share of a short window: an MLP 1024-H-H-10 (H=2048: 6.3M parameters, 25 MB) trained with batch
16 and a fixed anchor of 4 steps. Three ElChe runs, interleaved and repeated:
  - blocking: policy="cadence", every boundary waits for its all-reduce;
  - overlapped: policy="async", the all-reduce runs while the next window trains;
  - rare: policy="cadence" with a 200-step window, where averaging costs next to nothing: the
    time the same samples take without communication.
Hidden fraction = (t_blocking - t_overlapped) / (t_blocking - t_rare), with t the training-clock
seconds per sample of the cohort (medians of the repeats).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parent.parent
MODULE = "benchmarks.overlap"
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


def main() -> None:
    from lightning_elche._jobs import run_job

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    params = 1024 * args.hidden + args.hidden * args.hidden + args.hidden * 10 + 2 * args.hidden + 10
    print(f"MLP 1024-{args.hidden}-{args.hidden}-10: {params / 1e6:.1f}M parameters, batch 16, 2 ranks, equal speeds")
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    boundary_ms: dict[str, list[float]] = {name: [] for name in RUNS}
    for repeat in range(args.repeats):
        for name, elche in RUNS.items():
            config = {"name": name, "hidden": args.hidden, "samples": args.samples, "elche": elche}
            reports = run_job(MODULE, config, ranks=2, timeout=900, cwd=str(REPO))
            times[name].append(seconds_per_sample(reports))
            boundary_ms[name].append(statistics.median(r["boundary_ms"] for r in reports))
            print(f"  repeat {repeat + 1} {name:10s} {1 / times[name][-1]:8.0f} samples/s, "
                  f"boundary {boundary_ms[name][-1]:6.1f} ms ({reports[0]['boundaries']} boundaries)", flush=True)
    t = {name: statistics.median(values) for name, values in times.items()}
    hidden = (t["blocking"] - t["overlapped"]) / (t["blocking"] - t["rare"]) if t["blocking"] > t["rare"] else float("nan")
    print()
    print("| run | samples/s (median) | boundary ms (median) |")
    print("|---|---|---|")
    for name in RUNS:
        print(f"| {name} | {1 / t[name]:.0f} | {statistics.median(boundary_ms[name]):.1f} |")
    print(f"\nShare of the averaging cost hidden by policy='async': {hidden:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
