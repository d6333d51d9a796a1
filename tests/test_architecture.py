"""The package's shape, checked from the source like a lint (docs/architecture.md).

Nothing here imports the package or starts a process: every module under ``lightning_elche/`` is
parsed with :mod:`ast` and its imports are read, at module level, inside functions and under
``if TYPE_CHECKING:`` alike. The rules:

- only ``lightning_elche/comm/`` touches torch.distributed (collectives, process groups, the
  rendezvous store), directly or through Lightning's process-group helpers;
- no import cycle among the package's modules;
- the layers: ``cohort/`` imports only ``cohort/`` and neither Lightning nor torch.distributed;
  ``comm/`` imports only ``comm/`` and the control vocabulary ``cohort/control.py``; ``sim/``
  imports only ``sim/`` and ``cohort/`` (Lightning only in ``sim/slowdown.py``, a callback);
  nothing under ``cohort/``, ``comm/`` or ``sim/`` imports ``lightning_elche.lightning``;
- no module over 450 lines.

Every checker is first run on small inline sources whose answer is known, so a checker that went
blind fails its own test instead of letting the rule pass silently.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "lightning_elche"
LAYERS = ("cohort", "comm", "lightning", "sim")
MAX_LINES = 450

# Lightning's modules of process-group helpers, and the torch.distributed names that create
# groups, touch the store or are collectives. From these modules (or a `dist.` alias) they are
# forbidden outside comm/; a strategy's own `self.barrier()` / `super().reduce()` is Lightning's
# strategy API and stays allowed.
LIGHTNING_DISTRIBUTED = (
    "lightning.fabric.utilities.distributed",
    "lightning_fabric.utilities.distributed",
    "lightning.pytorch.overrides.distributed",
    "pytorch_lightning.overrides.distributed",
)
PROCESS_GROUP_NAMES = frozenset({
    "_init_dist_connection", "_destroy_dist_connection", "_sync_module_states", "_InfiniteBarrier",
    "_sync_ddp", "_sync_ddp_if_available", "_gather_all_tensors", "_simple_gather_all_tensors",
    "_all_gather_ddp_if_available", "is_shared_filesystem", "group",
    "init_process_group", "destroy_process_group", "new_group", "new_subgroups",
    "TCPStore", "PrefixStore", "FileStore", "HashStore", "Store",
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "gather", "gather_object",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
})
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


# --- reading the source -----------------------------------------------------------------------


@dataclass
class Module:
    name: str  # dotted, e.g. lightning_elche.cohort.plan
    path: str  # relative to the repository, for messages
    is_package: bool
    source: str
    tree: ast.Module = field(init=False)
    parents: dict = field(init=False)

    def __post_init__(self) -> None:
        self.tree = ast.parse(self.source, filename=self.path)
        self.parents = {child: node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)}

    @property
    def layer(self) -> Optional[str]:
        parts = self.name.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and self.is_package) else None

    def context(self, node: ast.AST) -> str:
        """Where an import sits, for messages: under TYPE_CHECKING, inside a function, or ''."""
        where = []
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where.append(f"inside {node.name}()")
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                where.append("under `if TYPE_CHECKING:`")
        return f" ({', '.join(where)})" if where else ""


def parse_modules(files: Mapping[str, str]) -> dict[str, Module]:
    """``{"pkg/sub/mod.py": source}`` -> ``{"pkg.sub.mod": Module}``."""
    modules = {}
    for path, source in files.items():
        parts = path.removesuffix(".py").split("/")
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = Module(name, path, is_package, source)
    return modules


def read_package() -> dict[str, Module]:
    files = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in sorted((ROOT / PACKAGE).rglob("*.py"))}
    return parse_modules(files)


@dataclass(frozen=True)
class Imported:
    node: ast.stmt
    module: str  # the absolute module the statement names
    name: Optional[str]  # `from module import name`; None for `import module`
    bound: str  # the local name the statement binds
    target: str  # the qualified name of what `bound` refers to

    @property
    def statement(self) -> str:
        return ast.unparse(self.node)


def imports_of(mod: Module) -> list[Imported]:
    """Every import of a module, wherever it stands, relative ones made absolute."""
    found = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for a in node.names:  # `import a.b` binds a; `import a.b as c` binds c to a.b
                bound = a.asname or a.name.split(".")[0]
                found.append(Imported(node, a.name, None, bound, a.name if a.asname else bound))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{module}" if module else base
            found += [Imported(node, module, a.name, a.asname or a.name, f"{module}.{a.name}") for a in node.names]
    return sorted(found, key=lambda imp: (imp.node.lineno, imp.node.col_offset))


def internal_target(imp: Imported, modules: Mapping[str, Module]) -> Optional[str]:
    """The package module an import loads: ``from pkg.x import y`` is ``pkg.x.y`` when y is a
    submodule, else ``pkg.x``; None for an import from outside the package. A module that does not
    exist (yet) counts as its closest existing package."""
    if imp.module.split(".")[0] not in {name.split(".")[0] for name in modules}:
        return None
    if imp.name not in (None, "*") and f"{imp.module}.{imp.name}" in modules:
        return f"{imp.module}.{imp.name}"
    parts = imp.module.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


# --- rule 1: torch.distributed only in comm/ ---------------------------------------------------


def _is_torch_distributed(name: str) -> bool:
    return name in ("torch.distributed", "torch._C._distributed_c10d") or name.startswith(("torch.distributed.", "torch._C._distributed"))


def _is_process_group_helper(name: str) -> bool:
    module, _, attr = name.rpartition(".")
    return module in LIGHTNING_DISTRIBUTED and attr in PROCESS_GROUP_NAMES


def distributed_uses(mod: Module) -> list[tuple[int, str]]:
    """(line, what) for every touch of torch.distributed or Lightning's process-group helpers."""
    findings: list[tuple[int, str]] = []
    bindings: dict[str, str] = {}  # local name -> qualified name, from imports that are allowed
    flagged: set[str] = set()
    for imp in imports_of(mod):
        if _is_torch_distributed(imp.module) or _is_torch_distributed(imp.target) or _is_process_group_helper(imp.target):
            findings.append((imp.node.lineno, f"`{imp.statement}`{mod.context(imp.node)}"))
            flagged.add(imp.bound)
        else:
            bindings[imp.bound] = imp.target
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in bindings:
            qualified, top = bindings[node.id], node
            while isinstance(mod.parents.get(top), ast.Attribute) and mod.parents[top].value is top:
                top = mod.parents[top]
                qualified += "." + top.attr
            if _is_torch_distributed(qualified) or _is_process_group_helper(qualified):
                findings.append((node.lineno, f"`{ast.unparse(top)}` ({qualified})"))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "dist":
            if node.value.id not in bindings and node.value.id not in flagged and node.attr in PROCESS_GROUP_NAMES:
                findings.append((node.lineno, f"`dist.{node.attr}` (a torch.distributed alias)"))
        elif isinstance(node, ast.Call) and node.args:
            function, args = ast.unparse(node.func), node.args
            dynamic_import = (function.endswith(("import_module", "__import__")) and isinstance(args[0], ast.Constant)
                              and _is_torch_distributed(str(args[0].value)))
            by_getattr = (function == "getattr" and len(args) > 1 and isinstance(args[0], ast.Name)
                          and bindings.get(args[0].id) == "torch" and isinstance(args[1], ast.Constant)
                          and args[1].value == "distributed")
            if dynamic_import or by_getattr:
                findings.append((node.lineno, f"`{ast.unparse(node)}`"))
    return sorted(set(findings))


