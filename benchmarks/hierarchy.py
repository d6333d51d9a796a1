"""Hierarchical against flat averaging when the link between nodes is slow.

    python benchmarks/hierarchy.py                 # about 4 minutes
    python benchmarks/hierarchy.py --delay-ms 100 --repeats 1
    python benchmarks/hierarchy.py --smoke --json /tmp/hierarchy.json   # one short repeat

Four processes on this machine play two nodes of two ranks (``ranks_per_node=2``), equal speeds,
an MLP 1024-1024-1024-10 (2.1M parameters) with batch 16 and a fixed 4-step window. The slow
inter-node link is injected: every all-reduce of the parameters over *all* ranks sleeps
``--delay-ms`` first (the node groups' reduces and the small control reduce are not delayed).
  - flat: ``node_sync_every=1``, every boundary averages over all ranks (and pays the delay);
  - hierarchical: ``node_sync_every=4``, the nodes average every window, all ranks every 4th.
Samples per second of training clock, all ranks, medians (min-max) of the repeats, the two runs of
a repeat in an order rotated every repeat; results in ``benchmarks/results/hierarchy.json``. A run
that fails is recorded as failed (JSON and table), the others go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

if __package__ in (None, ""):  # run as `python benchmarks/hierarchy.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cell, conclude, failed, results_path, run_job
from benchmarks.provenance import Failures, rotated, spread

MODULE = "benchmarks.hierarchy"
# one repeat of 4 windows per rank (16 steps of 16): flat and hierarchical boundaries both happen
SMOKE = {"samples": 1024, "repeats": 1, "delay_ms": 10.0, "timeout": 180.0}
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


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, list[Optional[dict[str, Any]]]]:
    """Flat and hierarchical averaging in every repeat, in an order rotated every repeat."""
    runs = {"flat": 1, "hierarchical": args.every}
    rows: dict[str, list[Optional[dict[str, Any]]]] = {name: [None] * args.repeats for name in runs}
    for repeat in range(args.repeats):
        for name in rotated(list(runs), repeat):
            config = {"name": name, "every": runs[name], "delay_ms": args.delay_ms, "samples": args.samples}
            row = failures.attempt(name, repeat, lambda: job_figures(run_job(MODULE, worker, config, 4, args.timeout, warm=args.smoke)))
            rows[name][repeat] = row
            if row is not None:
                print(f"  repeat {repeat + 1} {name:13s} {row['samples_per_s']:7.0f} samples/s "
                      f"({row['global']} global, {row['node']} node-level boundaries)", flush=True)
    return rows


def job_figures(reports: list[dict[str, Any]]) -> dict[str, Any]:
    rate = sum(r["samples"] for r in reports) / max(r["seconds"] for r in reports)
    return {"samples_per_s": rate, "global": reports[0]["global"], "node": reports[0]["node"]}


def summary(rows: dict[str, list[Optional[dict[str, Any]]]]) -> dict[str, Any]:
    """Spreads per run, and hierarchical over flat paired within each repeat."""
    out: dict[str, Any] = {}
    for name, runs in rows.items():
        done = [r for r in runs if r]
        if done:
            out[name] = {key: spread([r[key] for r in done]) for key in ("samples_per_s", "global", "node")}
    paired = [h["samples_per_s"] / f["samples_per_s"] for h, f in zip(rows["hierarchical"], rows["flat"]) if h and f]
    out["hierarchical_over_flat"] = spread(paired) if paired else None
    return out


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``averaging``: samples/s of training clock (all ranks), boundaries of each level, medians (min-max)."""
    args, results = record["args"], record["results"]["summary"]
    labels = {"flat": "flat", "hierarchical": f"hierarchical, global every {args['every']} windows"}
    lines = ["| averaging | samples/s | global boundaries | node-level boundaries | over flat, paired |", "|---|---|---|---|---|"]
    for name, label in labels.items():
        row, lost = results.get(name), failed(record, name)
        if row is None:
            lines.append(f"| {label} | failed ({lost} of {lost} runs) | | | |")
            continue
        ratio = "1" if name == "flat" else cell(results["hierarchical_over_flat"])
        lines.append(f"| {label}{f' ({lost} failed)' if lost else ''} | {cell(row['samples_per_s'], '.0f')} "
                     f"| {cell(row['global'], 'g')} | {cell(row['node'], 'g')} | {ratio} |")
    return {"averaging": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=200.0)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a job counts as hung")
    parser.add_argument("--smoke", action="store_true", help="one repeat of 4 windows, a short delay: does everything run?")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/hierarchy.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.json = results_path("hierarchy", args)
    print(f"4 ranks as 2 nodes of 2, inter-node all-reduce delayed by {args.delay_ms:.0f} ms")
    failures = Failures()
    rows = measure(args, failures)
    conclude("hierarchy", args, {"runs": rows, "summary": summary(rows)}, failures, tables)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
