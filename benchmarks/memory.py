"""Peak memory per rank: ElChe's boundary buffer against DDP's gradient buckets.

    python benchmarks/memory.py                    # about a minute
    python benchmarks/memory.py --hidden 4096 --repeats 3

ElChe keeps one persistent flat buffer of parameters and float buffers per rank and allocates
no parameter-sized temporaries at a boundary; DDP keeps gradient buckets of the same size. On a
model big enough for that buffer to matter (an MLP of ~21M parameters, 84 MB in float32),
two processes train a few dozen steps with Adam under each strategy, and every rank reports
its peak RSS (``getrusage``). On CUDA the same comparison would read
``torch.cuda.max_memory_allocated``; this machine has no GPU.
"""

from __future__ import annotations

import argparse
import resource
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parent.parent
MODULE = "benchmarks.memory"


def worker(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from lightning_elche import ElCheStrategy
    from lightning_elche._jobs import QUIET_TRAINER, Classifier, write_report

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    hidden = config["hidden"]

    g = torch.Generator().manual_seed(0)
    samples = config["samples"]
    data = TensorDataset(torch.randn(samples, 1024, generator=g), torch.randint(0, 10, (samples,), generator=g))
    net = nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    strategy: Any = ElCheStrategy(policy=config["policy"], timeout=120) if config["strategy"] == "elche" else "ddp"
    model = Classifier(net, data, batch_size=16, lr=1e-4)
    trainer = pl.Trainer(
        devices=2, strategy=strategy, max_epochs=1, limit_val_batches=0, **QUIET_TRAINER
    )
    trainer.fit(model)
    write_report(
        config["out"],
        trainer.global_rank,
        {
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "param_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        },
    )


def main() -> None:
    from lightning_elche._jobs import run_job

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=960, help="training samples (batch 16 per rank)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    runs = {"ddp": ("ddp", "sync"), "elche cadence": ("elche", "cadence"), "elche sync": ("elche", "sync")}
    peaks: dict[str, list[float]] = {name: [] for name in runs}
    param_mb = 0.0
    for _ in range(args.repeats):
        for name, (strategy, policy) in runs.items():
            config = {"name": name, "strategy": strategy, "policy": policy, "hidden": args.hidden, "samples": args.samples}
            reports = run_job(MODULE, config, ranks=2, timeout=600, cwd=str(REPO))
            peaks[name].append(max(r["peak_rss_mb"] for r in reports))
            param_mb = reports[0]["param_mb"]
            print(f"{name}: peak RSS per rank {peaks[name][-1]:.0f} MB", flush=True)
    ddp = statistics.median(peaks["ddp"])
    print(f"\nmodel parameters: {param_mb:.0f} MB (float32)")
    print("| strategy | peak RSS per rank (MB, median) | vs DDP |")
    print("|---|---|---|")
    for name, values in peaks.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.0f} | {median - ddp:+.0f} MB |")


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
