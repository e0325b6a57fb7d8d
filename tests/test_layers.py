"""The package's layering, read from the source: a package imports (at module level) only from
its own layer or the ones below, so each layer can be read, tested and reused without the ones
above it; and config/ imports no torch code (a recipe parses and checks without torch, and
engine, actor and workers take their settings from it). A function-level import of a registry
(config checking a name against the registered ones, which users extend) is the one way up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "fastdraft"
LAYERS = [{"errors"}, {"utils"}, {"config"}, {"models", "kernels"},
          {"databuffer", "checkpoint", "observability"}, {"engine", "drafter"},
          {"algo", "data", "export"}, {"bootstrap"}, {"actor"}, {"trainer"}, {"cluster"},
          {"workers"}, {"backends"}, {"run"}, {"bench", "demo", "cli", "__init__"}]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def module_level_imports(path: Path) -> list[str]:
    """The modules `path` imports when it is imported: not inside a function, not under
    `if TYPE_CHECKING:`."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.dump(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append(child.module)
            elif isinstance(child, ast.Import):
                found.extend(alias.name for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _package(path: Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def test_every_package_has_a_layer():
    assert {_package(p) for p in ROOT.rglob("*.py")} == set(LAYER)


def test_no_package_imports_from_a_layer_above_it():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        here = _package(path)
        for module in module_level_imports(path):
            parts = module.split(".")
            if parts[0] == "fastdraft" and len(parts) > 1 and LAYER[parts[1]] > LAYER[here]:
                upward.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not upward, "\n".join(upward)


def _module_files(module: str) -> list[Path]:
    """The file of `module` and its packages' __init__.py below `fastdraft` itself (importing
    a module runs them all)."""
    parts = module.split(".")
    files = [ROOT.parent.joinpath(*parts[:k], "__init__.py") for k in range(2, len(parts))]
    path = ROOT.parent.joinpath(*parts)
    return [*files, path / "__init__.py" if path.is_dir() else path.with_suffix(".py")]


@pytest.mark.parametrize("path", sorted((ROOT / "config").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_config_imports_no_torch_code(path):
    """config's modules and everything of fastdraft they import, transitively (the
    `fastdraft` package's own __init__, the public API, aside)."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for module in module_level_imports(current):
            assert module.split(".")[0] not in ("torch", "numpy", "safetensors"), (
                f"{current.relative_to(ROOT.parent)} imports {module}")
            if module.startswith("fastdraft."):
                todo.extend(_module_files(module))
