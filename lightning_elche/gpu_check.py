"""GPU check: ElChe's CUDA path on this machine, in a few minutes, before a long job.

    python -m lightning_elche.gpu_check                  # a few minutes on one GPU
    python -m lightning_elche.gpu_check --ranks 4        # four processes (on one GPU: they share it)
    python -m lightning_elche.gpu_check --smoke          # on CPU, tiny: does every path run? (the test suite)

Every run is ``--ranks`` processes (2) training an MLP on generated data, rank 1 made 3x slower
(``Slowdown`` on the wall clock, with the step synchronised so that the clock sees the GPU's
work). With as many GPUs as ranks each process has its own and the process group is NCCL; with
fewer, the processes share them and the process group is gloo (NCCL refuses two ranks on one
device), so ``reduce_on="device"`` then reduces CUDA tensors over gloo. Each process is started
here, one per "node" of one device (``num_nodes=ranks, devices=1``), so any number of processes can
share a GPU.

  reduce_on=device   ElChe's boundary on the model's device (NCCL with a GPU per rank)
  reduce_on=cpu      the boundary staged through pinned host memory over a gloo group
  bf16-mixed         ``precision="bf16-mixed"``
  16-mixed           ``precision="16-mixed"`` (a GradScaler per rank; CUDA only)
  ddp                Lightning's DDP on the same ranks: the reference for memory and throughput

Checks: every ElChe run trains every sample exactly once per epoch (the indices each rank trained)
and ends with the same parameters on every rank, with a finite loss; peak
``torch.cuda.max_memory_allocated`` per rank against DDP's (on CPU: peak RSS) at most
``--memory-bound`` (1.25) times; ElChe's samples per second with the slowed rank at least
``--speedup-bound`` (1.2) times DDP's. A smoke run checks coverage, consensus and finiteness only (its
timings are too short to mean anything). Prints a table, writes what it measured to ``--json PATH``
when asked, and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from lightning_elche.comm.rendezvous import free_port

MODULE = "lightning_elche.gpu_check"
SLOWDOWN = 3.0
RUNS = {  # name: (strategy, reduce_on, precision)
    "reduce_on=device": ("elche", "device", "32-true"),
    "reduce_on=cpu": ("elche", "cpu", "32-true"),
    "bf16-mixed": ("elche", "device", "bf16-mixed"),
    "16-mixed": ("elche", "device", "16-mixed"),
    "ddp": ("ddp", None, "32-true"),
}
SMOKE = {"hidden": 32, "samples": 512, "batch_size": 16, "epochs": 1, "timeout": 120.0}


class Indexed(Dataset):
    """Generated inputs and labels, and each item's index, so that coverage can be checked."""

    def __init__(self, samples: int, features: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, features, generator=g)
        self.y = torch.randint(0, 10, (samples,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


def worker(config: dict[str, Any]) -> None:
    """One rank of one configuration: train, then write what it trained, its digest, timings and peak memory."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_elche import ElCheStrategy, Slowdown
    from lightning_elche._jobs import QUIET_TRAINER, TrainClock, write_report

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    cuda = config["accelerator"] == "gpu"
    trained: dict[int, list[int]] = {}
    losses: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            h = config["hidden"]
            self.net = nn.Sequential(nn.Linear(256, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, index = batch
            trained.setdefault(self.current_epoch, []).extend(index.tolist())
            loss = nn.functional.cross_entropy(self.net(x), y)
            if cuda:
                torch.cuda.synchronize()  # the slowdown's wall clock then sees the GPU's work
            losses.append(float(loss))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Indexed(config["samples"]), batch_size=config["batch_size"], shuffle=True)

    backend = config["process_group_backend"]
    if config["strategy"] == "elche":
        strategy: Any = ElCheStrategy(reduce_on=config["reduce_on"], process_group_backend=backend, timeout=120)
    else:
        strategy = DDPStrategy(process_group_backend=backend)
    clock = TrainClock()
    trainer = pl.Trainer(
        devices=1, num_nodes=config["ranks"], strategy=strategy, precision=config["precision"], max_epochs=config["epochs"],
        callbacks=[clock, Slowdown({1: SLOWDOWN}, clock="wall")], **{**QUIET_TRAINER, "accelerator": config["accelerator"]},
    )  # fmt: skip
    module = Module()
    trainer.fit(module)
    digest = hashlib.sha256(b"".join(p.detach().float().cpu().numpy().tobytes() for p in module.parameters()))
    peak_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    write_report(config["out"], trainer.global_rank, {
        "trained": trained, "digest": digest.hexdigest(), "finite": all(math.isfinite(loss) for loss in losses),
        "seconds": clock.seconds, "samples": clock.samples, "peak_mb": peak_mb,
    })  # fmt: skip


class RunFailed(RuntimeError):
    """A configuration's ranks failed, hung past ``--timeout`` or wrote no report."""


def run_ranks(name: str, configs: list[dict[str, Any]], envs: list[dict[str, str]], out: Path, timeout: float) -> list[dict]:
    """Start ``python -m lightning_elche.gpu_check --worker CONFIG`` once per rank, each in a session of
    its own, and return the reports they write to ``out/rank<r>.json``; whatever happens, every rank
    is ended on the way out."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, (config, env) in enumerate(zip(configs, envs)):
            with open(out / f"rank{rank}.err", "w") as stderr:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", MODULE, "--worker", json.dumps(config)], env=env,
                    stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                ))  # fmt: skip
        deadline = time.monotonic() + timeout
        while (codes := [p.poll() for p in procs]) != [0] * len(procs):
            failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                raise RunFailed(f"{name}: rank {failed} failed (exit {codes[failed]}):\n{_tail(out / f'rank{failed}.err')}")
            if time.monotonic() > deadline:
                raise RunFailed(f"{name} did not finish within {timeout:.0f} s (--timeout); rank 0:\n{_tail(out / 'rank0.err')}")
            time.sleep(0.1)
        reports = []
        for rank in range(len(procs)):
            path = out / f"rank{rank}.json"
            if not path.exists():
                raise RunFailed(f"{name}: rank {rank} wrote no report:\n{_tail(out / f'rank{rank}.err')}")
            reports.append(json.loads(path.read_text()))
        return reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="backslashreplace")[-chars:] if path.exists() else ""


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration on ``args.ranks`` processes, each its own node of one device."""
    strategy, reduce_on, precision = RUNS[name]
    gpus = args.gpus
    backend = "nccl" if gpus >= args.ranks else "gloo"
    config = {"name": name, "strategy": strategy, "reduce_on": reduce_on, "precision": precision, "ranks": args.ranks,
              "process_group_backend": backend, "accelerator": "gpu" if gpus else "cpu", "hidden": args.hidden,
              "samples": args.samples, "batch_size": args.batch_size, "epochs": args.epochs}  # fmt: skip
    port = free_port("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="elche-gpu-check-") as folder:
        configs = [dict(config, out=folder) for _ in range(args.ranks)]
        envs = [dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.ranks),
                     NODE_RANK=str(rank), LOCAL_RANK="0", PYTHONWARNINGS="ignore",
                     **({"CUDA_VISIBLE_DEVICES": str(rank % gpus)} if gpus else {})) for rank in range(args.ranks)]  # fmt: skip
        reports = run_ranks(name, configs, envs, Path(folder), args.timeout)
    return {"backend": backend, **summarize(reports, args)}


def summarize(reports: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Coverage, consensus and finiteness across the ranks, the cohort's rate, the largest peak."""
    epochs = sorted({int(e) for r in reports for e in r["trained"]})
    per_epoch = [sorted(i for r in reports for i in r["trained"].get(str(e), [])) for e in epochs]
    return {
        "exact_coverage": len(epochs) == args.epochs and all(trained == list(range(args.samples)) for trained in per_epoch),
        "consensus": len({r["digest"] for r in reports}) == 1,
        "finite": all(r["finite"] for r in reports),
        "samples_per_s": sum(r["samples"] for r in reports) / max(r["seconds"] for r in reports),
        "peak_mb": max(r["peak_mb"] for r in reports),
        "samples_per_rank": [r["samples"] for r in reports],
    }


def judge(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each check: its name, whether it passed (None: not judged) and what it measured."""
    checks: list[dict[str, Any]] = []
    for name, result in runs.items():
        if "skipped" in result or "failed" in result:
            failed = "failed" in result
            checks.append({"check": name, "passed": False if failed else None,
                           "detail": result.get("failed") or result["skipped"]})  # fmt: skip
            continue
        if name == "ddp":
            continue
        ok = result["exact_coverage"] and result["consensus"] and result["finite"]
        detail = (f"{result['backend']}; coverage {'exact' if result['exact_coverage'] else 'WRONG'}, "
                  f"{'one model' if result['consensus'] else 'ranks DIFFER'}, {'finite' if result['finite'] else 'NON-FINITE'}; "
                  f"samples per rank {result['samples_per_rank']}")  # fmt: skip
        checks.append({"check": name, "passed": ok, "detail": detail})
    elche, ddp = runs["reduce_on=device"], runs["ddp"]
    if "samples_per_s" in elche and "samples_per_s" in ddp:
        memory = elche["peak_mb"] / ddp["peak_mb"]
        speedup = elche["samples_per_s"] / ddp["samples_per_s"]
        unit = "max_memory_allocated" if args.gpus else "peak RSS"
        checks.append({"check": "memory vs DDP", "passed": None if args.smoke else memory <= args.memory_bound,
                       "detail": f"{unit} {elche['peak_mb']:.0f} / {ddp['peak_mb']:.0f} MB = {memory:.2f} "
                                 f"(bound {args.memory_bound})"})  # fmt: skip
        checks.append({"check": f"speed vs DDP, rank 1 {SLOWDOWN:g}x slower",
                       "passed": None if args.smoke else speedup >= args.speedup_bound,
                       "detail": f"{elche['samples_per_s']:.0f} / {ddp['samples_per_s']:.0f} samples/s = {speedup:.2f}x "
                                 f"(bound {args.speedup_bound})"})  # fmt: skip
    return checks


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration in turn (one that fails is recorded and the others still run), then the checks."""
    runs: dict[str, dict[str, Any]] = {}
    for name in RUNS:
        if RUNS[name][2] == "16-mixed" and not args.gpus:
            runs[name] = {"skipped": "16-mixed needs CUDA"}
            continue
        try:
            runs[name] = run(name, args)
        except RunFailed as error:
            runs[name] = {"failed": str(error)}
        print(f"{name}: {runs[name]}", flush=True)
    return {"gpus": args.gpus, "device": torch.cuda.get_device_name(0) if args.gpus else "cpu", "runs": runs,
            "checks": judge(runs, args)}  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """One row per check: what it measured and its verdict."""
    verdict = {True: "pass", False: "**FAIL**", None: "-"}
    lines = [f"Device: {results['device']} x {results['gpus']}.", "", "| check | result | measured |", "|---|---|---|"]
    lines += [f"| {c['check']} | {verdict[c['passed']]} | {c['detail'].splitlines()[0]} |" for c in results["checks"]]
    return "\n".join(lines) + "\n"


def versions() -> dict[str, Optional[str]]:
    """What ran the check, for a report: the packages, CUDA and NCCL as torch was built with them."""
    import lightning

    import lightning_elche

    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {"lightning_elche": lightning_elche.__version__, "torch": torch.__version__, "lightning": lightning.__version__,
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--ranks", type=int, default=2, help="processes (on fewer GPUs they share them)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--memory-bound", type=float, default=1.25)
    parser.add_argument("--speedup-bound", type=float, default=1.2)
    parser.add_argument("--timeout", type=float, default=600, help="seconds one configuration may take")
    parser.add_argument("--smoke", action="store_true", help="tiny, on CPU: every path once, no verdict on timings")
    parser.add_argument("--json", type=Path, default=None, help="also write what was measured to this file")
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error(f"--ranks {args.ranks}: the check needs at least 2 processes (rank 1 is the slowed one)")
    if args.smoke:
        vars(args).update(SMOKE)
    args.gpus = 0 if args.smoke else torch.cuda.device_count()
    if not args.gpus and not args.smoke:
        print(f"{MODULE}: no CUDA device is visible (torch.cuda.device_count() is 0): the checks run on CPU over "
              "gloo, which takes long at full size; --smoke runs them tiny", flush=True)
    results = measure(args)
    print("\n" + table(results), flush=True)
    if args.json is not None:
        arguments = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
        record = {"check": "gpu_check", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "versions": versions(), "arguments": arguments, "results": results}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    sys.exit(1 if any(check["passed"] is False for check in results["checks"]) else 0)


if __name__ == "__main__":
    from lightning_elche._jobs import main_or_worker

    main_or_worker(main, worker)
