"""Throughput on uneven ranks: ElChe cadence vs Lightning DDP vs uniform local SGD vs the ideal.

    python benchmarks/throughput.py                 # k = 1, 2, 4; 3 repeats; about 25 minutes
    python benchmarks/throughput.py --slowdowns 2 --repeats 1 --samples 8192 --epochs 2

Two processes on this machine's two cores, gloo, one thread each; rank 1 is made k times
slower with ``lightning_elche.Slowdown``. Model and data as in reference/benchmarking.md: a small
CNN (conv5x5(16)-pool-conv5x5(32)-pool-fc128-fc10, 215k parameters), batch 64 per rank, Adam
1e-3, on generated 28x28 ten-class images (throughput does not depend on the pixels).

Per slowdown k, in one run, interleaved and repeated:
  - solo fast / solo slow: each rank's rate training alone, both processes running at the same
    time (so the two-processes-on-two-cores contention is in the ideal as well); their sum is
    the ideal cohort rate;
  - DDP: Lightning's DDPStrategy;
  - ElChe: ElCheStrategy(policy="cadence"), defaults;
  - uniform local SGD: ElChe with equal fixed shares and a fixed anchor (what torchft's and
    Accelerate's LocalSGD do), to show what speed-aware partitioning adds.
Rates are samples per training-clock second (set-up excluded, no validation); the table shows
medians and the paired ratios. Also reports peak RSS per rank (memory check).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parent.parent
MODULE = "benchmarks.throughput"


def synthetic_images(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(x, y)


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from lightning_elche import ElCheStrategy, Slowdown
    from lightning_elche._jobs import QUIET_TRAINER, Classifier, TrainClock, write_report

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    pl.seed_everything(config.get("seed", 0), verbose=False)

    kind = config["strategy"]
    if kind == "elche":
        strategy: Any = ElCheStrategy(timeout=120, **config.get("elche", {}))
    elif kind == "ddp":
        strategy = "ddp"
    else:
        strategy = "auto"
    clock = TrainClock()
    trainer = pl.Trainer(
        devices=config["devices"],
        strategy=strategy,
        max_epochs=config["epochs"],
        callbacks=[clock, Slowdown({config["slow_rank"]: config["k"]}, clock="cpu")],
        limit_val_batches=0,
        **QUIET_TRAINER,
    )
    trainer.fit(Classifier(small_cnn(), synthetic_images(config["samples"]), batch_size=64))
    boundaries = getattr(trainer.strategy, "boundaries", [])
    write_report(
        config["out"],
        trainer.global_rank,
        {
            "seconds": clock.seconds,
            "samples": clock.samples,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "boundaries": len(boundaries),
            "final_anchor": boundaries[-1].anchor if boundaries else None,
            "final_counts": boundaries[-1].counts if boundaries else None,
        },
    )


def cohort_rate(reports: list[dict]) -> float:
    """Samples of all ranks per second of the slowest rank's training clock."""
    return sum(r["samples"] for r in reports) / max(r["seconds"] for r in reports)


def run_config(name: str, strategy: str, devices: int, k: float, slow_rank: int, args: argparse.Namespace, **extra: Any):
    from lightning_elche._jobs import run_job

    config = {
        "name": name, "strategy": strategy, "devices": devices, "k": k, "slow_rank": slow_rank,
        "samples": args.samples, "epochs": args.epochs, **extra,
    }
    return run_job(MODULE, config, ranks=devices, timeout=args.timeout, cwd=str(REPO))


