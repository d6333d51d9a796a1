"""A tiny LightningCLI entry point for tests/test_cli.py.

``python tests/cli_app.py fit --config run.yaml`` trains a small MLP on a fixed random set.
Lightning's popen launcher re-executes this same command line for ranks 1..N-1, so nothing
here depends on being the first process. With ``marker_dir`` set, every rank writes
``rank{r}.json`` (global step, batches and samples it trained, strategy settings,
boundary count, final parameters) at the end of fit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_elche  # noqa: E402,F401  (registers the "elche" strategy names)


class TinyModule(pl.LightningModule):
    def __init__(self, samples: int = 96, batch_size: int = 8, lr: float = 0.1, marker_dir: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.batches_trained = 0
        self.samples_trained = 0

    def _dataset(self, n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=g)
        y = (x @ torch.randn(8, 4, generator=g)).argmax(dim=1)
        return TensorDataset(x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches_trained += 1
        self.samples_trained += len(x)
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(self._dataset(self.hparams.samples, 0), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self._dataset(32, 1), batch_size=16)

    def on_fit_end(self) -> None:
        if self.hparams.marker_dir is None:
            return
        trainer = self.trainer
        out = Path(self.hparams.marker_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "batches_trained": self.batches_trained,
            "samples_trained": self.samples_trained,
            "strategy": type(trainer.strategy).__name__,
            "policy": trainer.strategy.settings.averaging.policy,
            "anchor": trainer.strategy.settings.window.anchor,
            "timeout_s": trainer.strategy._timeout.total_seconds() if trainer.strategy._timeout else None,
            "boundaries": len(getattr(trainer.strategy, "boundaries", [])),
            "params": [p.detach().tolist() for p in self.parameters()],
        }
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def make_cli(args=None, run: bool = True) -> LightningCLI:
    return LightningCLI(
        TinyModule,
        run=run,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    make_cli()