def is_comm(mod: Module) -> bool:
    return mod.layer == "comm"


# --- rule 2: no import cycle ------------------------------------------------------------------


def import_graph(modules: Mapping[str, Module]) -> dict[str, dict[str, Imported]]:
    """module -> {imported package module: the first import statement that loads it}."""
    graph: dict[str, dict[str, Imported]] = {name: {} for name in modules}
    for name, mod in modules.items():
        for imp in imports_of(mod):
            target = internal_target(imp, modules)
            if target is not None:
                graph[name].setdefault(target, imp)
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Cycles ``[a, b, ..., a]``, each starting at its smallest module: the strongly connected components
    (Tarjan), and in each a shortest cycle through every member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = set()
    for component in components:
        if len(component) == 1 and min(component) not in graph.get(min(component), ()):
            continue
        for start in component:  # a shortest cycle through each member: a component may hold several
            cycle = _shortest_cycle(graph, start, component)[:-1]
            first = cycle.index(min(cycle))
            cycles.add(tuple(cycle[first:] + cycle[:first] + [cycle[first]]))
    return sorted(list(cycle) for cycle in cycles)


def _shortest_cycle(graph: Mapping[str, Iterable[str]], start: str, component: set[str]) -> list[str]:
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w == start:
                chain = [v]
                while chain[-1] != start:
                    chain.append(previous[chain[-1]])
                return chain[::-1] + [start]
            if w in component and w not in previous:
                previous[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


def describe_cycle(cycle: list[str], graph: Mapping[str, Mapping[str, Imported]], modules: Mapping[str, Module]) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        imp = graph[a][b]
        lines.append(f"  {modules[a].path}:{imp.node.lineno}: `{imp.statement}`{modules[a].context(imp.node)}")
    return "\n".join(lines)


# --- rule 3: the layers -----------------------------------------------------------------------


@dataclass(frozen=True)
class LayerRule:
    may_import: tuple[str, ...]  # package-relative modules or folders this layer may import
    forbidden: tuple[str, ...]  # external modules this layer may not import
    exempt: tuple[str, ...]  # package-relative modules of the layer allowed the forbidden ones
    advice: str


LAYER_RULES = {
    "cohort": LayerRule(
        ("cohort",), LIGHTNING_PACKAGES + ("torch.distributed",), (),
        "the core decides from plain values, without Lightning or torch.distributed: let the adapter in "
        "lightning/ read the trainer and comm/ move the bytes, and pass the values in",
    ),
    "comm": LayerRule(
        ("comm", "cohort.control"), (), (),
        "comm/ moves bytes and reads only the control vocabulary in cohort/control.py: put the decision in "
        "cohort/ and hand comm/ its result, or add the field to cohort/control.py",
    ),
    "sim": LayerRule(
        ("sim", "cohort"), LIGHTNING_PACKAGES, ("sim.slowdown",),
        "the simulator drives the cohort core against simulated ranks: take the decision from cohort/ (not a "
        "copy, not lightning/ or comm/); only sim/slowdown.py, a Lightning callback, may import lightning",
    ),
}


def _within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_violations(modules: Mapping[str, Module], layer: str) -> list[str]:
    rule = LAYER_RULES[layer]
    problems = []
    for mod in modules.values():
        if mod.layer != layer:
            continue
        package = mod.name.split(".")[0]
        for imp in imports_of(mod):
            target = internal_target(imp, modules)
            where = f"{mod.path}:{imp.node.lineno}: `{imp.statement}`{mod.context(imp.node)}"
            if target is not None and not _within(target, [f"{package}.{p}" for p in rule.may_import]):
                problems.append(f"{where} imports {target}; {layer}/ may import only {', '.join(rule.may_import)}: {rule.advice}")
            elif (target is None and not _within(mod.name, [f"{package}.{p}" for p in rule.exempt])
                  and (_within(imp.module, rule.forbidden) or _within(imp.target, rule.forbidden))):
                problems.append(f"{where}: {layer}/ may not import {imp.target}: {rule.advice}")
    return problems


def adapter_imports(modules: Mapping[str, Module]) -> list[str]:
    """Imports of ``lightning_elche.lightning`` from cohort/, comm/ or sim/."""
    problems = []
    for mod in modules.values():
        if mod.layer not in ("cohort", "comm", "sim"):
            continue
        adapters = f"{mod.name.split('.')[0]}.lightning"
        for imp in imports_of(mod):
            target = internal_target(imp, modules)
            if target is not None and _within(target, [adapters]):
                problems.append(
                    f"{mod.path}:{imp.node.lineno}: `{imp.statement}`{mod.context(imp.node)}: {mod.layer}/ is below the "
                    f"Lightning adapters; move what it needs down into cohort/ (a decision) or comm/ (bytes)"
                )
    return problems


# --- self-tests of the checkers ---------------------------------------------------------------


def _snippet(source: str, path: str = "pkg/lightning/adapter.py") -> Module:
    return parse_modules({path: source})[path.removesuffix(".py").replace("/", ".")]


VIOLATING = {
    "import as dist": "import torch.distributed as dist\n",
    "plain import": "import torch.distributed\n",
    "from import": "from torch.distributed import all_reduce\n",
    "from torch import distributed": "from torch import distributed\n",
    "submodule": "from torch.distributed.algorithms.join import Join\n",
    "attribute": "import torch\n\ntorch.distributed.all_reduce(t)\n",
    "aliased torch": "import torch as th\n\nth.distributed.barrier()\n",
    "is_initialized": "import torch\n\nok = torch.distributed.is_initialized()\n",
    "in a function": "def f():\n    import torch.distributed as dist\n    dist.barrier()\n",
    "type checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torch.distributed import ProcessGroup\n",
    "lightning init": "from lightning.fabric.utilities.distributed import _init_dist_connection\n",
    "lightning destroy": "from lightning.fabric.utilities.distributed import _destroy_dist_connection as d\n",
    "lightning sync states": "from lightning.pytorch.overrides.distributed import _sync_module_states\n",
    "lightning module alias": "import lightning.fabric.utilities.distributed as lfd\n\nlfd._init_dist_connection(env, 'gloo')\n",
    "dist parameter": "def f(dist, t):\n    dist.all_reduce(t)\n",
    "import_module": "import importlib\n\nd = importlib.import_module('torch.distributed')\n",
    "getattr": "import torch\n\nd = getattr(torch, 'distributed')\n",
}
ALLOWED = {
    "strategy API": (
        "from lightning.pytorch.strategies import DDPStrategy\n\nclass S(DDPStrategy):\n"
        "    def reduce(self, t, group=None, reduce_op='mean'):\n        return super().reduce(t, group, reduce_op)\n"
        "    def barrier(self, name=None):\n        super().barrier(name)\n"
    ),
    "trainer and module API": "trainer.strategy.barrier('x')\nout = pl_module.all_gather(t)\nself.all_gather(t)\n",
    "other torch": "import torch\nimport torch.utils.data\nfrom torch import nn\n\nx = torch.nn.Linear(2, 2)\n",
    "comm's averager": "from pkg.comm.averaging import FlatAverager\n\naverager.all_reduce(x)\n",
    "a name that only looks alike": "distributed = torch_like.distributed\nreport.reduce(x)\n",
}


@pytest.mark.parametrize("source", VIOLATING.values(), ids=VIOLATING.keys())
def test_distributed_checker_catches(source: str) -> None:
    assert distributed_uses(_snippet(source)), f"the checker missed:\n{source}"


@pytest.mark.parametrize("source", ALLOWED.values(), ids=ALLOWED.keys())
def test_distributed_checker_allows(source: str) -> None:
    assert distributed_uses(_snippet(source)) == [], f"the checker flagged allowed code:\n{source}"


def test_cycle_finder_on_synthetic_graphs() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a"}, "b": set()}) == [["a", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}}) == [["a", "b", "a"], ["c", "d", "c"]]
    # one component, two cycles through a: both are reported
    assert find_cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"], ["a", "c", "a"]]


SYNTHETIC = {
    "pkg/__init__.py": "",
    "pkg/cohort/__init__.py": "",
    "pkg/cohort/control.py": "",
    "pkg/cohort/a.py": "import lightning.pytorch as pl\nfrom ..comm import b\n",
    "pkg/comm/__init__.py": "",
    "pkg/comm/b.py": "from pkg.cohort.control import LocalReport\n\ndef f():\n    from pkg.cohort import a\n",
    "pkg/sim/__init__.py": "",
    "pkg/sim/slowdown.py": "import lightning.pytorch as pl\nfrom . import simulator\n",
    "pkg/sim/simulator.py": (
        "from typing import TYPE_CHECKING\nimport lightning\nif TYPE_CHECKING:\n    from pkg.lightning.callback import R\n"
    ),
    "pkg/lightning/__init__.py": "",
    "pkg/lightning/callback.py": "from pkg.sim import slowdown\n",
}


def test_import_graph_counts_every_import_and_resolves_submodules() -> None:
    modules = parse_modules(SYNTHETIC)
    graph = import_graph(modules)
    assert set(graph["pkg.cohort.a"]) == {"pkg.comm.b"}  # relative, and `from package import submodule`
    assert set(graph["pkg.comm.b"]) == {"pkg.cohort.control", "pkg.cohort.a"}  # inside a function too
    assert set(graph["pkg.sim.simulator"]) == {"pkg.lightning.callback"}  # under TYPE_CHECKING too
    cycles = find_cycles(graph)
    assert cycles == [
        ["pkg.cohort.a", "pkg.comm.b", "pkg.cohort.a"],
        ["pkg.lightning.callback", "pkg.sim.slowdown", "pkg.sim.simulator", "pkg.lightning.callback"],
    ]
    assert "pkg/comm/b.py:4: `from pkg.cohort import a` (inside f())" in describe_cycle(cycles[0], graph, modules)


def test_layer_checker_on_a_synthetic_package() -> None:
    modules = parse_modules(SYNTHETIC)
    cohort, comm, sim = (layer_violations(modules, layer) for layer in ("cohort", "comm", "sim"))
    assert [p.split(":")[:2] for p in cohort] == [["pkg/cohort/a.py", "1"], ["pkg/cohort/a.py", "2"]]
    assert [p.split(":")[:2] for p in comm] == [["pkg/comm/b.py", "4"]]  # cohort/control.py is allowed
    assert [p.split(":")[:2] for p in sim] == [["pkg/sim/simulator.py", "2"], ["pkg/sim/simulator.py", "4"]]
    assert [p.split(":")[:2] for p in adapter_imports(modules)] == [["pkg/sim/simulator.py", "4"]]


# --- the rules, on the package ----------------------------------------------------------------

MODULES = read_package()


def test_the_lint_sees_the_package() -> None:
    """Guards against a lint that passes because it read nothing."""
    assert {mod.layer for mod in MODULES.values()} >= set(LAYERS), sorted(MODULES)
    assert len(MODULES) >= 20, sorted(MODULES)
    assert sum(len(edges) for edges in import_graph(MODULES).values()) >= 15
    assert any(distributed_uses(mod) for mod in MODULES.values() if is_comm(mod)), "comm/ seems not to use torch.distributed"


def test_only_comm_touches_torch_distributed() -> None:
    problems = [
        f"{mod.path}:{line}: {what}: only lightning_elche/comm/ may call torch.distributed, create process groups "
        f"or touch the store; move this into comm/ and call it from there"
        for mod in MODULES.values() if not is_comm(mod)
        for line, what in distributed_uses(mod)
    ]
    assert not problems, "\n".join(problems)


def test_no_import_cycle() -> None:
    graph = import_graph(MODULES)
    cycles = [describe_cycle(cycle, graph, MODULES) for cycle in find_cycles(graph)]
    for cycle in cycles:
        print(cycle)
    assert not cycles, (
        "import cycles (TYPE_CHECKING and function-level imports count): break each one by moving what both "
        "sides need into a lower module, or by typing against a Protocol defined below\n" + "\n".join(cycles)
    )


@pytest.mark.parametrize("layer", sorted(LAYER_RULES))
def test_layer_imports(layer: str) -> None:
    problems = layer_violations(MODULES, layer)
    assert not problems, "\n".join(problems)


def test_cohort_comm_and_sim_do_not_import_the_lightning_adapters() -> None:
    problems = adapter_imports(MODULES)
    assert not problems, "\n".join(problems)


def test_no_module_over_the_line_limit() -> None:
    problems = [
        f"{mod.path}:{MAX_LINES + 1}: {len(mod.source.splitlines())} lines, over the {MAX_LINES}-line limit: split it "
        f"along a responsibility (docs/architecture.md says which layer each piece belongs to)"
        for mod in MODULES.values() if len(mod.source.splitlines()) > MAX_LINES
    ]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- @override


def _lightning_overrides(cls: type) -> list[str]:
    """Methods ``cls`` (or a mixin of ours in its MRO) defines that a Lightning base class also defines."""
    ours = [k for k in cls.__mro__ if k.__module__.startswith("lightning_elche")]
    theirs = [k for k in cls.__mro__ if k.__module__.startswith("lightning.")]
    names = []
    for klass in ours:
        for name, member in vars(klass).items():
            if name.startswith("__") or not any(name in vars(base) for base in theirs):
                continue
            function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(function) and not getattr(function, "__override__", False):
                names.append(f"{klass.__module__}.{klass.__qualname__}.{name}")
    return names


def test_every_overridden_lightning_method_carries_override():
    import lightning_elche
    from lightning_elche import _jobs
    from lightning_elche.lightning.callback import ElCheCallback

    classes = [lightning_elche.ElCheStrategy, ElCheCallback, lightning_elche.Slowdown, _jobs.TrainClock, _jobs.Classifier]
    missing = [name for cls in classes for name in _lightning_overrides(cls)]
    assert not missing, "add @override (typing_extensions) to: " + ", ".join(missing)


def test_the_override_check_sees_a_missing_override():
    import lightning.pytorch as pl

    class Forgetful(pl.Callback):
        def on_train_start(self, trainer, pl_module):  # no @override: must be reported
            pass

        def helper(self):  # not a Lightning method: not reported
            pass

    Forgetful.__module__ = "lightning_elche.fake"
    assert _lightning_overrides(Forgetful) == [f"lightning_elche.fake.{Forgetful.__qualname__}.on_train_start"]


# --- rule 4: the adapters and the entry points -------------------------------------------------

LAYER_RULES["lightning"] = LayerRule(
    ("cohort", "comm", "lightning"), (), (),
    "the adapters stand on the core (cohort/) and the transport (comm/) only: a test tool of sim/ must not be "
    "on the product's path (type against a Protocol instead), and an entry point above the layers is not theirs to use",
)


def entry_point_imports(modules: Mapping[str, Module]) -> list[str]:
    """Imports of a top-level module (an entry point: the launcher, the demo, the simulator's command,
    the GPU check) from a layer: the entry points sit above every layer."""
    problems = []
    top_level = {name for name, mod in modules.items() if mod.layer is None and not mod.is_package}
    for mod in modules.values():
        if mod.layer is None:
            continue
        for imp in imports_of(mod):
            target = internal_target(imp, modules)
            if target in top_level:
                problems.append(
                    f"{mod.path}:{imp.node.lineno}: `{imp.statement}`{mod.context(imp.node)}: {target} is an entry "
                    f"point above the layers; move what {mod.layer}/ needs of it into a layer"
                )
    return problems


def test_the_entry_points_are_above_every_layer() -> None:
    problems = entry_point_imports(MODULES)
    assert not problems, "\n".join(problems)


def test_the_entry_point_rule_sees_a_layer_importing_one() -> None:
    modules = parse_modules({
        "pkg/__init__.py": "", "pkg/launch.py": "from pkg.comm import b\n", "pkg/comm/__init__.py": "",
        "pkg/comm/b.py": "def f():\n    from pkg import launch\n",
    })  # fmt: skip
    assert [p.split(":")[:2] for p in entry_point_imports(modules)] == [["pkg/comm/b.py", "2"]]


# --- rule 5: Lightning's private names only in lightning/_lightning.py ------------------------

PRIVATE_HOME = "lightning_elche.lightning._lightning"


def private_accesses(mod: Module) -> list[str]:
    """``obj._name`` on an object that is not this one (``self``, ``cls``, ``super()``): in lightning/,
    whatever the object (the adapters hold Lightning's objects) but a standard library module
    (``os._exit``); elsewhere, on a name imported from a Lightning package."""
    from_lightning = {imp.bound for imp in imports_of(mod) if _within(imp.module, LIGHTNING_PACKAGES + ("lightning_utilities",))}
    standard = {imp.bound for imp in imports_of(mod) if imp.module in sys.stdlib_module_names}
    problems = []
    for node in ast.walk(mod.tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        if isinstance(owner, ast.Name) and owner.id in standard:
            continue
        if mod.layer == "lightning" or (isinstance(owner, ast.Name) and owner.id in from_lightning):
            problems.append(f"{mod.path}:{node.lineno}: `{ast.unparse(node)}`")
    return problems


def test_lightnings_private_names_are_used_only_in_lightning_private_module() -> None:
    problems = [problem for mod in MODULES.values() if mod.name != PRIVATE_HOME for problem in private_accesses(mod)]
    assert not problems, (
        "a private name of another object (Lightning's, or one the adapters hold) outside lightning/_lightning.py, "
        "where tests/test_lightning_internals.py checks each against the installed Lightning: add a named "
        "function there and call it\n" + "\n".join(problems)
    )


def test_the_private_name_rule_sees_them() -> None:
    adapter = _snippet("import os\ndef f(trainer):\n    os._exit(0)\n    return trainer._checkpoint_connector, self._own, super()._base\n")
    assert [p.split(": ")[1] for p in private_accesses(adapter)] == ["`trainer._checkpoint_connector`"]
    entry = _snippet("from lightning_utilities.core import rank_zero\nx = rank_zero._get_rank()\ny = other._z\n", "pkg/tool.py")
    assert [p.split(": ")[1] for p in private_accesses(entry)] == ["`rank_zero._get_rank`"]


# --- rule 6: small units ----------------------------------------------------------------------

MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 400, 60, 10
SIZE_EXCEPTIONS = {
    # The strategy's constructor is what LightningCLI and jsonargparse read: the seven settings most
    # projects set, the six groups and DDPStrategy's seven arguments must each be a parameter to appear
    # in a YAML config and in --print_config.
    "lightning_elche.lightning.strategy.ElCheStrategy.__init__": "parameters",
}


def unit_sizes(mod: Module) -> list[str]:
    """Classes over 400 lines, functions over 60, signatures over 10 parameters (``self``/``cls`` aside)."""
    problems = []

    def visit(node: ast.AST, qualified: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{qualified}.{child.name}"
                lines = child.end_lineno - child.lineno + 1
                if lines > MAX_CLASS_LINES and SIZE_EXCEPTIONS.get(name) != "lines":
                    problems.append(f"{mod.path}:{child.lineno}: class {name} has {lines} lines (at most {MAX_CLASS_LINES})")
                visit(child, name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{qualified}.{child.name}"
                lines = child.end_lineno - child.lineno + 1
                arguments = child.args
                count = len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
                count += (arguments.vararg is not None) + (arguments.kwarg is not None)
                if arguments.args and arguments.args[0].arg in ("self", "cls"):
                    count -= 1
                if lines > MAX_FUNCTION_LINES and SIZE_EXCEPTIONS.get(name) != "lines":
                    problems.append(f"{mod.path}:{child.lineno}: {name} has {lines} lines (at most {MAX_FUNCTION_LINES})")
                if count > MAX_PARAMETERS and SIZE_EXCEPTIONS.get(name) != "parameters":
                    problems.append(f"{mod.path}:{child.lineno}: {name} takes {count} parameters (at most {MAX_PARAMETERS})")
                visit(child, name)

    visit(mod.tree, mod.name)
    return problems


def test_small_units_in_the_core_the_transport_and_the_adapters() -> None:
    problems = [p for mod in MODULES.values() if mod.layer in ("cohort", "comm", "lightning") for p in unit_sizes(mod)]
    assert not problems, "split these along a responsibility, or group the parameters that travel together\n" + "\n".join(problems)


def test_the_size_rule_sees_a_long_signature_and_a_long_function() -> None:
    long_body = "\n".join(f"    x{i} = {i}" for i in range(61))
    mod = _snippet(f"def f(a, b, c, d, e, f, g, h, i, j, k):\n    pass\n\ndef g():\n{long_body}\n\nclass C:\n    def m(self, a):\n        pass\n")
    assert [p.split(": ", 1)[1] for p in unit_sizes(mod)] == [
        "pkg.lightning.adapter.f takes 11 parameters (at most 10)", "pkg.lightning.adapter.g has 62 lines (at most 60)",
    ]


# --- rule 7: collaborators, not mixins --------------------------------------------------------


def mixed_classes(mod: Module) -> list[str]:
    """Classes of lightning/ with more than one base that is not Lightning's (a mixin of ours, say)."""
    from_lightning = {imp.bound for imp in imports_of(mod) if _within(imp.module, LIGHTNING_PACKAGES)}
    problems = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ClassDef):
            own = [ast.unparse(base) for base in node.bases if ast.unparse(base).split(".")[0] not in from_lightning]
            if len(own) > 1:
                problems.append(f"{mod.path}:{node.lineno}: class {node.name}({', '.join(own)})")
    return problems


def test_no_adapter_class_mixes_in_more_than_one_base_of_its_own() -> None:
    problems = [p for mod in MODULES.values() if mod.layer == "lightning" for p in mixed_classes(mod)]
    assert not problems, "hand the work to a collaborator instead of mixing it in\n" + "\n".join(problems)


def test_the_mixin_rule_sees_a_mixin() -> None:
    mod = _snippet("from lightning.pytorch.strategies import DDPStrategy\nclass S(Checkpoints, Elastic, DDPStrategy):\n    pass\n"
                   "class T(DDPStrategy):\n    pass\n")
    assert [p.split(": ")[1] for p in mixed_classes(mod)] == ["class S(Checkpoints, Elastic)"]


# --- rule 8: the core's state is the core's to change -----------------------------------------

CORE = "lightning_elche.cohort.core"


def self_assigned(node: ast.ClassDef) -> set[str]:
    """The attributes a class assigns to itself (``self.x = ...`` in its methods)."""
    return {
        inner.attr for inner in ast.walk(node)
        if isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store) and ast.unparse(inner.value) == "self"
    }  # fmt: skip


def core_attributes(modules: Mapping[str, Module]) -> set[str]:
    """The attributes of the cohort core (``Cohort``) that no other class of the package has: an assignment
    to one of them on another object can only be an assignment to the core's."""
    classes = [(mod.name, node) for mod in modules.values() for node in ast.walk(mod.tree) if isinstance(node, ast.ClassDef)]
    core = next(node for name, node in classes if name == CORE and node.name == "Cohort")
    others = set().union(*(self_assigned(node) for name, node in classes if node is not core))
    return self_assigned(core) - others


def core_assignments(mod: Module, attributes: set[str]) -> list[str]:
    """``x.name = ...`` (or ``+=``, or in a tuple) on another object: an attribute only the core has, or any
    attribute of an object the code calls a cohort (``cohort``, ``old_cohort``, ``session.cohort``)."""
    problems = []
    for node in ast.walk(mod.tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)):
            continue
        owner = ast.unparse(node.value)
        if owner == "self":
            continue
        if node.attr in attributes or owner.split(".")[-1].endswith("cohort"):
            problems.append(f"{mod.path}:{node.lineno}: `{ast.unparse(node)} = ...`")
    return problems


def test_no_module_outside_the_core_assigns_the_cores_attributes() -> None:
    attributes = core_attributes(MODULES)
    assert {"history", "in_window", "last_checkpoint_path", "requests"} <= attributes, sorted(attributes)
    problems = [p for mod in MODULES.values() if mod.layer != "cohort" for p in core_assignments(mod, attributes)]
    assert not problems, (
        "the cohort core's state changes through its methods (Cohort.next_generation, note_checkpoint, ...), "
        "not from an adapter\n" + "\n".join(problems)
    )


def test_the_core_assignment_rule_sees_one() -> None:
    mod = _snippet("def f(session, old):\n    session.cohort.plan = None\n    old.history = []\n    self.history = []\n"
                   "    other.rank = 1\n")
    assert [p.split(": ")[1] for p in core_assignments(mod, {"history"})] == [
        "`session.cohort.plan = ...`", "`old.history = ...`",
    ]
