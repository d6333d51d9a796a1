"""``python -m lightning_elche.gpu_check``: the GPU check ships in the package, and every path of it runs.

There is no GPU here: the smoke run (``--smoke``) trains each configuration tiny on CPU over gloo,
from a folder outside the repository (a user has only the installed package), and its verdicts on
coverage, consensus and finiteness must pass; the wheel built from the repository must hold it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import run_python

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(270)
def test_the_smoke_run_passes_every_check_it_can_judge_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = run_python(["-m", "lightning_elche.gpu_check", "--smoke", "--json", str(out)], tmp_path, 240,
                      what="python -m lightning_elche.gpu_check --smoke")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    record = json.loads(out.read_text())
    assert record["check"] == "gpu_check" and record["versions"]["lightning_elche"] and record["arguments"]["smoke"]
    checks = {check["check"]: check for check in record["results"]["checks"]}
    for name in ("reduce_on=device", "reduce_on=cpu", "bf16-mixed"):
        assert checks[name]["passed"] is True, checks[name]
    assert checks["16-mixed"] == {"check": "16-mixed", "passed": None, "detail": "16-mixed needs CUDA"}
    assert checks["memory vs DDP"]["passed"] is None  # a smoke run's timings and peaks mean nothing
    assert "| reduce_on=cpu | pass |" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.timeout(180)
def test_the_wheel_holds_the_gpu_check(tmp_path):
    """Built from a copy of what the wheel is made of, so that no build output lands in the checkout."""
    pytest.importorskip("setuptools")
    source = tmp_path / "source"
    shutil.copytree(REPO / "lightning_elche", source / "lightning_elche", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [wheel] = tmp_path.glob("lightning_elche-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_elche/gpu_check.py" in names and "lightning_elche/py.typed" in names, sorted(names)
