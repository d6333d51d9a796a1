"""What the char LM's gap is made of, with the clock taken out: the samples two replicas need to the
target when they average their parameters (and, or not, their AdamW moments, or with an outer step)
every few steps, at equal speeds against DDP's averaged gradient and at speed ratios 2 and 4 against
the fast device alone.

    python -m benchmarks.optimizer_averaging            # 16 ways x 2 seeds, about 13 minutes
    python -m benchmarks.optimizer_averaging --smoke --json /tmp/optimizer_averaging.json   # tiny

No processes and no clock: the question is how many samples each way of averaging needs, which decides
time to target once throughputs are known (``benchmarks/time_to_accuracy.py`` measures those). Replicas
of ``examples/char_lm.py``'s GPT at half size (``benchmarks/tta_tasks.py``) train in turn in one process,
batch 32 each, AdamW with warm-up and cosine decay over the 300 DDP-equivalent steps of one pass (the
cohort's samples over 64), gradients clipped at 1 per replica, as ``Trainer(gradient_clip_val=1)`` does
per rank. A way is ``[kK:]kind-H``: at speed ratio K (default 1) the fast replica runs K steps for each
step of the slow one and takes the next K batches of the data order, the slow one the batch after; every
H steps of the slow replica the two meet, their parameters averaged weighted by the steps each ran:

  alone        one replica on the whole order, its schedule over its own 600 steps (the fast device alone)
  ddp          one model, the two halves' gradients averaged every step (clipped after), DDP's update
  params-H     the weighted average (ElChe's plain averaging)
  moments-H    the same, and AdamW's two moments (``exp_avg``, ``exp_avg_sq``) averaged with the parameters
  sqrt-H       an outer step of the average's move from the last consensus, scaled by sqrt(W), W = (sum of
               the steps)^2 / (sum of their squares) the window's effective number of replicas (sqrt(2) at
               equal speeds): Adam's step grows by about that when the gradients it normalizes are averaged
  nesterov-H   DiLoCo's outer Nesterov step (lr 0.7, momentum 0.9), ElChe's default where speeds differ

The consensus is scored on the 128 held-out blocks at the first meeting at or after every 320 blocks
(half the time-to-accuracy benchmark's interval); *samples to target* is the first score at or under 2.1,
and *ideal time* those samples over the fast device alone's, times K / (K + 1): the time to target over
the fast device's were both devices always busy and averaging free, the best any clock could do.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

if __package__ in (None, ""):  # run as `python benchmarks/optimizer_averaging.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cell, conclude, results_path
from benchmarks.provenance import Failures, spread
from benchmarks.tta_tasks import TASKS, charlm_optimizers

WAYS = (
    "alone", "ddp", "params-1", "moments-1", "sqrt-1", "params-10", "moments-10", "sqrt-10",
    "k2:params-1", "k2:sqrt-1", "k2:params-10", "k2:nesterov-10",
    "k4:params-1", "k4:sqrt-1", "k4:params-10", "k4:nesterov-10",
)  # fmt: skip
KINDS = ("alone", "ddp", "params", "moments", "sqrt", "nesterov")
TARGET = 2.1
SCORE_EVERY = 320  # blocks between scores
BATCH = 32
DILOCO_LR, DILOCO_MOMENTUM = 0.7, 0.9
SMOKE = {"blocks": 192, "seeds": [0], "target": 4.0, "ways": ["alone", "ddp", "params-1", "k2:sqrt-1", "k2:nesterov-2"]}


@dataclass(frozen=True)
class Way:
    """``[kK:]kind[-H]`` parsed: the speed ratio, what happens at a meeting, the slow replica's steps between meetings."""

    name: str
    speed_ratio: int
    kind: str
    every: int

    @classmethod
    def parse(cls, name: str) -> Way:
        ratio, _, rest = name.rpartition(":")
        kind, _, every = rest.partition("-")
        if kind not in KINDS or (ratio and not ratio[1:].isdigit()) or (kind not in ("alone", "ddp")) != every.isdigit():
            raise argparse.ArgumentTypeError(f"a way is [kK:]kind-H with kind one of {', '.join(KINDS[2:])}, or alone / ddp; got {name!r}")
        speed_ratio = int(ratio[1:]) if ratio else 1
        if kind in ("alone", "ddp") and speed_ratio != 1:
            raise argparse.ArgumentTypeError(f"{kind} has no speed ratio (got {name!r})")
        return cls(name, speed_ratio, kind, int(every or 1))


