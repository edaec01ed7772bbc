"""The engine's imports run one way: trace -> graph -> blocks -> simulator -> problem ->
schedule -> solvers -> runtime. No module of `core/` imports, directly or through others, a
module that imports it back, and none hides an import inside a function to dodge a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

CORE = Path(__file__).resolve().parents[2] / "core"


def _module(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in sorted(CORE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path], where: str) -> set[str]:
    """The core modules `path` imports: anywhere (`where="all"`: module level, under `if
    TYPE_CHECKING`, inside functions) or inside functions only (`"functions"`)."""
    tree = ast.parse(path.read_text())
    if where == "all":
        nodes = list(ast.walk(tree))
    else:
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        nodes = [x for f in functions for x in ast.walk(f)]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against this module's package
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}"
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from core import costs`
    return {m for m in found if m in modules and m != name}


def test_core_import_graph_has_no_cycle():
    """Every import counts, lazy and type-only ones included: hiding an import inside a
    function or under TYPE_CHECKING does not make a cycle go away."""
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for dep in _imports(name, path, modules, "all"):
            if dep != "core" and not name.startswith(dep + "."):  # a package's own __init__
                graph.add_edge(name, dep)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles in core/: {cycles}"


def test_no_function_level_imports_of_core():
    """No exceptions: the command line and the benchmarks, which import lazily on purpose
    (start-up time, optional extras), live outside `core/` (app/cli.py, bench/)."""
    modules = _modules()
    hidden = {
        name: sorted(_imports(name, path, modules, "functions")) for name, path in modules.items()
    }
    assert not {k: v for k, v in hidden.items() if v}


@pytest.mark.slow
def test_each_module_imports_alone():
    """Each module imported first, with every `core` module forgotten before it, in one fresh
    interpreter (torch stays loaded: importing it per module would cost seconds each): a
    cycle that only breaks in some import orders fails here."""
    code = (
        "import importlib, sys\n"
        f"for name in {sorted(_modules())!r}:\n"
        "    for m in [m for m in sys.modules if m == 'core' or m.startswith('core.')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=CORE.parent, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
