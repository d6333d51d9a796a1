"""Fashion-MNIST, the small CNN and the scoring of model copies, shared by the benchmarks.

Data: Fashion-MNIST (60k train / 10k test, 28x28, MIT licence) from the Debian package
``dataset-fashion-mnist``, read from local files only (``apt-get install -y dataset-fashion-mnist``;
``dpkg -L dataset-fashion-mnist`` lists them), parsed once into ``benchmarks/results/``, which git
ignores. Without it a benchmark warns and falls back to scikit-learn's bundled 8x8 digits (1,797
images: a smoke test, too small to measure much).
"""

from __future__ import annotations

import gzip
import struct
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from benchmarks.provenance import RESULTS

FASHION = Path("/usr/share/datasets/fashion-mnist")
CACHE = RESULTS / "fashion_mnist_uint8.pt"


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (gzip; header: zero, dtype, ndim, then ndim big-endian sizes; uint8 data)."""
    data = gzip.open(path, "rb").read()
    _, _, ndim = struct.unpack(">HBB", data[:4])
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return torch.from_numpy(np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape).copy())


def load_data(name: str) -> tuple[TensorDataset, TensorDataset]:
    """(train, test): standardised float images (N, 1, side, side) and labels, from local files only."""
    if name == "digits":
        from lightning_elche.demo import digits_split  # standardised, fixed 80/20 split

        return tuple(TensorDataset(d.tensors[0].view(-1, 1, 8, 8), d.tensors[1]) for d in digits_split())
    if not CACHE.exists():  # parse the IDX files once, keep uint8 tensors
        raw = {split: (read_idx(FASHION / f"{split}-images-idx3-ubyte.gz"), read_idx(FASHION / f"{split}-labels-idx1-ubyte.gz"))
               for split in ("train", "t10k")}
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        torch.save(raw, CACHE)
    raw = torch.load(CACHE)
    return tuple(TensorDataset(((x.float() / 255 - 0.2860) / 0.3530).unsqueeze(1), y.long()) for x, y in (raw["train"], raw["t10k"]))


def choose_data(requested: str) -> str:
    if requested == "fashion" and not (FASHION / "train-images-idx3-ubyte.gz").exists() and not CACHE.exists():
        warnings.warn(f"Fashion-MNIST not found in {FASHION} (apt-get install -y dataset-fashion-mnist); "
                      "falling back to scikit-learn digits, which is too small for meaningful timings", stacklevel=2)
        return "digits"
    return requested


def subset(data: TensorDataset, n: Optional[int]) -> TensorDataset:
    return data if n is None else TensorDataset(*(t[:n] for t in data.tensors))


def small_cnn(side: int = 28) -> nn.Module:
    """conv5x5(16)-pool-conv5x5(32)-pool-fc128-fc10: 215k parameters at 28x28."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (side // 4) ** 2, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def repeated_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor, repeats: int = 1) -> torch.Tensor:
    """Cross-entropy over ``repeats`` identical forward passes, averaged: the same loss and gradient
    for ``repeats`` times the arithmetic, forward and backward. The second model of a slower rank
    (``--slowdown-model arithmetic``): it really computes k times as much, where ``Slowdown``
    sleeps for it, and neither touches communication."""
    return sum(nn.functional.cross_entropy(net(x), y) for _ in range(repeats)) / repeats


@torch.inference_mode()
def accuracy(state: dict[str, torch.Tensor], test: TensorDataset, net: Optional[nn.Module] = None) -> float:
    """Test accuracy of ``state`` loaded into ``net`` (default: a fresh :func:`small_cnn`)."""
    x, y = test.tensors
    net = small_cnn(x.shape[-1]) if net is None else net
    net.load_state_dict(state)
    net.eval()
    correct = sum(int((net(xb).argmax(1) == yb).sum()) for xb, yb in zip(x.split(250), y.split(250)))
    return correct / len(y)


def score(points: list[dict[str, Any]], test: TensorDataset, target: float, budget_s: float, stride: int = 4) -> dict[str, Any]:
    """Time to target, accuracy at the budget and final accuracy from one run's model copies.

    ``points``: ``{"seconds", "samples", "state"}`` in training-clock order, the last one the
    final model. To keep scoring short, copies are scored every ``stride``-th until one reaches
    the target, then the ones just before it, in order: the first copy at the target is found
    unless an earlier one reached it and the next scored one fell back below.
    """
    scored: dict[int, float] = {}

    def acc(i: int) -> float:
        if i not in scored:
            scored[i] = accuracy(points[i]["state"], test)
        return scored[i]

    hit = None
    for j in range(stride - 1, len(points) + stride - 1, stride):
        j = min(j, len(points) - 1)
        if acc(j) >= target:
            hit = next(i for i in range(max(j - stride + 1, 0), j + 1) if acc(i) >= target)
            break
    final = len(points) - 1
    ended_early = points[final]["seconds"] <= budget_s  # then its final model is the one at the budget
    budget = final if ended_early else max((i for i, p in enumerate(points) if p["seconds"] <= budget_s), default=None)
    return {
        "to_target_s": None if hit is None else points[hit]["seconds"],
        "to_target_samples": None if hit is None else points[hit]["samples"],
        "acc_at_budget": None if budget is None else acc(budget),
        "ended_before_budget": ended_early,
        "final_acc": acc(final),
        "curve": [(round(points[i]["seconds"], 2), points[i]["samples"], a) for i, a in sorted(scored.items())],
    }


class ModelCopies:
    """Copies of the cohort's model at points of the training clock, for :func:`score`.

    Call :meth:`offer` wherever the cohort holds one model (after any step under DDP, after an
    averaging under local SGD or ElChe): a copy is kept at the first such point at or after each
    multiple of ``every_s``, and the last one before ``budget_s`` (the model at the budget).
    Plain-loop peers and the Lightning callback share it, so every configuration is scored alike.
    """

    def __init__(self, every_s: float, budget_s: float, lookback_s: float = 5.0) -> None:
        self.every_s, self.budget_s, self.lookback_s = every_s, budget_s, lookback_s
        self.next_s = every_s
        self.points: list[dict[str, Any]] = []
        self.before_budget: Optional[dict[str, Any]] = None

    @staticmethod
    def copy(net: nn.Module, seconds: float, samples: int) -> dict[str, Any]:
        return {"seconds": seconds, "samples": samples, "state": {k: v.detach().clone() for k, v in net.state_dict().items()}}

    def offer(self, net: nn.Module, seconds: float, samples: int) -> None:
        """``seconds`` of training clock, ``samples`` the cohort (all ranks) has trained so far."""
        if self.budget_s - self.lookback_s <= seconds < self.budget_s:
            self.before_budget = self.copy(net, seconds, samples)
        elif seconds >= self.budget_s and self.before_budget is not None:
            self.points.append(self.before_budget)
            self.before_budget = None
        if seconds >= self.next_s:
            self.points.append(self.copy(net, seconds, samples))
            self.next_s = (int(seconds / self.every_s) + 1) * self.every_s

    def finish(self, net: nn.Module, seconds: float, samples: int, path: str) -> None:
        """Add the final model (equal samples for every configuration) and save the copies."""
        self.points.append(self.copy(net, seconds, samples))
        torch.save(self.points, path)
