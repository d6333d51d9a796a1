"""LitData streaming data under ElChe: throughput against map-style data, and memory as the dataset grows.

    python -m benchmarks.streaming            # 3 repeats of 16,384 samples, then the memory runs; about 20 minutes
    python -m benchmarks.streaming --quick    # 1 repeat of 8192 samples, then the memory runs
    python -m benchmarks.streaming --smoke --json /tmp/streaming.json   # every run once, tiny

Two processes on this machine's two cores, gloo, one thread each, rank 1 three times slower
(``Slowdown({1: 3.0})``: its computation slows, its communication does not), ElChe's
default dispatch.

Throughput: the small CNN of ``benchmarks/fashion.py`` (batch 32, Adam) trains one epoch of the generated
images of ``dispatch.py``, whose items carry their index, in two forms side by side in every repeat:
``map``, the items in memory behind a torch ``DataLoader(shuffle=True)``; ``streaming``, the same
items written once with LitData's ``Cache`` writer (512 items a chunk) and read through
``StreamingDataLoader(StreamingDataset(dir, shuffle=True))``, which ElChe reads item by item
through its chunks; ``shards``, the same items in shard files (512 items each, ``torch.save``)
behind an ``IterableDataset`` with ``shards()``, which ElChe hands out whole and reads in order
(docs/streaming.md#sharded-iterables). Each form is compared with its own ideal, the sum of both ranks' solo rates
measured at the same time (``strategy="auto"``, one device, half the epoch each, the solo under its
rank's slowdown, on the same form of data), and DDP on the streaming data (LitData shards it
itself) is run for reference. Reported per run: the fast rank's share of the epoch's samples, the
cohort rate, exact coverage (every item of the epoch trained once, from the indices each rank
recorded); and, paired within a repeat, cohort / ideal per form and each streamed form's over map's.

Memory: datasets of 10^5, 10^6 and 10^7 single-int items (LitData ``Cache``, 4096 items a chunk;
written once under ``/tmp/elche_streaming_bench/<n>`` and reused) each train a tiny model
(an embedding of ``item % 1000``, batch 256) for the same 150 steps on the two slowed ElChe ranks (76,800
items, inside the first epoch at every size); each rank reports its peak RSS (``getrusage``). What ElChe's
plan holds that grows with the data is its chunk table (two ints per chunk) and one chunk's in-chunk
permutation; the table prints that size, computed from the chunk table the cohort used, next to what
an order of every item would take.

The runs of a repeat go in an order rotated every repeat; a run that fails is recorded as failed (in
``benchmarks/results/streaming.json`` and the tables), the others go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

if __package__ in (None, ""):  # run as `python benchmarks/streaming.py`: import the repository's packages as under -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dispatch import IndexedImages, Rows, recorder, summarize
from benchmarks.fashion import small_cnn
from benchmarks.harness import both_at_once, cell, conclude, failed, results_path, run_job
from benchmarks.provenance import Failures, rotated, spread

MODULE = "benchmarks.streaming"
SLOW = {1: 3.0}
IMAGE_CHUNK = 512
INT_CHUNK = 4096
MEMORY_ROOT = Path("/tmp/elche_streaming_bench")
MEMORY_SIZES = (10**5, 10**6, 10**7)
MEMORY_STEPS = 150  # x 256 x 2 ranks = 76,800 items: every size trains inside its first epoch
MEMORY_BATCH = 256
FORMS = ("map", "streaming", "shards")
# every form once on one chunk's worth of images, and one memory run of two chunks
SMOKE = {"repeats": 1, "samples": 256, "memory_sizes": [2 * INT_CHUNK], "memory_steps": 4, "timeout": 120.0}


def write_litdata(folder: Path, items: Any, n: int, chunk_size: int) -> None:
    """``items[0..n)`` in LitData's chunk format, by LitData's own writer in this process
    (``litdata.optimize`` would switch the start method to spawn for the whole benchmark)."""
    from litdata.streaming import Cache

    cache = Cache(str(folder), chunk_size=chunk_size)
    for index in range(n):
        cache[index] = items[index]
    cache.done()
    cache.merge()


class ShardFile:
    """One shard file of ``(x, y, index)`` items, read whole and in order."""

    def __init__(self, path: str, count: int) -> None:
        self.path, self.count = path, count

    def __iter__(self) -> Any:
        x, y, index = torch.load(self.path, weights_only=True)
        return zip(x, y, index.tolist())

    def __len__(self) -> int:
        return self.count


class ImageShards(torch.utils.data.IterableDataset):
    """The shard files of a folder, listed by ``shards()`` (read in order by ``__iter__`` for a solo run)."""

    def __init__(self, folder: str) -> None:
        self._shards = [ShardFile(str(path), count) for path, count in json.loads((Path(folder) / "shards.json").read_text())]

    def shards(self) -> list[ShardFile]:
        return self._shards

    def __iter__(self) -> Any:
        return (item for shard in self._shards for item in shard)


def write_shards(folder: Path, items: IndexedImages, per_shard: int) -> None:
    folder.mkdir(parents=True)
    table = []
    for number, start in enumerate(range(0, len(items), per_shard)):
        end, path = min(start + per_shard, len(items)), folder / f"shard-{number:05d}.pt"
        torch.save((items.x[start:end].clone(), items.y[start:end].clone(), torch.arange(start, end)), path)
        table.append((str(path), end - start))
    (folder / "shards.json").write_text(json.dumps(table))


def int_dataset(n: int, root: Path) -> Path:
    """The memory runs' dataset of ``n`` ints (item i is i) under ``root``, written on first use and reused after."""
    folder = root / str(n)
    if not (folder / "index.json").exists():
        shutil.rmtree(folder, ignore_errors=True)  # a write that was interrupted
        print(f"writing {n:,} items to {folder}", flush=True)
        write_litdata(folder, range(n), n, INT_CHUNK)
    return folder


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_elche import ElCheStrategy, Slowdown
    from lightning_elche._jobs import QUIET_TRAINER, Classifier, TrainClock, write_report

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(0, verbose=False)
    peak_before_fit_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    class Trained(Callback):
        """The item indices this rank trained, for the coverage check."""

        def __init__(self) -> None:
            self.indices: list[int] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.indices.extend((batch[2] if config["task"] == "images" else batch).tolist())

    class Model(Classifier):
        """Images ``(x, y, index)``: the small CNN; ints: an embedding of ``item % 1000`` predicting ``item % 10``."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if config["task"] == "images":
                x, y, _ = batch
                return nn.functional.cross_entropy(self.net(x), y)
            return nn.functional.cross_entropy(self.net(batch % 1000), batch % 10)

        def train_dataloader(self) -> DataLoader:
            """The streaming loader is built here, in ``fit``: a StreamingDataset reads the world size at construction."""
            if config["data"] == "map":
                return super().train_dataloader()
            if config["data"] == "shards":
                return DataLoader(ImageShards(config["shards_dir"]), batch_size=self.batch_size)
            import litdata

            streamed = litdata.StreamingDataset(config["data_dir"], shuffle=True)
            return litdata.StreamingDataLoader(streamed, batch_size=self.batch_size)

    kind = config["strategy"]
    if kind == "elche":
        strategy: Any = ElCheStrategy(timeout=120)
    else:
        strategy = "ddp" if kind == "ddp" else "auto"
    factors = {0: SLOW.get(config["solo_rank"], 1.0)} if kind == "solo" else SLOW
    clock, trained = TrainClock(), Trained()
    limits = {"max_steps": config["max_steps"]} if config["task"] == "ints" else {"max_epochs": 1}
    if kind == "solo":  # half the epoch, from the whole dataset (a streaming solo reads the same chunks)
        limits["limit_train_batches"] = config["solo_samples"] // config["batch_size"]
    trainer = pl.Trainer(
        devices=config["devices"], strategy=strategy, limit_val_batches=0,
        callbacks=[clock, trained, Slowdown(factors)], **limits, **QUIET_TRAINER,
    )  # fmt: skip
    if config["task"] == "images":
        net: nn.Module = small_cnn()
        train_set: Any = IndexedImages(config["samples"]) if config["data"] == "map" else None  # streamed: see above
    else:
        net, train_set = nn.Sequential(nn.Embedding(1000, 16), nn.Linear(16, 10)), None
    trainer.fit(Model(net, train_set, batch_size=config["batch_size"]))
    report: dict[str, Any] = {
        "seconds": clock.seconds, "samples": clock.samples, "indices": trained.indices,
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "peak_rss_before_fit_kib": peak_before_fit_kib,
        "boundary_ms": [b.boundary_ms for b in getattr(trainer.strategy, "boundaries", [])],
    }  # fmt: skip
    if kind == "elche":
        data = trainer.strategy.cohort.data
        report["dispatch"] = trainer.strategy.settings.cohort.dispatch_mode(trainer.world_size)
        if data.chunks is not None:
            report["chunks"] = len(data.chunks)
            report["largest_chunk"] = max(end - start for start, end in data.chunks)
            report["num_samples"] = data.num_samples
    write_report(config["out"], trainer.global_rank, report)


def run(args: argparse.Namespace, task: str, strategy: str, data: str, devices: int = 2, **extra: Any) -> list[dict]:
    config = {
        "name": f"{task}-{strategy}-{data}", "task": task, "strategy": strategy, "data": data, "devices": devices,
        "samples": args.samples, "batch_size": args.batch_size, "data_dir": args.data_dir, "shards_dir": args.shards_dir,
        "solo_rank": None, "max_steps": args.memory_steps, **extra,
    }  # fmt: skip
    return run_job(MODULE, worker, config, ranks=devices, timeout=args.timeout, warm=args.smoke)


def solo_pair(args: argparse.Namespace, data: str) -> dict[str, float]:
    """The ideal of ``data``'s form: both ranks' solo rates, each under its rank's slowdown, measured at the same time."""
    def one(rank: int) -> float:
        (report,) = run(args, "images", "solo", data, devices=1, solo_rank=rank, solo_samples=args.samples // 2)
        return report["samples"] / report["seconds"]

    rates = both_at_once(one)
    return {"cohort_rate": sum(rates), "fast_share": rates[0] / sum(rates)}


def measure_throughput(args: argparse.Namespace, failures: Failures) -> Rows:
    rows: Rows = {}
    record = recorder(rows, args.repeats, failures, 18)

    def cohort(strategy: str, data: str) -> dict[str, Any]:
        reports = run(args, "images", strategy, data)
        row = summarize(reports, args.samples, args.batch_size)
        row["fast_share"] = row["rank_samples"][0] / sum(row["rank_samples"])
        if strategy == "elche":
            row["dispatch"] = reports[0]["dispatch"]
        return row

    runs: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for data in FORMS:
        runs += [(f"ideal/{data}", lambda data=data: solo_pair(args, data)), (f"elche/{data}", lambda data=data: cohort("elche", data))]
    runs.append(("ddp/streaming", lambda: cohort("ddp", "streaming")))
    with tempfile.TemporaryDirectory(prefix="elche-streaming-") as folder:
        args.data_dir = str(Path(folder) / "images")
        write_litdata(Path(args.data_dir), IndexedImages(args.samples), args.samples, IMAGE_CHUNK)
        args.shards_dir = str(Path(folder) / "shards")
        write_shards(Path(args.shards_dir), IndexedImages(args.samples), IMAGE_CHUNK)
        for repeat in range(args.repeats):
            print(f"--- repeat {repeat + 1} of {args.repeats}", flush=True)
            for name, job in rotated(runs, repeat):
                record(name, repeat, job)
    args.data_dir = args.shards_dir = None  # gone with the folder
    return rows


def throughput_summary(rows: Rows) -> dict[str, Any]:
    """Per run: spreads of the fast share and cohort rate, cohort / ideal of its form paired within each
    repeat; and each streamed form's cohort / ideal over map's, paired the same way."""

    def over_ideal(name: str) -> list[Optional[float]]:
        ideal = rows.get(f"ideal/{name.partition('/')[2]}", [])
        return [a["cohort_rate"] / b["cohort_rate"] if a and b else None for a, b in zip(rows.get(name, []), ideal)]

    def spread_of(values: list[Optional[float]]) -> Optional[dict[str, float]]:
        present = [v for v in values if v is not None]
        return spread(present) if present else None

    out: dict[str, Any] = {}
    for name, runs in rows.items():
        done = [r for r in runs if r]
        if not done:
            continue
        entry: dict[str, Any] = {
            "fast_share": spread([r["fast_share"] for r in done]), "cohort_rate": spread([r["cohort_rate"] for r in done]),
        }
        if not name.startswith("ideal/"):
            entry["cohort_over_ideal"] = spread_of(over_ideal(name))
            entry["exact_coverage"] = all(r["exact_coverage"] for r in done)
        out[name] = entry
    for form in FORMS[1:]:
        if f"elche/{form}" in out:
            paired = [s / m if s and m else None for s, m in zip(over_ideal(f"elche/{form}"), over_ideal("elche/map"))]
            out[f"elche/{form}"]["over_map_cohort_over_ideal"] = spread_of(paired)
    streaming = out.get("elche/streaming", {})
    if streaming.get("over_map_cohort_over_ideal"):
        out["targets"] = {
            "fast_share_streaming_at_least_0.70": streaming["fast_share"]["min"] >= 0.70,
            "streaming_no_more_than_5pct_below_map": streaming["over_map_cohort_over_ideal"]["median"] >= 0.95,
        }  # fmt: skip
    return out


def measure_memory(args: argparse.Namespace, failures: Failures) -> dict[str, dict[str, Any]]:
    """Peak RSS per rank at each dataset size, the same steps trained at each."""
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="elche-streaming-ints-") as scratch:
        # a smoke run writes its small dataset afresh: two at once (the suite, run by two people) must not share one
        root = Path(scratch) if args.smoke else MEMORY_ROOT
        for n in args.memory_sizes:
            row = failures.attempt(f"memory/{n}", 0, lambda: memory_run(args, int_dataset(n, root)))
            if row is not None:
                out[str(n)] = row
                print(
                    f"memory {n:>10,} items  chunks {row['chunks']}  plan {row['plan_bytes']:,} B  "
                    f"peak RSS {', '.join(f'{m:.0f}' for m in row['peak_rss_mib'])} MiB  samples {row['rank_samples']}",
                    flush=True,
                )
    return out


