"""The compiled path: `compile_config_for_cpu()` for a fast decode step on CPU; `warmup()` compiles before serving.

Design decisions:
- One option, in upstream's own terms: `compile_config_for_cpu()` returns a `transformers.CompileConfig`, which
  `generate(compile_config=...)` already takes for every cache (upstream's static cache too, so a comparison is
  fair). Compiling is a property of the call, not of the cache: it does not belong in `cache_config`.
- Its settings were measured on the benchmark's models (docs/performance.md): inductor with `freezing=True` (weights
  become constants of the graph, so linear layers run prepacked oneDNN/MKL kernels and their layout conversions are
  folded away) and `dynamic=False` (a graph per shape, which the fixed-shape policies bound; a dynamic graph would
  give up the static sizes that make the kernels fast). `fullgraph=True`: a graph break would be a silent slow path.
  `_compile_all_devices`: upstream's generate compiles on accelerators only unless told. The frozen fp32 linears run
  oneDNN's kernels where MKL has no fast path (CPUs other than Intel's; `linear_kernels.py`): on an AMD EPYC a step
  at batch 4-8 took a third of the time of MKL's linears.
- Freezing needs gradients off while compiling, which upstream's `generate` guarantees (`torch.no_grad`), and it must
  be on while dynamo *traces*: dynamo decides then whether parameters become graph constants, reading inductor's
  global `freezing` (torch==2.13.0: `torch._dynamo.utils.is_parameter_freezing`), and `torch.compile(options=...)`
  only reaches inductor afterwards. So `options={"freezing": True}` alone is silently ignored (measured: the graph
  kept `aten.mm` on parameter inputs). `compile_settings` sets it for the duration of each flexible fixed-shape
  `generate` call whose `compile_config` asks for it (`PaddedPolicy.generate`), and puts the previous value back.
  Graphs keep what they were compiled with, so later calls reuse them. What freezing costs: weights changed after a
  graph was compiled are not seen by it (the graph holds its own constants), and the prepacked copies take memory
  beside the model's parameters.
- `warmup()` runs one short call per shape of `PaddedPolicy.call_shapes`, so that every graph the shape policy can
  need is compiled (and, under `mode="reduce-overhead"`, recorded as a CUDA graph) before the first request
  (padded: one shape; bucketed: one per combination of buckets).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from transformers import CompileConfig
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from .cache import CacheConfig
from .compiled_encoder import FlexCompileConfig, encoder_graph, encoder_warmup_calls, has_int8_variants
from .decode_attention import OneQueryAttention, resolve_decode_attention
from .linear_kernels import (
    Int8DotExpansion,
    Int8DotProducts,
    Int8FbgemmMatmuls,
    Int8FloatGemms,
    OneDNNLinears,
    OneRowLinears,
    resolve_int8_linears,
    resolve_linear_kernels,
    resolve_one_row_linears,
)
from .padding import POLICIES, compile_settings
from .request import FLEXIBLE_STATIC

# Forwards of each warm-up call: the first, one decode step that compiles, one that records CUDA graphs.
WARMUP_FORWARDS = 3
# Inductor settings of `compile_config_for_cpu`, measured (docs/compile.md, "Compiling `generate`").
CPU_INDUCTOR_OPTIONS = {"freezing": True}

__all__ = [
    "compile_config_for_cpu",
    "compile_settings",
    "warmup",
]  # `compile_settings` lives with its user, padding.py


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
            `"mkl"` (inductor's own choice), `"onednn"`, or `"auto"`: MKL on Intel CPUs, oneDNN on the others (as
            CTranslate2 chooses). oneDNN is set as an inductor post-grad pass (`OneDNNLinears`).
        one_row_linears (`str`, *optional*, defaults to `"auto"`): the frozen fp32 linears of a graph of one row (a
            decode step at batch 1): `"inductor"` (a dot product per output that inductor generates, reading the
            weight once: `OneRowLinears`), `"library"` (the `linear_kernels` above), or `"auto"`: inductor's where
            the CPU is not Intel's. On an AMD EPYC Zen 3 T5's step at batch 1 took 22 ms against oneDNN's 30.
        int8_linears (`str`, *optional*, defaults to `"auto"`): the int8 matrix multiplies of a model quantized with
            `quantize(model, "int8")`: `"fbgemm"` (FBGEMM's int8 GEMMs, exact on 7-bit weights:
            `Int8FbgemmMatmuls`; decode steps of 1-2 rows as inductor's dot products, but their output layer),
            `"inductor"` (in graphs of at most 8 rows, decode steps, dot products that inductor generates:
            `Int8DotProducts`; in graphs of dynamic rows, the compiled encoder and projections, float32 GEMMs of
            the integers up to 128 positions a call: `Int8FloatGemms`; both exact), `"library"` (oneDNN's int8
            kernels), or `"auto"`: where the CPU has no VNNI, where oneDNN's int8 kernels are slower than float32's,
            FBGEMM's (inductor's where torch has no FBGEMM); elsewhere the library's.
        decode_attention (`str`, *optional*, defaults to `"auto"`): the attention of a decode step (one query
            position, float32): `"inductor"` (written as products, sums and softmax that inductor generates and fuses:
            `decode_attention.OneQueryAttention`), `"library"` (torch's flash attention kernel, one call per
            attention), or `"auto"`: inductor's. On an AMD EPYC Zen 3 the kernel's fixed cost was about 0.7 ms of
            T5's 12 ms step at batch 1.
        encoder (`bool`, *optional*, defaults to `True`): under a padded or bucketed `flexible_static` policy (and in
            the serving engine), compile an encoder-decoder call's token encoder too, with dynamic shapes
            (`compiled_encoder.py`); upstream's generate runs it eagerly.
        step_guards (`str`, *optional*, defaults to `"first"`): `"first"`: a flexible call's compiled decode steps
            check dynamo's guards in full at the call's first step, the later steps only those that tell its graphs
            apart (`generation.GuardsOfFirstStep`; 0.4-0.7 ms a step less on T5); `"every"`: every guard at every
            step, as upstream's generate.
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
    passes = []  # one-row linears first: `OneDNNLinears` repacks whichever MKL linears are left
    kernel_options = {}
    int8_kernels = resolve_int8_linears(int8_linears)
    if int8_kernels == "fbgemm":  # before freezing, which would make them oneDNN's; one row: dot products
        kernel_options["joint_custom_post_pass"] = (Int8FbgemmMatmuls(), Int8DotProducts())
        passes.append(Int8DotExpansion())
    elif int8_kernels == "inductor":  # marked before freezing, expanded after
        kernel_options["joint_custom_post_pass"] = (Int8DotProducts(), Int8FloatGemms())
        passes.append(Int8DotExpansion())
    if resolve_one_row_linears(one_row_linears) == "inductor":
        passes.append(OneRowLinears())
    if resolve_linear_kernels(linear_kernels) == "onednn":
        passes.append(OneDNNLinears())
    if resolve_decode_attention(decode_attention) == "inductor":
        passes.append(OneQueryAttention())
    if passes:
        kernel_options["post_grad_custom_post_pass"] = tuple(passes)
    config = FlexCompileConfig(
        compile_encoder=encoder,
        step_guards=step_guards,
        fullgraph=fullgraph,
        dynamic=False,
        backend="inductor",
        mode=None,  # torch.compile takes a mode or options, not both
        options={**CPU_INDUCTOR_OPTIONS, **kernel_options, **options},
    )
    config._compile_all_devices = True  # upstream's generate compiles on CPU only when told to
    return config


class StopAfterSteps(StoppingCriteria):
    """Stops every row after `num_steps` decoding steps: a warm-up call needs the graphs, not the tokens."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        # input_ids: [rows, T] -> [rows]
        self.steps += 1
        return torch.full(
            (input_ids.shape[0],), self.steps >= self.num_steps, dtype=torch.bool, device=input_ids.device
        )


