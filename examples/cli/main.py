"""LightningCLI with ElChe chosen in YAML: no ElChe-specific line in the Python code.

    python examples/cli/main.py fit --config examples/cli/config.yaml

``config.yaml`` selects ``lightning_elche.ElCheStrategy`` with its init_args, a TensorBoard
logger, checkpointing, early stopping and a simulated slow rank. Any setting can be overridden
on the command line (``--trainer.strategy.init_args.overhead_target 0.1``, ``--trainer.max_epochs
5``); ``--print_config`` shows the whole resolved configuration, ElChe's defaults included. A
project that already has a LightningCLI switches from DDP by changing ``strategy: ddp`` to the
``class_path`` block, which imports lightning_elche itself. The short form ``strategy: elche`` needs
``import lightning_elche`` in the script first (importing it registers the name; without it
Lightning says "You selected an invalid strategy name"), which this script leaves out on purpose.

The model is an MLP on scikit-learn's bundled 8x8 digits (no download).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DigitsData(pl.LightningDataModule):
    """scikit-learn's 1,797 digits, standardised, 80/20 split with a fixed seed."""

    def __init__(self, batch_size: int = 32, limit: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32)
        x = (x - x.mean(0)) / (x.std(0) + 1e-6)
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[: self.hparams.limit]
        cut = int(0.8 * len(order))
        self.train_set = TensorDataset(x[order[:cut]], y[order[:cut]])
        self.val_set = TensorDataset(x[order[cut:]], y[order[cut:]])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=128)


class DigitsClassifier(pl.LightningModule):
    def __init__(self, hidden: int = 256, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    torch.set_num_threads(1)  # one core per process: the ranks share the machine
    LightningCLI(DigitsClassifier, DigitsData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
