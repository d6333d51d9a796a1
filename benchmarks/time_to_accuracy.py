"""Time to accuracy on uneven ranks: one fast process, Lightning DDP and ElChe, side by side.

    python benchmarks/time_to_accuracy.py                   # 3 seeds x 6 configurations, 1 epoch; ~13 min here
    python benchmarks/time_to_accuracy.py --equal-speeds    # no slowdown: is cadence as quick as DDP?
    python benchmarks/time_to_accuracy.py --quick           # smoke run (6k images, 1 seed), ~1.5 min
    python benchmarks/time_to_accuracy.py --configs ddp elche-cadence --seeds 1 --target 0.85

Data: Fashion-MNIST (60k train / 10k test, 28x28, MIT licence) from the Debian package
``dataset-fashion-mnist``, read from local files only:

    apt-get install -y dataset-fashion-mnist     # files in /usr/share/datasets/fashion-mnist/

(``dpkg -L dataset-fashion-mnist`` lists them; parsed once into benchmarks/results/, ignored by
git.) Without it the script warns and falls back to scikit-learn's bundled 8x8 digits (1,797
images: a smoke test, too small to measure much), as does ``--data digits``.

Model and training as in benchmarks/throughput.py: small CNN (conv5x5(16)-pool-conv5x5(32)-pool-
fc128-fc10), batch 64 per rank, Adam 1e-3. Two rank processes (Lightning's launcher,
accelerator="cpu", devices=2, gloo, one thread each); rank 1 is made 3x slower with
``Slowdown({1: 3}, clock="cpu")`` (its computation is slower, its communication is not).

Configurations:
  fast-alone      one process, no slowdown, same batch size: what the fast rank does without help
  ddp             strategy="ddp"
  elche-sync      ElCheStrategy(policy="sync"): averages the parameters after every step
  elche-cadence   ElCheStrategy(): the default, speed-aware windows
  elche-async     ElCheStrategy(policy="async")
  elche-outer     ElCheStrategy(outer_optimizer=OuterNesterov(lr=0.7, momentum=0.9))
A configuration whose strategy cannot be built yet (NotImplementedError, TypeError, ImportError)
is skipped with a note, so the script picks it up as soon as it exists; one whose run fails is
dropped from the remaining seeds with the error shown.

Defaults (Fashion-MNIST): 1 epoch (all six configurations x 3 seeds fit in ~13 minutes on 2
cores), target 84 % (the fast process alone, DDP and ElChe all reach it at about half an epoch;
85 % sits on a noisy plateau that DDP crossed only at ~0.8 epoch), budget 12 s (before the quickest configuration finishes its epoch; 6 s at equal speeds).

What it measures, per configuration (medians over seeds):
  - training-clock seconds until the test accuracy first reaches --target (default 84 %), and
    the paired ratio to DDP and to fast-alone (ratio within each seed, then the median), with
    the number of seeds that reached it and the samples seen by then (all ranks);
  - test accuracy of the model the cohort had at --budget-s seconds of training clock;
  - test accuracy after --epochs epochs, i.e. at equal samples seen: every configuration trains
    the same epochs over the same 60k images (all ranks together);
  - training-clock seconds of those epochs.

Rules: paired runs (all configurations of a seed run back to back, the order rotated from seed
to seed); medians over seeds; the training clock is rank 0's (set-up excluded, no validation
loop). Rank 0 copies the cohort's model (after any batch under DDP and alone, after a boundary
under ElChe, where every rank holds the average) at the first such point after each
--eval-every-s seconds of training clock, and at the last one before --budget-s. The copies are
scored on the 10k test images after the run, between jobs, so evaluation costs the clock
nothing. The machine must be otherwise quiet: the load average is printed at the start.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import statistics
import struct
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_elche import ElCheStrategy, Slowdown
from lightning_elche._jobs import QUIET_TRAINER, Classifier, JobFailed, TrainClock, main_or_worker, run_job, write_report

REPO = Path(__file__).resolve().parent.parent
MODULE = "benchmarks.time_to_accuracy"
FASHION = Path("/usr/share/datasets/fashion-mnist")
CACHE = REPO / "benchmarks" / "results" / "fashion_mnist_uint8.pt"
CONFIGS = ("fast-alone", "ddp", "elche-sync", "elche-cadence", "elche-async", "elche-outer")
# Per data set; the budget ends before the quickest configuration's epochs do (rank 1 3x slower / equal speeds).
DEFAULTS = {
    "fashion": {"seeds": 3, "target": 0.84, "budget_s": 12.0, "budget_s_equal": 6.0, "epochs": 1, "eval_every_s": 1.0},
    "digits": {"seeds": 3, "target": 0.95, "budget_s": 1.5, "budget_s_equal": 1.0, "epochs": 30, "eval_every_s": 0.1},
}
QUICK = {"seeds": 1, "train_samples": 6144, "test_samples": 2000, "target": 0.7, "budget_s": 1.5, "epochs": 1, "eval_every_s": 0.5}


# ----------------------------------------------------------------------------- data


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (gzip; header: zero, dtype, ndim, then ndim big-endian sizes; uint8 data)."""
    data = gzip.open(path, "rb").read()
    _, _, ndim = struct.unpack(">HBB", data[:4])
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return torch.from_numpy(np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape).copy())


