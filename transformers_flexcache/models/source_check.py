"""Which cache internals a piece of model code reads: the one check behind the override rule and the generic route.

Models may reach a cache only through its public methods (`update`, `get_seq_length`, `get_mask_sizes`, `get_kv`,
`cross_attention_kv`, the linear-attention state accessors, ...). Two places ask whether code keeps to that:
`tests/models/test_no_cache_internals.py` for our own overrides, and `generic.py` for upstream model code that is to run on
the flexible cache without any override. Both read the syntax tree, so docstrings and comments never count, and decide
precisely:
- `.is_updated`, `.key_cache`, `.value_cache`, `.conv_states`, `.ssm_states`, `.recurrent_states`, and any
  private `_..._storage` attribute: always internal.
- `.keys` / `.values`: internal unless called with no arguments (`mapping.keys()`, `dict.values()`), which no cache
  layer offers: a layer's keys and values are tensor attributes; or read from the result of a torch reduction that
  returns `(values, indices)` (`x.max(dim=-1).values`, `torch.cummax(x, dim=1).values`).
- `.layers`, and any private `._name`: internal on an expression that names a cache (`cache.layers`,
  `past_key_values.layers`, `curr_cache.layers`, `cache.cross_attention_cache._x`); a model's own `self.layers` (its
  decoder layers) and `self._private_method` are not a cache's.
- `getattr(obj, "<any of these names>")`: the same reads, spelled as strings.

`model_code(upstream_class)` finds the code a model runs: the methods of the class and of its bases defined in
`transformers.models`, and, transitively, the classes and functions of `transformers.models` that this code names
(its submodules, their helpers), so that an attention class built by a decoder layer is read too.

It reads the model's own code behind the wrappers of `kernels` (`original_code`), deliberately. transformers' kernel
decorators wrap whenever `kernels` is installed, and from transformers 5.25 it always is (a hard dependency):
`use_kernelized_func` replaces a class's `__init__` with a function of `kernels` and its `forward` with one that
`functools.wraps` it, and `use_kernel_forward_from_hub` turns a function (`apply_rotary_pos_emb`, Jamba's
`causal_conv1d_forward` and `mamba_scan_forward`, which read the cache) into an instance of an `nn.Module` class of
`kernels`. Read as they are, the check would see `kernels`' source instead of the model's, and would not follow the
functions at all (an instance is neither a class nor a function): a cache read moved into one would go unseen.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

ALWAYS_INTERNAL = {
    "is_updated",
    "key_cache",
    "value_cache",
    "conv_states",
    "ssm_states",
    "recurrent_states",
}
PRIVATE_STORAGE = re.compile(r"^_\w*storage\w*$")
CALLABLE_ON_DICTS = {"keys", "values"}
# torch functions and methods that return a `(values, indices)` named tuple.
VALUES_INDICES_REDUCTIONS = {
    "max",
    "min",
    "sort",
    "topk",
    "cummax",
    "cummin",
    "median",
    "nanmedian",
    "mode",
    "kthvalue",
}
# An expression that names a cache: `cache`, `x.cross_attention_cache`, `self_attention_cache`, `past_key_values`.
CACHE_RECEIVER = re.compile(r"(?:^|[._])cache$|past_key_values?$")
# Where upstream's model code lives: what `model_code` follows.
MODEL_CODE_PACKAGE = "transformers.models."


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _internal_attribute(node: ast.Attribute, parent: ast.AST | None) -> str | None:
    """Why reading `node` is a cache internal, or None."""
    name = node.attr
    if name in ALWAYS_INTERNAL or PRIVATE_STORAGE.match(name):
        return f".{name}"
    if name in CALLABLE_ON_DICTS:
        called_bare = isinstance(parent, ast.Call) and parent.func is node and not parent.args and not parent.keywords
        return None if called_bare or _is_reduction_result(node.value) else f".{name} (not a `.{name}()` dict call)"
    receiver = ast.unparse(node.value)
    if (name == "layers" or _is_private(name)) and CACHE_RECEIVER.search(receiver):
        return f".{name} of {receiver}"
    return None


def _is_reduction_result(node: ast.AST) -> bool:
    # `x.max(dim=-1)`, `torch.cummax(x, dim=1)`: a call of a function that returns `(values, indices)`
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name in VALUES_INDICES_REDUCTIONS


def _internal_getattr(node: ast.Call) -> str | None:
    is_getattr = isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2
    name = node.args[1].value if is_getattr and isinstance(node.args[1], ast.Constant) else None
    if not isinstance(name, str):
        return None
    if name in ALWAYS_INTERNAL | CALLABLE_ON_DICTS or PRIVATE_STORAGE.match(name):
        return f'getattr(..., "{name}")'
    if (name == "layers" or _is_private(name)) and CACHE_RECEIVER.search(ast.unparse(node.args[0])):
        return f'getattr({ast.unparse(node.args[0])}, "{name}")'
    return None


def _reads(tree: ast.AST) -> list[tuple[int, str, str]]:
    # -> (line, code, why) for every read of a cache internal in `tree`
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            why = _internal_attribute(node, parents.get(node))
        elif isinstance(node, ast.Call):
            why = _internal_getattr(node)
        else:
            why = None
        if why:
            found.append((node.lineno, ast.unparse(node), why))
    return sorted(found)


def cache_internal_reads(source: str) -> list[str]:
    """Every read of a cache internal in `source`, as "line N: <code> (<why>)"."""
    return [f"line {line}: {code} ({why})" for line, code, why in _reads(ast.parse(source))]


@dataclass(frozen=True)
class CacheRead:
    """One read of a cache internal in upstream model code: where it is, and what it reads."""

    function: str  # qualified name, e.g. "transformers.models.gpt2.modeling_gpt2.GPT2Attention.forward"
    path: str  # the file that defines it, from the package root: "transformers/models/gpt2/modeling_gpt2.py"
    line: int
    code: str  # the expression, e.g. "curr_cache.layers[self.layer_idx].keys"
    why: str  # which rule it breaks, e.g. ".keys (not a `.keys()` dict call)"

    @property
    def short_name(self) -> str:
        """The function without its module: `GPT2Attention.forward`."""
        module = self.path.removesuffix(".py").replace("/", ".")
        return self.function.removeprefix(module + ".")

    def describe(self) -> str:
        return f"{self.short_name} ({self.path}, line {self.line}) reads `{self.code}` ({self.why})"


# What `kernels` (0.19) keeps the wrapped code in: the closure variable of its wrapper functions that holds it.
KERNELS_PACKAGE = "kernels"
KERNELS_WRAPPED = ("orig_init", "orig_forward", "func")


def _from_kernels(obj) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == KERNELS_PACKAGE or module.startswith(KERNELS_PACKAGE + ".")


def _closure(function: Callable) -> dict:
    cells = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return cells


def original_code(obj):
    """The model's own function or class behind the wrappers of `kernels` (module docstring): the function that a
    `use_kernelized_func` `__init__` or `forward` wraps, or that a `use_kernel_forward_from_hub` module instance calls.
    Anything else is returned as it is (a function unwrapped of `functools.wraps` layers)."""
    forward = getattr(type(obj), "forward", None)
    if (
        not (inspect.isfunction(obj) or inspect.isclass(obj))
        and inspect.isfunction(forward)
        and _from_kernels(forward)
    ):
        obj = forward  # a function made a module (its class named after the function's module): forward calls it
    while inspect.isfunction(obj) and _from_kernels(obj):
        wrapped = next((value for name, value in _closure(obj).items() if name in KERNELS_WRAPPED), None)
        if wrapped is None:
            break
        obj = wrapped
    return inspect.unwrap(obj) if inspect.isfunction(obj) else obj


def _functions_of(cls: type) -> list[tuple[str, Callable]]:
    # (qualified name, function) of the methods, static/class methods and properties that `cls` itself defines
    found = []
    for name, value in vars(cls).items():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        value = original_code(value) if inspect.isfunction(value) else None
        # Code of `kernels` left on a model class (`kernel_condition`, set by `use_kernel_forward_from_hub`) is not
        # the model's.
        if value is not None and not _from_kernels(value):
            found.append((f"{cls.__module__}.{cls.__qualname__}.{name}", value))
    return found


def _is_model_code(obj) -> bool:
    return (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "").startswith(
        MODEL_CODE_PACKAGE
    )


def _named_model_code(function: Callable, tree: ast.AST) -> list:
    # The classes and functions of transformers.models that `function`'s code names (directly, or in a module-level
    # dict, list or tuple of them: a decoder layer chosen by layer type).
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named = []
    for name in names:
        obj = function.__globals__.get(name)
        candidates = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else [obj]
        named.extend(original_code(candidate) for candidate in candidates if _is_model_code(original_code(candidate)))
    return named


def model_code(upstream_class: type) -> list[tuple[str, Callable, ast.AST, int]]:
    """The functions of `transformers.models` that `upstream_class` runs (module docstring): `(qualified name,
    function, syntax tree, first line)` for each, in the order found.

    A class is followed through its bases and the names its methods use; names that its methods do not use (a
    submodule class chosen by a config string resolved elsewhere) are not found.
    """
    found, seen, queue = [], set(), [upstream_class]
    while queue:
        obj = queue.pop(0)
        if obj in seen:
            continue
        seen.add(obj)
        if inspect.isclass(obj):
            queue.extend(base for base in obj.__mro__ if _is_model_code(base))
            functions = _functions_of(obj) if _is_model_code(obj) else []
        else:
            functions = [(f"{obj.__module__}.{obj.__qualname__}", obj)]
        for qualname, function in functions:
            function = original_code(function)
            try:
                lines, first_line = inspect.getsourcelines(function)
            except (OSError, TypeError):  # no source (builtins, generated code): nothing to read
                continue
            tree = ast.parse(textwrap.dedent("".join(lines)))
            found.append((qualname, function, tree, first_line))
            queue.extend(_named_model_code(function, tree))
    return found


def upstream_cache_reads(upstream_class: type) -> list[CacheRead]:
    """Every read of a cache internal in the code that `upstream_class` runs (see `model_code`)."""
    reads = []
    for qualname, function, tree, first_line in model_code(upstream_class):
        path = _package_path(inspect.getsourcefile(function) or "")
        reads.extend(CacheRead(qualname, path, first_line + line - 1, code, why) for line, code, why in _reads(tree))
    return reads


def _package_path(path: str) -> str:
    # ".../site-packages/transformers/models/gpt2/modeling_gpt2.py" -> "transformers/models/gpt2/modeling_gpt2.py"
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[parts.index("transformers") :]) if "transformers" in parts else path
