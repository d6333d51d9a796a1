"""Griffe extension for the docs build: Sphinx roles in docstrings become Markdown.

The package's docstrings use reST cross-reference roles (``:class:`~lightning_elche.OuterNesterov```),
which mkdocstrings would print literally. This rewrites each role when griffe loads an object:
a role naming a public object of ``lightning_elche`` (one that docs/api.md renders) becomes a
cross-reference link to it, any other (Lightning's classes, private modules, bare method names)
plain inline code. The source files are not touched. Loaded from mkdocs.yml by path; excluded
from the built site there (``exclude_docs``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|attr|obj|data|exc):`(~?)([^`<>]+)`")
CALLABLE_ROLES = ("meth", "func")
PACKAGE = "lightning_elche"
# Public names rendered somewhere else than ``lightning_elche.<name>`` in docs/api.md.
RENDERED_AT = {"Slowdown": "lightning_elche.Slowdown"}


def _public_names() -> set[str]:
    """``lightning_elche.__all__``, read without importing the package (and torch)."""
    init = Path(__file__).resolve().parent.parent / PACKAGE / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {name for name in ast.literal_eval(node.value) if not name.startswith("_")}
    return set()


class RstRoles(griffe.Extension):
    """Rewrite reST roles in every docstring griffe loads."""

    def __init__(self) -> None:
        super().__init__()
        self.public = _public_names()

    def _replace(self, match: re.Match[str]) -> str:
        role, short, target = match.groups()
        name = target.rsplit(".", 1)[-1] if short else target
        text = f"`{name}()`" if role in CALLABLE_ROLES else f"`{name}`"
        last = target.rsplit(".", 1)[-1]
        if target.startswith(PACKAGE + ".") and last in self.public:
            return f"[{text}][{RENDERED_AT.get(last, f'{PACKAGE}.{last}')}]"
        return text

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = ROLE.sub(self._replace, obj.docstring.value)
