"""Checkpoint save and load, 2 and 4 ranks: each rank writing its own part against every rank's states gathered to rank 0.

    python benchmarks/checkpoint.py                     # about 20 minutes here; about 15 GB of memory at 4 ranks
    python benchmarks/checkpoint.py --ranks 2 --repeats 1
    python benchmarks/checkpoint.py --smoke --json /tmp/checkpoint.json   # a small MLP, 2 ranks, once

An MLP of ``--layers`` Linear(H, H) layers (H = ``--hidden``; 3 x 4096: 50.3M parameters, 201 MB in
float32) trains two steps per rank with Adam under ElCheStrategy(policy="sync") on CPU ranks (gloo,
one thread each), so every rank holds its own Adam moments (two copies of the parameters, 403 MB).
At the end of the epoch, at a boundary, ``trainer.save_checkpoint`` runs ``--saves`` times; then a
second fit (fresh processes) resumes from that checkpoint. Two layouts, in the same run:

- before, "single file": the layout of earlier versions, every rank's optimizer states gathered
  to rank 0 and written by it in the one file (``CohortCheckpoints.single_file``, a switch that only
  this benchmark and the tests set; it runs the same code the single-file writer ran before the parts);
- after, "parts": every other rank writes its own part beside the checkpoint, rank 0 gathers nothing.

Measured, per configuration (layout x world size):

- save: the wall time of ``trainer.save_checkpoint`` on each rank, the slowest rank's (every rank
  waits for the outcome), and rank 0's peak RSS while it runs: Linux's high-water mark
  (``VmHWM`` in ``/proc/self/status``) reset just before the save (``/proc/self/clear_refs``), read
  just after, shown as what the save adds above rank 0's RSS when it began;
- load: the resumed fit's restore on each rank, the slowest rank's: the strategy's ``load_checkpoint``
  (the checkpoint file), ElChe's state (with the check of every part) and the optimizers' restore
  (a rank's part); and rank 0's peak RSS while ``load_checkpoint`` reads the file, above its RSS then;
- the bytes on disk: the checkpoint file and its parts.

Files go to the temporary folder (``--dir``), into the page cache with no fsync, for both layouts
alike; they are removed after each configuration. Configurations run in an order rotated every
repeat; before/after ratios are paired within a repeat. A configuration that fails is recorded as
failed (JSON and table), the others go on, and the exit status is 1. A smoke run forks its ranks
from the benchmark's interpreter: their memory figures count the pages they share, so they are no
measurement.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as `python benchmarks/checkpoint.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cell, conclude, failed, results_path, run_job
from benchmarks.provenance import Failures, rotated, spread

MODULE = "benchmarks.checkpoint"
SMOKE = {"hidden": 64, "layers": 2, "ranks": "2", "saves": 1, "repeats": 1, "timeout": 120.0}
LAYOUTS = {"single file (before)": True, "parts (after)": False}  # name -> CohortCheckpoints.single_file
STEPS_PER_RANK = 2
BATCH = 2


# --------------------------------------------------------------------------- rank 0's memory


def _status_mb(field: str) -> float:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


def reset_peak_rss() -> float:
    """Reset this process's peak RSS to its RSS now (Linux >= 4.0) and return the RSS in MB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def peak_rss() -> float:
    """This process's peak RSS in MB since the last :func:`reset_peak_rss`."""
    return _status_mb("VmHWM")


