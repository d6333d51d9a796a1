"""LitData streaming data under ElChe: throughput against map-style data, and memory as the dataset grows.

    python -m benchmarks.streaming            # 3 repeats of 16,384 samples, then the memory runs; about 20 minutes
    python -m benchmarks.streaming --quick    # 1 repeat of 8192 samples, then the memory runs

Two processes on this machine's two cores, gloo, one thread each, rank 1 three times slower
(``Slowdown({1: 3.0}, clock="cpu")``: its computation slows, its communication does not), ElChe's
default dispatch.

Throughput: the small CNN of ``throughput.py`` (batch 32, Adam) trains one epoch of the generated
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
items, inside the first epoch at every size); each rank reports its peak RSS (``getrusage``). What ElChe's plan holds that grows with the data is
its chunk table (two ints per chunk) and one chunk's in-chunk permutation; the table prints that
size, computed from the chunk table the cohort used, next to what an order of every item would take.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.dispatch import IndexedImages, both_at_once, provenance, recorder, small_cnn, spread, summarize

REPO = Path(__file__).resolve().parent.parent
MODULE = "benchmarks.streaming"
SLOW = {1: 3.0}
IMAGE_CHUNK = 512
INT_CHUNK = 4096
MEMORY_ROOT = Path("/tmp/elche_streaming_bench")
MEMORY_SIZES = (10**5, 10**6, 10**7)
MEMORY_STEPS = 150  # x 256 x 2 ranks = 76,800 items: every size trains inside its first epoch
MEMORY_BATCH = 256
FORMS = ("map", "streaming", "shards")


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


def int_dataset(n: int) -> Path:
    """The memory runs' dataset of ``n`` ints (item i is i), written on first use and reused after."""
    folder = MEMORY_ROOT / str(n)
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
    limits = {"max_steps": MEMORY_STEPS} if config["task"] == "ints" else {"max_epochs": 1}
    if kind == "solo":  # half the epoch, from the whole dataset (a streaming solo reads the same chunks)
        limits["limit_train_batches"] = config["solo_samples"] // config["batch_size"]
    trainer = pl.Trainer(
        devices=config["devices"], strategy=strategy, limit_val_batches=0,
        callbacks=[clock, trained, Slowdown(factors, clock="cpu")], **limits, **QUIET_TRAINER,
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
    from lightning_elche._jobs import run_job

    config = {
        "name": f"{task}-{strategy}-{data}", "task": task, "strategy": strategy, "data": data, "devices": devices,
        "samples": args.samples, "batch_size": args.batch_size, "data_dir": args.data_dir, "shards_dir": args.shards_dir,
        "solo_rank": None, **extra,
    }  # fmt: skip
    return run_job(MODULE, config, ranks=devices, timeout=args.timeout, cwd=str(REPO))


def solo_pair(args: argparse.Namespace, data: str) -> dict[str, float]:
    """The ideal of ``data``'s form: both ranks' solo rates, each under its rank's slowdown, measured at the same time."""
    def one(rank: int) -> float:
        (report,) = run(args, "images", "solo", data, devices=1, solo_rank=rank, solo_samples=args.samples // 2)
        return report["samples"] / report["seconds"]

    rates = both_at_once(one)
    return {"cohort_rate": sum(rates), "fast_share": rates[0] / sum(rates)}


def measure_throughput(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {}
    record = recorder(rows, 18)

    def cohort(strategy: str, data: str) -> dict[str, Any]:
        reports = run(args, "images", strategy, data)
        row = summarize(reports, args.samples, args.batch_size)
        row["fast_share"] = row["rank_samples"][0] / sum(row["rank_samples"])
        if strategy == "elche":
            row["dispatch"] = reports[0]["dispatch"]
        return row

    with tempfile.TemporaryDirectory(prefix="elche-streaming-") as folder:
        args.data_dir = str(Path(folder) / "images")
        write_litdata(Path(args.data_dir), IndexedImages(args.samples), args.samples, IMAGE_CHUNK)
        args.shards_dir = str(Path(folder) / "shards")
        write_shards(Path(args.shards_dir), IndexedImages(args.samples), IMAGE_CHUNK)
        for repeat in range(args.repeats):
            print(f"--- repeat {repeat + 1} of {args.repeats}", flush=True)
            for data in FORMS:
                record(f"ideal/{data}", solo_pair(args, data))
                record(f"elche/{data}", cohort("elche", data))
            record("ddp/streaming", cohort("ddp", "streaming"))
    return rows


def throughput_summary(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per run: spreads of the fast share and cohort rate, cohort / ideal of its form paired within each
    repeat; and each streamed form's cohort / ideal over map's, paired the same way."""

    def over_ideal(name: str) -> list[float]:
        ideal = f"ideal/{name.partition('/')[2]}"
        return [a["cohort_rate"] / b["cohort_rate"] for a, b in zip(rows[name], rows[ideal])]

    out: dict[str, Any] = {}
    for name, runs in rows.items():
        entry: dict[str, Any] = {
            "fast_share": spread([r["fast_share"] for r in runs]),
            "cohort_rate": spread([r["cohort_rate"] for r in runs]),
        }
        if not name.startswith("ideal/"):
            entry["cohort_over_ideal"] = spread(over_ideal(name))
            entry["exact_coverage"] = all(r["exact_coverage"] for r in runs)
        out[name] = entry
    for form in FORMS[1:]:
        paired = [s / m for s, m in zip(over_ideal(f"elche/{form}"), over_ideal("elche/map"))]
        out[f"elche/{form}"]["over_map_cohort_over_ideal"] = spread(paired)
    out["targets"] = {
        "fast_share_streaming_at_least_0.70": min(r["fast_share"] for r in rows["elche/streaming"]) >= 0.70,
        "streaming_no_more_than_5pct_below_map": out["elche/streaming"]["over_map_cohort_over_ideal"]["median"] >= 0.95,
    }  # fmt: skip
    return out


def measure_memory(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Peak RSS per rank at each dataset size, the same steps trained at each."""
    out: dict[str, dict[str, Any]] = {}
    for n in args.memory_sizes:
        folder = int_dataset(n)
        reports = run(args, "ints", "elche", "streaming", data_dir=str(folder), batch_size=MEMORY_BATCH)
        trained = [i for r in reports for i in r["indices"]]
        fast = reports[0]
        row = {
            "items": fast["num_samples"], "chunks": fast["chunks"], "largest_chunk": fast["largest_chunk"],
            # what the plan holds that grows with the data: the chunk table, two int64 per chunk, and the cached
            # in-chunk permutation of one chunk; an order of every item would be one int64 per item
            "plan_bytes": fast["chunks"] * 16 + fast["largest_chunk"] * 8, "per_item_order_bytes": fast["num_samples"] * 8,
            "peak_rss_mib": [r["peak_rss_kib"] / 1024 for r in reports],
            "peak_rss_before_fit_mib": [r["peak_rss_before_fit_kib"] / 1024 for r in reports],
            "rank_samples": [len(r["indices"]) for r in reports], "no_item_twice": len(trained) == len(set(trained)),
            "dispatch": fast["dispatch"],
        }  # fmt: skip
        out[str(n)] = row
        print(
            f"memory {n:>10,} items  chunks {row['chunks']}  plan {row['plan_bytes']:,} B  "
            f"peak RSS {', '.join(f'{m:.0f}' for m in row['peak_rss_mib'])} MiB  samples {row['rank_samples']}",
            flush=True,
        )
    return out


def memory_ratio(memory: dict[str, dict[str, Any]]) -> Optional[list[float]]:
    """Peak RSS per rank at the largest size over the smallest."""
    if len(memory) < 2:
        return None
    smallest, largest = memory[min(memory, key=int)], memory[max(memory, key=int)]
    return [big / small for big, small in zip(largest["peak_rss_mib"], smallest["peak_rss_mib"])]


def print_tables(throughput: Optional[dict[str, Any]], memory: Optional[dict[str, dict[str, Any]]]) -> None:
    def show(value: Optional[dict[str, float]], digits: int = 2) -> str:
        return "-" if value is None else f"{value['median']:.{digits}f} ({value['min']:.{digits}f}-{value['max']:.{digits}f})"

    if throughput is not None:
        print("\n| run | fast rank's share | cohort rate (samples/s) | cohort / ideal | over map (cohort / ideal) | exact coverage |")
        print("|---|---|---|---|---|---|")
        for name, row in throughput.items():
            if name == "targets":
                continue
            print(
                f"| {name} | {show(row['fast_share'])} | {show(row['cohort_rate'], 0)} | {show(row.get('cohort_over_ideal'))} | "
                f"{show(row.get('over_map_cohort_over_ideal'), 3)} | {row.get('exact_coverage', '-')} |"
            )
        print(f"\ntargets: {throughput['targets']}")
    if memory is not None:
        print("\n| items | chunks | plan's data-dependent bytes | a per-item order's bytes | peak RSS rank 0 (MiB) | peak RSS rank 1 (MiB) | samples per rank | no item twice |")
        print("|---|---|---|---|---|---|---|---|")
        for row in memory.values():
            print(
                f"| {row['items']:,} | {row['chunks']:,} | {row['plan_bytes']:,} | {row['per_item_order_bytes']:,} | "
                f"{row['peak_rss_mib'][0]:.0f} | {row['peak_rss_mib'][1]:.0f} | {row['rank_samples']} | {row['no_item_twice']} |"
            )
        ratio = memory_ratio(memory)
        if ratio is not None:
            print(f"\npeak RSS, largest over smallest dataset: rank 0 {ratio[0]:.3f}, rank 1 {ratio[1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 8192 samples")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--samples", type=int, default=None, help="samples in the epoch; default 16384 (8192 with --quick)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--memory-sizes", type=int, nargs="+", default=list(MEMORY_SIZES), help="items per memory run")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/results/streaming[_quick].json")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.samples = args.samples or (8192 if args.quick else 16384)
    args.data_dir = args.shards_dir = None
    path = args.json or REPO / "benchmarks" / "results" / ("streaming_quick.json" if args.quick else "streaming.json")
    rows = None if args.skip_throughput else measure_throughput(args)
    throughput = None if rows is None else throughput_summary(rows)
    memory = None if args.skip_memory else measure_memory(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "provenance": provenance(), "args": {k: str(v) for k, v in vars(args).items() if k not in ("data_dir", "shards_dir")},
        "throughput": throughput, "memory": memory, "memory_largest_over_smallest": None if memory is None else memory_ratio(memory),
        "runs": rows,
    }, indent=2))  # fmt: skip
    print_tables(throughput, memory)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
