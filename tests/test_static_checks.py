"""The type checker and the linter pass, as configured in pyproject.toml.

mypy checks ``lightning_elche/`` (strict on ``cohort/`` and ``comm/``, so that ``py.typed`` and the
Protocols the package ships are checked); ruff lints the package, ``benchmarks/`` and ``examples/``
(and ``tests/`` with its bug-finding rules only).
Both run as a contributor runs them (CONTRIBUTING.md, "Tests"), with no arguments, from the
repository root; a failure prints their findings. Both are pinned in the ``test`` extra, so a
new release of either cannot fail a suite that passed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A hang guard, not a speed bound: a cold mypy run takes about a minute on a quiet 2-core machine and
# four times that while other processes keep both cores busy (240 s ran out in a loaded CI run).
TOOL_TIMEOUT_S = 900


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f'{tool} is not installed: pip install -e ".[test]" (the test extra pins it)')
    return subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, check=False, timeout=TOOL_TIMEOUT_S
    )


@pytest.mark.timeout(TOOL_TIMEOUT_S + 30)
def test_mypy_passes() -> None:
    result = _run("mypy")
    assert result.returncode == 0, f"mypy found problems (run `mypy` to see them):\n{result.stdout}{result.stderr}"


@pytest.mark.timeout(TOOL_TIMEOUT_S + 30)
def test_ruff_passes() -> None:
    result = _run("ruff", "check", "--no-fix", "--output-format", "concise")
    assert result.returncode == 0, f"ruff found problems (run `ruff check`):\n{result.stdout}{result.stderr}"
