"""Every core dependency in pyproject.toml is imported by the package: an install pulls only
what the code uses (onnx-graphsurgeon was one that nothing imported)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "onnx_bisect"


def core_dependencies() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in project["dependencies"]]


def imported_top_levels(root: Path) -> set[str]:
    """The top-level modules that any module under ``root`` imports, at any depth."""
    found: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def providers() -> dict[str, set[str]]:
    """distribution name (normalized) -> the top-level modules it installs."""
    out: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            out.setdefault(_normal(dist), set()).add(module)
    return out


def test_every_core_dependency_is_imported_by_the_package() -> None:
    deps = core_dependencies()
    assert "onnx" in deps and "numpy" in deps, deps
    imported = imported_top_levels(PACKAGE)
    modules = providers()
    unused = [d for d in deps if not modules.get(_normal(d), set()) & imported]
    assert not unused, f"core dependencies that no module of onnx_bisect imports: {unused}"


def test_the_check_catches_an_unused_dependency(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("import numpy as np\nfrom rich.console import Console\n")
    imported = imported_top_levels(tmp_path)
    modules = providers()
    assert modules["numpy"] & imported and modules["rich"] & imported
    assert not modules["pandas"] & imported
