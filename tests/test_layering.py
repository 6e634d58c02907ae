"""The package's layering, read from the source with ``ast``: imports only point down.

Order, bottom to top (docs/architecture.md)::

    core -> sched -> sim -> ops -> forward -> layers -> models -> engine -> server
         -> bench, demo -> cli

An import of a package above the importer's, a circle between modules, or torch under the
torch-free packages fails here, whether the import sits at the top of a file or inside a
function (``ast.walk`` sees both).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridkv"
ORDER = ("core", "sched", "sim", "ops", "forward", "layers", "models", "engine", "server")
RANK = {name: i for i, name in enumerate(ORDER)} | {"bench": 9, "demo": 9, "cli": 10}
TORCH_FREE = ("core", "sched", "sim")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names), relative imports resolved."""
    own = module_name(path).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "hybridkv" and len(parts) > 1 else None


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
IMPORTS = {name: imported_modules(path) for name, path in MODULES.items()}


def test_the_package_root_holds_only_the_map_and_main() -> None:
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]
    assert set(RANK) <= {p.name for p in PACKAGE.iterdir() if p.is_dir()} | {"bench", "demo"}


def test_imports_point_down() -> None:
    upward = [
        f"{module} imports {target}"
        for module, targets in IMPORTS.items()
        for target in targets
        if (src := layer_of(module)) in RANK
        and (dst := layer_of(target)) in RANK
        and RANK[dst] > RANK[src]
    ]
    assert upward == []


def test_torch_free_packages_never_import_torch() -> None:
    torchy = [
        module
        for module, targets in IMPORTS.items()
        if layer_of(module) in TORCH_FREE and any(t.split(".")[0] == "torch" for t in targets)
    ]
    assert torchy == []


def test_no_module_imports_itself_through_others() -> None:
    """No circles. A package ``__init__`` that re-exports its modules is its face, not a node."""
    graph = {
        name: {t for t in targets if t in MODULES and MODULES[t].name != "__init__.py"}
        for name, targets in IMPORTS.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if target == module:
                continue
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []
