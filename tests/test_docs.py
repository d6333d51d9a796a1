"""The documentation site builds under --strict, and the reference pages cannot fall behind the code.

`mkdocs build --strict` fails on a broken link or anchor, a page missing from the nav and any
mkdocstrings/griffe warning about a docstring, so the first test catches a docstring or a page
that went stale. The other two check what strict mode cannot: that every `ElCheStrategy`
argument is in the configuration reference, and that every page is reachable from the nav.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.mark.timeout(180)
def test_site_builds_strict_with_api_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not ours
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="lightning_elche.ElCheStrategy"' in api, "the API page does not document ElCheStrategy"
    assert "overhead_target" in api and "fraction of a window the boundary may cost" in api, (
        "the API page lacks the documentation of ElCheStrategy's constructor arguments"
    )
    for name in ("OuterNesterov", "TrendGuard", "MsfGuard", "Slowdown", "BoundaryRecord"):
        assert f'id="lightning_elche.{name}"' in api, name
    assert ":class:" not in api, "a reST role was rendered literally (docs/griffe_rst_roles.py)"
    assert (site / "img" / "windows.svg").is_file()


def test_configuration_reference_lists_every_strategy_argument() -> None:
    from lightning_elche import ElCheStrategy

    reference = (DOCS / "configuration.md").read_text(encoding="utf-8")
    parameters = [name for name in inspect.signature(ElCheStrategy.__init__).parameters if name != "self"]
    missing = [name for name in parameters if f"`{name}`" not in reference]
    assert not missing, f"docs/configuration.md does not document ElCheStrategy arguments {missing}"


def _nav_pages(entries: object) -> list[str]:
    """Every page path in a mkdocs ``nav`` (strings, {title: page} and {title: [section]} entries)."""
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, list):
        return [page for entry in entries for page in _nav_pages(entry)]
    if isinstance(entries, dict):
        return [page for value in entries.values() for page in _nav_pages(value)]
    return []


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = set(_nav_pages(config["nav"]))
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert pages - nav == set(), f"pages missing from the nav in mkdocs.yml: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"


def test_benchmark_plots_in_the_docs_are_the_current_ones() -> None:
    """The site shows copies of benchmarks/plots (outside docs/); benchmarks/report.py writes both."""
    for plot in (ROOT / "benchmarks" / "plots").glob("*.png"):
        copy = DOCS / "img" / f"benchmark-{plot.stem.replace('_', '-')}.png"
        assert copy.read_bytes() == plot.read_bytes(), f"{copy} is stale: run python benchmarks/report.py"