def warmup(
    model,
    make_inputs,
    *,
    max_new_tokens: int,
    cache_config,
    compile_config: CompileConfig | None = None,
    **generate_kwargs,
) -> list:
    """Compile every graph that calls under a fixed-shape `cache_config` can need, before serving any of them.

    Runs one `generate` call per shape of the shape policy (`PaddedPolicy.call_shapes`: every rows bucket, prompt or
    encoder length bucket and decoder length bucket that calls of up to `max_new_tokens` new tokens reach), each
    stopped after three forwards: the first (eager, or a compiled prefill) and two decode steps, the first of which
    compiles the shape's graph and the second of which records its CUDA graph (`mode="reduce-overhead"` runs a new
    graph once before recording it). Afterwards no call within the capacities compiles or records anything.

    Args:
        model: a model with `flexible_static` in its generate (an override model).
        make_inputs (`Callable[[int, int], dict]`): `make_inputs(batch_size, length)` returns generate inputs of
            `batch_size` rows whose prompt (decoder-only) or encoder input (encoder-decoder) is `length` positions
            long, e.g. `lambda b, n: {"input_ids": torch.full((b, n), 5)}`. For Whisper `length` can be ignored.
        max_new_tokens (`int`): the most new tokens a served call will ask for.
        cache_config (`dict` or `CacheConfig`): the `cache_config` of the served calls: a fixed-shape policy with
            its capacities set.
        compile_config (`CompileConfig`, *optional*): what the served calls pass; None when `model.forward` is
            compiled already.
        **generate_kwargs: other arguments the served calls pass (`num_beams` changes the rows per input).

    Run it as the served calls run: dynamo guards on the grad mode, so served calls under `torch.inference_mode()`
    need a warmup under it too (else they compile again).

    Returns:
        `list[CallShape]`: the shapes run (`transformers_flexcache.padded_call.CallShape`). Generate's `compile_config`
        compiles one decode graph per distinct `(batch_size, cache_len)` (decoder-only) or `(batch_size, length,
        cache_len)` (encoder-decoder); a compiled `model.forward` also one prefill graph per shape.

    Raises:
        ValueError: the policy is `"exact"`, a capacity is not set, `max_new_tokens` does not fit, or there are more
            shapes than dynamo keeps graphs of one function (`torch._dynamo.config.recompile_limit`): the others would
            run eagerly, without a word.
    """
    config = CacheConfig.parse(cache_config)
    policy = POLICIES[config.shape_policy]
    if not policy.fixed_shapes:
        raise ValueError(
            f'warmup needs a fixed-shape policy, not shape_policy={config.shape_policy!r}: pass cache_config={{"shape_'
            'policy": "bucketed", ...}} (or "padded"); the exact policy compiles a new graph for every shape'
        )
    generation_config = model.generation_config
    expand = max(
        generate_kwargs.get("num_beams", generation_config.num_beams) or 1,
        generate_kwargs.get("num_return_sequences", generation_config.num_return_sequences) or 1,
    )
    shapes = policy.call_shapes(model, config, max_new_tokens=max_new_tokens, expand=expand)
    limit = torch._dynamo.config.recompile_limit
    if len(shapes) > limit:
        raise ValueError(
            f"{len(shapes)} shapes to compile exceed torch._dynamo.config.recompile_limit={limit}: dynamo would run "
            f"the calls of the others eagerly; set torch._dynamo.config.recompile_limit = {len(shapes)} (or more) "
            'first, or list fewer sizes in cache_config["buckets"]'
        )
    with explained_recompile_limit(len(shapes)):
        _run_shapes(model, make_inputs, shapes, config, compile_config, generate_kwargs)
        _run_shapes(
            model, make_inputs, _encoder_shapes(model, shapes, compile_config), config, compile_config, generate_kwargs
        )
    return shapes


