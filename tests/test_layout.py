"""The shape of the package: wings whose imports go one way, one seam, private torch names in one wing, one version.

The wings, lowest first (docs/design.md opens with this map): `cache/` <- `generate/` <- `compile/` and `models/`
(with `model_overrides/`) <- `serving/` and `export/` <- `server/` and `bench/`. A module imports its own wing and
those below, never one above; the leaves at the root (`log.py`, and `zoo.py`, the benchmark's and the tests' model
configs, which import nothing of the package) are below everything, the package's `__init__`/`__main__` above.

Imports are read from the syntax tree of every module, those inside functions included: an import made lazily to get
around a circle is still a circle of ideas.
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

from setuptools.config.setupcfg import read_configuration

import transformers_flexcache
from utils import torch_drift

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


# Each wing's level: a module may import modules of its level or below.
PACKAGE = "transformers_flexcache"
WING_LEVELS = {
    f"{PACKAGE}.log": 0,
    f"{PACKAGE}.zoo": 0,  # the benchmark's and the tests' model configs: imports nothing of the package
    f"{PACKAGE}.cache": 1,
    f"{PACKAGE}.generate": 2,
    f"{PACKAGE}.compile": 3,
    f"{PACKAGE}.models": 3,
    f"{PACKAGE}.generic": 3,  # the pickle path of models/generic.py's classes
    f"{PACKAGE}.saved": 3,  # the entry point of saved folders (models)
    "model_overrides": 3,
    f"{PACKAGE}.serving": 4,
    f"{PACKAGE}.export": 4,
    f"{PACKAGE}.server": 5,
    f"{PACKAGE}.bench": 5,
    PACKAGE: 6,  # the package's own __init__ (its public names) and __main__ (the command line)
    f"{PACKAGE}.__main__": 6,
}
MAX_ROOT_MODULES = 8  # besides __init__ and __main__


def wing_of(module: str) -> str:
    """The longest key of `WING_LEVELS` that `module` is or lies in."""
    return max((wing for wing in WING_LEVELS if module == wing or module.startswith(wing + ".")), key=len)


def test_the_package_has_no_import_circles_not_even_through_lazy_imports():
    graph = import_graph()
    assert len(graph) > 40 and graph[f"{PACKAGE}.models.registry"]  # the graph was read
    assert import_circles(graph) == []


def test_no_wing_imports_a_wing_above_it():
    upward = sorted(
        f"{module} -> {name}"
        for module, imported in import_graph().items()
        for name in imported
        if WING_LEVELS[wing_of(name)] > WING_LEVELS[wing_of(module)]
    )
    assert not upward, "imports from a lower wing up (move the code, or ask through generate/hooks.py):\n" + "\n".join(
        upward
    )


def test_the_wing_map_knows_every_module_and_the_root_holds_at_most_eight():
    modules = [module for module in import_graph() if module.startswith(PACKAGE)]
    assert all(wing_of(module) for module in modules)
    root = sorted(path.stem for path in (REPO_ROOT / PACKAGE).glob("*.py"))
    assert len([name for name in root if name not in ("__init__", "__main__")]) <= MAX_ROOT_MODULES, root


def test_private_torch_names_are_used_in_the_compile_wing_only_and_export_s_lowering():
    allowed = (str(REPO_ROOT / PACKAGE / "compile") + "/", str(REPO_ROOT / PACKAGE / "export") + "/")
    outside = {
        name: [place for place in places if not place.startswith(allowed)]
        for name, places in torch_drift.find_private_uses().items()
        if not torch_drift.is_public_op(name)
    }
    outside = {name: places for name, places in outside.items() if places}
    assert not outside, f"private torch names outside compile/ (ask compile/runtime.py or compile/hooks.py): {outside}"


def test_generate_models_and_overrides_know_nothing_of_serving():
    folders = [REPO_ROOT / PACKAGE / "generate", REPO_ROOT / PACKAGE / "models", REPO_ROOT / "model_overrides"]
    found = [
        f"{path.relative_to(REPO_ROOT)}: {word}"
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
        for word in ("serving_request", "RequestSeats", "from ..serving", "transformers_flexcache.serving")
        if word in path.read_text(encoding="utf-8")
    ]
    assert not found, found


def test_the_wing_checks_find_an_upward_import(tmp_path, monkeypatch):
    # A cache module that imported generate would be an arrow up: the check sees it.
    graph = {f"{PACKAGE}.cache.layers": {f"{PACKAGE}.generate.plan"}, f"{PACKAGE}.generate.plan": set()}
    upward = [
        (module, name)
        for module, imported in graph.items()
        for name in imported
        if WING_LEVELS[wing_of(name)] > WING_LEVELS[wing_of(module)]
    ]
    assert upward == [(f"{PACKAGE}.cache.layers", f"{PACKAGE}.generate.plan")]


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