# --------------------------------------------------------------------------- the ranks


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from lightning_elche import ElCheStrategy
    from lightning_elche._jobs import QUIET_TRAINER, write_report

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(nn.Linear(config["hidden"], config["hidden"]) for _ in range(config["layers"])))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            samples = config["ranks"] * STEPS_PER_RANK * BATCH
            data = TensorDataset(torch.randn(samples, config["hidden"], generator=g), torch.randn(samples, config["hidden"], generator=g))
            return DataLoader(data, batch_size=BATCH)

    class TimedSaves(pl.Callback):
        """``trainer.save_checkpoint`` at the epoch's end (a boundary), timed, with this rank's peak RSS."""

        def __init__(self) -> None:
            self.saves: list[dict[str, float]] = []

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            for _ in range(config["saves"]):
                before = reset_peak_rss()
                started = time.perf_counter()
                trainer.save_checkpoint(config["path"])
                self.saves.append({"seconds": time.perf_counter() - started, "rss_mb": before, "peak_mb": peak_rss()})

    class TimedRestore(ElCheStrategy):
        """ElCheStrategy timing its part of a resume: the checkpoint file, ElChe's state, the optimizers."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.restore_s = 0.0
            self.load_memory: dict[str, float] = {}
            load_state = self.checkpoints.load_state

            def timed_load_state(state: dict[str, Any]) -> None:
                started = time.perf_counter()
                load_state(state)
                self.restore_s += time.perf_counter() - started

            self.checkpoints.load_state = timed_load_state  # type: ignore[method-assign]

        def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
            before = reset_peak_rss()
            started = time.perf_counter()
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
            self.restore_s += time.perf_counter() - started
            self.load_memory = {"rss_mb": before, "peak_mb": peak_rss()}
            return checkpoint

        def load_optimizer_state_dict(self, checkpoint: Any) -> None:
            started = time.perf_counter()
            super().load_optimizer_state_dict(checkpoint)
            self.restore_s += time.perf_counter() - started

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    strategy = TimedRestore(policy="sync", timeout=config["timeout"])
    strategy.checkpoints.single_file = config["single_file"]
    saving = config["mode"] == "save"
    saves = TimedSaves()
    trainer = pl.Trainer(devices=config["ranks"], strategy=strategy, max_epochs=1, limit_val_batches=0,
                         callbacks=[saves] if saving else [], **QUIET_TRAINER)  # fmt: skip
    model = Regression()
    trainer.fit(model, ckpt_path=None if saving else config["path"])
    report: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    if saving:
        report["saves"] = saves.saves
        if trainer.global_rank == 0:
            path = Path(config["path"])
            parts = Path(str(path) + ".parts")
            report["file_mb"] = path.stat().st_size / 2**20
            report["parts_mb"] = sum(p.stat().st_size for p in parts.iterdir()) / 2**20 if parts.exists() else 0.0
    else:
        report["restore_s"] = strategy.restore_s
        report["load_memory"] = strategy.load_memory
    write_report(config["out"], trainer.global_rank, report)


# --------------------------------------------------------------------------- the driver


def run_configuration(args: argparse.Namespace, ranks: int, layout: str, folder: Path) -> dict[str, Any]:
    """One save job and one load job of ``layout`` on ``ranks`` ranks; the figures of rank 0 and the slowest rank."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"name": f"{layout}, {ranks} ranks", "hidden": args.hidden, "layers": args.layers, "ranks": ranks,
              "saves": args.saves, "single_file": LAYOUTS[layout], "path": str(folder / "bench.ckpt"),
              "timeout": args.timeout}  # fmt: skip
    try:
        saved = run_job(MODULE, worker, {**config, "mode": "save"}, ranks, args.timeout, warm=args.smoke)
        loaded = run_job(MODULE, worker, {**config, "mode": "load"}, ranks, args.timeout, warm=args.smoke)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    save_s = [max(report["saves"][i]["seconds"] for report in saved) for i in range(args.saves)]
    leader = saved[0]
    return {
        "parameters": leader["parameters"],
        "save_s": save_s,
        "save_rank0_added_mb": [s["peak_mb"] - s["rss_mb"] for s in leader["saves"]],
        "save_rank0_peak_mb": [s["peak_mb"] for s in leader["saves"]],
        "load_s": max(report["restore_s"] for report in loaded),
        "load_rank0_added_mb": loaded[0]["load_memory"]["peak_mb"] - loaded[0]["load_memory"]["rss_mb"],
        "load_rank0_peak_mb": loaded[0]["load_memory"]["peak_mb"],
        "file_mb": leader["file_mb"],
        "parts_mb": leader["parts_mb"],
    }


FIGURES = ("save_s", "load_s", "save_rank0_added_mb", "load_rank0_added_mb")


