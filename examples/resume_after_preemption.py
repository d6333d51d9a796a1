"""A preempted ElChe run, resumed: every sample of every epoch is trained exactly once.

    python examples/resume_after_preemption.py

Phase 1 trains an MLP on scikit-learn's bundled digits with two CPU processes, rank 1
made slower. In the middle of epoch 1, rank 1 alone receives SIGTERM, as a preempted
spot instance or a SLURM job at its time limit does. Both ranks stop together at the
next averaging boundary, where ElChe writes ``hpc_ckpt_1.ckpt`` into the root dir.
Phase 2, a fresh job as a requeued one would be, resumes with
``trainer.fit(model, ckpt_path="hpc")`` and trains to the end.

Every rank records the dataset indices it trains, and the report counts per epoch what
each phase trained, the duplicates and the missing samples. That is the point: a
preemption costs neither repeated nor skipped data, whereas a DDP checkpoint taken
mid-epoch resumes by restarting that epoch from its first batch.

Each phase runs as ``python examples/resume_after_preemption.py train ...``: Lightning's
launcher re-executes that command line for rank 1, and the SIGTERMed fit ends its
processes with Lightning's ``SIGTERMException``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_elche import ElCheStrategy, Slowdown
from lightning_elche.cohort.resume import ResumePoint

PHASE_TIMEOUT_S = 300
CHECKPOINT = "hpc_ckpt_1.ckpt"  # Lightning's preemption checkpoint, written at the stop
COLUMNS = ("epoch", "samples", "before stop", "after resume", "duplicates", "missing")

Record = dict[str, Any]


class IndexedDigits(Dataset):
    """The 1,797 8x8 digits, standardised; each item carries its index."""

    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        data = load_digits()
        x = torch.tensor(data.data, dtype=torch.float32)
        self.x = (x - x.mean(0)) / (x.std(0) + 1e-6)
        self.y = torch.tensor(data.target, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class DigitsMLP(pl.LightningModule):
    """A plain classifier that also notes which samples it trained in each epoch."""

    def __init__(self, hidden: int, batch_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )
        self.batch_size = batch_size
        self.trained: dict[int, list[int]] = defaultdict(list)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.trained[self.current_epoch].extend(index.tolist())
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDigits(), batch_size=self.batch_size, shuffle=True)


class PreemptionNotice(pl.Callback):
    """The cluster's preemption notice: SIGTERM to rank 1 alone, after its ``batch``.

    Sent in epoch 1. The callback also notes where this rank is (epoch, batch,
    boundaries so far), so that the report can show every rank stopping at the first
    boundary after the notice. ElChe's callback runs first, so the count includes a
    boundary that closed this very batch.
    """

    def __init__(self, batch: int | None) -> None:
        self.batch = batch
        self.notice: dict[str, int] | None = None
        self.last: dict[str, int] = {}

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        epoch, boundaries = trainer.current_epoch, len(trainer.strategy.boundaries)
        self.last = {"epoch": epoch, "batch": batch_idx, "boundaries": boundaries}
        if trainer.global_rank == 1 and epoch == 1 and batch_idx == self.batch:
            self.notice = self.last
            os.kill(os.getpid(), signal.SIGTERM)


def train(args: argparse.Namespace) -> None:
    """One fit on two processes. Each rank writes what it trained to
    ``<phase>_rank<r>.json``, in ``finally`` so that a stopped fit writes it too."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = DigitsMLP(args.hidden, args.batch_size)
    notice = PreemptionNotice(args.preempt_at_batch)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=2,  # the demo is about two ranks: one preempted, the other told at the boundary
        # Windows of at most 4 steps of the slow rank: the stop lands mid-epoch here. On
        # a cluster, keep a window well inside the grace period before the SIGKILL.
        strategy=ElCheStrategy(max_anchor=4),
        max_epochs=args.epochs,
        default_root_dir=args.root_dir,
        callbacks=[notice, Slowdown({1: args.slow_rank_factor})],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    exception = None
    try:
        trainer.fit(model, ckpt_path="hpc" if args.phase == "resumed" else None)
    except BaseException as exc:
        exception = type(exc).__name__
        raise
    finally:
        record = {
            "trained": model.trained,
            "global_step": trainer.global_step,
            "notice": notice.notice,
            "last": notice.last,
            "exception": exception,
        }
        path = Path(args.root_dir) / f"{args.phase}_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record))


