"""A training job for torchrun: ``tests/torchrun_app.py OUT [--nodes N] [--procs P] [--every M] [--kill] ...``.

It trains two epochs under ElChe (rank 1 two times slower) with
``ModelCheckpoint(every_n_train_steps=3, save_last=True)`` and ``fit(ckpt_path="last")``, on
``--nodes`` nodes of ``--procs`` processes each, averaging across nodes every ``--every`` windows
(``node_sync_every``; ``--ranks-per-node`` regroups the ranks into nodes). ``--width`` widens the MLP's
hidden layer (16 by default), so that a test can tell a boundary's parameters from the rest of the
traffic on a link; ``--anchor`` fixes the window (2 steps of the slow rank) and ``--checkpoint-every``
the checkpoints' interval (3 steps). With ``--kill``, rank 1 kills itself mid-window
in the first attempt, so that ``torchrun --max-restarts=1`` relaunches both ranks, which resume
from ``last.ckpt``. Each rank writes, per attempt, what it had trained when the latest checkpoint
was saved and what it trained in all (plus its boundaries), for the tests' assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections import defaultdict
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scenario import IndexedDataset, make_model  # noqa: E402

from lightning_elche import ElCheStrategy, Slowdown  # noqa: E402

SAMPLES = 320
ARGS = argparse.ArgumentParser()
ARGS.add_argument("out", type=Path)
ARGS.add_argument("--nodes", type=int, default=1)
ARGS.add_argument("--procs", type=int, default=2)
ARGS.add_argument("--every", type=int, default=1)
ARGS.add_argument("--ranks-per-node", type=int, default=None)
ARGS.add_argument("--width", type=int, default=None)
ARGS.add_argument("--anchor", type=int, default=2)
ARGS.add_argument("--checkpoint-every", type=int, default=3)
ARGS.add_argument("--kill", action="store_true")
OPTIONS = ARGS.parse_args()
OUT = OPTIONS.out
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model("mlp") if OPTIONS.width is None else torch.nn.Sequential(
            torch.nn.Linear(8, OPTIONS.width), torch.nn.Tanh(), torch.nn.Linear(OPTIONS.width, 4)
        )
        self.trained: dict[int, list[int]] = defaultdict(list)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.trained[self.current_epoch].extend(idx.tolist())
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(IndexedDataset(SAMPLES), batch_size=8, shuffle=True)


class Record(pl.Callback):
    saved = False  # a checkpoint was written in this attempt

    def _write(self, trainer, module, kind: str) -> None:
        record = {
            "trained": {str(k): v for k, v in module.trained.items()},
            "global_step": trainer.global_step,
            "boundaries": [[b.epoch, b.window, b.steps, b.cohort_step, b.level] for b in trainer.strategy.boundaries],
            "parameter_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
        }
        (OUT / f"{kind}_a{ATTEMPT}_r{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self._write(trainer, module, "at_checkpoint")
        self.saved = True

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        """Rank 1 (the slow one) of attempt 0 dies at its first batch after the first checkpoint: inside
        a window of epoch 0, whatever share of the batches dispatch gave it."""
        if OPTIONS.kill and ATTEMPT == 0 and trainer.global_rank == 1 and trainer.current_epoch == 0 and self.saved:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer, module):
        self._write(trainer, module, "final")


if __name__ == "__main__":
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    OUT.mkdir(parents=True, exist_ok=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        num_nodes=OPTIONS.nodes,
        devices=OPTIONS.procs,
        strategy=ElCheStrategy(
            timeout=30, anchor=OPTIONS.anchor, max_anchor=OPTIONS.anchor,
            node_sync_every=OPTIONS.every, ranks_per_node=OPTIONS.ranks_per_node,
        ),  # fmt: skip
        max_epochs=2,
        callbacks=[
            Slowdown({1: 2.0}),
            Record(),
            ModelCheckpoint(
                dirpath=OUT / "checkpoints", every_n_train_steps=OPTIONS.checkpoint_every, save_top_k=-1, save_last=True
            ),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), ckpt_path="last")
