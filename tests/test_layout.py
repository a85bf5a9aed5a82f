"""The shape of the package: wings whose imports go one way, one seam, private torch names in one wing, the compile
wing reached through its face, one version.

The wings, lowest first (docs/design.md opens with this map): `cache/` <- `generate/` <- `compile/` and `models/`
(with `model_overrides/`) <- `serving/` and `export/` <- `server/` and `bench/`. A module imports its own wing and
those below, never one above; the leaves at the root (`log.py`, and `zoo.py`, the benchmark's and the tests' model
configs, which import nothing of the package, and `_version.py`) are below everything, the package's
`__init__`/`__main__` above. No module imports the package's face (its `__init__`): `__version__` comes from
`_version.py`.

The compile wing has a face: `transformers_flexcache.compile` exports in `__all__` what the other wings use, and no
module outside `compile/` (the package's, `model_overrides/`, the tests of the other wings, `scripts/`) imports one
of the modules behind it.

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
    f"{PACKAGE}._version": 0,
    f"{PACKAGE}.log": 0,
    f"{PACKAGE}.zoo": 0,  # the benchmark's and the tests' model configs: imports nothing of the package
    f"{PACKAGE}.cache": 1,
    f"{PACKAGE}.generate": 2,
    f"{PACKAGE}.compile": 3,
    f"{PACKAGE}.models": 3,
    f"{PACKAGE}.generic": 3,  # the old pickle path of models/generic.py's classes
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
    assert parser["metadata"]["version"] == "attr: transformers_flexcache._version.__version__"
    assert (
        read_configuration(str(REPO_ROOT / "setup.cfg"))["metadata"]["version"] == transformers_flexcache.__version__
    )


COMPILE = f"{PACKAGE}.compile"


def _absolute_imports(path: Path) -> set[str]:
    """The dotted names that the absolute imports of the file at `path` name (`import a.b`, `from a.b import c` gives
    `a.b` and `a.b.c`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def _behind_the_compile_face(names) -> list[str]:
    """The names among `names` that are modules of the compile wing other than its face (`compile/__init__.py`)."""
    modules = _modules()
    return sorted(name for name in names if name.startswith(COMPILE + ".") and name in modules)


def test_no_module_outside_the_compile_wing_imports_one_behind_its_face():
    graph = import_graph()
    behind = sorted(
        f"{module} -> {name}"
        for module, imported in graph.items()
        if not module.startswith(COMPILE + ".") and module != COMPILE
        for name in _behind_the_compile_face(imported)
    )
    # the tests of the other wings and the scripts are users of the package like any other
    outside = [
        path
        for folder in ("tests", "scripts")
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        if not path.is_relative_to(REPO_ROOT / "tests" / "compile")
    ]
    behind += [
        f"{path.relative_to(REPO_ROOT)} -> {name}"
        for path in outside
        for name in _behind_the_compile_face(_absolute_imports(path))
    ]
    assert graph[f"{PACKAGE}.models.modeling"] >= {COMPILE}  # the graph reaches the face
    assert not behind, "import these names from transformers_flexcache.compile (add them to its __all__):\n" + (
        "\n".join(behind)
    )


def test_the_compile_face_gives_every_name_it_lists_and_no_name_is_also_a_module_of_the_wing():
    import importlib

    compile_wing = importlib.import_module(COMPILE)
    assert compile_wing.__all__ and all(getattr(compile_wing, name) is not None for name in compile_wing.__all__)
    # A name that were also a module of the wing would be replaced by the module once the module is imported.
    modules = {name.rpartition(".")[2] for name in _modules() if name.startswith(COMPILE + ".")}
    assert not modules & set(compile_wing.__all__)
    # the package's own public names of the wing come through the face
    for name in ("compile_config_for_cpu", "quantize", "warmup"):
        assert getattr(transformers_flexcache, name) is getattr(compile_wing, name)


def test_the_compile_face_check_finds_an_import_behind_the_face():
    assert _behind_the_compile_face({COMPILE, f"{COMPILE}.compile_config_for_cpu"}) == []
    assert _behind_the_compile_face({f"{COMPILE}.config", f"{COMPILE}.config.FlexCompileConfig"}) == [
        f"{COMPILE}.config"
    ]


def _imports_of_the_package_face(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """The names that `module` (at `path`) imports from the package's face: `import transformers_flexcache`, or a
    name of the root package that is not a module of it (`from .. import __version__`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                target = ".".join([*base[: len(base) - node.level + 1], *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target == PACKAGE:
                found += [alias.name for alias in node.names if f"{PACKAGE}.{alias.name}" not in modules]
    return found


def test_no_module_imports_the_package_s_face():
    modules = _modules()
    found = {
        module: names
        for module, path in modules.items()
        if module not in (PACKAGE, f"{PACKAGE}.__main__")
        for names in [_imports_of_the_package_face(module, path, modules)]
        if names
    }
    assert not found, found


def test_the_face_check_finds_a_module_that_imports_the_package_s_version_from_its_face(tmp_path):
    modules = _modules()
    source = tmp_path / "caching.py"
    source.write_text("from .. import __version__\nfrom .. import zoo\nfrom .._version import __version__\n")
    assert _imports_of_the_package_face(f"{PACKAGE}.compile.caching", source, modules) == ["__version__"]
    source.write_text("import transformers_flexcache\n")
    assert _imports_of_the_package_face(f"{PACKAGE}.compile.caching", source, modules) == [PACKAGE]