def _encoder_shapes(model, shapes: list, compile_config) -> list:
    """The calls that compile the encoder graphs the shapes leave out: a compiled encoder (`compiled_encoder.py`) runs
    at the call's own rows and length with dynamic shapes: one graph for a single row (where the encoder does not
    pack: a packed one, and an int8 model's projections, run it in the graph of several), one for more, and for an
    int8 model one more for many (`compiled_encoder.encoder_graph`). Each shape's call ran at its bucket's rows and
    length (the capacities always among them); a graph none of them reached gets a call of its own."""
    if not shapes:
        return []
    calls = encoder_warmup_calls(
        model, compile_config, max(shape.batch_size for shape in shapes), max(shape.length for shape in shapes)
    )
    variants = has_int8_variants(model, compile_config)
    reached = {
        encoder_graph(shape.batch_size, shape.length, int8_variants=variants) for shape in shapes if shape.length > 1
    }
    smallest = min(shapes, key=lambda shape: (shape.batch_size, shape.length))
    return [
        dataclasses.replace(smallest, batch_size=batch, length=positions)
        for batch, positions in calls
        if encoder_graph(batch, positions, int8_variants=variants) not in reached
    ]


def _run_shapes(model, make_inputs, shapes, config, compile_config, generate_kwargs: dict) -> None:
    for shape in shapes:
        stopping = StoppingCriteriaList(
            [*(generate_kwargs.get("stopping_criteria") or []), StopAfterSteps(WARMUP_FORWARDS)]
        )
        model.generate(
            **make_inputs(shape.batch_size, shape.length),
            **{**generate_kwargs, "stopping_criteria": stopping},
            cache_implementation=FLEXIBLE_STATIC,
            cache_config=config.to_dict(),
            compile_config=compile_config,
            max_new_tokens=shape.max_new_tokens,
            min_new_tokens=min(WARMUP_FORWARDS, shape.max_new_tokens),
        )


@contextlib.contextmanager
def explained_recompile_limit(num_shapes: int):
    """Re-raise dynamo's recompile-limit failure of a warm-up with what it means here.

    Every flexible model's forward is one function to dynamo (`FlexModelMixin.__call__`, which generate's
    `compile_config` compiles), so the graphs compiled earlier in the process for other models, or for copies of this
    one, count against the same `recompile_limit`: a warm-up that fits the limit alone can still reach it.
    """
    try:
        yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        limit = torch._dynamo.config.recompile_limit
        raise RuntimeError(
            f"dynamo's recompile limit ({limit} graphs of one function) was reached while compiling {num_shapes} "
            "shapes: every flexible model's forward is one function to dynamo (FlexModelMixin.__call__), so the graphs "
            "compiled earlier in this process for other models, or for copies of this one, count too. Set "
            "torch._dynamo.config.recompile_limit and accumulated_recompile_limit to the graphs of all the models "
            "this process compiles, or call torch._dynamo.reset() before warming up another model"
        ) from error
