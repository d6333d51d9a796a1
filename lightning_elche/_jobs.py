"""Run one training configuration as its own multi-process job and collect what each rank reports.

The package's own entry points need it, ``python -m lightning_elche.demo`` and ``python -m
lightning_elche.gpu_check``, each comparing several configurations in one invocation; the benchmarks
(a folder of the repository, not of the package) use it as any user of the package would, beside
their own harness (``benchmarks/harness.py``). Lightning's
subprocess launcher re-executes the command line for the other ranks, so each configuration
runs as a fresh ``python -m <module> --worker '<json>'`` job, one after the other; every rank
writes ``rank{r}.json`` into the job's folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_elche.comm.groups import destroy_process_group_at_exit


class JobFailed(RuntimeError):
    pass


# A measured job's Trainer: CPU ranks, and nothing that writes files or prints per batch.
QUIET_TRAINER: dict[str, Any] = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


def run_job(
    module: str, config: dict[str, Any], ranks: int, timeout: float, cwd: Optional[str] = None, env: Optional[dict[str, str]] = None
) -> list[dict]:
    """Run ``python -m module --worker <config>`` (with ``env`` added to this process's environment) and
    return the per-rank reports."""
    with tempfile.TemporaryDirectory(prefix="elche-job-") as folder:
        config = dict(config, out=folder)
        env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", **(env or {}))
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", module, "--worker", json.dumps(config)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                cwd=cwd,
            )
        except subprocess.TimeoutExpired as exc:
            raise JobFailed(f"{config.get('name', module)} did not finish within {timeout:.0f} s") from exc
        if proc.returncode != 0:
            raise JobFailed(f"{config.get('name', module)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        reports = []
        for rank in range(ranks):
            path = Path(folder) / f"rank{rank}.json"
            if not path.exists():
                raise JobFailed(f"{config.get('name', module)}: rank {rank} wrote no report:\n{proc.stderr[-3000:]}")
            report = json.loads(path.read_text())
            report["job_s"] = time.perf_counter() - started
            reports.append(report)
        return reports


def write_report(out: str, rank: int, report: dict[str, Any]) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))


def main_or_worker(main: Callable[[], Any], worker: Callable[[dict[str, Any]], None]) -> Any:
    """Run ``worker(config)`` when :func:`run_job` started this process, else ``main()``.

    A worker destroys its process group at exit whatever the strategy: Lightning does so only
    for NCCL, and a gloo group left to interpreter shutdown can abort an otherwise finished job.
    """
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        destroy_process_group_at_exit()
        return worker(json.loads(sys.argv[2]))
    return main()



class TrainClock(pl.Callback):
    """Training-clock seconds and samples on this rank: set-up and validation excluded."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.samples = 0
        self._started: Optional[float] = None

    def _pause(self) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        self.samples += len(first)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._pause()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.training:
            self._started = time.perf_counter()

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._pause()


class Classifier(pl.LightningModule):
    """Cross-entropy classification of ``(x, y)`` batches with Adam, for the demo and benchmarks.

    With a ``val_set`` it logs ``val_acc`` (a torchmetrics accuracy, synced across ranks at
    epoch end like any Lightning project would).
    """

    def __init__(
        self,
        net: nn.Module,
        train_set: Dataset,
        batch_size: int,
        lr: float = 1e-3,
        val_set: Optional[Dataset] = None,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.net = net
        self.train_set = train_set
        self.val_set = val_set
        self.batch_size = batch_size
        self.lr = lr
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes, average="micro")

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_acc(self.net(x), y)
        self.log("val_acc", self.val_acc, on_epoch=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> Any:
        return [] if self.val_set is None else DataLoader(self.val_set, batch_size=256)