def set_learning_rate(optimizer: torch.optim.Optimizer, schedule: Any, step: int) -> None:
    """The schedule's learning rate at ``step`` (its factor of each group's initial rate), whoever counts the steps."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * schedule.lr_lambdas[0](step)


class Replica:
    """One model and its optimizer, stepped on a batch at the schedule's step the caller names."""

    def __init__(self, config: dict[str, Any], total_steps: int) -> None:
        self.task = TASKS["charlm"]
        self.net = self.task.network(config)
        self.optimizer, self.schedule = charlm_optimizers(self.net, total_steps)

    def step(self, batches: list[Any], schedule_step: int) -> None:
        """One optimizer step on the mean of ``batches``' gradients (one batch: a replica; two: DDP's)."""
        set_learning_rate(self.optimizer, self.schedule, schedule_step)
        self.optimizer.zero_grad()
        for batch in batches:
            (self.task.loss(self.net, batch) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.task.clip)
        self.optimizer.step()


class Meeting:
    """What two replicas do when they meet: the weighted average, then the way's outer step or moments."""

    def __init__(self, way: Way, replicas: list[Replica]) -> None:
        self.way, self.replicas = way, replicas
        self.params = [list(group) for group in zip(*(r.net.parameters() for r in replicas))]
        self.consensus = [p[0].detach().clone() for p in self.params]  # the last meeting's model
        self.velocity = [torch.zeros_like(p) for p in self.consensus]

    @torch.no_grad()
    def __call__(self, steps: tuple[int, int]) -> None:
        weights = [s / sum(steps) for s in steps]
        scale = math.sqrt(sum(steps) ** 2 / sum(s * s for s in steps)) if self.way.kind == "sqrt" else 1.0
        for params, consensus, velocity in zip(self.params, self.consensus, self.velocity):
            move = sum(w * p for w, p in zip(weights, params)) - consensus
            if self.way.kind == "nesterov":
                velocity.mul_(DILOCO_MOMENTUM).add_(move)
                move = DILOCO_LR * (move + DILOCO_MOMENTUM * velocity)
            consensus.add_(scale * move)
            for p in params:
                p.copy_(consensus)
            if self.way.kind == "moments":
                states = [r.optimizer.state[p] for r, p in zip(self.replicas, params)]
                for key in ("exp_avg", "exp_avg_sq"):
                    mean = sum(w * state[key] for w, state in zip(weights, states))
                    for state in states:
                        state[key].copy_(mean)


def run(way: Way, blocks: Optional[int], seed: int, target: float) -> dict[str, Any]:
    """One pass of ``way``: the score curve (blocks trained, validation loss) and the blocks to ``target``."""
    task = TASKS["charlm"]
    config = {"seed": 0, "train_samples": blocks}
    train, score = task.train_set(config), task.scorer(config)
    torch.manual_seed(seed)
    order = torch.randperm(len(train))
    batches = len(train) // BATCH

    def batch(index: int) -> list[torch.Tensor]:
        return [torch.stack(parts) for parts in zip(*(train[int(i)] for i in order[index * BATCH:(index + 1) * BATCH]))]

    curve: list[tuple[int, float]] = []

    def consensus(trained: int, net: nn.Module) -> None:
        """Score the consensus ``net`` if ``trained`` blocks have passed the next interval, or the pass's last batch."""
        if trained >= SCORE_EVERY * (len(curve) + 1) or trained >= batches * BATCH:
            curve.append((trained, score(net.state_dict())))

    train_way(way, config, batch, batches, consensus)
    reached = next((samples for samples, loss in curve if task.reached(loss, target)), None)
    return {"curve": curve, "samples_to_target": reached, "final": curve[-1][1]}


