"""Speeds that move, on the wall clock: does the fast rank keep its pace when the slow one changes speed?

    python -m benchmarks.alternation              # 3 repeats of every run; about 20 minutes
    python -m benchmarks.alternation --quick      # 1 repeat; about 7 minutes
    python -m benchmarks.alternation --smoke --json /tmp/alternation.json   # every kind of run once, tiny

The set-up issue 35 measured from outside: one epoch of 38,400 generated samples, an MLP
64-1024-1024-10, batch 128, SGD, two CPU ranks (gloo, one thread each) under ``ElCheStrategy()``'s
defaults, rank 1 slowed by :class:`~lightning_elche.Slowdown` (it sleeps ``k - 1`` times its training
thread's CPU time before each optimizer step: its computation slows, its communication and waiting
do not). Rank 1's speed follows a profile:

  - ``steady4``: 4x slower throughout (the reference);
  - ``step``: full speed, then 4x slower from its 40th step;
  - ``alternate``: 1x and 4x, switching every 25 of its steps.

Measured: rank 0's samples per wall-clock second, from the start times of its batches after the
first 10 % of them, over its rate training alone (one process on the machine, the same model and
batch, the same DataLoader workers). Not a training clock: every wait, boundary and hook the fast
rank pays is in it. The must-show: ``step`` and ``alternate`` at >= 0.97 of ``steady4``, with and
without two DataLoader workers per rank; the ratio is paired within a repeat. ``benchmarks/dispatch.py``
measures balance and idle shares on its own training clock; this is the wall-clock figure beside it.

The two ranks share this machine's two cores, caches and memory: while rank 1 computes at full speed
the fast rank's steps are slower than while rank 1 sleeps out a 4x step, cohort or not. So each
profile also runs *beside*: the fast rank's solo at the same time as a second plain process that
trains at rank 1's speed under the profile (no cohort, no boundary); the cohort's pace over that is
what ElChe itself costs the fast rank (1: nothing), and the neighbour's effect is that pace over solo.
Exact coverage (every sample of the epoch trained once) is checked from the indices each rank trained.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

if __package__ in (None, ""):  # run as `python benchmarks/alternation.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dispatch import Rows, recorder
from benchmarks.harness import both_at_once, cell, conclude, failed, results_path, run_job
from benchmarks.provenance import Failures, rotated, spread

MODULE = "benchmarks.alternation"
PROFILES = ("steady4", "step", "alternate")
SKIPPED_SHARE = 0.10  # the first batches carry start-up, not pace
SMOKE = {"repeats": 1, "samples": 2560, "timeout": 120.0}


class TeacherData(Dataset):
    """Generated 64-feature samples labelled by a fixed random linear teacher; each carries its index."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 64, generator=g)
        self.y = (self.x @ torch.randn(64, 10, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def factors(profile: str) -> dict[int, Any]:
    """Slowdown factors of rank 1 under ``profile`` (functions of its local step)."""
    if profile == "steady4":
        return {1: 4.0}
    if profile == "step":
        return {1: lambda step: 1.0 if step < 40 else 4.0}
    if profile == "alternate":
        return {1: lambda step: 4.0 if (step // 25) % 2 else 1.0}
    raise ValueError(f"unknown profile {profile!r}; choose from {PROFILES}")


def pace(starts: list[float], batch_size: int) -> float:
    """Samples per second from batch start times, after the first ``SKIPPED_SHARE`` of the batches."""
    first = int(len(starts) * SKIPPED_SHARE)
    if len(starts) - first < 2:
        raise ValueError(f"{len(starts)} batches are too few to read a pace from")
    return (len(starts) - 1 - first) * batch_size / (starts[-1] - starts[first])


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_elche import ElCheStrategy, Slowdown
    from lightning_elche._jobs import QUIET_TRAINER, write_report

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(0, verbose=False)

    class Mlp(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            workers = config["num_workers"]
            return torch.utils.data.DataLoader(
                TeacherData(config["samples"]), batch_size=config["batch_size"], shuffle=True,
                num_workers=workers, persistent_workers=workers > 0,
            )  # fmt: skip

    class Starts(Callback):
        """Each batch's wall-clock start and the indices it trained."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.indices: list[int] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())
            self.indices.extend(batch[2].tolist())

    solo = config["part"] is not None  # one process: the fast rank alone (part 0) or playing rank 1's speed (part 1)
    slow = factors(config["profile"]) if config["profile"] else {}
    if solo:
        slow = {0: slow[1]} if config["part"] == 1 else {}
    starts = Starts()
    trainer = pl.Trainer(
        devices=1 if solo else 2, strategy="auto" if solo else ElCheStrategy(timeout=120), max_epochs=1,
        limit_val_batches=0, callbacks=[starts, Slowdown(slow)], **QUIET_TRAINER,
    )  # fmt: skip
    trainer.fit(Mlp())
    write_report(config["out"], trainer.global_rank, {"pace": pace(starts.starts, config["batch_size"]), "indices": starts.indices})


def job(args: argparse.Namespace, profile: Optional[str], workers: int, part: Optional[int] = None) -> list[dict[str, Any]]:
    """A cohort fit under ``profile`` (``part`` None), or one process: the fast rank alone (``part`` 0) or
    one running rank 1's speed under ``profile`` (``part`` 1); each process's report."""
    name = f"{profile or 'solo'}/{workers}-workers" + ("" if part is None else f"/part-{part}")
    config = {"name": name, "profile": profile, "part": part, "num_workers": workers, "batch_size": args.batch_size,
              "samples": args.samples if part is None else args.samples // 2}
    return run_job(MODULE, worker, config, ranks=1 if part is not None else 2, timeout=args.timeout, warm=args.smoke)


def cohort(args: argparse.Namespace, profile: str, workers: int) -> dict[str, Any]:
    """Rank 0's pace in the cohort, and whether every sample of the epoch was trained once."""
    reports = job(args, profile, workers)
    trained = sorted(i for report in reports for i in report["indices"])
    return {"fast_pace": reports[0]["pace"], "exact_coverage": trained == list(range(args.samples))}


def beside(args: argparse.Namespace, profile: Optional[str], workers: int) -> dict[str, Any]:
    """The fast rank's pace training alone, without (``profile`` None) or beside a process that trains at
    rank 1's speed under ``profile`` at the same time, as the cohort's ranks share this machine's cores,
    caches and memory: what the fast rank would do with no cohort at all."""
    if profile is None:
        return {"fast_pace": job(args, None, workers, part=0)[0]["pace"]}
    paces = both_at_once(lambda part: job(args, profile, workers, part=part)[0]["pace"])
    return {"fast_pace": paces[0]}


def measure(args: argparse.Namespace, failures: Failures) -> Rows:
    runs: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for workers in args.workers:
        runs.append((f"solo/{workers}", lambda w=workers: beside(args, None, w)))
        for profile in PROFILES:
            runs.append((f"{profile}/{workers}", lambda p=profile, w=workers: cohort(args, p, w)))
            runs.append((f"beside-{profile}/{workers}", lambda p=profile, w=workers: beside(args, p, w)))
    rows: Rows = {}
    record = recorder(rows, args.repeats, failures, 22)
    for repeat in range(args.repeats):
        print(f"--- repeat {repeat + 1} of {args.repeats}", flush=True)
        for name, run in rotated(runs, repeat):
            record(name, repeat, run)
    return rows


def ratios(rows: Rows) -> dict[str, Any]:
    """Per profile and worker count, paired within each repeat: the fast rank's pace over its solo pace,
    over its pace beside a steadily 4x slower rank, and over its pace beside a plain process at rank 1's
    speed (1: the cohort costs it nothing)."""

    def paired(name: str, reference: str) -> Optional[dict[str, float]]:
        values = [a["fast_pace"] / b["fast_pace"] for a, b in zip(rows.get(name, []), rows.get(reference, [])) if a and b]
        return spread(values) if values else None

    out: dict[str, Any] = {}
    for name, runs in rows.items():
        profile, _, workers = name.partition("/")
        done = [r for r in runs if r]
        if profile == "solo" or profile.startswith("beside-") or not done:
            continue
        entry = {
            "over_solo": paired(name, f"solo/{workers}"),
            "over_steady4": paired(name, f"steady4/{workers}") if profile != "steady4" else None,
            "over_beside": paired(name, f"beside-{profile}/{workers}"),
            "beside_over_solo": paired(f"beside-{profile}/{workers}", f"solo/{workers}"),
            "exact_coverage": all(r["exact_coverage"] for r in done),
        }
        out[name] = {k: v for k, v in entry.items() if v is not None}
    return out


LABELS = {"steady4": "steadily 4x slower", "step": "4x slower from its 40th step", "alternate": "1x / 4x every 25 of its steps"}


def tables(record: dict[str, Any]) -> dict[str, str]:
    """The fast rank's wall-clock pace per profile, medians (min-max) over the repeats."""
    summary, runs = record["results"]["summary"], record["results"]["runs"]
    lines = [
        "| rank 1 | DataLoader workers | fast rank's pace / its solo pace | / its pace beside a steady 4x "
        "| / its pace beside a plain process at rank 1's speed | that plain neighbour's pace / solo | exact coverage |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in runs:
        profile, _, workers = name.partition("/")
        if profile not in LABELS:
            continue
        row, lost = summary.get(name), failed(record, name)
        if row is None:
            lines.append(f"| {LABELS[profile]} | {workers} | failed ({lost} of {len(runs[name])} runs) | | | | |")
            continue
        lines.append(f"| {LABELS[profile]}{f' ({lost} failed)' if lost else ''} | {workers} | {cell(row.get('over_solo'))} "
                     f"| {cell(row.get('over_steady4')) if profile != 'steady4' else '1'} | {cell(row.get('over_beside'))} "
                     f"| {cell(row.get('beside_over_solo'))} | {'yes' if row['exact_coverage'] else 'no'} |")
    return {"pace": "\n".join(lines) + "\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    parser.add_argument("--smoke", action="store_true", help="every kind of run once, tiny: does everything run?")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--samples", type=int, default=153600,
                        help="samples in the epoch (a solo trains half); issue 35 measured 38,400, whose fits last 2-3 s here")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers per rank, each measured")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/alternation[_quick].json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.json = results_path("alternation", args)
    failures = Failures()
    rows = measure(args, failures)
    conclude("alternation", args, {"summary": ratios(rows), "runs": rows}, failures, tables)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
