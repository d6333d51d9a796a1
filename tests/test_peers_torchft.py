"""torchft's LocalSGD and DiLoCo, the benchmark's torchft peers (``benchmarks/peers_torchft.py``),
really run as two replica groups behind a lighthouse: each replica trains its own half of the data,
the replicas synchronise every ``sync_every`` steps and once more after a shorter last window
(else one would hang waiting for the other), rank 0's copies are taken at synchronisations, and
the model learns. A timeout must leave no replica behind.

Digits, 1,200 images: 600 per replica, 10 steps of 64, so windows of 4, 4 and 2 steps; DiLoCo's
outer Nesterov step needs that many to leave chance (about 5 steps leave it near 10 %).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.fashion import accuracy, load_data  # noqa: E402
from benchmarks.peers_torchft import run  # noqa: E402
from lightning_elche._jobs import JobFailed  # noqa: E402

RUN_TIMEOUT_S = 90


def config(tmp_path: Path, algorithm: str) -> dict[str, Any]:
    return {
        "algorithm": algorithm, "ranks": 2, "factors": {"1": 2.0}, "slowdown_model": "sleep",
        "data": "digits", "train_samples": 1200, "epochs": 1, "seed": 0, "batch_size": 64, "lr": 1e-3,
        "sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9,
        "eval_every_s": 0.001, "budget_s": 100.0,  # a copy at every synchronisation
        "snapshots": str(tmp_path / "copies.pt"), "out": str(tmp_path / "job"),
    }  # fmt: skip


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("algorithm", ["localsgd", "diloco"])
def test_replicas_train_their_halves_and_synchronise(tmp_path: Path, algorithm: str) -> None:
    reports = run(config(tmp_path, algorithm), timeout=RUN_TIMEOUT_S)
    assert [(r["samples"], r["steps"], r["syncs"]) for r in reports] == [(600, 10, 3)] * 2
    assert all(0 < r["sync_s"] < r["seconds"] for r in reports)
    copies = torch.load(tmp_path / "copies.pt")
    assert [c["samples"] for c in copies] == [512, 1024, 1200]  # after steps 4, 8 and the last window
    seconds = [c["seconds"] for c in copies]
    assert all(a < b for a, b in zip(seconds, seconds[1:])) and seconds[-1] == reports[0]["seconds"]
    assert accuracy(copies[-1]["state"], load_data("digits")[1]) > 0.3  # 0.52 / 0.47 measured; chance is 0.1


@pytest.mark.timeout(60)
def test_a_timeout_kills_the_replicas(tmp_path: Path) -> None:
    with pytest.raises(JobFailed, match="did not finish within 1 s"):
        run(config(tmp_path, "localsgd"), timeout=1)

    def cmdline(pid: str) -> str:
        try:
            return (Path("/proc") / pid / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return ""

    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and str(tmp_path) in cmdline(pid)]
