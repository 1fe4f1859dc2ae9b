"""The layout's rules, checked on the code as it is (docs/architecture.md states them).

The layer order is an import-linter contract in pyproject.toml (``make lint``); these tests add
what a layers contract cannot see: cycles between modules of one package, and size limits.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp

PACKAGE = Path(__file__).resolve().parents[1] / "onnx_bisect"
# The repro.py template is a standalone program shipped inside the package; it is long by
# nature (it restates what a user needs without onnx-bisect installed).
LONG_MODULES_ALLOWED = {"repro/template.py"}
STAGES = ("graph", "inputs", "compare", "backends", "engine", "repro", "report", "transforms")
# The engine's rooms (docs/architecture.md); the import-linter contract "engine rooms" orders them.
ENGINE_ROOMS = ("measure", "search", "oracle", "passes", "dataset")


def _cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import cycle among the package's modules, or None; imports inside functions count."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for nxt in sorted(graph.find_modules_directly_imported_by(module)):
            if not nxt.startswith("onnx_bisect."):
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph.modules):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle_between_modules() -> None:
    graph = grimp.build_graph("onnx_bisect", include_external_packages=False)
    # The root package re-exports the API; its imports of its children are not a layer edge.
    for child in graph.find_modules_directly_imported_by("onnx_bisect"):
        graph.remove_import(importer="onnx_bisect", imported=child)
    assert _cycle(graph) is None


def test_stage_subpackages_exist() -> None:
    missing = [s for s in STAGES if not (PACKAGE / s / "__init__.py").is_file()]
    missing += [r for r in ENGINE_ROOMS if not (PACKAGE / "engine" / r / "__init__.py").is_file()]
    assert not missing


def test_modules_and_functions_stay_small() -> None:
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > 600 and rel not in LONG_MODULES_ALLOWED:
            long_modules.append(rel)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = node.body
                if (
                    body
                    and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                ):
                    body = body[1:]  # the docstring does not count
                if body and (node.end_lineno or 0) - body[0].lineno + 1 > 80:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}")
    assert not long_modules
    assert not long_functions


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _table_paths(text: str) -> list[str]:
    """The package paths the Modules table's first column names, relative to the package.

    A cell's first path sets the folder for the bare names after it (`graph/sizes.py`,
    `save.py`); `{a,b}.py` expands; a path ending in `/` stands for everything under it."""
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    paths: list[str] = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split(" | ", 1)[0]
        folder = ""
        for token in re.findall(r"`([^`]+)`", cell):
            if "{" in token:
                head, names, tail = re.fullmatch(r"(.*)\{(.*)\}(.*)", token).groups()  # type: ignore[union-attr]
                expanded = [f"{head}{n}{tail}" for n in names.split(",")]
            else:
                expanded = [token]
            for path in expanded:
                if "/" in path.rstrip("/"):
                    folder = path.rsplit("/", 1)[0] + "/" if not path.endswith("/") else ""
                    paths.append(path)
                else:
                    paths.append(folder + path)
    return paths


def test_architecture_module_table_matches_the_tree() -> None:
    named = _table_paths(ARCHITECTURE.read_text())
    missing = [p for p in named if not (PACKAGE / p).exists()]
    assert not missing, f"architecture.md names modules that do not exist: {missing}"
    folders = [p for p in named if p.endswith("/")]
    files = set(named)
    unlisted = [
        rel
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__init__.py"
        and (rel := path.relative_to(PACKAGE).as_posix()) not in files
        and not any(rel.startswith(folder) for folder in folders)
    ]
    assert not unlisted, f"modules missing from architecture.md's Modules table: {unlisted}"
