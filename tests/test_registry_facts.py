"""Every fact about a strategy lives in its registry row: no module outside parabench/families/ and
parabench/peers/ (and reference_impls/, outside parabench) tells strategies apart by name. The scan
looks, in every other module of parabench, for a string literal that is a registered strategy's
name, a library prefix of one ("ref.", "torch.", "deepspeed."), or a piece of one tested with
``startswith`` / ``endswith`` / ``in`` against a strategy."""

from __future__ import annotations

import ast
from pathlib import Path

from parabench.registry import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "parabench"
# Where strategies are defined, and so named.
HOMES = ("families", "peers")
# Modules that may still name strategies, each with the reason.
ALLOWED = {
    "fidelity": "peer fidelity reruns each peer library's own example script: it is peer code, one script a peer",
}


def _library_prefixes() -> set[str]:
    return {name.split(".", 1)[0] + "." for name in STRATEGIES if "." in name}


def _pieces_tested(tree: ast.AST):
    """(line, literal) of every string literal tested against some string as a prefix, suffix or
    substring: ``x.startswith(lit)``, ``x.endswith((lit, ...))``, ``lit in x``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("startswith", "endswith") and node.args:
                arg = node.args[0]
                elts = arg.elts if isinstance(arg, ast.Tuple) else [arg]
                for e in elts:
                    if isinstance(e, ast.Constant) and isinstance(e.value, str):
                        yield e.lineno, e.value, node.func.attr
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
            if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and not all(
                isinstance(c, (ast.Tuple, ast.List, ast.Set, ast.Dict)) for c in node.comparators
            ):
                yield node.lineno, node.left.value, "in"


def strategy_literals(path: Path) -> list[str]:
    """Every place in ``path`` that names a strategy or classifies one by a piece of its name."""
    names = set(STRATEGIES)
    prefixes = _library_prefixes()
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in names or node.value in prefixes:
                found.append(f"{where}:{node.lineno}: {node.value!r}")
    for line, piece, how in _pieces_tested(tree):
        if len(piece) < 3 or not any(c.isalpha() for c in piece):  # "." or "0" tell nothing about a strategy
            continue
        match = {
            "startswith": lambda n: n.startswith(piece),
            "endswith": lambda n: n.endswith(piece),
            "in": lambda n: piece in n,
        }[how]
        if any(match(n) for n in names) and piece not in names | prefixes:
            found.append(f"{where}:{line}: {how} {piece!r}")
    return found


def scanned_modules() -> list[Path]:
    skipped = HOMES + tuple(ALLOWED)
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in skipped]


def test_no_module_outside_the_registry_names_a_strategy():
    found = [hit for path in scanned_modules() for hit in strategy_literals(path)]
    assert found == [], "strategy facts outside their rows:\n" + "\n".join(found)


def test_the_scan_finds_a_name_a_prefix_and_a_piece(tmp_path):
    """The scan is not blind: a name compared, a library prefix and a suffix test are each found."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        'def f(strategy):\n    return strategy == "torch.ddp" or strategy.startswith("ref.") or strategy.endswith("_sp")\n'
    )
    found = strategy_literals(probe)
    assert len(found) == 3 and "'torch.ddp'" in found[0], found


def test_the_allowlist_is_short_and_still_needed():
    assert len(ALLOWED) <= 3
    for folder in ALLOWED:
        hits = [h for p in sorted((PACKAGE / folder).rglob("*.py")) for h in strategy_literals(p)]
        assert hits, f"parabench/{folder} no longer names a strategy: drop it from the allowlist"


def test_every_row_carries_its_planner_facts_and_peers():
    """The rows the planner models say which family prices them; a reference's peers are peers."""
    for name, row in STRATEGIES.items():
        assert row.plan.family in (None, "data_parallel", "sharded", "model_parallel"), name
        for peer in row.peers:
            assert row.kind == "reference" and STRATEGIES[peer].kind == "peer", (name, peer)
    modelled = {n for n, r in STRATEGIES.items() if r.plan.family}
    assert {"single", "torch.ddp", "ref.zero3", "torch.fsdp2", "ref.tp", "torch.pp_1f1b"} <= modelled
