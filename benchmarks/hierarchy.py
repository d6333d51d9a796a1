"""Hierarchical against flat averaging when the link between nodes is slow.

    python benchmarks/hierarchy.py                 # about 4 minutes
    python benchmarks/hierarchy.py --delay-ms 100 --repeats 1

Four processes on this machine play two nodes of two ranks (``ranks_per_node=2``), equal speeds,
an MLP 1024-1024-1024-10 (2.1M parameters) with batch 16 and a fixed 4-step window. The slow
inter-node link is injected: every all-reduce of the parameters over *all* ranks sleeps
``--delay-ms`` first (the node groups' reduces and the small control reduce are not delayed).
  - flat: ``node_sync_every=1``, every boundary averages over all ranks (and pays the delay);
  - hierarchical: ``node_sync_every=4``, the nodes average every window, all ranks every 4th.
Samples per second of training clock, all ranks, medians of the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parent.parent
MODULE = "benchmarks.hierarchy"
LARGE = 100_000  # elements: a parameter reduce, not the control region


def slow_inter_node_link(delay_s: float) -> None:
    """Make every all-ranks all-reduce of a large tensor wait ``delay_s`` first."""
    import torch.distributed as dist

    original = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        if tensor.numel() > LARGE and (group is None or dist.get_world_size(group) == dist.get_world_size()):
            time.sleep(delay_s)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from lightning_elche import ElCheStrategy
    from lightning_elche._jobs import QUIET_TRAINER, Classifier, TrainClock, write_report

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    slow_inter_node_link(config["delay_ms"] / 1000.0)
    g = torch.Generator().manual_seed(0)
    samples = config["samples"]
    data = TensorDataset(torch.randn(samples, 1024, generator=g), torch.randint(0, 10, (samples,), generator=g))
    net = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    strategy = ElCheStrategy(
        timeout=120, guard="none", anchor=4, max_anchor=4, ranks_per_node=2, node_sync_every=config["every"]
    )
    clock = TrainClock()
    trainer = pl.Trainer(
        devices=4, strategy=strategy, max_epochs=1, callbacks=[clock], limit_val_batches=0, **QUIET_TRAINER
    )
    trainer.fit(Classifier(net, data, batch_size=16, lr=1e-4))
    levels = [b.level for b in trainer.strategy.boundaries]
    write_report(
        config["out"], trainer.global_rank,
        {"seconds": clock.seconds, "samples": clock.samples, "global": levels.count("global"), "node": levels.count("node")},
    )


def main() -> None:
    from lightning_elche._jobs import run_job

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=200.0)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = {"flat": 1, "hierarchical": args.every}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    print(f"4 ranks as 2 nodes of 2, inter-node all-reduce delayed by {args.delay_ms:.0f} ms")
    for repeat in range(args.repeats):
        for name, every in runs.items():
            config = {"name": name, "every": every, "delay_ms": args.delay_ms, "samples": args.samples}
            reports = run_job(MODULE, config, ranks=4, timeout=900, cwd=str(REPO))
            rates[name].append(sum(r["samples"] for r in reports) / max(r["seconds"] for r in reports))
            print(f"  repeat {repeat + 1} {name:13s} {rates[name][-1]:7.0f} samples/s "
                  f"({reports[0]['global']} global, {reports[0]['node']} node-level boundaries)", flush=True)
    flat, hierarchical = (statistics.median(rates[name]) for name in runs)
    print(f"\n| averaging | samples/s (median) |\n|---|---|\n| flat | {flat:.0f} |\n"
          f"| hierarchical, global every {args.every} windows | {hierarchical:.0f} |")
    print(f"\nhierarchical / flat: {hierarchical / flat:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