def load_data(name: str) -> tuple[TensorDataset, TensorDataset]:
    """(train, test): standardised float images (N, 1, side, side) and labels, from local files only."""
    if name == "digits":
        from lightning_elche.demo import digits_split  # standardised, fixed 80/20 split

        return tuple(TensorDataset(d.tensors[0].view(-1, 1, 8, 8), d.tensors[1]) for d in digits_split())
    if not CACHE.exists():  # parse the IDX files once, keep uint8 tensors
        raw = {split: (read_idx(FASHION / f"{split}-images-idx3-ubyte.gz"), read_idx(FASHION / f"{split}-labels-idx1-ubyte.gz"))
               for split in ("train", "t10k")}
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        torch.save(raw, CACHE)
    raw = torch.load(CACHE)
    return tuple(TensorDataset(((x.float() / 255 - 0.2860) / 0.3530).unsqueeze(1), y.long()) for x, y in (raw["train"], raw["t10k"]))


def choose_data(requested: str) -> str:
    if requested == "fashion" and not (FASHION / "train-images-idx3-ubyte.gz").exists() and not CACHE.exists():
        warnings.warn(f"Fashion-MNIST not found in {FASHION} (apt-get install -y dataset-fashion-mnist); "
                      "falling back to scikit-learn digits, which is too small for meaningful timings")
        return "digits"
    return requested


def subset(data: TensorDataset, n: Optional[int]) -> TensorDataset:
    return data if n is None else TensorDataset(*(t[:n] for t in data.tensors))


