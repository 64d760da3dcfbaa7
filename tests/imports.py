"""The package's imports as its source states them, read with `ast` (nothing is imported): what the structure
tests (test_ownership.py, test_structure.py) walk."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "scratchlm"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """`root/a/b.py` -> "scratchlm.a.b" (with root's own name first); a package's `__init__.py` is the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = PACKAGE) -> set[str]:
    """Every module `path` imports: at the top, inside a function or under `TYPE_CHECKING` (each is a
    dependency a reader follows), relative imports resolved against the file's package. `from a import b`
    counts `a` and `a.b`, since `b` may be a module as well as a name of `a`'s."""
    name = module_name(path, root).split(".")
    package = name if path.name == "__init__.py" else name[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def module_file(module: str, root: Path = PACKAGE) -> Path | None:
    """The file of a module of `root` (a package's `__init__.py`), or None for a name that is not one (an
    attribute imported from a module: `from scratchlm.x import name`)."""
    parts = module.split(".")
    if parts[0] != root.name:
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (itself left out)."""
    modules = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    return {
        name: {module for module in imported_modules(path, root) if module in modules and module != name}
        for name, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively): each is a
    set of modules that import each other around a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
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
                    found.append(sorted(component))
    return found
