"""What every benchmark records beside its figures: where and when they were measured, their
spread, the order configurations ran in, and the configurations that failed.

A figure in a README is only worth what can be traced back: the results JSON keeps the commit
(and whether the measured code had uncommitted changes), the date, the machine and its load, the
versions of everything that moved bytes, and min / median / max over the repeats. Configurations
run in an order rotated every repeat, so the machine's drift over minutes does not always fall
on the same one, and a configuration that fails is kept as a failure (with its error), never left
out of the table.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MEASURED_CODE = ("lightning_elche", "benchmarks", "pyproject.toml")
NOT_CODE = (":(exclude)benchmarks/results", ":(exclude)benchmarks/plots", ":(exclude)benchmarks/*.md")  # results, not code
PACKAGES = ("torch", "lightning", "torchmetrics", "lightning-elche", "torchft", "litdata", "hivemind")

T = TypeVar("T")


def provenance() -> dict[str, Any]:
    """Commit, date, machine, load and versions, taken when a benchmark starts."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout

    changed = git("status", "--porcelain", "--untracked-files=no", "--", *MEASURED_CODE, *NOT_CODE).splitlines()
    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "code_dirty": bool(changed),
        "uncommitted_files": [line[3:] for line in changed],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "machine": machine(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in PACKAGES if _version(name)},
    }


def machine() -> str:
    model = ""
    try:
        model = next(
            line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} CPUs{', ' + model if model else ''}, {memory_gib:.0f} GiB"


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def spread(values: Sequence[float]) -> dict[str, float]:
    """min / median / max over the repeats (and how many there were)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def rotated(items: Sequence[T], repeat: int) -> list[T]:
    """``items`` starting at position ``repeat``: each configuration takes every slot in turn."""
    shift = repeat % len(items) if items else 0
    return list(items[shift:]) + list(items[:shift])


class Failures:
    """The configurations that failed, each with its repeat and the end of its error."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def attempt(self, name: str, repeat: int, run: Callable[[], T]) -> Optional[T]:
        """``run()``, or ``None`` with the failure recorded and printed (the benchmark goes on)."""
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - any failure of a measured job is a result
            message = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
            self.records.append({"configuration": name, "repeat": repeat, "error": message})
            print(f"FAILED {name} (repeat {repeat + 1}): {message.splitlines()[0] if message else type(exc).__name__}", flush=True)
            return None

    def of(self, name: str) -> list[dict[str, Any]]:
        return [record for record in self.records if record["configuration"] == name]


def write_results(path: Path, benchmark: str, args: Any, results: Any, failures: Optional[Failures] = None, **extra: Any) -> Path:
    """Write the results JSON: provenance first, then the arguments, results and failures."""
    record = {
        "benchmark": benchmark,
        "provenance": provenance(),
        "args": {key: value if isinstance(value, (int, float, bool, type(None))) else str(value) for key, value in vars(args).items()},
        "results": results,
        "failures": failures.records if failures is not None else [],
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(path)
    print(f"results: {path}", flush=True)
    return path