def solo_rate(k: float, args: argparse.Namespace) -> float:
    """One rank's rate training alone: a single process, no communication."""
    return cohort_rate(run_config("solo", "solo", 1, k, 0, args, samples=args.samples // 2))


def solo_pair(k: float, args: argparse.Namespace) -> tuple[float, float]:
    """Both ranks' solo rates measured at the same time, each process on its own core."""
    factors = (1.0, k)
    results = [0.0, 0.0]

    def one(index: int) -> None:
        results[index] = solo_rate(factors[index], args)

    threads = [threading.Thread(target=one, args=(index,)) for index in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results[0], results[1]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    uniform = {"partition_ratios": [1.0, 1.0], "anchor": args.uniform_anchor, "max_anchor": args.uniform_anchor}
    table: dict[str, Any] = {}
    for k in args.slowdowns:
        rows: dict[str, list[float]] = {name: [] for name in ("ideal", "ideal_alone", "solo_fast", "ddp", "elche", "uniform")}
        rss: dict[str, list[float]] = {"ddp": [], "elche": []}
        for repeat in range(args.repeats):
            fast, slow = solo_pair(k, args)
            rows["solo_fast"].append(fast)
            rows["ideal"].append(fast + slow)
            rows["ideal_alone"].append(solo_rate(1.0, args) + solo_rate(k, args))
            ddp = run_config("ddp", "ddp", 2, k, 1, args)
            elche = run_config("elche", "elche", 2, k, 1, args)
            local = run_config("uniform", "elche", 2, k, 1, args, elche=uniform)
            rows["ddp"].append(cohort_rate(ddp))
            rows["elche"].append(cohort_rate(elche))
            rows["uniform"].append(cohort_rate(local))
            rss["ddp"].append(max(r["peak_rss_mb"] for r in ddp))
            rss["elche"].append(max(r["peak_rss_mb"] for r in elche))
            print(
                f"k={k:g} repeat {repeat + 1}: ideal {rows['ideal'][-1]:.0f} (alone {rows['ideal_alone'][-1]:.0f})  "
                f"ddp {rows['ddp'][-1]:.0f}  elche {rows['elche'][-1]:.0f} (anchor {elche[0]['final_anchor']}, "
                f"counts {elche[0]['final_counts']})  uniform {rows['uniform'][-1]:.0f} samples/s",
                flush=True,
            )

        def paired(name: str, reference: str) -> float:
            return statistics.median(v / i for v, i in zip(rows[name], rows[reference]))

        table[f"{k:g}"] = {
            "median_samples_per_s": {name: statistics.median(v) for name, v in rows.items()},
            "ratio_to_ideal": {name: paired(name, "ideal") for name in ("ddp", "elche", "uniform")},
            "ratio_to_ideal_alone": {name: paired(name, "ideal_alone") for name in ("ddp", "elche", "uniform")},
            "elche_over_ddp": paired("elche", "ddp"),
            "elche_over_solo_fast": paired("elche", "solo_fast"),
            "peak_rss_mb": {name: statistics.median(v) for name, v in rss.items()},
        }
    return table


def print_table(table: dict[str, Any]) -> None:
    print("\nsamples/s (medians) and paired ratios; ideal = both solo rates measured at the same time,")
    print("ideal alone = each solo rate measured with the machine otherwise idle")
    print("\n| k | ideal | ideal alone | DDP | ElChe cadence | uniform local SGD | DDP/ideal | ElChe/ideal | uniform/ideal | ElChe/ideal alone | ElChe/DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, row in table.items():
        rate, ratio, alone = row["median_samples_per_s"], row["ratio_to_ideal"], row["ratio_to_ideal_alone"]
        print(
            f"| {k} | {rate['ideal']:.0f} | {rate['ideal_alone']:.0f} | {rate['ddp']:.0f} | {rate['elche']:.0f} | "
            f"{rate['uniform']:.0f} | {ratio['ddp']:.2f} | {ratio['elche']:.2f} | {ratio['uniform']:.2f} | "
            f"{alone['elche']:.2f} | {row['elche_over_ddp']:.2f} |"
        )
    print("\n| k | peak RSS per rank, DDP (MB) | peak RSS per rank, ElChe (MB) |")
    print("|---|---|---|")
    for k, row in table.items():
        print(f"| {k} | {row['peak_rss_mb']['ddp']:.0f} | {row['peak_rss_mb']['elche']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16384, help="training samples per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--uniform-anchor", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "throughput.json")
    args = parser.parse_args()
    table = measure(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": table}, indent=2))
    print_table(table)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