def small_cnn(side: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (side // 4) ** 2, 128), nn.ReLU(), nn.Linear(128, 10),
    )


# ----------------------------------------------------------------------------- configurations


def make_strategy(name: str) -> Any:
    """The Trainer's strategy for a configuration; raises if this version of ElChe lacks it."""
    if name == "fast-alone":
        return "auto"
    if name == "ddp":
        return "ddp"
    if name == "elche-sync":
        return ElCheStrategy(policy="sync", timeout=120)
    if name == "elche-cadence":
        return ElCheStrategy(timeout=120)
    if name == "elche-async":
        return ElCheStrategy(policy="async", timeout=120)
    if name == "elche-outer":
        from lightning_elche import OuterNesterov  # ImportError until it exists

        return ElCheStrategy(outer_optimizer=OuterNesterov(lr=0.7, momentum=0.9), timeout=120)
    raise ValueError(f"unknown configuration {name!r}")


def available(names: list[str]) -> list[str]:
    usable = []
    for name in names:
        try:
            make_strategy(name)
        except (NotImplementedError, TypeError, ImportError) as exc:
            print(f"note: skipping {name}: {type(exc).__name__}: {exc}", flush=True)
        else:
            usable.append(name)
    return usable


# ----------------------------------------------------------------------------- worker (one rank)


class SnapshotClock(TrainClock):
    """TrainClock that, on rank 0, copies the cohort's model at points of the training clock.

    The cohort has one model after any batch under DDP or alone, and after a boundary under
    ElChe (where every rank holds the average). A copy is taken at the first such point at or
    after each multiple of ``every_s``, and at the last one before ``budget_s`` (the model the
    cohort had at the budget). ``samples`` of a copy counts all ranks' samples so far.
    """

    def __init__(self, every_s: float, budget_s: float, lookback_s: float = 5.0) -> None:
        super().__init__()
        self.every_s, self.budget_s, self.lookback_s = every_s, budget_s, lookback_s
        self.next_s = every_s
        self.points: list[dict[str, Any]] = []
        self.before_budget: Optional[dict[str, Any]] = None
        self.boundaries_seen = 0
        self.cohort_samples = 0

    def now(self) -> float:
        return self.seconds + (time.perf_counter() - self._started if self._started is not None else 0.0)

    def copy(self, pl_module: "pl.LightningModule", seconds: float) -> dict[str, Any]:
        state = {k: v.detach().clone() for k, v in pl_module.net.state_dict().items()}
        return {"seconds": seconds, "samples": self.cohort_samples, "state": state}

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        records = getattr(trainer.strategy, "boundaries", None)
        if records is None:  # DDP or alone: every batch ends on the cohort's model
            self.cohort_samples = self.samples * trainer.world_size
            consensus = True
        else:  # ElChe: only a boundary does
            new = records[self.boundaries_seen :]
            self.boundaries_seen = len(records)
            self.cohort_samples += sum(sum(r.samples) for r in new)
            consensus = bool(new)
        if trainer.global_rank != 0 or not consensus:
            return
        now = self.now()
        if self.budget_s - self.lookback_s <= now < self.budget_s:  # the latest model before the budget
            self.before_budget = self.copy(pl_module, now)
        elif now >= self.budget_s and self.before_budget is not None:
            self.points.append(self.before_budget)
            self.before_budget = None
        if now >= self.next_s:
            self.points.append(self.copy(pl_module, now))
            self.next_s = (math.floor(now / self.every_s) + 1) * self.every_s


def worker(config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(config["seed"], verbose=False)
    train, _ = load_data(config["data"])
    train = subset(train, config["train_samples"])
    clock = SnapshotClock(config["eval_every_s"], config["budget_s"])
    callbacks: list[Any] = [clock]
    if config["devices"] > 1 and config["slowdown"] > 1:
        callbacks.append(Slowdown({1: config["slowdown"]}, clock="cpu"))
    trainer = pl.Trainer(
        devices=config["devices"],
        strategy=make_strategy(config["name"]),
        max_epochs=config["epochs"],
        callbacks=callbacks,
        limit_val_batches=0,
        **QUIET_TRAINER,
    )
    model = Classifier(small_cnn(train.tensors[0].shape[-1]), train, batch_size=64)
    trainer.fit(model)
    if trainer.global_rank == 0:
        clock.points.append(clock.copy(model, clock.seconds))  # the final model: equal samples seen
        torch.save(clock.points, config["snapshots"])
    write_report(config["out"], trainer.global_rank, {"seconds": clock.seconds, "samples": clock.samples})


# ----------------------------------------------------------------------------- main


@torch.inference_mode()
def accuracy(state: dict[str, torch.Tensor], test: TensorDataset) -> float:
    x, y = test.tensors
    net = small_cnn(x.shape[-1])
    net.load_state_dict(state)
    net.eval()
    correct = sum(int((net(xb).argmax(1) == yb).sum()) for xb, yb in zip(x.split(250), y.split(250)))
    return correct / len(y)


def score(points: list[dict[str, Any]], test: TensorDataset, target: float, budget_s: float, stride: int = 4) -> dict[str, Any]:
    """Time to target, accuracy at the budget and final accuracy from one run's copies (the last is the final model).

    To keep scoring short, copies are scored every ``stride``-th until one reaches the target,
    then the ones just before it, in order: the first copy at the target is found unless an
    earlier one reached it and the next scored one fell back below.
    """
    scored: dict[int, float] = {}

    def acc(i: int) -> float:
        if i not in scored:
            scored[i] = accuracy(points[i]["state"], test)
        return scored[i]

    hit = None
    for j in range(stride - 1, len(points) + stride - 1, stride):
        j = min(j, len(points) - 1)
        if acc(j) >= target:
            hit = next(i for i in range(max(j - stride + 1, 0), j + 1) if acc(i) >= target)
            break
    final = len(points) - 1
    ended_early = points[final]["seconds"] <= budget_s  # then its final model is the one at the budget
    budget = final if ended_early else max((i for i, p in enumerate(points) if p["seconds"] <= budget_s), default=None)
    return {
        "to_target_s": None if hit is None else points[hit]["seconds"],
        "to_target_samples": None if hit is None else points[hit]["samples"],
        "acc_at_budget": None if budget is None else acc(budget),
        "ended_before_budget": ended_early,
        "final_acc": acc(final),
        "curve": [(round(points[i]["seconds"], 2), points[i]["samples"], a) for i, a in sorted(scored.items())],
    }


def run_one(name: str, seed: int, args: argparse.Namespace, test: TensorDataset) -> dict[str, Any]:
    devices = 1 if name == "fast-alone" else 2
    with tempfile.TemporaryDirectory(prefix="elche-tta-") as folder:
        config = {
            "name": name, "seed": seed, "devices": devices, "data": args.data, "slowdown": args.slowdown,
            "epochs": args.epochs, "budget_s": args.budget_s, "eval_every_s": args.eval_every_s,
            "train_samples": args.train_samples, "snapshots": str(Path(folder) / "snapshots.pt"),
        }
        reports = run_job(MODULE, config, ranks=devices, timeout=args.timeout, cwd=str(REPO))
        points = torch.load(config["snapshots"])
    result = score(points, test, args.target, args.budget_s)
    result["train_s"] = max(r["seconds"] for r in reports)
    result["job_s"] = reports[0]["job_s"]
    result["samples"] = sum(r["samples"] for r in reports)
    return result


def median(values: list[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def paired(runs: list[dict], reference: list[dict]) -> Optional[float]:
    """Median over seeds of this config's time to target over the reference's, same seed."""
    return median([a["to_target_s"] / b["to_target_s"] if a["to_target_s"] and b["to_target_s"] else None
                   for a, b in zip(runs, reference)])


def fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def speeds(args: argparse.Namespace) -> str:
    return "equal speeds" if args.slowdown == 1 else f"rank 1 {args.slowdown:g}x slower"


def print_table(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    seeds = len(next(iter(results.values())))
    print(f"\n{args.data}, 2 ranks ({speeds(args)}), batch 64 per rank, Adam 1e-3, {args.epochs} epoch(s); "
          f"medians of {seeds} seed(s), ratios paired per seed")
    print(f"\n| configuration | reached {args.target:.0%} | time to {args.target:.0%} (s) | vs DDP | vs fast-alone "
          f"| samples to {args.target:.0%} (k) | acc at {args.budget_s:g} s | acc after {args.epochs} ep "
          f"| train s, {args.epochs} ep |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        early = "*" if any(r["ended_before_budget"] for r in runs) else ""
        samples = median([r["to_target_samples"] for r in runs])
        print(
            f"| {name} | {sum(r['to_target_s'] is not None for r in runs)}/{len(runs)} "
            f"| {fmt(median([r['to_target_s'] for r in runs]), '.1f')} "
            f"| {fmt(paired(runs, results['ddp']) if 'ddp' in results else None, '.2f')} "
            f"| {fmt(paired(runs, results['fast-alone']) if 'fast-alone' in results else None, '.2f')} "
            f"| {fmt(None if samples is None else samples / 1000, '.1f')} "
            f"| {fmt(median([r['acc_at_budget'] for r in runs]), '.2%')}{early} "
            f"| {median([r['final_acc'] for r in runs]):.2%} | {median([r['train_s'] for r in runs]):.1f} |"
        )
    if any(r["ended_before_budget"] for runs in results.values() for r in runs):
        print(f"\n\\* some runs finished their epochs before {args.budget_s:g} s: their final accuracy is shown")


def settle(args: argparse.Namespace) -> None:
    """Fill unset options: --quick's values, then the data set's defaults."""
    args.data = choose_data(args.data)
    if args.equal_speeds:
        args.slowdown = 1.0
    defaults = dict(DEFAULTS[args.data])
    equal = defaults.pop("budget_s_equal")
    defaults["budget_s"] = defaults["budget_s"] if args.slowdown > 1 else equal
    if args.quick:
        defaults.update(QUICK)
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=("fashion", "digits"), default="fashion")
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--target", type=float, help="target test accuracy (fashion 0.84, digits 0.95)")
    parser.add_argument("--budget-s", type=float, help="training-clock budget of 'acc at' (fashion 12 s, 6 s at equal speeds)")
    parser.add_argument("--epochs", type=int, help="epochs of every configuration (fashion 1, digits 30)")
    parser.add_argument("--eval-every-s", type=float, help="copy interval, training clock (fashion 1, digits 0.1)")
    parser.add_argument("--equal-speeds", action="store_true", help="no slowdown (same as --slowdown 1)")
    parser.add_argument("--slowdown", type=float, default=3.0, help="how many times slower rank 1 is (default 3)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--train-samples", type=int, help="train on the first N training images only")
    parser.add_argument("--test-samples", type=int, help="score on the first N test images only")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 6k/2k images, 1 epoch, low target")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a run counts as hung")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "time_to_accuracy.json")
    args = parser.parse_args()
    started = time.perf_counter()
    settle(args)
    print(f"time to accuracy: {args.data}, {speeds(args)}, {args.seeds} seed(s), target {args.target:.0%}, "
          f"budget {args.budget_s:g} s, {args.epochs} epoch(s); load average {os.getloadavg()[0]:.2f} "
          "(should be ~0: the machine must be quiet)", flush=True)
    names = available(args.configs)
    test = subset(load_data(args.data)[1], args.test_samples)
    torch.set_num_threads(os.cpu_count() or 1)  # scoring runs between jobs, never during one
    results: dict[str, list[dict]] = {name: [] for name in names}
    for seed in range(args.seeds):
        shift = seed % max(len(names), 1)
        order = names[shift:] + names[:shift]  # paired runs back to back, the order rotated
        for name in order:
            try:
                r = run_one(name, seed, args, test)
            except JobFailed as exc:  # e.g. a policy still in development: drop it, keep the others
                print(f"note: dropping {name}, it failed in seed {seed}: {exc}", flush=True)
                names.remove(name)
                del results[name]
                continue
            results[name].append(r)
            print(f"seed {seed} {name:<14} to {args.target:.0%}: {fmt(r['to_target_s'], '.1f')} s, "
                  f"acc at {args.budget_s:g} s {fmt(r['acc_at_budget'], '.4f')}, after {args.epochs} ep {r['final_acc']:.4f} "
                  f"({r['train_s']:.1f} s training, {r['job_s']:.0f} s job)", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    if results:
        print_table(results, args)
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s; per-run curves in {args.json}")


if __name__ == "__main__":
    main_or_worker(main, worker)