class DemoFailed(RuntimeError):
    pass


def run_phase(args: argparse.Namespace, phase: str) -> tuple[list[Record], int]:
    """Run one phase as its own job, its output in ``<phase>.log``; return each rank's
    record and the job's exit status."""
    root = Path(args.root_dir)
    command = [sys.executable, str(Path(__file__).resolve()), "train", "--phase", phase]
    options = ["root_dir", "epochs", "slow_rank_factor", "hidden", "batch_size", "accelerator"]
    if phase == "first":
        options.append("preempt_at_batch")
    for option in options:
        command += ["--" + option.replace("_", "-"), str(getattr(args, option))]
    log = root / f"{phase}.log"
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # rank 0 and its child, rank 1
            log.write_text(proc.communicate()[0])
            raise DemoFailed(f"{phase} did not end within {PHASE_TIMEOUT_S} s: {log}") from None
    log.write_text(output)
    paths = [root / f"{phase}_rank{rank}.json" for rank in range(2)]
    if not all(path.exists() for path in paths):
        raise DemoFailed(f"{phase} wrote no records (exit {proc.returncode}): {log}")
    return [json.loads(path.read_text()) for path in paths], proc.returncode


def check_stop(first: list[Record], root: Path) -> dict[str, Any]:
    """Phase 1 stopped on SIGTERM, both ranks at the first boundary after the notice,
    with the checkpoint written there; return the checkpoint."""
    notice = first[1]["notice"]
    if notice is None:
        raise DemoFailed("rank 1 never reached --preempt-at-batch in epoch 1")
    exceptions = [record["exception"] for record in first]
    if exceptions != ["SIGTERMException"] * 2:
        raise DemoFailed(f"phase 1 did not stop on SIGTERM: {exceptions}")
    stopped_at = [record["last"]["boundaries"] for record in first]
    if stopped_at != [notice["boundaries"] + 1] * 2:
        raise DemoFailed(
            f"SIGTERM after boundary {notice['boundaries']}, stops after {stopped_at}"
        )
    checkpoint = torch.load(root / CHECKPOINT, weights_only=True)
    steps = [record["global_step"] for record in first]
    if steps != [checkpoint["global_step"]] * 2:
        raise DemoFailed(f"global_step {steps}, checkpoint {checkpoint['global_step']}")
    return checkpoint


def coverage(
    first: list[Record], resumed: list[Record], size: int, epochs: int
) -> list[tuple[int, ...]]:
    """Per epoch: samples, trained in phase 1, in phase 2, duplicates, missing."""
    rows = []
    for epoch in range(epochs):
        before = [i for r in first for i in r["trained"].get(str(epoch), [])]
        after = [i for r in resumed for i in r["trained"].get(str(epoch), [])]
        counts = Counter(before + after)
        duplicates = sum(n - 1 for n in counts.values())
        missing = size - len(counts)
        rows.append((epoch, size, len(before), len(after), duplicates, missing))
    return rows


