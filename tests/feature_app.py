"""An ordinary Lightning project run under ElChe with one feature switched on per mode.

``python tests/feature_app.py MODE`` trains 2 processes (rank 1 two times slower) with a per-step
cosine LR schedule, LearningRateMonitor, ModelCheckpoint on a synced validation metric,
EarlyStopping, a TensorBoard logger and sanity validation, then runs ``trainer.test`` and
``trainer.predict``; each rank writes its result to ``result_rank{r}.txt``. Modes: plain, two_opt (manual
optimization with two optimizers), bf16 (``precision="bf16-mixed"``), clip (gradient clipping),
reload (``reload_dataloaders_every_n_epochs=1``), workers (``num_workers=2``, persistent).
"""

import sys, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, EarlyStopping
from lightning.pytorch.loggers import TensorBoardLogger
import lightning_elche  # noqa: F401  (registers the strategy names)
from lightning_elche import ElCheStrategy, Slowdown
from prefork import fork_ranks, wait_for_ranks

mode = sys.argv[1]
class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)); self.disc = nn.Linear(8, 1)
        if mode == "two_opt": self.automatic_optimization = False
    def training_step(self, b, i):
        x, y = b
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        if mode == "two_opt":
            o1, o2 = self.optimizers()
            o1.zero_grad(); self.manual_backward(loss); o1.step()
            l2 = self.disc(x).pow(2).mean(); o2.zero_grad(); self.manual_backward(l2); o2.step()
            return None
        return loss
    def validation_step(self, b, i):
        x, y = b; self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)
    def test_step(self, b, i):
        x, y = b; self.log("test_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)
    def predict_step(self, b, i):
        return self.net(b[0])
    def configure_optimizers(self):
        o = torch.optim.SGD(self.net.parameters(), lr=0.1)
        if mode == "two_opt": return [o, torch.optim.SGD(self.disc.parameters(), lr=0.1)]
        s = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=50)
        return {"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,))), batch_size=8, shuffle=True, num_workers=2 if mode=="workers" else 0, persistent_workers=mode=="workers")
    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=16)
    def test_dataloader(self): return self.val_dataloader()
    def predict_dataloader(self): return self.val_dataloader()

if __name__ == "__main__":
    fork_ranks(2)
    torch.set_num_threads(1)
    kw = dict(accelerator="cpu", devices=2, strategy=ElCheStrategy(timeout=60), max_epochs=3, callbacks=[Slowdown({1: 2.0}), LearningRateMonitor(), ModelCheckpoint(monitor="val_loss", save_top_k=2), EarlyStopping("val_loss", patience=5)],
              logger=TensorBoardLogger(sys.argv[2]), num_sanity_val_steps=2, log_every_n_steps=5)
    if mode == "bf16": kw["precision"] = "bf16-mixed"
    if mode == "clip": kw["gradient_clip_val"] = 0.5
    if mode == "reload": kw["reload_dataloaders_every_n_epochs"] = 1
    t = pl.Trainer(**kw)
    m = M()
    t.fit(m)
    r = t.test(m, verbose=False)
    p = t.predict(m)
    best = t.checkpoint_callback.best_model_path.split("/")[-1]
    lr = t.optimizers[0].param_groups[0]["lr"]
    result = f"step={t.global_step} best={best} lr={lr:.6g} test={r[0]['test_loss']:.6f} preds={len(p)}"
    with open(f"result_rank{t.global_rank}.txt", "w") as out:  # not stdout: ranks share it with the progress bars
        out.write(result)
    wait_for_ranks()  # rank 1's result file is written once this process has exited
