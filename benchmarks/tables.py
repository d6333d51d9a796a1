"""The READMEs' benchmark tables, generated from the results JSON kept in ``benchmarks/results/``.

A table in ``README.md``, ``benchmarks/README.md`` or ``docs/*.md`` sits between two markers::

    <!-- table: peers k=2 -->
    | ... generated ... |
    <!-- end table -->

``peers`` names the benchmark module (``benchmarks/peers.py``), whose ``tables(record)`` renders
every table it has from its results JSON (``record``, as :func:`benchmarks.provenance.write_results`
wrote it) into a mapping ``{"k=2": markdown, ...}``. A results file of another name (the marker
``dispatch_noise_long profiles`` reads ``dispatch_noise_long.json``) is rendered by the module its
``benchmark`` field names. The line under each table, with the commit and date it was measured at,
is generated too, so a figure cannot be quoted without its provenance.

    python -m benchmarks.tables            # rewrite every marked table from the JSON
    python -m benchmarks.tables --check    # exit 1 and show the tables that differ (a test runs this)
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.provenance import REPO, RESULTS

DOCUMENTS = ("README.md", "benchmarks/README.md", "docs/*.md")
MARKED = re.compile(r"(<!-- table: (?P<module>[\w]+) (?P<name>[^>]*?) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def results_file(module: str) -> Path:
    return RESULTS / f"{module}.json"


def render(module: str, name: str, cache: dict[str, dict[str, str]]) -> str:
    if module not in cache:
        path = results_file(module)
        if not path.exists():
            raise FileNotFoundError(
                f"table '{module} {name}': no results file {path.relative_to(REPO)}; run `python -m benchmarks.{module}`"
            )
        record: dict[str, Any] = json.loads(path.read_text())
        # a second results file of a benchmark (``dispatch_noise_long.json``) names the module that renders it
        cache[module] = importlib.import_module(f"benchmarks.{record.get('benchmark', module)}").tables(record)
    tables = cache[module]
    if name not in tables:
        raise KeyError(f"table '{module} {name}': benchmarks.{module}.tables() has {sorted(tables)}")
    return tables[name].rstrip("\n") + "\n\n" + measured_at(module) + "\n"  # a blank line: else the table takes it as a row


def measured_at(module: str) -> str:
    record = json.loads(results_file(module).read_text())
    p = record["provenance"]
    dirty = " plus uncommitted changes" if p.get("code_dirty") else ""
    earlier = "".join(f", continuing a run at {e['commit'][:7]} ({e['date']})" for e in record.get("resumed_from", []))
    return f"<sub>`benchmarks/results/{module}.json`: commit {p['commit'][:7]}{dirty}, {p['date']}{earlier}, {p['machine']}.</sub>\n"


def documents() -> list[Path]:
    return sorted({path for pattern in DOCUMENTS for path in REPO.glob(pattern)})


def regenerate(text: str, cache: dict[str, dict[str, str]]) -> str:
    return MARKED.sub(lambda m: m.group(1) + render(m["module"], m["name"], cache) + m.group(5), text)


def differences() -> list[str]:
    """A unified diff per document whose tables differ from what their JSON renders."""
    cache: dict[str, dict[str, str]] = {}
    diffs = []
    for path in documents():
        text = path.read_text()
        fresh = regenerate(text, cache)
        if fresh != text:
            name = str(path.relative_to(REPO))
            diffs.append("".join(difflib.unified_diff(text.splitlines(True), fresh.splitlines(True), name, f"{name} (from JSON)")))
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a table differs")
    args = parser.parse_args()
    if args.check:
        diffs = differences()
        print("\n".join(diffs) if diffs else "every table matches its results JSON")
        sys.exit(1 if diffs else 0)
    cache: dict[str, dict[str, str]] = {}
    for path in documents():
        text = path.read_text()
        fresh = regenerate(text, cache)
        if fresh != text:
            path.write_text(fresh)
            print(f"rewrote the tables of {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