def report_stop(first: list[Record], status: int, root: Path) -> dict[str, Any]:
    """Print how phase 1 stopped and check that the checkpoint marks as trained exactly
    the samples phase 1 trained in the interrupted epoch; return its ElChe state."""
    checkpoint = check_stop(first, root)
    notice, stops = first[1]["notice"], [record["last"] for record in first]
    state = checkpoint["callbacks"]["ElCheCallback"]
    epoch, size = state["epoch"], state["num_samples"]
    print(
        f"  rank 1 got SIGTERM after its batch {notice['batch']} of epoch 1, "
        f"after boundary {notice['boundaries']}\n"
        f"  both ranks stopped at boundary {notice['boundaries'] + 1} (rank 0 after "
        f"its batch {stops[0]['batch']}, rank 1 after its batch {stops[1]['batch']}), "
        f"global_step {checkpoint['global_step']}\n"
        f"  both raised SIGTERMException; the job's exit status was {status}"
    )
    covered = set(ResumePoint.from_state(state).covered_samples(shuffle=True).tolist())
    trained = {i for r in first for i in r["trained"].get(str(epoch), [])}
    print(
        f"  {root / CHECKPOINT}: epoch {epoch}, {len(covered)} of {size} samples "
        f"marked trained; trained after that boundary: {len(trained - covered)}"
    )
    if trained != covered:
        raise DemoFailed(
            f"the checkpoint marks {len(covered)} samples of epoch {epoch} trained, "
            f"phase 1 trained {len(trained)}"
        )
    return state


def main(args: argparse.Namespace) -> int:
    root = Path(args.root_dir)
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):  # an old hpc_ckpt_1.ckpt would make this run's hpc_ckpt_2
        print(f"resume_after_preemption: FAILED - {root} is not empty")
        return 1
    print(
        f"resume_after_preemption: root dir {root}\n"
        f"phase 1: 2 CPU processes, rank 1 {args.slow_rank_factor:g}x slower, "
        f"{args.epochs} epochs; SIGTERM to rank 1 mid-epoch 1 ...",
        flush=True,
    )
    try:
        first, status = run_phase(args, "first")
        state = report_stop(first, status, root)
        print('phase 2: trainer.fit(model, ckpt_path="hpc") ...', flush=True)
        resumed, status = run_phase(args, "resumed")
        if status != 0:
            raise DemoFailed(f"phase 2 failed (exit {status}): {root / 'resumed.log'}")
    except DemoFailed as exc:
        print(f"resume_after_preemption: FAILED - {exc}")
        return 1
    print(
        f"  global_step {first[0]['global_step']} at the stop, "
        f"{resumed[0]['global_step']} after the resume\n"
    )
    rows = coverage(first, resumed, state["num_samples"], args.epochs)
    for row in (COLUMNS, *rows):
        print("  ".join(f"{value:>12}" for value in row))
    print(
        f"\n(Plain DDP resumes a mid-epoch checkpoint by restarting epoch "
        f"{state['epoch']} from its first batch: what it trained before the stop, it "
        "trains again.)\n"
    )
    duplicates, missing = sum(row[4] for row in rows), sum(row[5] for row in rows)
    if duplicates or missing:
        failure = f"{duplicates} duplicates, {missing} missing"
        print(f"resume_after_preemption: FAILED - {failure}")
        return 1
    print(
        f"resume_after_preemption: coverage exact - {state['num_samples']} samples "
        "per epoch, 0 duplicates, 0 missing"
    )
    return 0


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of the demo that its training jobs take too."""
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--slow-rank-factor", type=float, default=3.0, help="rank 1 is K times slower"
    )
    parser.add_argument("--hidden", type=int, default=512, help="MLP width")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--root-dir", help="a new or empty folder (default: temp)")
    parser.add_argument("--accelerator", default="cpu", help="'cpu' (default), 'gpu', or any Lightning accelerator")


def parse_demo(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_options(parser)
    parser.add_argument(
        "--preempt-at-batch", type=int, default=5, help="rank 1's batch of epoch 1"
    )
    parser.add_argument("--smoke", action="store_true", help="a small model (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden = 64
    args.root_dir = args.root_dir or tempfile.mkdtemp(prefix="elche-preemption-")
    return args


def parse_train(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="a training job of the demo")
    add_run_options(parser)
    parser.add_argument("--phase", choices=["first", "resumed"], required=True)
    parser.add_argument("--preempt-at-batch", type=int)
    return parser.parse_args(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["train"]:  # a job; Lightning re-runs this command for rank 1
        train(parse_train(sys.argv[2:]))
    else:
        raise SystemExit(main(parse_demo(sys.argv[1:])))
