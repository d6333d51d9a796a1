"""What the char LM's gap to DDP at k = 1 is made of: samples to the target when two replicas average
their parameters (and, or not, their AdamW moments) every H steps, against DDP's averaged gradient.

    python -m benchmarks.optimizer_averaging            # 5 ways x 2 seeds, about 6 minutes
    python -m benchmarks.optimizer_averaging --smoke --json /tmp/optimizer_averaging.json   # tiny

No processes and no clock: the question is how many samples each way of averaging needs, which at
equal speeds (k = 1) is what decides time to target against DDP once throughputs are known
(``benchmarks/time_to_accuracy.py`` measures those). Two replicas of ``examples/char_lm.py``'s GPT at
half size (``benchmarks/tta_tasks.py``) train in turn in one process, each on its own half of every
cohort step's 64 blocks (batch 32, AdamW with warm-up and cosine decay over the 300 DDP-equivalent steps
of one pass, gradients clipped at 1 per replica, as ``Trainer(gradient_clip_val=1)`` does per rank):

  ddp          one model, the two halves' gradients averaged every step (clipped after), DDP's update
  params-H     each replica steps on its half; every H steps the parameters are averaged (ElChe at k = 1)
  moments-H    the same, and AdamW's two moments (``exp_avg``, ``exp_avg_sq``) are averaged with them

The averaged model is scored on the 128 held-out blocks every 10 cohort steps (640 blocks), as the
time-to-accuracy benchmark scores its copies; *samples to target* is the first score at or under 2.1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import torch

if __package__ in (None, ""):  # run as `python benchmarks/optimizer_averaging.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cell, conclude, results_path
from benchmarks.provenance import Failures, spread
from benchmarks.tta_tasks import TASKS, charlm_optimizers

WAYS = ("ddp", "params-1", "moments-1", "params-10", "moments-10")
TARGET = 2.1
SCORE_EVERY = 10  # cohort steps between scores: 640 blocks
BATCH = 32
SMOKE = {"blocks": 192, "seeds": [0], "target": 4.0}


def average(tensors: list[torch.Tensor]) -> None:
    """Replace every tensor of ``tensors`` (one per replica) by their mean, in place."""
    mean = torch.stack(tensors).mean(0)
    for tensor in tensors:
        tensor.copy_(mean)


def run(way: str, blocks: Optional[int], seed: int, target: float) -> dict[str, Any]:
    """One pass of ``way``: the score curve (cohort samples, validation loss) and the samples to ``target``."""
    task = TASKS["charlm"]
    config = {"seed": 0, "train_samples": blocks}
    train, score = task.train_set(config), task.scorer(config)
    torch.manual_seed(seed)
    order = torch.randperm(len(train))
    steps = len(train) // (2 * BATCH)
    replicas = [task.network(config) for _ in range(1 if way == "ddp" else 2)]
    optimizers = [charlm_optimizers(net, steps) for net in replicas]
    every = None if way == "ddp" else int(way.split("-")[1])
    curve: list[tuple[int, float]] = []
    for step in range(steps):
        halves = [order[(2 * step + half) * BATCH:(2 * step + half + 1) * BATCH] for half in (0, 1)]
        batches = [[torch.stack(parts) for parts in zip(*(train[int(i)] for i in half))] for half in halves]
        if way == "ddp":
            net, (optimizer, schedule) = replicas[0], optimizers[0]
            optimizer.zero_grad()
            for batch in batches:
                (task.loss(net, batch) / 2).backward()  # the mean of the two halves' gradients
            torch.nn.utils.clip_grad_norm_(net.parameters(), task.clip)
            optimizer.step()
            schedule.step()
        else:
            for net, (optimizer, schedule), batch in zip(replicas, optimizers, batches):
                optimizer.zero_grad()
                task.loss(net, batch).backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), task.clip)
                optimizer.step()
                schedule.step()
            if (step + 1) % every == 0 or step + 1 == steps:
                with torch.no_grad():
                    for params in zip(*(net.parameters() for net in replicas)):
                        average(list(params))
                        if way.startswith("moments"):
                            states = [optimizer.state[p] for (optimizer, _), p in zip(optimizers, params)]
                            for key in ("exp_avg", "exp_avg_sq"):
                                average([state[key] for state in states])
        if (step + 1) % SCORE_EVERY == 0 or step + 1 == steps:
            curve.append(((step + 1) * 2 * BATCH, score(replicas[0].state_dict())))
    reached = next((samples for samples, loss in curve if loss <= target), None)
    return {"curve": curve, "samples_to_target": reached, "final": curve[-1][1]}


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, list[Optional[dict[str, Any]]]]:
    runs: dict[str, list[Optional[dict[str, Any]]]] = {way: [] for way in args.ways}
    for seed in args.seeds:
        for way in args.ways:
            result = failures.attempt(way, seed, lambda: run(way, args.blocks, seed, args.target))
            runs[way].append(result)
            shown = "failed" if result is None else f"{result['samples_to_target']} blocks to target, final {result['final']:.3f}"
            print(f"seed {seed} {way}: {shown}", flush=True)
    return runs


def summarize(runs: dict[str, list[Optional[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per way: how many runs reached the target, blocks to it (thousands), over DDP's (paired by seed), the final loss."""
    ddp = [r["samples_to_target"] if r else None for r in runs.get("ddp", [])]
    out: dict[str, dict[str, Any]] = {}
    for way, results in runs.items():
        done = [r for r in results if r]
        reached = [r["samples_to_target"] / 1000 for r in done if r["samples_to_target"]]
        ratios = [r["samples_to_target"] / d for r, d in zip(results, ddp) if r and r["samples_to_target"] and d]
        out[way] = {
            "runs": len(results), "reached": len(reached), "blocks_k": spread(reached) if reached else None,
            "over_ddp": spread(ratios) if ratios else None, "final": spread([r["final"] for r in done]) if done else None,
        }  # fmt: skip
    return out


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``samples``: per way, blocks to the target and over DDP's, the final loss (medians over the seeds)."""
    lines = ["| way | reached | blocks to target (k) | over DDP's | validation loss at the end |", "|---|---|---|---|---|"]
    for way, row in record["results"]["summary"].items():
        lines.append(f"| {way} | {row['reached']}/{row['runs']} | {cell(row['blocks_k'], '.1f')} | {cell(row['over_ddp'])} "
                     f"| {cell(row['final'], '.3f')} |")
    return {"samples": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="data orders")
    parser.add_argument("--blocks", type=int, default=None, help="training blocks (default: the task's one pass, 19,200)")
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument("--smoke", action="store_true", help="192 blocks, one seed: does everything run?")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/optimizer_averaging.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.json = results_path("optimizer_averaging", args)
    torch.set_num_threads(2)
    failures = Failures()
    runs = measure(args, failures)
    conclude("optimizer_averaging", args, {"runs": runs, "summary": summarize(runs), "target": args.target}, failures, tables,
             spread=f"over {len(args.seeds)} data orders (seeds), the same weights")


if __name__ == "__main__":
    main()