def memory_run(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    reports = run(args, "ints", "elche", "streaming", data_dir=str(data_dir), batch_size=MEMORY_BATCH)
    trained = [i for r in reports for i in r["indices"]]
    fast = reports[0]
    return {
        "items": fast["num_samples"], "chunks": fast["chunks"], "largest_chunk": fast["largest_chunk"],
        # what the plan holds that grows with the data: the chunk table, two int64 per chunk, and the cached
        # in-chunk permutation of one chunk; an order of every item would be one int64 per item
        "plan_bytes": fast["chunks"] * 16 + fast["largest_chunk"] * 8, "per_item_order_bytes": fast["num_samples"] * 8,
        "peak_rss_mib": [r["peak_rss_kib"] / 1024 for r in reports],
        "peak_rss_before_fit_mib": [r["peak_rss_before_fit_kib"] / 1024 for r in reports],
        "rank_samples": [len(r["indices"]) for r in reports], "no_item_twice": len(trained) == len(set(trained)),
        "dispatch": fast["dispatch"],
    }  # fmt: skip


def memory_ratio(memory: dict[str, dict[str, Any]]) -> Optional[list[float]]:
    """Peak RSS per rank at the largest size over the smallest."""
    if len(memory) < 2:
        return None
    smallest, largest = memory[min(memory, key=int)], memory[max(memory, key=int)]
    return [big / small for big, small in zip(largest["peak_rss_mib"], smallest["peak_rss_mib"])]


LABELS = {
    "elche/map": "map-style, ElChe", "elche/streaming": "LitData streaming, ElChe",
    "elche/shards": "sharded iterable, ElChe", "ddp/streaming": "LitData streaming, DDP",
}


def tables(record: dict[str, Any]) -> dict[str, str]:
    """``throughput`` (every run against its form's ideal, medians (min-max) over the repeats) and
    ``memory`` (peak RSS per rank at each dataset size), as benchmarks/README.md shows them."""
    results, out = record["results"], {}
    if results["throughput"] is not None:
        lines = ["| run | fast rank's share | cohort / ideal | exact coverage |", "|---|---|---|---|"]
        for name, label in LABELS.items():
            row, lost = results["throughput"].get(name), failed(record, name)
            if row is None:
                if lost:
                    lines.append(f"| {label} | failed ({lost} of {lost} runs) | | |")
                continue
            ratio = cell(row["cohort_over_ideal"])
            if row.get("over_map_cohort_over_ideal"):
                ratio += f"; over map-style's, paired: {cell(row['over_map_cohort_over_ideal'])}"
            ideal_lost = failed(record, f"ideal/{name.partition('/')[2]}")
            notes = "".join(f" ({k} {what} failed)" for k, what in ((lost, "runs"), (ideal_lost, "ideal runs")) if k)
            lines.append(f"| {label}{notes} | {row['fast_share']['median']:.2f} | {ratio} | {'yes' if row['exact_coverage'] else 'no'} |")
        out["throughput"] = "\n".join(lines) + "\n"
    if results["memory"] is not None:
        lines = [
            "| items | chunks | what the plan holds that grows with the data | an order of every item | peak RSS rank 0 / rank 1 |",
            "|---|---|---|---|---|",
        ]
        lost = {int(f["configuration"].partition("/")[2]) for f in record["failures"] if f["configuration"].startswith("memory/")}
        for size in sorted({int(n) for n in results["memory"]} | lost):
            row = results["memory"].get(str(size))
            if row is None:
                lines.append(f"| {items(size)} | failed | | | |")
                continue
            lines.append(
                f"| {items(row['items'])} | {row['chunks']:,} | {row['plan_bytes'] / 1000:.0f} kB "
                f"| {row['per_item_order_bytes'] / 1e6:.2g} MB "
                f"| {' / '.join(f'{m:.0f}' for m in row['peak_rss_mib'])} MiB |"
            )
        out["memory"] = "\n".join(lines) + "\n"
    return out


def items(n: int) -> str:
    """``10^k`` for a power of ten, else the number."""
    k = round(math.log10(n)) if n > 0 else 0
    return f"10^{k}" if 10**k == n else f"{n:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 8192 samples")
    parser.add_argument("--smoke", action="store_true", help="every run once, tiny: does everything run?")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--samples", type=int, default=None, help="samples in the epoch; default 16384 (8192 with --quick)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--memory-sizes", type=int, nargs="+", default=list(MEMORY_SIZES), help="items per memory run")
    parser.add_argument("--memory-steps", type=int, default=MEMORY_STEPS,
                        help="steps of each memory run; every size must hold them (x 256 x 2 ranks) in its first epoch")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/streaming[_quick].json")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.samples = args.samples or (8192 if args.quick else 16384)
    args.data_dir = args.shards_dir = None
    args.json = results_path("streaming", args)
    failures = Failures()
    rows = None if args.skip_throughput else measure_throughput(args, failures)
    memory = None if args.skip_memory else measure_memory(args, failures)
    results = {
        "throughput": None if rows is None else throughput_summary(rows), "memory": memory,
        "memory_largest_over_smallest": None if memory is None else memory_ratio(memory), "runs": rows,
    }
    conclude("streaming", args, results, failures, tables)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
