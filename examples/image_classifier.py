"""An ordinary Lightning image classifier trained with ``strategy="elche"`` on two uneven processes.

    python examples/image_classifier.py --slow-rank-factor 3      # then: tensorboard --logdir lightning_logs

Everything here is what a DDP project already has: a LightningModule with torchmetrics accuracy,
ModelCheckpoint and EarlyStopping on the validation accuracy, a TensorBoard logger and an LR
monitor. The only ElChe-specific lines are ``import lightning_elche`` and ``strategy="elche"``
(``--strategy ddp`` runs the very same script under DDP for comparison).

Data: Fashion-MNIST from the Debian package ``dataset-fashion-mnist``
(``apt-get install dataset-fashion-mnist``; files in /usr/share/datasets/fashion-mnist), read from
local files only; without it, scikit-learn's bundled 8x8 digits. Nothing is downloaded.

``--slow-rank-factor K`` makes rank 1 K times slower (:class:`lightning_elche.Slowdown`), so two
processes on one CPU behave like a fast and a slow GPU: under ElChe the fast rank trains more
batches instead of waiting. TensorBoard shows the ``elche/`` series (anchor, per-rank shares and
throughput, estimated speedup over DDP) next to the model's own curves.
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elche  # registers strategy="elche"

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file as shipped by the MNIST family: gzip; zero, dtype, ndim, big-endian sizes, uint8 data."""
    with gzip.open(path, "rb") as file:
        data = file.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return torch.from_numpy(np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape).copy())


def load_images(data: str) -> tuple[TensorDataset, TensorDataset, int]:
    """Train and validation sets as (N, 1, side, side) floats, standardised, and the image side."""
    if data == "auto":
        data = "fashion-mnist" if (FASHION_MNIST / "train-images-idx3-ubyte.gz").exists() else "digits"
        if data == "digits":
            print(f"{FASHION_MNIST} not found (apt-get install dataset-fashion-mnist): using scikit-learn's digits")
    if data == "fashion-mnist":
        splits = [
            (read_idx(FASHION_MNIST / f"{s}-images-idx3-ubyte.gz"), read_idx(FASHION_MNIST / f"{s}-labels-idx1-ubyte.gz"))
            for s in ("train", "t10k")
        ]
        (train_x, train_y), (val_x, val_y) = [(x.float().div(255).unsqueeze(1), y.long()) for x, y in splits]
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).div(16).unsqueeze(1)
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        cut = int(0.8 * len(x))
        (train_x, train_y), (val_x, val_y) = (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])
    mean, std = train_x.mean(), train_x.std()
    return TensorDataset((train_x - mean) / std, train_y), TensorDataset((val_x - mean) / std, val_y), train_x.shape[-1]


class ImageClassifier(pl.LightningModule):
    def __init__(self, side: int, width: int = 32, lr: float = 1e-3, batch_size: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, width // 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width // 2, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(width * (side // 4) ** 2, 128), nn.ReLU(), nn.Linear(128, 10),
        )  # fmt: skip
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        # Per-step values stay local (a per-step sync_dist would pair up collectives across ranks
        # that run different numbers of batches); the epoch accuracy syncs once, at epoch end.
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        # A per-step schedule: ElChe advances it with the cohort's DDP-equivalent global_step.
        steps = max(1, self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow-rank-factor", type=float, default=1.0, help="make rank 1 K times slower (default 1: equal)")
    parser.add_argument("--strategy", default="elche", help="'elche' (default) or 'ddp' to compare")
    parser.add_argument("--accelerator", default="cpu", help="'cpu' (default), 'gpu', or any Lightning accelerator")
    parser.add_argument("--devices", type=int, default=2, help="processes, one per device (default 2)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--data", choices=["auto", "fashion-mnist", "digits"], default="auto")
    parser.add_argument("--root-dir", default=".", help="lightning_logs/ and checkpoints go here")
    parser.add_argument("--smoke", action="store_true", help="a few seconds of training on a small subset (tests)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per process: the processes share the machine
    pl.seed_everything(0, verbose=False)
    train_set, val_set, side = load_images(args.data)
    if args.smoke:
        train_set, val_set = (TensorDataset(*(t[:1024] for t in d.tensors)) for d in (train_set, val_set))
        args.epochs = 2
    model = ImageClassifier(side)
    model.train_set, model.val_set = train_set, val_set

    callbacks: list[pl.Callback] = [
        ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=2, save_last=True, filename="{epoch}-{val_acc:.3f}"),
        EarlyStopping(monitor="val_acc", mode="max", patience=2),
        LearningRateMonitor(),
    ]
    if args.slow_rank_factor != 1:
        callbacks.append(lightning_elche.Slowdown({1: args.slow_rank_factor}))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=TensorBoardLogger(Path(args.root_dir) / "lightning_logs", name="image_classifier"),
        default_root_dir=args.root_dir,
        log_every_n_steps=10,
    )
    trainer.fit(model)
    if trainer.is_global_zero:
        best = trainer.checkpoint_callback.best_model_path
        print(
            f"image_classifier: done - strategy={args.strategy} val_acc={float(trainer.callback_metrics['val_acc']):.4f} "
            f"global_step={trainer.global_step} best={best}\n"
            f"  tensorboard --logdir {trainer.logger.root_dir}"
        )


if __name__ == "__main__":
    main()
