"""The package's shape, read from its source: no two modules import each other around a circle, every import
goes down the layers written in docs/architecture.md, and no module or class outgrows what a reader holds at
once (450 and 200 lines)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from imports import PACKAGE, circles, import_graph

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
MODULE_LINES = 450
CLASS_LINES = 200


def doc_layers(text: str) -> dict[str, int]:
    """The table of the "## Layers" section: each top-level name of scratchlm/ (a package, or a module without
    its `.py`) -> its layer's number; the lowest layer is 1."""
    section = re.search(r"^## Layers\s*$(.*?)(?=^## )", text, re.M | re.S)
    assert section, "docs/architecture.md has no '## Layers' section"
    layers: dict[str, int] = {}
    for number, names in re.findall(r"^\| (\d+) \| ([^|]+) \|", section.group(1), re.M):
        for name in re.findall(r"`([^`]+)`", names):
            assert name not in layers, f"{name} stands in two layers"
            layers[name.removesuffix("/").removesuffix(".py")] = int(number)
    return layers


def top(module: str) -> str:
    """The top-level name of a module of the package: scratchlm.run.load -> "run"; the package's face (its
    `__init__.py`) -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_breaks(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Each import from one top-level part to another that does not go to a lower layer."""
    return sorted(
        f"{module} (layer {layers[top(module)]}) -> {target} (layer {layers[top(target)]})"
        for module, targets in graph.items()
        for target in targets
        if top(module) != top(target) and layers[top(target)] >= layers[top(module)]
    )


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return root


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_two_modules_import_each_other_around_a_circle(graph):
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk read the package
    assert circles(graph) == []


def test_every_import_goes_down_the_layers_of_the_architecture_doc(graph):
    layers = doc_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    parts = {top(module) for module in graph}
    assert parts - layers.keys() == set(), "top-level parts of scratchlm/ that the Layers table leaves out"
    assert layers.keys() - parts == set(), "names in the Layers table that scratchlm/ does not have"
    assert layer_breaks(graph, layers) == []


def test_the_walk_finds_a_circle_through_a_function_level_and_a_relative_import(tmp_path):
    root = write_package(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a/__init__.py": "",
            "a/x.py": "from .y import f\n",
            "a/y.py": "def f():\n    from pkg.b import z\n",
            "b/__init__.py": "",
            "b/z.py": "import pkg.a.x\n",
        },
    )
    assert circles(import_graph(root)) == [["pkg.a.x", "pkg.a.y", "pkg.b.z"]]


def test_an_import_up_or_across_a_layer_is_a_break(tmp_path):
    root = write_package(
        tmp_path / "scratchlm",
        {
            "__init__.py": "",
            "low.py": "from scratchlm.high import g\n",
            "high.py": "",
            "mid.py": "import scratchlm.side\n",
            "side.py": "",
        },
    )
    graph = import_graph(root)
    layers = {"__init__": 4, "low": 1, "mid": 2, "side": 2, "high": 3}
    assert layer_breaks(graph, layers) == [
        "scratchlm.low (layer 1) -> scratchlm.high (layer 3)",
        "scratchlm.mid (layer 2) -> scratchlm.side (layer 2)",
    ]


def test_the_layers_table_is_read_as_written():
    text = "## Layers\n\n| layer | names |\n| --- | --- |\n| 1 | `errors.py`, `io.py` |\n| 2 | `run/` |\n\n## Next\n"
    assert doc_layers(text) == {"errors": 1, "io": 1, "run": 2}


def test_no_module_is_longer_than_a_reader_holds():
    lengths = {
        str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert max(lengths.values()) > 200  # the package was read
    assert {name: n for name, n in lengths.items() if n > MODULE_LINES} == {}


def test_no_class_is_longer_than_a_reader_holds():
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > CLASS_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - start + 1
    assert long == {}
