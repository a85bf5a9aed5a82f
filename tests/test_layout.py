"""The shape of the package: imports go one way, and the package states one version.

Imports are read from the syntax tree of every module, those inside functions included: an import made lazily to get
around a circle is still a circle of ideas.
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

from setuptools.config.setupcfg import read_configuration

import transformers_flexcache

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("transformers_flexcache", "model_overrides")


def _modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of `PACKAGES` (a package by its `__init__.py`)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `node` (in `module`) imports."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            target = ".".join([*base, *([node.module] if node.module else [])])
        else:
            target = node.module or ""
        names = [target, *(f"{target}.{alias.name}" for alias in node.names)]
    else:
        names = [alias.name for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports, anywhere in its source. Imports of a module's own parent
    packages are left out: a package is always imported before its modules."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported |= _imported(module, path, node, modules)
        graph[module] = {name for name in imported if name != module and not module.startswith(name + ".")}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_package_has_no_import_circles_not_even_through_lazy_imports():
    graph = import_graph()
    assert len(graph) > 40 and graph["transformers_flexcache.registry"]  # the graph was read
    assert import_circles(graph) == []


def test_the_circle_finder_finds_a_circle_made_of_lazy_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_the_runtime_package_imports_neither_the_benchmark_nor_the_drift_check():
    for module, imported in import_graph().items():
        # The command line (`__main__`) dispatches to the benchmark's command; nothing else may reach it.
        if not module.startswith(("transformers_flexcache.bench", "transformers_flexcache.__main__")):
            assert not any(name.startswith("transformers_flexcache.bench") for name in imported), module
    assert not (REPO_ROOT / "transformers_flexcache" / "upstream.py").exists()  # utils/upstream_drift.py


def test_setup_cfg_and_the_package_state_one_version():
    parser = configparser.ConfigParser()
    parser.read(REPO_ROOT / "setup.cfg")
    assert parser["metadata"]["version"] == "attr: transformers_flexcache.__version__"
    assert (
        read_configuration(str(REPO_ROOT / "setup.cfg"))["metadata"]["version"] == transformers_flexcache.__version__
    )
