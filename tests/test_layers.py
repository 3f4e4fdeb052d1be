"""The package's layering: a torch-free core, and an import graph without circles.

The graph counts every import in a file, the ones inside functions too: a lazy import hides a
circle from Python's loader, not from a reader, and it is the reader who has to untangle it.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("parabench", "reference_impls")

# The modules a process that only plans, lists, reads or checks suites and records loads: they
# must not pay torch's import (seconds) nor need it installed.
TORCH_FREE = (
    "parabench.case",
    "parabench.suite",
    "parabench.recipes",
    "parabench.topology",
    "parabench.record",
    "parabench.stats",
    "parabench.theory",
    "parabench.shapes",
    "parabench.strategies",
    "parabench.registry",
    "parabench.families",
    "parabench.families.compression",
    "parabench.families.context",
    "parabench.families.data_parallel",
    "parabench.families.expert",
    "parabench.families.model_parallel",
    "parabench.families.sharded",
    "parabench.collectives_config",
    "parabench.version",
)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the checked packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name an ImportFrom's ``from X`` part names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    # A package's own name is its first level; a plain module's first level is its package.
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The checked modules ``module`` imports anywhere in its file. ``from pkg import name``
    counts as importing ``pkg.name`` where that is a module, else ``pkg``; ``import a.b.c`` imports
    the packages ``a`` and ``a.b`` too, as Python runs them, except the packages ``module`` itself
    is inside (they are being imported already, whoever imported ``module``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    targets: set[str] = set()

    def add(name: str) -> None:
        parts = name.split(".")
        if name in modules:
            targets.add(name)
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in modules and not module.startswith(parent + "."):
                targets.add(parent)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            for name in submodules:
                add(name)
            if len(submodules) < len(node.names):  # names defined in ``base`` itself
                add(base)
    targets.discard(module)
    return targets


@functools.cache
def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: one shortest circle through each strongly connected
    component of more than one module."""
    edges = graph
    # Tarjan's strongly connected components, iteratively (the graph has hundreds of nodes).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_shortest_cycle(edges, set(c)) for c in components]


def _shortest_cycle(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle inside one strongly connected component, from its first module."""
    start = min(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & component):
                if child == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle in a strongly connected component: {sorted(component)}")


def test_import_graph_has_no_circles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_reference_impls_import_nothing_from_parabench():
    graph = import_graph()
    reaching = {m: sorted(t for t in ts if t.split(".")[0] == "parabench") for m, ts in graph.items()}
    offenders = {m: ts for m, ts in reaching.items() if m.split(".")[0] == "reference_impls" and ts}
    assert not offenders, offenders


def test_cycle_finder_reports_each_circle():
    graph = {
        "p": {"p.a"},
        "p.a": {"p.b"},
        "p.b": {"p.c"},
        "p.c": {"p.a"},
        "q": {"r"},
        "r": {"q"},
        "s": set(),
    }
    assert find_cycles(graph) == [["p.a", "p.b", "p.c", "p.a"], ["q", "r", "q"]]
    graph["p.c"] = set()
    graph["r"] = {"s"}
    assert find_cycles(graph) == []


def test_import_resolution_follows_relative_lazy_and_submodule_imports(tmp_path):
    package = tmp_path / "parabench"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "top.py").write_text("x = 1\n")
    (package / "sub" / "__init__.py").write_text("from . import leaf\n")
    (package / "sub" / "leaf.py").write_text("def f():\n    from ..top import x\n    from parabench import sub\n")
    (package / "user.py").write_text("import parabench.sub.leaf\n")
    graph = import_graph(tmp_path)
    assert graph["parabench.sub"] == {"parabench.sub.leaf"}
    # ``parabench`` and ``parabench.sub`` are being imported when ``leaf`` runs: only ``sub`` is named.
    assert graph["parabench.sub.leaf"] == {"parabench.top", "parabench.sub"}
    assert graph["parabench.user"] == {"parabench.sub", "parabench.sub.leaf"}
    assert find_cycles(graph) == [["parabench.sub", "parabench.sub.leaf", "parabench.sub"]]


def test_core_modules_import_without_torch():
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "from parabench.registry import STRATEGIES\n"
        "assert len(STRATEGIES) > 10, len(STRATEGIES)\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(' '.join(loaded[:5]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "", f"torch loaded by the core: {proc.stdout.strip()}"


if __name__ == "__main__":
    for cycle in find_cycles(import_graph()):
        print(" -> ".join(cycle))