def measure(args: argparse.Namespace, failures: Failures, folder: Path) -> dict[str, Any]:
    """Every configuration in every repeat, in an order rotated every repeat; spreads and paired ratios."""
    configurations = [(ranks, layout) for ranks in args.ranks for layout in LAYOUTS]
    runs: dict[str, list[Optional[dict[str, Any]]]] = {_key(*c): [None] * args.repeats for c in configurations}
    for repeat in range(args.repeats):
        for ranks, layout in rotated(configurations, repeat):
            key = _key(ranks, layout)
            place = folder / f"{ranks}-{'single' if LAYOUTS[layout] else 'parts'}-{repeat}"
            result = failures.attempt(key, repeat, lambda: run_configuration(args, ranks, layout, place))
            runs[key][repeat] = result
            if result is not None:
                print(f"{key}: save {statistics.median(result['save_s']):.2f} s, load {result['load_s']:.2f} s, rank 0 "
                      f"+{statistics.median(result['save_rank0_added_mb']):.0f} MB saving, "
                      f"+{result['load_rank0_added_mb']:.0f} MB loading", flush=True)  # fmt: skip
    summary: dict[str, Any] = {}
    for key, results in runs.items():
        done = [r for r in results if r is not None]
        if done:
            summary[key] = {
                **{name: spread(_flat(r[name] for r in done)) for name in FIGURES},
                "save_rank0_peak_mb": spread(_flat(r["save_rank0_peak_mb"] for r in done)),
                "load_rank0_peak_mb": spread([r["load_rank0_peak_mb"] for r in done]),
                "file_mb": done[-1]["file_mb"], "parts_mb": done[-1]["parts_mb"], "parameters": done[-1]["parameters"],
            }  # fmt: skip
    ratios: dict[str, Any] = {}
    for ranks in args.ranks:
        before, after = runs[_key(ranks, "single file (before)")], runs[_key(ranks, "parts (after)")]
        pairs = [(b, a) for b, a in zip(before, after) if b is not None and a is not None]
        if pairs:  # before / after within each repeat, of that repeat's medians
            ratios[str(ranks)] = {name: spread([_median(b[name]) / max(_median(a[name]), 1e-9) for b, a in pairs])
                                  for name in FIGURES}  # fmt: skip
    return {"runs": runs, "summary": summary, "ratios": ratios}


def _key(ranks: int, layout: str) -> str:
    return f"{ranks} ranks, {layout}"


def _flat(values: Any) -> list[float]:
    return [x for value in values for x in (value if isinstance(value, list) else [value])]


def _median(value: Any) -> float:
    return statistics.median(value) if isinstance(value, list) else float(value)


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``checkpoint``: save and load seconds, rank 0's added peak RSS and the bytes written, per layout and
    world size, medians (min-max), and the before/after ratios paired within a repeat."""
    results, args = record["results"], record["args"]
    summary, ratios = results["summary"], results["ratios"]
    lines = ["| ranks | layout | save (s) | load (s) | rank 0 peak RSS added, save (MB) | rank 0 peak RSS added, load (MB) "
             "| checkpoint file (MB) | parts (MB) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for ranks in [int(r) for r in str(args["ranks"]).split(",")]:
        for layout in LAYOUTS:
            key, lost = _key(ranks, layout), failed(record, _key(ranks, layout))
            row = summary.get(key)
            if row is None:
                lines.append(f"| {ranks} | {layout} | failed ({lost} of {lost} runs) | | | | | |")
                continue
            lines.append(
                f"| {ranks} | {layout}{f' ({lost} failed)' if lost else ''} | {cell(row['save_s'])} | {cell(row['load_s'])} "
                f"| {cell(row['save_rank0_added_mb'], '.0f')} | {cell(row['load_rank0_added_mb'], '.0f')} "
                f"| {row['file_mb']:.1f} | {row['parts_mb']:.1f} |"
            )
        ratio = ratios.get(str(ranks))
        if ratio is not None:
            lines.append(f"| {ranks} | **before / after** | {cell(ratio['save_s'], unit='x')} | {cell(ratio['load_s'], unit='x')} "
                         f"| {cell(ratio['save_rank0_added_mb'], unit='x')} | {cell(ratio['load_rank0_added_mb'], unit='x')} "
                         "| | |")  # fmt: skip
    return {"checkpoint": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096, help="width H of the Linear(H, H) layers")
    parser.add_argument("--layers", type=int, default=3, help="Linear(H, H) layers (3 x 4096: 50.3M parameters)")
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--saves", type=int, default=3, help="saves per save job (each timed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a job counts as hung")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints are written (default: the temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="a small MLP on 2 ranks, once: does everything run?")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/checkpoint.json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.ranks = [int(r) for r in str(args.ranks).split(",")]
    args.json = results_path("checkpoint", args)
    folder = Path(tempfile.mkdtemp(prefix="elche-checkpoint-bench-", dir=args.dir))
    failures = Failures()
    try:
        results = measure(args, failures, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    parameters = next((row["parameters"] for row in results["summary"].values()), None)
    if parameters is not None:
        print(f"\nmodel: {parameters / 1e6:.1f}M parameters ({parameters * 4 / 2**20:.0f} MB float32), Adam", flush=True)
    args.ranks = ",".join(str(r) for r in args.ranks)  # as the table reads it back
    conclude("checkpoint", args, results, failures, tables, memory_measured_by=(
        "rank 0's VmHWM (/proc/self/status), reset with /proc/self/clear_refs just before the save (the load's "
        "load_checkpoint), minus its VmRSS at that moment" + ("; forked ranks share pages: no measurement" if args.smoke else "")
    ))


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