def train_way(
    way: Way, config: dict[str, Any], batch: Callable[[int], list[torch.Tensor]], batches: int, consensus: Callable[[int, nn.Module], None]
) -> None:
    """Train ``way``'s replicas (built from ``config``, as the scorer's model) over ``batches`` batches in order
    (a pass), handing ``consensus`` each agreed model."""
    if way.kind in ("alone", "ddp"):
        replica = Replica(config, batches if way.kind == "alone" else batches // 2)
        group = 1 if way.kind == "alone" else 2
        for step in range(batches // group):
            replica.step([batch(group * step + i) for i in range(group)], step)
            consensus(group * (step + 1) * BATCH, replica.net)
        return
    replicas = [Replica(config, batches // 2) for _ in range(2)]
    meet = Meeting(way, replicas)
    ratio, used = way.speed_ratio, 0
    while used + (ratio + 1) * way.every <= batches:
        for _ in range(way.every):
            for replica, steps in zip(replicas, (ratio, 1)):
                for _ in range(steps):
                    replica.step([batch(used)], used // 2)  # the cohort's DDP-equivalent step: its samples over 64
                    used += 1
        meet((ratio * way.every, way.every))
        consensus(used * BATCH, replicas[0].net)


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, list[Optional[dict[str, Any]]]]:
    runs: dict[str, list[Optional[dict[str, Any]]]] = {way.name: [] for way in args.ways}
    for seed in args.seeds:
        for way in args.ways:
            result = failures.attempt(way.name, seed, lambda: run(way, args.blocks, seed, args.target))
            runs[way.name].append(result)
            shown = "failed" if result is None else f"{result['samples_to_target']} blocks to target, final {result['final']:.3f}"
            print(f"seed {seed} {way.name}: {shown}", flush=True)
    return runs


def paired(results: list[Optional[dict[str, Any]]], base: list[Optional[dict[str, Any]]], scale: float = 1.0) -> Optional[dict[str, float]]:
    """The spread of ``results``' samples to target over ``base``'s of the same seed, times ``scale``."""
    ratios = [scale * r["samples_to_target"] / b["samples_to_target"] for r, b in zip(results, base)
              if r and b and r["samples_to_target"] and b["samples_to_target"]]
    return spread(ratios) if ratios else None


def summarize(runs: dict[str, list[Optional[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per way: runs at the target, blocks to it (thousands), over DDP's and over the fast device alone's
    (paired by seed), the ideal time over the fast device's (``K / (K + 1)`` of that), the final loss."""
    out: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        way = Way.parse(name)
        done = [r for r in results if r]
        reached = [r["samples_to_target"] / 1000 for r in done if r["samples_to_target"]]
        ratio = way.speed_ratio
        out[name] = {
            "speed_ratio": ratio, "runs": len(results), "reached": len(reached), "blocks_k": spread(reached) if reached else None,
            "over_ddp": paired(results, runs["ddp"]) if ratio == 1 and "ddp" in runs else None,
            "over_alone": paired(results, runs["alone"]) if "alone" in runs else None,
            "ideal_time": paired(results, runs["alone"], 1.0 if way.kind == "alone" else ratio / (ratio + 1)) if "alone" in runs else None,
            "final": spread([r["final"] for r in done]) if done else None,
        }  # fmt: skip
    return out


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``samples``: per way, blocks to the target, over DDP's and the fast device's, the ideal time, the final loss."""
    lines = ["| way | k | reached | blocks to target (k) | over DDP's | over the fast device's | ideal time vs the fast device "
             "| validation loss at the end |", "|---|---|---|---|---|---|---|---|"]
    for way, row in record["results"]["summary"].items():
        lines.append(f"| {way} | {row['speed_ratio']} | {row['reached']}/{row['runs']} | {cell(row['blocks_k'], '.1f')} "
                     f"| {cell(row['over_ddp'])} | {cell(row['over_alone'])} | {cell(row['ideal_time'])} | {cell(row['final'], '.3f')} |")
    return {"samples": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ways", nargs="+", type=Way.parse, default=[Way.parse(w) for w in WAYS], help="[kK:]kind[-H], as above")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="data orders")
    parser.add_argument("--blocks", type=int, default=None, help="training blocks (default: the task's one pass, 19,200)")
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument("--smoke", action="store_true", help="192 blocks, one seed, five ways: does everything run?")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/optimizer_averaging.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE, ways=[Way.parse(w) for w in SMOKE["ways"]])
    args.json = results_path("optimizer_averaging", args)
    torch.set_num_threads(2)
    failures = Failures()
    runs = measure(args, failures)
    conclude("optimizer_averaging", args, {"runs": runs, "summary": summarize(runs), "target": args.target}, failures, tables,
             spread=f"over {len(args.seeds)} data orders (seeds), the same weights")


if __name__ == "__main__":
    main()
