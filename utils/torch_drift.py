"""Every private torch name the package uses, what it is for, and a check that the installed torch still has it.

torch keeps no promise for `torch._...`, `torch.ops.<namespace>._...` or inductor's and dynamo's config names: a
minor release may rename one. Code that reads such a name behind `getattr(..., None)` then silently switches a
feature off (VNNI detection once read `torch._C._cpu._is_vnni_supported`, which torch 2.13 does not have, and
answered "no VNNI" on every CPU). So each name is an entry of `TORCH_NAMES`, `tests/test_torch_drift.py` checks every
entry on the installed torch (it exists, and a function or op still takes the arguments we pass), and a scan of the
package sources (`find_private_uses`) demands an entry for every private name the code spells out, so that a new use
cannot skip the table. It lives outside the runtime package, as `utils/upstream_drift.py` does for transformers.

Kinds of entry:
- `"object"`: a module attribute (`torch._guards.detect_fake_mode`), imported and looked up; `args`, where given, are
  parameter names its signature must have.
- `"op"`: an operator overload (`torch.ops.mkldnn._linear_pointwise.default`); `args`, where given, are its schema's
  argument names, in order (the positional calls in our graph passes depend on it).
- `"config"`: an option of a config module (`torch._inductor.config.freezing`, passed in `compile_config.options`;
  `torch._inductor.config.cpp.enable_kernel_profile`, an option of a nested class).
- `"stamp"`: a name that torch sets (an attribute on tensors, a key of its metrics) and our code reads or removes by
  its string, listed under the function of torch that sets it; `args` are the strings that function's source must
  still spell.

What the scan sees: attribute chains from `torch` (also through `import torch._x as y`, `from torch._x import y` and
an alias of `torch.ops.<namespace>`), and the attribute that `getattr`, `hasattr`, `setattr`, `delattr` or
`mock.patch.object` names by a literal string. A found name is covered by its own entry only (`entry_for`): an
attribute of a listed object needs an entry of its own (it can be renamed alone), except the methods of a plain
Python value (a dict's `get`); an operator packet (`torch.ops.mkl._mkl_linear`) is covered by its listed overload.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
from dataclasses import dataclass

# The top-level packages whose sources are scanned for private torch names.
PACKAGES = ("transformers_flexcache", "model_overrides")
# The torch minors on which every entry below was checked (tests/test_torch_drift.py, run on each): the supported
# window of setup.cfg. torch 2.15.0 renamed or removed none of them (all 47 present, with the arguments we pass).
# The entries added when the scan stopped counting an attribute of a listed name as listed (CompileContext.
# current_compile_id, CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM, cpp.enable_kernel_profile, convert_frame._compile's
# "_compile.compile_inner", the FBGEMM overload's `_op`) were checked on 2.13.0, 2.14.1 and 2.15.0
# (tests/test_torch_drift.py: 65 passed on each, 2026-12-07).
CHECKED_TORCH = ("2.13", "2.14", "2.15")


@dataclass(frozen=True)
class TorchName:
    """One private torch name we use.

    Args:
        kind (`str`): `"object"`, `"op"` or `"config"` (see the module docstring).
        used_for (`str`): what our code does with it, which the failure message repeats.
        args (`tuple[str, ...]`): parameter or schema argument names it must take (empty: not checked).
    """

    kind: str
    used_for: str
    args: tuple[str, ...] = ()


_PASSES = "our inductor graph passes (compile/passes/)"

TORCH_NAMES: dict[str, TorchName] = {
    # --- CPU facts are public (torch.cpu.get_capabilities, torch.backends.cpu.get_cpu_capability): no entry.
    # --- dynamo
    "torch._dynamo.config.recompile_limit": TorchName(
        "config", "graphs dynamo keeps per function: warmup, the engine and serve raise it to their shape count"
    ),
    "torch._dynamo.config.accumulated_recompile_limit": TorchName(
        "config", "the total of those graphs, raised with recompile_limit (serve, bench)"
    ),
    "torch._dynamo.config.patch": TorchName(
        "object", "compile/runtime.py: the bench raises the recompile limits for its run"
    ),
    "torch._functorch._aot_autograd.runtime_wrappers.mark_dynamo_propagated_dynamic_indices": TorchName(
        "stamp",
        "sets the stamp that the compiled encoder takes off its outputs, so that the decode graphs keep fixed sizes "
        "(compile/encoder.py)",
        ("_dynamo_propagated_dynamic_indices",),
    ),
    "torch._dynamo.config.specialize_float": TorchName(
        "config", "the compiled encoder keeps its modules' float attributes constant (no retrace: compile/encoder.py)"
    ),
    "torch._dynamo.exc.FailOnRecompileLimitHit": TorchName("object", "warmup() turns it into a ValueError"),
    "torch._dynamo.mark_static_address": TorchName(
        "object",
        "cache tensors keep static addresses under CUDA graphs (compile/hooks.py, mark_static_addresses)",
        ("t", "guard"),
    ),
    "torch._dynamo.decorators.mark_unbacked": TorchName(
        "object", "the compiled encoder's rows, one graph for one row and more", ("t", "index")
    ),
    "torch._dynamo.eval_frame._stance": TorchName(
        "object",
        "step_guards='first' skips guards only under the default stance (compile/hooks.py, GuardsOfFirstStep)",
    ),
    "torch._dynamo.utils.counters": TorchName("object", "the bench counts graphs compiled"),
    "torch._dynamo.utils.compilation_time_metrics": TorchName("object", "the bench's compile seconds"),
    "torch._dynamo.convert_frame._compile": TorchName(
        "stamp",
        "times each frame's compile under the key that runtime.compile_seconds() sums in compilation_time_metrics",
        ("_compile.compile_inner",),
    ),
    "torch._guards.detect_fake_mode": TorchName("object", f"fake values of new nodes in {_PASSES}", ("inputs",)),
    "torch._guards.CompileContext.current_compile_id": TorchName(
        "object", "gc_heap tells collections during a compile apart (the id is None outside one)"
    ),
    "torch._check": TorchName("object", "shape facts for the compiled encoder's dynamic dimensions", ("cond",)),
    "torch.fx.experimental._config.use_duck_shape": TorchName(
        "config", "the compiled encoder keeps rows and positions distinct symbols"
    ),
    "torch.fx.experimental._config.patch": TorchName("object", "setting use_duck_shape around the encoder's trace"),
    # --- inductor
    "torch._inductor.config.freezing": TorchName("config", "compile_config_for_cpu(): frozen, prepacked weights"),
    "torch._inductor.config.joint_custom_post_pass": TorchName(
        "config",
        "the passes that run before freezing (OneDNNLinears, Int8FbgemmMatmuls, Int8DotProducts, Int8FloatGemms)",
    ),
    "torch._inductor.config.post_grad_custom_post_pass": TorchName(
        "config", "OneRowLinears, Int8DotExpansion, OneQueryAttention after freezing"
    ),
    "torch._inductor.codegen.cpp.CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM": TorchName(
        "object",
        "bench-profile sets it to 0 to end a C++ function after each fused group (runtime.kernel_profile_compile)",
    ),
    "torch._inductor.config.cpp.enable_kernel_profile": TorchName(
        "config", "bench-profile records each C++ kernel in torch's profiler (runtime.kernel_profile_compile)"
    ),
    "torch._inductor.config.cpp.threads": TorchName(
        "config", "a forked artifact build (compile/builds.py) generates code for the parent's thread count"
    ),
    "torch._inductor.config.patch": TorchName("object", "trace-time inductor settings (padding.compile_settings)"),
    "torch._inductor.custom_graph_pass.CustomGraphPass": TorchName("object", f"the base class of {_PASSES}"),
    "torch._inductor.custom_graph_pass.get_hash_for_files": TorchName(
        "object", "each pass's cache key (uuid): the hash of the file that defines it", ("paths", "extra")
    ),
    "torch._inductor.runtime.cache_dir_utils.cache_dir": TorchName("object", "the bench reports inductor's cache"),
    "torch._inductor.codecache.CacheabilityValidator.check_tensor": TorchName(
        "object",
        "compile/fx_cache.py lets the FX graph cache take frozen packed weights (it refuses mkldnn tensors here)",
        ("t",),
    ),
    "torch._inductor.codecache.FxGraphCachePickler._reduce_tensor": TorchName(
        "object",
        "compile/fx_cache.py keys frozen packed weights by their sizes, as other frozen constants",
        ("self", "t"),
    ),
    "torch._inductor.codecache._ident": TorchName(
        "object", "the FX cache key's reducer of frozen constants (fx_cache.py)"
    ),
    "torch._inductor.freezing_utils.is_frozen_param": TorchName(
        "object", "fx_cache.py tells frozen packed weights from other mkldnn tensors", ("t",)
    ),
    "torch._inductor.runtime.cache_dir_utils.temporary_cache_dir": TorchName(
        "object", "compile/caching.py points inductor's on-disk cache at the compile cache entry", ("directory",)
    ),
    "torch._inductor.aoti_compile_and_package": TorchName(
        "object",
        "compile/artifact.py compiles each exported graph of a compiled artifact with AOTInductor",
        ("exported_program", "package_path", "inductor_configs"),
    ),
    "torch.utils._pytree.tree_flatten": TorchName(
        "object",
        "compile/generate_artifact.py describes a generate call's forward kwargs (tensors, values, caches)",
        ("tree",),
    ),
    "torch.utils._pytree.tree_unflatten": TorchName(
        "object", "compile/generate_artifact.py rebuilds the forward's kwargs and outputs", ("leaves", "treespec")
    ),
    "torch.utils._pytree.tree_leaves": TorchName(
        "object", "compile/generate_artifact.py takes the tensors of a model output", ("tree",)
    ),
    "torch._C._aoti.AOTIModelPackageLoader": TorchName(
        "object", "compile/artifact.py loads a compiled artifact's graphs (a dlopen, no compiler probe)"
    ),
    "torch.compiler._cache.CacheArtifactManager.with_fresh_cache": TorchName(
        "object", "compile/caching.py saves the artifacts of one entry's compiles alone"
    ),
    "torch._guards.TracingContext.try_get": TorchName(
        "object", "OneDNNLinears finds the parameters that freezing makes constants (params_flat, fw_metadata)"
    ),
    "torch._inductor.virtualized.V.aot_compilation": TorchName(
        "object", "OneRowLinears tells an AOTInductor compile (the artifacts), whose weights are get_attr constants"
    ),
    "torch._prims_common.make_contiguous_strides_for": TorchName(
        "object", "OneRowLinears stores its input contiguously", ("shape",)
    ),
    # --- operators our passes match or emit
    "torch.ops.mkl._mkl_linear.default": TorchName(
        "op",
        "compile/kernel_choice.py measures MKL's packed linear (as inductor packs it under freezing)",
        ("X", "MKL_W", "ORI_W", "B", "batch_size"),
    ),
    "torch.ops.mkl._mkl_reorder_linear_weight.default": TorchName(
        "op", "compile/kernel_choice.py measures MKL's packed linear (as inductor packs it)", ("X", "batch_size")
    ),
    "torch.ops.mkldnn._reorder_linear_weight.default": TorchName(
        "op", "SharedOneDNNWeights packs a frozen weight for oneDNN", ("self", "batch_size")
    ),
    "torch.ops.mkldnn._linear_pointwise.default": TorchName(
        "op", "OneDNNLinears' oneDNN linear", ("X", "W", "B", "attr", "scalars", "algorithm")
    ),
    "torch.ops.aten.mm.default": TorchName("op", "the fp32 linears OneDNNLinears matches", ("self", "mat2")),
    "torch.ops.aten.addmm.default": TorchName(
        "op", "the fp32 linears with a bias OneDNNLinears matches", ("self", "mat1", "mat2")
    ),
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default": TorchName(
        "op",
        "OneQueryAttention replaces it in decode graphs",
        ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"),
    ),
    "torch.ops.aten._int_mm.default": TorchName(
        "op", "torchao's int8 linears, which the int8 passes match", ("self", "mat2")
    ),
    "torch.ops.aten._unsafe_view.default": TorchName("op", "export rewrites read through views", ("self", "size")),
    "torch.ops.prims.inductor_force_stride_order.default": TorchName(
        "op", "a buffer realized once in OneRowLinears and Int8DotExpansion", ("input", "stride")
    ),
    "torch.ops.prims.convert_element_type.default": TorchName("op", f"dtype casts in {_PASSES}", ("a", "dtype")),
    "torch.ops.quantized.linear_prepack": TorchName("object", "FBGEMM's packed int8 weights (Int8FbgemmMatmuls)"),
    "torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default": TorchName(
        "op", "FBGEMM's int8 GEMM that int8_fbgemm_mm calls", ("X", "X_scale", "X_zero_point", "W_prepack")
    ),
    "torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default._op": TorchName(
        "object",
        "int8_fbgemm_mm calls FBGEMM's linear past the overload's Python __call__ (int8_linears._fbgemm_linear; "
        "without it, through the overload: slower at one row)",
    ),
    # --- other private functions
    "torch._int_mm": TorchName("object", "int8_dot_products' eager kernel"),
    "torch._make_per_tensor_quantized_tensor": TorchName("object", "int8 weights as qint8 for FBGEMM"),
    "torch._C.DisableTorchFunctionSubclass": TorchName(
        "object", "calling FBGEMM's op without a Python dispatch check"
    ),
    "torch.nn.modules.conv._ConvNd": TorchName(
        "object", "quantize() leaves convolutions (Whisper's front end) in float"
    ),
}


def resolve(name: str):
    """The object at dotted `name`: the longest importable module prefix, then attributes (operators through
    `torch.ops`, which loads inductor's `prims` first).

    Raises:
        ImportError: no prefix of `name` is an importable module.
        AttributeError: an attribute after the module is missing.
    """
    if name.startswith("torch.ops."):
        importlib.import_module("torch._inductor.lowering")  # registers inductor's own prims
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(f"no module of {name!r} can be imported")


def _config_module(name: str) -> tuple[str, str]:
    """`(config module, option)` of a config entry: the module is the last `config` or `_config` part, and the option
    may be nested (`torch._inductor.config` and `cpp.enable_kernel_profile`)."""
    parts = name.split(".")
    last = max((i for i, part in enumerate(parts[:-1]) if part in ("config", "_config")), default=len(parts) - 2)
    return ".".join(parts[: last + 1]), ".".join(parts[last + 1 :])


def problem(name: str, entry: TorchName) -> str | None:
    """What is wrong with `name` on the installed torch (missing, or without the arguments we pass), or None."""
    try:
        if entry.kind == "config":
            module, option = _config_module(name)
            config = importlib.import_module(module)
            if option not in getattr(config, "_config", {}) and not hasattr(config, option):
                return f"{module} has no option {option!r}"
            return None
        obj = resolve(name)
    except (ImportError, AttributeError, RuntimeError) as error:
        return f"missing: {type(error).__name__}: {error}"
    if not entry.args:
        return None
    if entry.kind == "stamp":
        source = inspect.getsource(obj)
        missing = [attribute for attribute in entry.args if attribute not in source]
        return f"its source no longer sets {missing}" if missing else None
    if entry.kind == "op":
        found = tuple(argument.name for argument in obj._schema.arguments)
        if found[: len(entry.args)] != entry.args:
            return f"its schema's arguments are {found}, ours assume {entry.args}"
        return None
    try:
        parameters = tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return f"its signature cannot be read, and ours assume the parameters {entry.args}"
    missing = [arg for arg in entry.args if arg not in parameters]
    return f"its parameters are {parameters}, without {missing}" if missing else None


def drift_message(name: str, found: str) -> str:
    entry = TORCH_NAMES[name]
    import torch

    return (
        f"{name} ({entry.kind}) on torch=={torch.__version__}: {found}. We use it for: {entry.used_for}. Find the "
        "name that replaces it (torch's release notes, `git log -S` in pytorch), change our code to read it (guarded "
        "for both supported torch releases), and update TORCH_NAMES (utils/torch_drift.py)"
    )


# --- the scan of our sources ---------------------------------------------------------------------------------------
_PRIVATE = re.compile(r"(^|\.)_[A-Za-z0-9]")


def _source_files() -> list[str]:
    files = []
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        for root in spec.submodule_search_locations or []:
            for folder, _, names in os.walk(root):
                files += [os.path.join(folder, name) for name in sorted(names) if name.endswith(".py")]
    return files


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


# calls that name an attribute of their first argument by a literal string (`getattr(torch._x, "_y", None)`)
_ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr", "patch.object")


def _named_attribute(node: ast.AST) -> str | None:
    """`X.name` of a call that names an attribute by a literal (`_ATTRIBUTE_CALLS`), with X an attribute chain."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return None
    function, (target, attribute) = _dotted(node.func), node.args[:2]
    if function is None or not any(function == call or function.endswith("." + call) for call in _ATTRIBUTE_CALLS):
        return None
    if not (isinstance(attribute, ast.Constant) and isinstance(attribute.value, str)):
        return None
    dotted = _dotted(target)
    return f"{dotted}.{attribute.value}" if dotted else None


def find_private_uses(files: list[str] | None = None) -> dict[str, list[str]]:
    """`{torch name: ["file:line", ...]}` for every private torch name that our sources spell out: attribute chains
    from `torch` with a private part or through `torch.ops`, also through a local alias of `torch.ops.<namespace>`, of
    a private torch module (`import torch._x as y`) or of a name imported from one, `from torch._x import y`, and the
    attributes that `getattr` and its kind name by a literal string. The longest chain is reported."""
    found: dict[str, list[str]] = {}
    for path in files if files is not None else _source_files():
        with open(path) as f:
            tree = ast.parse(f.read())
        aliases = {"torch": "torch"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    aliases[alias.asname or alias.name] = full
                    if _PRIVATE.search(full):
                        found.setdefault(full, []).append(f"{path}:{node.lineno}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name.startswith("torch."):
                        aliases[alias.asname] = alias.name
                        if _PRIVATE.search(alias.name):
                            found.setdefault(alias.name, []).append(f"{path}:{node.lineno}")
            elif isinstance(node, ast.Assign):
                targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for target, value in zip(targets, values, strict=False):
                    dotted = _dotted(value)
                    if isinstance(target, ast.Name) and dotted and dotted.startswith("torch.ops."):
                        aliases[target.id] = dotted
        for node in ast.walk(tree):
            dotted = _dotted(node) if isinstance(node, ast.Attribute) else _named_attribute(node)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            if head not in aliases or (head == "torch" and not rest):
                continue
            full = aliases[head] + ("." + rest if rest else "")
            if (full + ".").startswith("torch.ops.transformers_flexcache."):  # our own operators
                continue
            if full.startswith("torch.ops.") or _PRIVATE.search(full.removeprefix("torch.")):
                found.setdefault(full, []).append(f"{path}:{node.lineno}")
    # keep the longest chains: `torch._dynamo.config.recompile_limit` covers `torch._dynamo.config`
    return {
        name: places
        for name, places in found.items()
        if not any(other != name and other.startswith(name + ".") for other in found)
    }


def entry_for(name: str) -> str | None:
    """The entry of `TORCH_NAMES` that covers a found `name`: itself; for an operator packet, its listed overload
    (`torch.ops.mkl._mkl_linear` is covered by `torch.ops.mkl._mkl_linear.default`); for a method of an entry that is a
    plain Python value, that entry (`compilation_time_metrics.get`, a dict's). Nothing else: an attribute of a listed
    module or class can be renamed alone and needs its own entry (`torch.ops.aten.add.Tensor` and other public aten
    ops need none: `is_public_op`)."""
    if name in TORCH_NAMES:
        return name
    if name.startswith("torch.ops."):
        overloads = [entry for entry in TORCH_NAMES if entry.rpartition(".")[0] == name]
        if overloads:
            return overloads[0]
    owner, _, attribute = name.rpartition(".")
    if owner in TORCH_NAMES and TORCH_NAMES[owner].kind == "object" and not attribute.startswith("_"):
        try:
            value = resolve(owner)
        except (ImportError, AttributeError, RuntimeError):
            return None
        if type(value).__module__ == "builtins" and hasattr(type(value), attribute):
            return owner
    return None


def unlisted(uses: dict[str, list[str]]) -> dict[str, list[str]]:
    """The found private names (`find_private_uses`) that no entry covers, with up to three places each."""
    return {name: places[:3] for name, places in uses.items() if entry_for(name) is None and not is_public_op(name)}


def is_public_op(name: str) -> bool:
    """`torch.ops.aten.<op>.<overload>` with a public op name (`aten.add.Tensor`, `aten.__rshift__.Scalar`): the
    operator library's API."""
    parts = name.split(".")
    if parts[:3] != ["torch", "ops", "aten"] or len(parts) < 4:
        return False
    return not parts[3].startswith("_") or (parts[3].startswith("__") and parts[3].endswith("__"))
