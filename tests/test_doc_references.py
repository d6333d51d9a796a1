"""What the README, CONTRIBUTING and docs/ name exists: repository paths, ``python -m`` modules and the
members docs/api.md lists.

A renamed file, a removed benchmark or a dropped attribute otherwise leaves the prose pointing at
nothing (CONTRIBUTING once told readers to run two benchmarks that had been removed, and docs/api.md
listed a member the strategy did not have). Nothing here imports more than the package itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])
# A path in backticks or a link target: folders of the repository, then a name with an extension.
PATH = re.compile(
    r"(?:`|\]\()((?:\.\./)*(?:\.ci|benchmarks|docs|examples|lightning_elche|tests|cohort|comm|lightning|sim)/"
    r"[\w./-]*\w)(?:#[\w-]*)?(?:`|\))"
)
BARE_FILE = re.compile(r"`([\w-]+\.(?:py|md|yaml|yml|json|toml))`")
MODULE = re.compile(r"python3? -m ([\w.]+)")
API_MEMBERS = re.compile(r"::: ([\w.]+)\n    options:\n      (?:[a-z_]+: \w+\n      )*members: \[([^\]]*)\]")
# Inside the package a folder is also named without its parent (``comm/link.py``), and files
# elsewhere by their bare name (``averaging.py``): both are looked up among the repository's files.
PACKAGE_FOLDERS = ("cohort", "comm", "lightning", "sim")
USER_SCRIPTS = {"train.py"}  # the user's own training script, in the command lines the docs show
PIP_MODULES = {"venv", "pytest", "pip", "mkdocs", "tensorboard", "mypy", "ruff", "torch.distributed.run"}
REPOSITORY_FILES = {
    path.relative_to(ROOT).as_posix()
    for path in ROOT.rglob("*")
    if path.is_file() and not {".git", ".venv", "site", "__pycache__"} & set(path.relative_to(ROOT).parts)
}


def _exists(name: str, document: Path) -> bool:
    if (document.parent / name).exists() or (ROOT / name).exists():
        return True
    if name.split("/")[0] in PACKAGE_FOLDERS:
        return (ROOT / "lightning_elche" / name).exists()
    return False


def _references(pattern: re.Pattern[str]) -> list[tuple[Path, str]]:
    return [
        (document, match)
        for document in DOCUMENTS
        for match in pattern.findall(document.read_text(encoding="utf-8"))
    ]


def test_every_repository_path_named_in_the_docs_exists() -> None:
    missing = [f"{doc.relative_to(ROOT)}: {name}" for doc, name in _references(PATH) if not _exists(name, doc)]
    assert not missing, "paths named in the docs that the repository does not have:\n" + "\n".join(missing)


def test_every_file_named_by_its_bare_name_exists_somewhere() -> None:
    names = {Path(path).name for path in REPOSITORY_FILES}
    missing = [f"{doc.relative_to(ROOT)}: {name}" for doc, name in _references(BARE_FILE) if name not in names | USER_SCRIPTS]
    assert not missing, "files named in the docs that the repository does not have:\n" + "\n".join(missing)


def test_every_python_dash_m_module_named_in_the_docs_exists() -> None:
    missing = []
    for document, module in _references(MODULE):
        if module in PIP_MODULES:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found and not (ROOT / (module.replace(".", "/") + ".py")).exists():
            missing.append(f"{document.relative_to(ROOT)}: python -m {module}")
    assert not missing, "modules the docs tell readers to run that do not exist:\n" + "\n".join(missing)


def test_every_member_docs_api_lists_exists() -> None:
    listed = API_MEMBERS.findall((ROOT / "docs" / "api.md").read_text(encoding="utf-8"))
    assert listed, "the pattern for docs/api.md's member lists found none: the checker went blind"
    missing = []
    for qualified, members in listed:
        module, name = qualified.rsplit(".", 1)
        owner = getattr(importlib.import_module(module), name)
        missing += [f"{qualified}.{m.strip()}" for m in members.split(",") if not hasattr(owner, m.strip())]
    assert not missing, f"docs/api.md lists members that do not exist: {missing}"


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("run `benchmarks/throughput.py` now", ["benchmarks/throughput.py"]),
        ("see [the page](../docs/elastic.md#limits).", ["../docs/elastic.md"]),
        ("in `comm/link.py`", ["comm/link.py"]),
        ("a word `not/a path`", []),
    ],
)
def test_the_path_pattern_finds_what_it_should(text: str, found: list[str]) -> None:
    assert PATH.findall(text) == found


SOURCE_PATH = re.compile(r"\b((?:docs|reference|benchmarks|tests|examples)/[\w./-]*\w\.(?:md|py|json|yaml))\b")


def test_every_file_the_packages_source_cites_exists() -> None:
    """Docstrings and comments point readers at docs and tests; once they cited design notes that are
    not in the repository (``reference/*.md``)."""
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "lightning_elche").rglob("*.py"))
        for name in SOURCE_PATH.findall(path.read_text(encoding="utf-8"))
        if not (ROOT / name).exists()
    ]
    assert not missing, "files the package's source cites that the repository does not have:\n" + "\n".join(missing)


def test_ci_runs_the_readmes_test_command() -> None:
    """`.ci/run` is the README's second command (the newcomer's) as it is, but for pip's ``-q``."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    [command] = [line for line in readme.splitlines() if line.startswith("python3 -m venv") and "pytest" in line]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").rstrip().splitlines()[-1]
    assert ci.replace(" -q ", " ") == command

