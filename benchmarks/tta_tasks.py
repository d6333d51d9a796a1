"""The tasks of the time-to-accuracy benchmark (``benchmarks/time_to_accuracy.py``): what each trains,
on which data, with which optimizer, and how its held-out metric is read from a model copy.

Every configuration of a task (the fast device alone, DDP, torchft's DiLoCo loop, ElChe's policies)
builds its model, loss, optimizer and schedule from the same :class:`Task`, so the only difference
between them is how the ranks cooperate.

  fashion   the small CNN of ``benchmarks/fashion.py`` (215k parameters) on Fashion-MNIST, batch 64
            per rank, Adam 1e-3, several epochs; test accuracy on the first 5,000 of the 10k test images
  mlp       an MLP (784-256-256-10, 269k parameters) on the same images as dense feature vectors,
            batch 64, Adam 1e-3: a step of a few milliseconds, as a GPU's step would be, so that what
            a cohort does per step and per boundary weighs as it would on a GPU (on these CPU ranks
            the CNN's step takes 20-30 ms); test accuracy
  charlm    the character-level GPT of ``examples/char_lm.py`` (its ``CharGPT``, blocks and text) at
            half its depth and context (2 layers, 128 wide, 64 characters: 0.4M parameters, as
            ``benchmarks/slow_link.py`` trains it), one pass over the blocks, AdamW with warmup and
            cosine decay per DDP-equivalent step and gradient clipping, as the example trains it;
            validation loss (cross-entropy in nats per character) on 128 held-out blocks (8k characters)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from benchmarks import slow_link
from benchmarks.fashion import load_data, small_cnn, subset

Metric = Callable[[dict[str, torch.Tensor]], float]


@dataclass(frozen=True)
class Task:
    """One task's recipe; sizes come from the job's config (``train_samples``, ``epochs``, ...)."""

    name: str
    metric: str  # what the held-out number is, for tables and plots
    higher_is_better: bool
    target: float  # the default target of the full run, near what the fast device alone converges to
    epochs: int
    every_samples: int  # evaluation interval: a copy at the first consensus at or after each multiple
    batch_size: int
    clip: Optional[float] = None  # gradient clipping norm, as the task's own training script sets it

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target

    def train_set(self, config: dict[str, Any]) -> Dataset:
        if self.name == "charlm":
            return charlm_data(config["train_samples"])[0]
        return subset(load_data(config["data"])[0], config["train_samples"])

    def network(self, config: dict[str, Any]) -> nn.Module:
        torch.manual_seed(config["seed"])  # every rank and configuration starts from the same weights
        if self.name == "charlm":
            return charlm_network()
        side = 8 if config["data"] == "digits" else 28
        if self.name == "fashion":
            return small_cnn(side)
        return nn.Sequential(nn.Flatten(), nn.Linear(side * side, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def loss(self, net: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = net(x)
        return F.cross_entropy(out.flatten(0, 1), y.flatten()) if self.name == "charlm" else F.cross_entropy(out, y)

    def optimizers(self, net: nn.Module, total_steps: int) -> tuple[torch.optim.Optimizer, Optional[Any]]:
        """The optimizer and, for the char LM, its per-step schedule over ``total_steps`` DDP-equivalent steps."""
        if self.name != "charlm":
            return torch.optim.Adam(net.parameters(), lr=1e-3), None
        return charlm_optimizers(net, total_steps)

    def scorer(self, config: dict[str, Any]) -> Metric:
        """``metric(state)`` of a model copy on this task's held-out data."""
        net = self.network(config)
        if self.name == "charlm":
            held_out = charlm_data(config["train_samples"])[1]
        else:
            held_out = subset(load_data(config["data"])[1], config.get("test_samples"))
        x, y = held_out.tensors

        @torch.inference_mode()
        def metric(state: dict[str, torch.Tensor]) -> float:
            net.load_state_dict(state)
            net.eval()
            if self.name == "charlm":
                losses = [F.cross_entropy(net(xb).flatten(0, 1), yb.flatten(), reduction="sum") for xb, yb in zip(x.split(64), y.split(64))]
                return float(sum(losses)) / y.numel()
            correct = sum(int((net(xb).argmax(1) == yb).sum()) for xb, yb in zip(x.split(500), y.split(500)))
            return correct / len(y)

        return metric


TASKS = {
    "fashion": Task("fashion", "test accuracy", True, target=0.885, epochs=3, every_samples=4000, batch_size=64),
    "mlp": Task("mlp", "test accuracy", True, target=0.88, epochs=10, every_samples=6000, batch_size=64),
    "charlm": Task("charlm", "validation loss", False, target=2.1, epochs=1, every_samples=640, batch_size=32, clip=1.0),
}

# The char LM: the example's model at half its depth and context (benchmarks/slow_link.py's size).
CHARLM_BLOCK, CHARLM_DIM, CHARLM_LAYERS, CHARLM_HEADS = 64, 128, 2, 4
CHARLM_BLOCKS = 19_200  # one pass: 600 steps of the fast device alone, 300 DDP-equivalent steps of two ranks
CHARLM_WARMUP_STEPS, CHARLM_LR = 20, 3e-3
CHARLM_HELD_OUT_BLOCKS = 128  # 8k characters of the last tenth of the text, which training never sees


@functools.lru_cache(maxsize=1)
def char_lm_module() -> Any:
    """``examples/char_lm.py``, imported from its file once per process."""
    return slow_link.char_lm_module()


@functools.lru_cache(maxsize=1)
def charlm_corpus() -> tuple[torch.Tensor, int]:
    """The plays as character indices, and the vocabulary's size, as ``examples/char_lm.py`` reads them."""
    text = char_lm_module().load_plays()
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    return torch.tensor([index[c] for c in text]), len(index)


def charlm_data(blocks: Optional[int]) -> tuple[Dataset, TensorDataset]:
    """(training blocks, held-out blocks as tensors), cut from the plays as ``examples/char_lm.py`` cuts them."""
    char_lm = char_lm_module()
    data = charlm_corpus()[0]
    cut = int(0.9 * len(data))
    train = char_lm.Blocks(data[:cut], CHARLM_BLOCK, blocks or CHARLM_BLOCKS)
    held_out = char_lm.Blocks(data[cut:], CHARLM_BLOCK, CHARLM_HELD_OUT_BLOCKS)
    pairs = [held_out[i] for i in range(len(held_out))]
    return train, TensorDataset(torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs]))


def charlm_network() -> nn.Module:
    """The example's ``CharGPT`` (a LightningModule, used here as a plain module by every configuration)."""
    vocabulary = charlm_corpus()[1]
    return char_lm_module().CharGPT(vocabulary, CHARLM_BLOCK, CHARLM_DIM, CHARLM_LAYERS, CHARLM_HEADS, CHARLM_LR, CHARLM_WARMUP_STEPS)


def charlm_optimizers(net: nn.Module, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """What ``examples/char_lm.py``'s ``configure_optimizers`` builds (it reads ``self.trainer``, which a
    plain loop has not): AdamW, weight decay on matrices only, linear warmup, cosine decay to a tenth."""
    matrices = [p for p in net.parameters() if p.dim() >= 2]
    others = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=CHARLM_LR, betas=(0.9, 0.95))
    warmup = CHARLM_WARMUP_STEPS

    def factor(step: int) -> float:
        progress = min(1.0, max(0, step - warmup) / max(1, total_steps - warmup))
        return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
