"""Shared helpers: run a multi-process scenario under a hard timeout and load what each rank saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCENARIO = Path(__file__).resolve().parent / "scenario.py"
SCENARIO_TIMEOUT_S = 150


def run_scenario(tmp_path: Path, expect_failure: bool = False, timeout: float = SCENARIO_TIMEOUT_S, **config: Any):
    """Run ``tests/scenario.py`` with ``config`` on real processes; return one result dict per rank.

    A hang becomes a test failure after ``timeout`` seconds (the strategy's own process-group
    timeout inside the scenario is shorter, so a collective mismatch surfaces as an error first).
    With ``expect_failure`` the completed process is returned instead, for asserting on stderr.
    """
    out = tmp_path / "out"
    config = {"out": str(out), **config}
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(
            [sys.executable, str(SCENARIO), json.dumps(config)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"scenario hung for more than {timeout} s (config {config}):\n{(exc.stderr or b'')[-4000:]!s}")
    if expect_failure:
        return proc
    if proc.returncode != 0:
        pytest.fail(f"scenario failed with exit code {proc.returncode}:\n{proc.stderr[-6000:]}")
    world = config.get("devices", 2)
    results = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result:\n{proc.stderr[-4000:]}"
        results.append(json.loads(path.read_text()))
    return results
