"""Lightning features that work unchanged under ElChe, each in a real 2-process run with uneven ranks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_python

APP = Path(__file__).resolve().parent / "feature_app.py"
STEPS_PER_EPOCH = 512 // 8 // 2  # DDP-equivalent: 512 samples, batch 8, 2 ranks


def run_app(tmp_path: Path, mode: str) -> list[dict[str, str]]:
    proc = run_python([str(APP), mode, str(tmp_path / "tb")], tmp_path, 150, what=f"mode {mode!r}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [(tmp_path / f"result_rank{rank}.txt").read_text() for rank in range(2)]
    return [dict(item.split("=", 1) for item in line.split()) for line in lines]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["plain", "two_opt", "bf16", "clip", "reload", "workers"])
def test_feature_trains_tests_and_predicts_like_ddp(tmp_path, mode):
    """Both ranks agree on global_step (DDP's count), the best checkpoint's name, the LR of the per-step
    schedule, the test metric and predict's output count."""
    rank0, rank1 = run_app(tmp_path, mode)
    assert rank0 == rank1
    optimizers = 2 if mode == "two_opt" else 1
    assert int(rank0["step"]) == 3 * STEPS_PER_EPOCH * optimizers
    assert re.fullmatch(r"epoch=\d-step=\d+\.ckpt", rank0["best"])
    assert int(rank0["preds"]) == 2  # 64 predict samples, batch 16, two ranks
    assert any((tmp_path / "tb").rglob("events.out.tfevents.*"))  # the logger wrote
