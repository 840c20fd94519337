"""The import graph of robustbn, aggregators and attacks, read from the source with the ast
module (imports inside function bodies included): no circles, and the layering DESIGN.md asks
for (aggregators below attacks, both below robustbn: aggregators imports neither attacks nor
robustbn, attacks never robustbn; the BN layer below the protocols)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("robustbn", "aggregators", "attacks")
# the project packages each lower package may import, itself included: aggregators at the
# bottom, attacks above it (its attacks aim at pipelines), robustbn above both
ALLOWED = {"aggregators": {"aggregators"}, "attacks": {"aggregators", "attacks"}}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(module: str, is_package: bool, node: ast.AST, known: set[str]) -> set[str]:
    """The project modules one import statement loads: `from a import b` counts as a.b where
    that is a module, else as a (the name is an attribute of a)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found - {module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = {_module_name(p, root): p for package in PACKAGES for p in (root / package).rglob("*.py")}
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = set().union(*(_targets(module, path.name == "__init__.py", node, set(files))
                                      for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))))
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'module -> target' for every import, lazy or not, by a module of aggregators or attacks
    of a project package above its own (ALLOWED)."""
    return [f"{module} -> {target}" for module, targets in sorted(graph.items()) if module.split(".")[0] in ALLOWED
            for target in sorted(targets) if target.split(".")[0] not in ALLOWED[module.split(".")[0]]]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, colors)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40 and "robustbn.protocols.fbn" in graph  # the whole tree was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set(), "c": {"c2"}, "c2": {"c"}}, ["c", "c2", "c"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
])
def test_the_cycle_finder_finds_cycles(graph, cycle):
    assert find_cycle(graph) == cycle


def test_lazy_imports_and_relative_imports_are_read(tmp_path):
    """An import inside a function body is an edge; `from . import x` and `from ..y import z`
    resolve to the modules they load."""
    pkg = tmp_path / "robustbn"
    (pkg / "sub").mkdir(parents=True)
    for package in ("aggregators", "attacks"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from .high import g\n")
    (pkg / "high.py").write_text("from . import low\n")
    (pkg / "sub" / "__init__.py").write_text("from ..low import f\n")
    graph = import_graph(tmp_path)
    assert graph["robustbn.low"] == {"robustbn.high"} and graph["robustbn.high"] == {"robustbn.low"}
    assert graph["robustbn.sub"] == {"robustbn.low"}
    assert find_cycle(graph) == ["robustbn.high", "robustbn.low", "robustbn.high"]


def test_aggregators_import_neither_attacks_nor_robustbn():
    """No arrow runs back up the house: what needs aggregators and attacks both (the measured
    kappa, an attack's checks) lives in robustbn."""
    graph = import_graph()
    assert "aggregators.testing" in graph and "attacks.base" in graph
    assert upward_imports(graph) == []


def test_an_import_up_the_layers_is_found_even_inside_a_function(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "aggregators" / "kit.py").write_text("import torch\n\n\ndef f():\n    import attacks\n")
    (tmp_path / "aggregators" / "low.py").write_text("def g():\n    from robustbn import run\n")
    (tmp_path / "attacks" / "a.py").write_text("from aggregators import kit\n\n\ndef h():\n    import attacks.a\n")
    assert upward_imports(import_graph(tmp_path)) == ["aggregators.kit -> attacks", "aggregators.low -> robustbn"]


def test_layers():
    """aggregators and attacks never import robustbn; the BN layer, the errors and the shared
    words sit below what uses them."""
    graph = import_graph()

    def reaches(start, target):
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node.startswith(target):
                return True
            if node not in seen:
                seen.add(node)
                todo += graph.get(node, ())
        return False

    for module in graph:
        if module.startswith(("aggregators", "attacks")):
            assert not reaches(module, "robustbn"), module
    for low, high in [("robustbn.norm", "robustbn.protocols"), ("robustbn.errors", "robustbn.scenario"),
                      ("robustbn.labels", "robustbn.plots"), ("robustbn.labels", "robustbn.worst"),
                      ("robustbn.worst", "robustbn.plots"), ("robustbn.protocols", "robustbn.models")]:
        assert not reaches(low, high), f"{low} reaches {high}"


def test_only_the_flower_bridge_imports_flwr():
    """flwr is an extra (robustbn[flower]): no module outside robustbn.flower (a module or a
    package) imports it."""
    importers = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                else:
                    continue
                if any(name == "flwr" or name.startswith("flwr.") for name in names):
                    importers.add(_module_name(path, ROOT))
    assert importers and all(m == "robustbn.flower" or m.startswith("robustbn.flower.") for m in importers), importers


def test_the_rule_kit_runs_without_attacks_or_robustbn():
    """What the AST cannot see (an `importlib.import_module("attacks")`): every module of
    aggregators imported and the property kit run on a pipeline, in a fresh interpreter, load
    neither attacks nor robustbn."""
    import subprocess
    import sys

    code = ("import importlib, pkgutil, sys, aggregators\n"
            "for m in pkgutil.iter_modules(aggregators.__path__):\n"
            "    importlib.import_module('aggregators.' + m.name)\n"
            "from aggregators.testing import check\n"
            "assert all(o.status != 'failed' for o in check('nnm+median', f=1, examples=3))\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'attacks', 'robustbn'}))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
