"""Lightning features that work unchanged under ElChe, each in a real 2-process run with uneven ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parent / "feature_app.py"
STEPS_PER_EPOCH = 512 // 8 // 2  # DDP-equivalent: 512 samples, batch 8, 2 ranks


def run_app(tmp_path: Path, mode: str) -> list[dict[str, str]]:
    try:
        proc = subprocess.run(
            [sys.executable, str(APP), mode, str(tmp_path / "tb")],
            capture_output=True, text=True, timeout=150, cwd=tmp_path,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"mode {mode!r} hung for more than 150 s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [(tmp_path / f"result_rank{rank}.txt").read_text() for rank in range(2)]
    return [dict(item.split("=", 1) for item in line.split()) for line in lines]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "mode",
    ["plain", "two_opt", pytest.param("bf16", marks=pytest.mark.slow), pytest.param("clip", marks=pytest.mark.slow),
     pytest.param("reload", marks=pytest.mark.slow), pytest.param("workers", marks=pytest.mark.slow)],
)
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
