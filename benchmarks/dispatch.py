"""Balance inside the window: planned vs dynamic dispatch vs DDP when speeds change or jitter.

    python -m benchmarks.dispatch            # every profile, 2 repeats; about 30 minutes
    python -m benchmarks.dispatch --quick    # 1 repeat, one epoch of 8192 samples; about 10 minutes
    python -m benchmarks.dispatch --smoke --json /tmp/dispatch.json   # every kind of run once, tiny

Two processes on this machine's two cores, gloo, one thread each, the small CNN of
``benchmarks/fashion.py`` (batch 32, Adam), one epoch of generated images. Rank 1's speed follows a
profile (``lightning_elche.Slowdown``, which measures the training thread's CPU time: its computation slows, its communication
does not):

  - ``steady1`` / ``steady2`` / ``steady4``: k times slower throughout;
  - ``step``: full speed, then 4x slower from its 40th optimizer step on;
  - ``alternate``: 1x and 4x, switching every 25 of its steps;
  - ``noise``: both ranks' speeds multiplied every 10 steps by a mean-one lognormal factor
    (sigma 0.3), on a base of 2x (rank 0) and 4x (rank 1).

Each profile runs under ElChe with ``dispatch="planned"`` and ``"dynamic"``, and under Lightning's
DDP; ``step``, ``alternate`` and their reference ``steady4`` also with two DataLoader workers per
rank. Reported, per run: rank 0's rate (its samples per second of training clock) over its rate in
``steady4`` with the same dispatch and workers, rank 0's idle share (time it waited at boundaries
for the other rank, over its training time), its longest wait at one boundary in rank 1's mean
batch times (the goal: about one batch at most), the cohort rate, and exact coverage (every sample of
the epoch trained once, from the indices each rank recorded). The ideal of ``noise`` and
``steady*`` is the sum of both ranks' solo rates, both solos running at the same time; under
``noise`` each solo trains exactly the steps its rank trained in that repeat's dynamic run, so it
meets the same speed draws (planned dispatch and DDP are compared with that same ideal). The runs
of a repeat go in an order rotated every repeat; one that fails is recorded as failed (in
``benchmarks/results/dispatch.json`` and the table), the others go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

if __package__ in (None, ""):  # run as `python benchmarks/dispatch.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fashion import small_cnn
from benchmarks.harness import both_at_once, cell, conclude, failed, results_path, run_job
from benchmarks.provenance import Failures, rotated, spread

MODULE = "benchmarks.dispatch"
PROFILES = ("steady1", "steady2", "steady4", "step", "alternate", "noise")
WITH_WORKERS = ("step", "alternate", "steady4")  # also run with two DataLoader workers per rank
NOISE_BASE = {0: 2.0, 1: 4.0}
# every kind of run once: a steady profile (the solo pair, DataLoader workers) and noise (its replayed ideal)
SMOKE = {"repeats": 1, "samples": 256, "profiles": ["steady4", "noise"], "workers": True, "timeout": 120.0}


class IndexedImages(Dataset):
    """Generated 28x28 ten-class images that carry their index, for the coverage check."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 1, 28, 28, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def factors(profile: str, seed: int = 0) -> dict[int, Any]:
    """Slowdown factors per rank for ``profile`` (functions of the rank's local step)."""
    if profile.startswith("steady"):
        return {1: float(profile.removeprefix("steady"))}
    if profile == "step":
        return {1: lambda step: 1.0 if step < 40 else 4.0}
    if profile == "alternate":
        return {1: lambda step: 4.0 if (step // 25) % 2 else 1.0}
    if profile == "noise":
        return {rank: _lognormal_every(10, base, random.Random(seed * 100 + rank)) for rank, base in NOISE_BASE.items()}
    raise ValueError(f"unknown profile {profile!r}; choose from {PROFILES}")


def _lognormal_every(steps: int, base: float, rng: random.Random) -> Callable[[int], float]:
    drawn: list[float] = []

    def factor(step: int) -> float:
        while len(drawn) <= step // steps:
            drawn.append(math.exp(rng.gauss(0.0, 0.3) - 0.045))
        return max(1.0, base * drawn[step // steps])

    return factor


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_elche import ElCheStrategy, Slowdown
    from lightning_elche._jobs import QUIET_TRAINER, Classifier, TrainClock, write_report

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(0, verbose=False)

    class IndexedClassifier(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            workers = config["num_workers"]
            return torch.utils.data.DataLoader(
                self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=workers,
                persistent_workers=workers > 0,
            )  # fmt: skip

    class Trained(Callback):
        def __init__(self) -> None:
            self.indices: list[int] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.indices.extend(batch[2].tolist())

    kind = config["strategy"]
    if kind == "elche":
        target = {} if config.get("overhead_target") is None else {"overhead_target": config["overhead_target"]}
        strategy: Any = ElCheStrategy(timeout=120, dispatch=config["dispatch"], **target)
    else:
        strategy = "ddp" if kind == "ddp" else "auto"
    profile = factors(config["profile"])
    if kind == "solo":  # one process running the given rank's profile alone
        profile = {0: profile.get(config["solo_rank"], 1.0)}
    clock, trained = TrainClock(), Trained()
    trainer = pl.Trainer(
        devices=config["devices"], strategy=strategy, max_epochs=1, limit_val_batches=0,
        callbacks=[clock, trained, Slowdown(profile)], **QUIET_TRAINER,
    )  # fmt: skip
    samples = config["solo_samples"] if kind == "solo" else config["samples"]
    trainer.fit(IndexedClassifier(small_cnn(), IndexedImages(samples), batch_size=config["batch_size"]))
    boundaries = getattr(trainer.strategy, "boundaries", [])
    write_report(config["out"], trainer.global_rank, {
        "seconds": clock.seconds, "samples": clock.samples, "indices": trained.indices,
        "boundary_ms": [b.boundary_ms for b in boundaries], "final_anchor": boundaries[-1].anchor if boundaries else None,
    })  # fmt: skip


def run(args: argparse.Namespace, strategy: str, profile: str, devices: int = 2, **extra: Any) -> list[dict]:
    config = {
        "name": f"{strategy}-{extra.get('dispatch', '')}-{profile}", "strategy": strategy, "profile": profile,
        "devices": devices, "samples": args.samples, "batch_size": args.batch_size, "num_workers": 0,
        "overhead_target": args.overhead_target, **extra,
    }  # fmt: skip
    return run_job(MODULE, worker, config, ranks=devices, timeout=args.timeout, warm=args.smoke)


def solo_pair(args: argparse.Namespace, profile: str, samples: Optional[list[int]] = None) -> float:
    """The ideal: both ranks' solo rates under ``profile``, measured at the same time; rank r's solo
    trains ``samples[r]`` (default: half the epoch each)."""
    shares = samples or [args.samples // 2] * 2

    def one(rank: int) -> float:
        (report,) = run(args, "solo", profile, devices=1, solo_rank=rank, solo_samples=shares[rank])
        return report["samples"] / report["seconds"]

    return sum(both_at_once(one))


def summarize(reports: list[dict], samples: int, batch_size: int) -> dict[str, Any]:
    fast = reports[0]
    row: dict[str, Any] = {
        "fast_rate": fast["samples"] / fast["seconds"],
        "cohort_rate": sum(r["samples"] for r in reports) / max(r["seconds"] for r in reports),
    }
    if fast["boundary_ms"]:  # rank 0's wait: its boundary time over the last arrival's
        waits = [mine - min(others) for mine, *others in zip(*(r["boundary_ms"] for r in reports))]
        row["fast_idle"] = sum(max(0.0, w) for w in waits) / 1000.0 / fast["seconds"]
        # "no rank waits more than about one batch": rank 0's longest wait at a boundary, in rank 1's
        # mean batch time over the run
        slow = reports[1]
        slow_batch_ms = 1000.0 * slow["seconds"] / max(1, len(slow["indices"]) // batch_size)
        row["max_wait_batches"] = max(0.0, *waits) / slow_batch_ms
    trained = sorted(i for r in reports for i in r["indices"])
    row["exact_coverage"] = trained == list(range(samples))
    row["boundaries"] = len(fast["boundary_ms"])
    row["rank_samples"] = [len(r["indices"]) for r in reports]
    return row


Rows = dict[str, list[Optional[dict[str, Any]]]]


def recorder(rows: Rows, repeats: int, failures: Failures, width: int) -> Callable[[str, int, Callable[[], dict]], Optional[dict]]:
    """``record(name, repeat, job)``: runs ``job`` through ``failures``, keeps its row at its repeat in
    ``rows[name]`` (``None`` when it failed, so that ratios pair repeats, not positions) and prints it:
    a long benchmark shows its progress."""

    def record(name: str, repeat: int, job: Callable[[], dict]) -> Optional[dict]:
        row = failures.attempt(name, repeat, job)
        rows.setdefault(name, [None] * repeats)[repeat] = row
        if row is not None:
            shown = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
            print(f"{name:{width}s} {shown}", flush=True)
        return row

    return record


def configurations(args: argparse.Namespace) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """A repeat's runs, by name. The ideal of ``noise`` is not among them: it replays the speed draws of
    the repeat's dynamic run, so it follows that run (:func:`measure`)."""

    def cohort(strategy: str, profile: str, **extra: Any) -> Callable[[], dict[str, Any]]:
        return lambda: summarize(run(args, strategy, profile, **extra), args.samples, args.batch_size)

    def ideal(profile: str) -> Callable[[], dict[str, Any]]:
        return lambda: {"cohort_rate": solo_pair(args, profile)}

    runs = []
    for profile in args.profiles:
        if profile.startswith("steady"):
            runs.append((f"ideal/{profile}", ideal(profile)))
        for dispatch in ("planned", "dynamic"):
            runs.append((f"{dispatch}/{profile}", cohort("elche", profile, dispatch=dispatch)))
            if profile in WITH_WORKERS and args.workers:
                runs.append((f"{dispatch}+workers/{profile}", cohort("elche", profile, dispatch=dispatch, num_workers=2)))
        runs.append((f"ddp/{profile}", cohort("ddp", profile)))
    return runs


def measure(args: argparse.Namespace, failures: Failures) -> Rows:
    rows: Rows = {}
    record = recorder(rows, args.repeats, failures, 28)
    for repeat in range(args.repeats):
        print(f"--- repeat {repeat + 1} of {args.repeats}", flush=True)
        for name, job in rotated(configurations(args), repeat):
            row = record(name, repeat, job)
            if name == "dynamic/noise":
                record("ideal/noise", repeat, lambda: {"cohort_rate": solo_pair(args, "noise", replayed(row))})
    return rows


def replayed(dynamic: Optional[dict[str, Any]]) -> list[int]:
    """The samples each solo of the noise ideal trains: what each rank trained in the dynamic run."""
    if dynamic is None:
        raise RuntimeError("the dynamic/noise run of this repeat failed: there are no speed draws to replay")
    return dynamic["rank_samples"]


def ratios(rows: Rows) -> dict[str, Any]:
    """The must-show ratios, paired within each repeat."""

    def paired(name: str, key: str, reference: str, reference_key: str) -> Optional[dict[str, float]]:
        values = [a[key] / b[reference_key] for a, b in zip(rows[name], rows.get(reference, [])) if a and b]
        return spread(values) if values else None

    out: dict[str, Any] = {}
    for name, runs in rows.items():
        dispatch, _, profile = name.partition("/")
        done = [r for r in runs if r]
        if dispatch == "ideal" or not done:
            continue
        loader = dispatch.partition("+")[2]  # with workers, planned dispatch with workers is the reference
        planned = f"planned+{loader}/{profile}" if loader else f"planned/{profile}"
        entry = {
            "fast_rate_over_steady4": paired(name, "fast_rate", f"{dispatch}/steady4", "fast_rate"),
            "cohort_over_ideal": paired(name, "cohort_rate", f"ideal/{profile}", "cohort_rate"),
            "cohort_over_ddp": paired(name, "cohort_rate", f"ddp/{profile}", "cohort_rate"),
            "cohort_over_planned": paired(name, "cohort_rate", planned, "cohort_rate"),
            "fast_idle": spread([r["fast_idle"] for r in done]) if "fast_idle" in done[0] else None,
            "max_wait_batches": spread([r["max_wait_batches"] for r in done]) if "max_wait_batches" in done[0] else None,
            "boundaries": spread([r["boundaries"] for r in done]) if done[0]["boundaries"] else None,
            "exact_coverage": all(r["exact_coverage"] for r in done),
        }
        out[name] = {k: v for k, v in entry.items() if v is not None}
    return out


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``profiles``: one row per run (the ideals only when they failed), medians (min-max) over the repeats."""
    summary, runs = record["results"]["summary"], record["results"]["runs"]
    lines = [
        "| run | fast rank rate / its steady-4x rate | fast rank idle | longest wait (rank 1 batches) | boundaries "
        "| cohort / ideal | cohort / DDP | cohort / planned | exact coverage |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in runs:
        row, lost = summary.get(name), failed(record, name)
        if row is None:
            if lost:
                lines.append(f"| {name} | failed ({lost} of {len(runs[name])} runs) |" + " |" * 7)
            continue
        lines.append(
            f"| {name}{f' ({lost} failed)' if lost else ''} | {cell(row.get('fast_rate_over_steady4'))} "
            f"| {cell(row.get('fast_idle'), '.0f', 100, ' %')} | {cell(row.get('max_wait_batches'), '.1f')} "
            f"| {cell(row.get('boundaries'), 'g')} | {cell(row.get('cohort_over_ideal'))} | {cell(row.get('cohort_over_ddp'))} "
            f"| {cell(row.get('cohort_over_planned'))} | {'yes' if row['exact_coverage'] else 'no'} |"
        )
    return {"profiles": "\n".join(lines) + "\n", "comparison": comparison(summary)}


SPEEDS = {
    "step": "4x slower from its 40th step", "alternate": "alternating 1x / 4x every 25 steps",
    "noise": "per-window lognormal noise (sigma 0.3) on 2x / 4x", "steady1": "steady, equal",
    "steady2": "steady 2x slower", "steady4": "steady 4x slower",
}  # fmt: skip


def comparison(summary: dict[str, Any]) -> str:
    """Planned beside dynamic dispatch per speed profile, medians: what docs/choosing.md shows."""
    lines = [
        "| rank 1's speed | fast rank's rate (planned, dynamic) | fast rank idle (planned, dynamic) "
        "| longest wait, rank 1 batches (planned, dynamic) | cohort / ideal (planned, dynamic) | dynamic / planned | dynamic / DDP |",
        "|---|---|---|---|---|---|---|",
    ]

    def median(row: Optional[dict[str, Any]], key: str, spec: str = ".2f", scale: float = 1.0, unit: str = "") -> str:
        value = None if row is None else row.get(key)
        return "-" if value is None else f"{format(value['median'] * scale, spec)}{unit}"

    for profile, speed in SPEEDS.items():
        for workers in ("", "+workers"):
            pair = summary.get(f"planned{workers}/{profile}"), summary.get(f"dynamic{workers}/{profile}")
            if pair == (None, None):
                continue
            moving = profile in ("step", "alternate")  # the rate beside the steady-4x run says something only there
            rate = ", ".join(median(row, "fast_rate_over_steady4") for row in pair) if moving else "-"
            idle = ", ".join(median(row, "fast_idle", ".0f", 100, " %") for row in pair)
            wait = ", ".join(median(row, "max_wait_batches", ".1f") for row in pair)
            ideal = ", ".join(median(row, "cohort_over_ideal") for row in pair) if not moving else "-"
            label = speed + (", 2 DataLoader workers per rank" if workers else "")
            lines.append(f"| {label} | {rate} | {idle} | {wait} | {ideal} | {median(pair[1], 'cohort_over_planned')} "
                         f"| {median(pair[1], 'cohort_over_ddp')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 8192 samples")
    parser.add_argument("--smoke", action="store_true", help="every code path once, tiny: does everything run?")
    parser.add_argument("--repeats", type=int, default=None, help="default 2 (1 with --quick)")
    parser.add_argument("--samples", type=int, default=None, help="samples in the epoch; default 16384 (8192 with --quick)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES)
    parser.add_argument("--no-workers", dest="workers", action="store_false", help="skip the num_workers=2 runs")
    parser.add_argument("--overhead-target", type=float, default=None,
                        help="ElCheStrategy(overhead_target=...): the share of time the controller lets averaging take "
                             "(default: the strategy's, 0.05); the ideal leaves averaging out")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/dispatch[_quick].json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.samples = args.samples or (8192 if args.quick else 16384)
    if {"step", "alternate"} & set(args.profiles) and "steady4" not in args.profiles:
        parser.error("--profiles with step or alternate must include steady4: their fast-rank rates are compared with it")
    args.json = results_path("dispatch", args)
    failures = Failures()
    rows = measure(args, failures)
    conclude("dispatch", args, {"summary": ratios(rows), "runs": rows}, failures, tables)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
