"""`core/__init__.py` is the engine's boundary: the app and the benchmarks import only the
names it exports (docs/api.md), apart from the documented exceptions below; the engine imports
neither the sample models nor the benchmarks; the app imports no benchmark (`remat bench` is
a command bench/ adds through an entry point)."""

from __future__ import annotations

import ast
from pathlib import Path

import core

ROOT = Path(__file__).resolve().parents[2]
# (file, module): internals a benchmark measures itself, documented in docs/architecture.md
EXCEPTIONS = {
    ("bench/solvers.py", "core.solvers"),  # the solvers' inner ILPs and option tables, timed
    ("bench/runtime.py", "core.costs"),  # the measured cost model, calibrated against eager
}


def _imports(folder: str) -> list[tuple[str, str, list[str], int]]:
    """(file, module, names, line) of every import anywhere in `folder`'s Python files."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(rel, a.name, [], node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((rel, node.module, [a.name for a in node.names], node.lineno))
    return found


def test_app_and_bench_import_only_cores_public_names():
    public = set(core.__all__)
    wrong = []
    for folder in ("app", "bench"):
        for rel, module, names, line in _imports(folder):
            if (rel, module) in EXCEPTIONS or not module.startswith("core"):
                continue
            if module != "core":
                wrong.append(f"{rel}:{line} imports {module}")
            wrong += [f"{rel}:{line} imports core.{n}" for n in names if n not in public]
    assert not wrong, "internal names imported past core/__init__.py:\n" + "\n".join(wrong)


def test_the_exceptions_are_still_needed():
    used = {(rel, m) for f in ("app", "bench") for rel, m, _, _ in _imports(f)}
    assert EXCEPTIONS <= used, f"drop the exceptions nothing uses: {EXCEPTIONS - used}"


def test_the_engine_imports_no_sample_models_and_no_bench():
    wrong = [
        f"{rel}:{line} imports {module}"
        for rel, module, _, line in _imports("core")
        if module.split(".")[0] in ("sample_models", "bench", "app")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_app_imports_no_bench():
    wrong = [
        f"{rel}:{line} imports {module}"
        for rel, module, _, line in _imports("app")
        if module.split(".")[0] == "bench"
    ]
    assert not wrong, "\n".join(wrong)


def test_every_public_name_is_documented():
    doc = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in core.__all__ if f"`{n}`" not in doc and f"core.{n}" not in doc]
    assert not missing, f"docs/api.md does not name {missing}"
