"""Heterogeneous training in one command: ElChe against DDP with one rank three times slower.

    python -m lightning_elche.demo                  # about a minute on a 2-core CPU
    python -m lightning_elche.demo --slowdown 4 --epochs 30

Trains an MLP on scikit-learn's bundled handwritten digits (no download) with two processes on
the CPU, rank 1 made k times slower with :class:`~lightning_elche.Slowdown`, once with
``strategy="ddp"`` and once with ``strategy="elche"``, and prints each run's training throughput,
the speedup and the final validation accuracy. Everything else in the two runs is identical.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_elche._jobs import (
    QUIET_TRAINER,
    Classifier,
    JobFailed,
    TrainClock,
    main_or_worker,
    run_job,
    write_report,
)

MODULE = "lightning_elche.demo"


def digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1,797 8x8 digits, standardised, split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, val = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from lightning_elche import Slowdown

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(0, verbose=False)
    train_set, val_set = digits_split()
    hidden = config["hidden"]
    net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    clock = TrainClock()
    trainer = pl.Trainer(
        devices=config["devices"],
        strategy=config["strategy"],
        max_epochs=config["epochs"],
        callbacks=[clock, Slowdown({1: config["slowdown"]})],
        **{**QUIET_TRAINER, "accelerator": config["accelerator"]},
    )
    trainer.fit(Classifier(net, train_set, config["batch_size"], val_set=val_set))
    write_report(
        config["out"],
        trainer.global_rank,
        {
            "seconds": clock.seconds,
            "samples": clock.samples,
            "val_acc": float(trainer.callback_metrics["val_acc"]),
        },
    )


def summarize(reports: list[dict]) -> dict[str, float]:
    seconds = max(r["seconds"] for r in reports)
    samples = sum(r["samples"] for r in reports)
    return {"seconds": seconds, "rate": samples / seconds, "val_acc": reports[0]["val_acc"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slowdown", type=float, default=3.0, help="how many times slower rank 1 is (default 3)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (compute per step)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a run counts as hung")
    parser.add_argument("--accelerator", default="cpu", help="'cpu' (default), 'gpu', or any Lightning accelerator")
    parser.add_argument("--devices", type=int, default=2, help="processes, one per device (default 2)")
    args = parser.parse_args(argv)
    if args.devices < 2:
        parser.error("--devices: the demo needs 2 or more processes (rank 1 is the slowed one)")
    print(
        f"lightning-elche demo: {args.devices} processes on {args.accelerator}, rank 1 made {args.slowdown:g}x slower, "
        "scikit-learn digits, "
        f"MLP 64-{args.hidden}-{args.hidden}-10, {args.epochs} epochs",
        flush=True,
    )
    results = {}
    for strategy in ("ddp", "elche"):
        print(f"  training with strategy={strategy!r} ...", flush=True)
        config = {
            "name": strategy,
            "strategy": strategy,
            "slowdown": args.slowdown,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "hidden": args.hidden,
            "accelerator": args.accelerator,
            "devices": args.devices,
        }
        try:
            results[strategy] = summarize(run_job(MODULE, config, ranks=args.devices, timeout=args.timeout))
        except JobFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print()
    print(f"  {'strategy':<10}{'samples/s':>12}{'train s':>10}{'val acc':>10}")
    for strategy, result in results.items():
        print(f"  {strategy:<10}{result['rate']:>12.0f}{result['seconds']:>10.1f}{result['val_acc']:>10.3f}")
    speedup = results["elche"]["rate"] / results["ddp"]["rate"]
    print(f"\n  speedup of ElChe over DDP: {speedup:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_or_worker(lambda: main(sys.argv[1:]), worker))
