"""The compiled path's settings: `compile_config_for_cpu()` for a fast decode step on CPU, and `compile_settings`.

Design decisions:
- One option, in upstream's own terms: `compile_config_for_cpu()` returns a `transformers.CompileConfig`, which
  `generate(compile_config=...)` already takes for every cache (upstream's static cache too, so a comparison is
  fair). Compiling is a property of the call, not of the cache: it does not belong in `cache_config`.
- Its settings were measured on the benchmark's models (docs/performance.md): inductor with `freezing=True` (weights
  become constants of the graph, so linear layers run prepacked oneDNN/MKL kernels and their layout conversions are
  folded away) and `dynamic=False` (a graph per shape, which the fixed-shape policies bound; a dynamic graph would
  give up the static sizes that make the kernels fast). `fullgraph=True`: a graph break would be a silent slow path.
  `_compile_all_devices`: upstream's generate compiles on accelerators only unless told. The frozen fp32 linears run
  oneDNN's kernels where MKL has no fast path (CPUs other than Intel's; `compile/passes/fp32_linears.py`; what that
  gains: docs/compile.md).
- Freezing needs gradients off while compiling, which upstream's `generate` guarantees (`torch.no_grad`), and it must
  be on while dynamo *traces*: dynamo decides then whether parameters become graph constants, reading inductor's
  global `freezing` (torch==2.13.0: `torch._dynamo.utils.is_parameter_freezing`), and `torch.compile(options=...)`
  only reaches inductor afterwards. So `options={"freezing": True}` alone is silently ignored (measured: the graph
  kept `aten.mm` on parameter inputs). `compile_settings` sets it for the duration of each flexible fixed-shape
  `generate` call whose `compile_config` asks for it (`hooks.CompileHooks.call_context`), and puts the previous
  value back.
  Graphs keep what they were compiled with, so later calls reuse them. What freezing costs: weights changed after a
  graph was compiled are not seen by it (the graph holds its own constants), and the prepacked copies take memory
  beside the model's parameters.
- `FlexCompileConfig` is upstream's `CompileConfig` plus what a flexible call's plug-ins read (`compile_encoder`,
  `step_guards`); `compile_settings` puts the inductor settings that dynamo reads while tracing in force around a
  call (`hooks.CompileHooks.call_context`), and with freezing lets inductor's FX graph cache take frozen graphs
  (`fx_cache.packed_weights_cacheable`), so that a second process loads what a first one compiled.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import CompileConfig

from .cpu import inductor_vector_bits
from .fx_cache import packed_weights_cacheable
from .passes import (
    Int8DotExpansion,
    Int8DotProducts,
    Int8FbgemmMatmuls,
    Int8FloatGemms,
    OneDNNLinears,
    OneQueryAttention,
    OneRowLinears,
    measured_linear_plan,
    resolve_decode_attention,
    resolve_int8_linears,
    resolve_linear_kernels,
    resolve_one_row_linears,
)

# Inductor settings of `compile_config_for_cpu`, measured (docs/compile.md, "Compiling `generate`").
CPU_INDUCTOR_OPTIONS = {"freezing": True}

# Inductor settings that dynamo reads while tracing, so that `torch.compile(options=...)` comes too late for them.
TRACE_TIME_OPTIONS = ("freezing",)
STEP_GUARDS = ("first", "every")

__all__ = ["FlexCompileConfig", "compile_config_for_cpu", "compile_settings"]


class FlexCompileConfig(CompileConfig):
    """Upstream's `CompileConfig`, whose `generate` compiles the decode step, plus `compile_encoder`: under a
    fixed-shape policy, compile the token encoder of an encoder-decoder call too, with dynamic shapes; and
    `step_guards`: `"first"` (a flexible call's compiled decode steps check dynamo's guards in full at the call's
    first step only, `hooks.GuardsOfFirstStep`) or `"every"` (at every step, as upstream's generate does).

    Neither is one of `torch.compile`'s arguments: they are kept out of `to_dict()` (which upstream passes to
    `torch.compile`) and out of equality (the decode graphs do not depend on them).

    Raises:
        ValueError: `step_guards` is not `"first"` or `"every"`.
    """

    def __init__(self, *args, compile_encoder: bool = True, step_guards: str = "first", **kwargs):
        if step_guards not in STEP_GUARDS:
            raise ValueError(f"step_guards={step_guards!r} is not one of {STEP_GUARDS}")
        super().__init__(*args, **kwargs)
        self.compile_encoder = compile_encoder
        self.step_guards = step_guards

    def to_dict(self) -> dict:
        arguments = super().to_dict()
        arguments.pop("compile_encoder", None)
        arguments.pop("step_guards", None)
        return arguments


@contextlib.contextmanager
def compile_settings(compile_config: CompileConfig | None):
    """Within this context, the inductor settings of `compile_config.options` that dynamo reads while tracing
    (`TRACE_TIME_OPTIONS`) are in force, as the config asks; the previous values are restored afterwards.

    It patches a global of inductor for the duration: compile (`compile.warming.warmup()`) before calls run in several
    threads.
    """
    options = getattr(compile_config, "options", None) or {}
    patch = {name: options[name] for name in TRACE_TIME_OPTIONS if name in options}
    if not patch:
        yield
        return
    # frozen graphs hold packed weights, which inductor's FX graph cache then takes (compile/fx_cache.py)
    cacheable = packed_weights_cacheable() if patch.get("freezing") else contextlib.nullcontext()
    with torch._inductor.config.patch(patch), cacheable:
        yield


def compile_config_for_cpu(
    *,
    fullgraph: bool = True,
    linear_kernels: str = "auto",
    one_row_linears: str = "auto",
    int8_linears: str = "auto",
    decode_attention: str = "auto",
    encoder: bool = True,
    step_guards: str = "first",
    **options,
) -> CompileConfig:
    """A `CompileConfig` that compiles generate's decode step for speed on CPU.

    Args:
        fullgraph (`bool`, *optional*, defaults to `True`): fail on a graph break instead of running a slow path.
        linear_kernels (`str`, *optional*, defaults to `"auto"`): the kernels of the frozen fp32 linear layers:
            `"mkl"` (inductor's own choice), `"onednn"`, or `"auto"`: with `one_row_linears="auto"` too, the kernel
            measured fastest on this CPU for each linear's rows and shape (`compile.kernel_choice`: measured once a
            CPU before the graphs of those rows compile, kept on disk), and where a shape is not measured the rule:
            MKL on Intel CPUs, oneDNN on the others (as CTranslate2 chooses). oneDNN is set as an inductor pass
            (`OneDNNLinears`).
        one_row_linears (`str`, *optional*, defaults to `"auto"`): the frozen fp32 linears of a graph of one row (a
            decode step at batch 1): `"inductor"` (a dot product per output that inductor generates, reading the
            weight once: `OneRowLinears`), `"library"` (the `linear_kernels` above), or `"auto"`: inductor's where
            the CPU is not Intel's (faster there than either library: docs/compile.md), or this CPU's measured
            choice as for `linear_kernels="auto"`.
        int8_linears (`str`, *optional*, defaults to `"auto"`): the int8 matrix multiplies of a model quantized with
            `quantize(model, "int8")`: `"fbgemm"` (FBGEMM's int8 GEMMs, exact on 7-bit weights, 8-bit with VNNI:
            `Int8FbgemmMatmuls`; decode steps of 1-2 rows as inductor's dot products, but their output layer),
            `"inductor"` (in graphs of at most 8 rows, decode steps, dot products that inductor generates:
            `Int8DotProducts`; in graphs of dynamic rows, the compiled encoder and projections, float32 GEMMs of
            the integers up to 128 positions a call: `Int8FloatGemms`; both exact), `"library"` (oneDNN's int8
            kernels), or `"auto"`: FBGEMM's wherever torch has FBGEMM (x86 builds) and the CPU has no AMX; without
            FBGEMM inductor's where the CPU has no VNNI, else the library's; on AMX CPUs the library's
            (docs/compile.md, "Routes per CPU").
        decode_attention (`str`, *optional*, defaults to `"auto"`): the attention of a decode step (one query
            position, float32): `"inductor"` (written as products, sums and softmax that inductor generates and fuses:
            `compile.passes.decode_attention.OneQueryAttention`), `"library"` (torch's flash attention kernel, one call
            per attention, whose fixed cost is most of its time at one query), or `"auto"`: inductor's.
        encoder (`bool`, *optional*, defaults to `True`): under a padded or bucketed `flexible_static` policy (and in
            the serving engine), compile an encoder-decoder call's token encoder too, with dynamic shapes
            (`compile/encoder.py`); upstream's generate runs it eagerly.
        step_guards (`str`, *optional*, defaults to `"first"`): `"first"`: a flexible call's compiled decode steps
            check dynamo's guards in full at the call's first step, the later steps only those that tell its graphs
            apart (`compile.hooks.GuardsOfFirstStep`: thousands of guards less a step); `"every"`: every guard at
            every step, as upstream's generate.
        **options: inductor settings added to (or replacing) `CPU_INDUCTOR_OPTIONS`, e.g. `cpp_wrapper=True`.

    Returns:
        `FlexCompileConfig` (upstream's `CompileConfig` with `compile_encoder`): inductor, `dynamic=False`, the options
        above; compiling on CPU enabled.

    Raises:
        ValueError: `linear_kernels` is not one of `"auto"`, `"onednn"`, `"mkl"`, `one_row_linears` or
            `decode_attention` not one of `"auto"`, `"inductor"`, `"library"`, `int8_linears` not one of `"auto"`,
            `"fbgemm"`, `"inductor"`, `"library"`, or `step_guards` not one of `"first"`, `"every"`.

    Example:

    ```python
    >>> out = model.generate(
    ...     **inputs,
    ...     cache_implementation="flexible_static",
    ...     cache_config={"shape_policy": "bucketed", "max_batch_size": 8, "max_cache_len": 64, "max_encoder_len": 64},
    ...     compile_config=compile_config_for_cpu(),
    ... )
    ```
    """
    joint_passes, passes = [], []  # before freezing; after it
    kernel_options = {}
    int8_kernels = resolve_int8_linears(int8_linears)
    if int8_kernels == "fbgemm":  # before freezing, which would make them oneDNN's; one row: dot products
        joint_passes += [Int8FbgemmMatmuls(), Int8DotProducts()]
        passes.append(Int8DotExpansion())
    elif int8_kernels == "inductor":  # marked before freezing, expanded after
        joint_passes += [Int8DotProducts(), Int8FloatGemms()]
        passes.append(Int8DotExpansion())
    plan = measured_linear_plan(linear_kernels, one_row_linears)
    if plan is not None:  # "auto": each linear on this CPU's measured kernel for its shape, else the rule by vendor
        joint_passes += [OneRowLinears(plan), OneDNNLinears(plan=plan)]
    else:
        one_row = resolve_one_row_linears(one_row_linears) == "inductor"
        if one_row:
            joint_passes.append(OneRowLinears())
        if resolve_linear_kernels(linear_kernels) == "onednn":  # one-row linears left to OneRowLinears where it runs
            joint_passes.append(OneDNNLinears(one_row=not one_row))
    if resolve_decode_attention(decode_attention) == "inductor":
        passes.append(OneQueryAttention())
    # a process whose ATEN_CPU_CAPABILITY caps inductor's vectors: the width pinned, so that inductor's FX graph cache
    # keys its graphs apart (`cpu.inductor_vector_bits`)
    vector_bits = inductor_vector_bits()
    vector_options = {} if vector_bits is None else {"cpp.simdlen": vector_bits}
    if joint_passes:
        kernel_options["joint_custom_post_pass"] = tuple(joint_passes)
    if passes:
        kernel_options["post_grad_custom_post_pass"] = tuple(passes)
    config = FlexCompileConfig(
        compile_encoder=encoder,
        step_guards=step_guards,
        fullgraph=fullgraph,
        dynamic=False,
        backend="inductor",
        mode=None,  # torch.compile takes a mode or options, not both
        options={**CPU_INDUCTOR_OPTIONS, **vector_options, **kernel_options, **options},
    )
    config._compile_all_devices = True  # upstream's generate compiles on CPU only when told to
    return config
