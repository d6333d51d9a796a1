"""The fast rank's wait at validation: DDP's equal shares against ElChe's split by speed.

    python benchmarks/validation_wait.py                    # about two minutes
    python benchmarks/validation_wait.py --smoke --json /tmp/validation_wait.json

Two ranks, rank 1 three times slower (``Slowdown``: its training steps and validation batches), an MLP
of width 2,048 (so that a validation takes a few tenths of a second to a second, most of it compute),
a validation set of 4,096 samples validated at every epoch's end. Each rank times every validation
from its start to its last batch's end and to the validation's end (after the metrics' reduce, where
it meets the other rank): the fast rank's wait is the difference, as a share of the validation's wall
time. Under DDP every rank validates half the set; under ElChe the first validation is a probe with
equal batch counts (it checks that no collective runs between validation steps) and the later ones
are split by speed. The strategies of a repeat run in an order rotated every repeat; results in
``benchmarks/results/validation_wait.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

if __package__ in (None, ""):  # run as `python benchmarks/validation_wait.py`: the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cell, conclude, failed, results_path, run_job
from benchmarks.provenance import Failures, rotated, spread

MODULE = "benchmarks.validation_wait"
STRATEGIES = ("ddp", "elche")
SMOKE = {"hidden": 64, "train_samples": 256, "val_samples": 512, "epochs": 2, "repeats": 1, "timeout": 120.0}


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from lightning_elche import ElCheStrategy, Slowdown
    from lightning_elche._jobs import QUIET_TRAINER, Classifier, write_report

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)

    def data(samples: int) -> TensorDataset:
        return TensorDataset(torch.randn(samples, 64, generator=g), torch.randint(0, 10, (samples,), generator=g))

    class ValidationClock(pl.Callback):
        """Per validation of the fit: seconds to this rank's last batch's end, and to the validation's end."""

        def __init__(self) -> None:
            self.runs: list[dict[str, float]] = []

        def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if not trainer.sanity_checking:
                self.runs.append({"started": time.perf_counter(), "samples": 0})

        def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                    batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
            if not trainer.sanity_checking:
                self.runs[-1]["batches_s"] = time.perf_counter() - self.runs[-1]["started"]
                self.runs[-1]["samples"] += len(batch[0])

        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if not trainer.sanity_checking:
                self.runs[-1]["total_s"] = time.perf_counter() - self.runs[-1].pop("started")

    clock = ValidationClock()
    hidden = config["hidden"]
    net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    model = Classifier(net, data(config["train_samples"]), batch_size=16, val_set=data(config["val_samples"]))
    strategy: Any = ElCheStrategy(timeout=120) if config["strategy"] == "elche" else "ddp"
    trainer = pl.Trainer(
        devices=2, strategy=strategy, max_epochs=config["epochs"], callbacks=[clock, Slowdown({1: 3.0})],
        **QUIET_TRAINER,
    )  # fmt: skip
    trainer.fit(model)
    write_report(config["out"], trainer.global_rank, {"validations": clock.runs})


def wait_share(run: dict[str, float]) -> float:
    return (run["total_s"] - run["batches_s"]) / run["total_s"]


def measure(args: argparse.Namespace, failures: Failures) -> dict[str, Any]:
    """Per strategy and repeat: the fast rank's wait share (median over the validations after the first) and
    the slow rank's share of the samples."""
    results: dict[str, list[Optional[dict[str, float]]]] = {name: [None] * args.repeats for name in STRATEGIES}
    for repeat in range(args.repeats):
        for name in rotated(list(STRATEGIES), repeat):
            config = {"name": name, "strategy": name, "hidden": args.hidden, "train_samples": args.train_samples,
                      "val_samples": args.val_samples, "epochs": args.epochs}  # fmt: skip
            reports = failures.attempt(name, repeat, lambda: run_job(MODULE, worker, config, 2, args.timeout, warm=args.smoke))
            if reports is None:
                continue
            fast, slow = (report["validations"][1:] for report in reports)  # ElChe's first is the probe
            row = {
                "fast_wait_share": statistics.median(wait_share(run) for run in fast),
                "slow_wait_share": statistics.median(wait_share(run) for run in slow),
                "slow_samples_share": statistics.median(s["samples"] / (f["samples"] + s["samples"]) for f, s in zip(fast, slow)),
                "validation_s": statistics.median(max(f["total_s"], s["total_s"]) for f, s in zip(fast, slow)),
                "first_fast_wait_share": wait_share(reports[0]["validations"][0]),
            }  # fmt: skip
            results[name][repeat] = row
            print(f"{name}: the fast rank waits {row['fast_wait_share']:.1%} of validation's wall time "
                  f"({row['validation_s']:.2f} s); the slow rank validates {row['slow_samples_share']:.1%} of the set",
                  flush=True)  # fmt: skip
    summary: dict[str, Any] = {}
    for name, rows in results.items():
        done = [row for row in rows if row is not None]
        if done:
            summary[name] = {key: spread([row[key] for row in done]) for key in done[0]}
    paired = [e["validation_s"] / d["validation_s"] for e, d in zip(results["elche"], results["ddp"]) if e and d]
    return {"runs": results, "summary": summary, "elche_over_ddp_validation_s": spread(paired) if paired else None}


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``wait``: the fast rank's wait at validation, medians (min-max) of the repeats."""
    results = record["results"]
    summary = results["summary"]
    lines = ["| strategy | fast rank's wait (share of validation) | slow rank's samples | validation (s) |",
             "|---|---|---|---|"]  # fmt: skip
    for name in STRATEGIES:
        row, lost = summary.get(name), failed(record, name)
        label = {"ddp": "DDP (equal shares)", "elche": "ElChe (split by speed)"}[name]
        if row is None:
            lines.append(f"| {label} | failed ({lost} of {lost} runs) | | |")
            continue
        lines.append(f"| {label} | {cell(row['fast_wait_share'], '.1%')} | {cell(row['slow_samples_share'], '.1%')} "
                     f"| {cell(row['validation_s'], '.2f')} |")
    ratio = results["elche_over_ddp_validation_s"]
    if ratio is not None:
        lines.append(f"\nElChe's validation takes {cell(ratio, '.2f')} of DDP's time (paired within a repeat).")
    return {"wait": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048, help="the MLP's width: validation takes about a second")
    parser.add_argument("--train-samples", type=int, default=1024)
    parser.add_argument("--val-samples", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=4, help="validations (the first is ElChe's probe)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a job counts as hung")
    parser.add_argument("--smoke", action="store_true", help="tiny, once: does everything run?")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/validation_wait.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.json = results_path("validation_wait", args)
    failures = Failures()
    conclude("validation_wait", args, measure(args, failures), failures, tables)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
