"""The strategies of `transformers-flexcache bench`: the ways a model's `generate` (or another runtime) runs the stream.

Design decisions:
- Strategies are rows of `STRATEGIES`: a cache implementation, extra `cache_config` keys and whether generate
  compiles; adding a mode is one entry. Compiled strategies use `compile_config_for_cpu()` on CPU; upstream's static
  cache with dynamic shapes and without freezing (with `dynamic=False` it would compile one graph per batch and
  length of the stream, past dynamo's recompile limit, and frozen weights do not survive dynamic shapes). They run
  by default for every model of the default run (`default_models`; not with `--quick`): compiling on CPU takes tens
  of seconds per graph. Each strategy reports the graphs it compiled and the time it spent compiling, apart from
  its warm time.
- The bucketed strategy compiles every bucket before the stream (`warmup()`), as a server would (its buckets:
  `stream.bench_buckets`).
- int8 strategies run a copy of the model quantized with `transformers_flexcache.quantize(model, "int8")`
  (CTranslate2's scheme: per-row int8 weights, per-token dynamic int8 activations, int8 GEMMs). Random weights make
  int8 tokens differ from fp32's, so their reference is `dynamic-int8`, the same int8 model run eagerly with
  DynamicCache (`reference`), whose own agreement with fp32 DynamicCache is reported. Their agreement is reported,
  not required: on real-sized models any float difference (inductor's fused kernels against eager ones) moves some
  activation across an int8 rounding boundary, and the difference grows from layer to layer to the size of int8's
  own error (measured on the t5-small-sized T5, one teacher-forced forward: compiled int8 against eager int8, max
  |logit diff| 2.3; eager int8 against fp32, 2.7; aot_eager, which runs eager's kernels, 0.0). The bench reports,
  per int8 row, its scores against the reference's and against fp32's where the prefix is the same, and the
  reference's margin where tokens part; the tiny-model tests require equal tokens. They run by default for the
  models CTranslate2 also runs in int8 (T5, Marian), beside its `ctranslate2-int8` row.
- ExecuTorch strategies (`executorch.py`) run exported programs on the same stream, interleaved like the others:
  ours (`executorch`, `executorch-8da4w`) and transformers' exporter (`executorch-transformers`). They run only
  when named (exporting and lowering a real-sized model takes minutes), for every model that export supports (a
  refused one gets a note), and report their export and lowering time apart from the warm time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..generate.request import FLEXIBLE_STATIC
from .executorch import OURS as EXECUTORCH
from .executorch import TRANSFORMERS as TRANSFORMERS_EXPORTER

BASELINE = "dynamic"
DYNAMIC_INT8 = "dynamic-int8"  # the reference of the int8 strategies


@dataclass(frozen=True)
class Strategy:
    """A way to run generate.

    Args:
        name: the `--strategies` name.
        cache_implementation: `generate(cache_implementation=...)`; None for upstream's default DynamicCache.
        cache_config: `cache_config` keys beside the capacities (flexible strategies only).
        compile: whether generate compiles the decoding forward (upstream's `compile_config`, on CPU too).
        dynamic: dynamo's `dynamic` for compiled strategies (None: upstream's automatic dynamic shapes).
        freezing: whether compiled strategies freeze weights (`compile_config_for_cpu()`'s default; it needs
            `dynamic=False`: MKL-packed linears are packed for one batch size).
        warm_up_every_shape: compile every shape before the stream (`warmup()`), instead of one warm-up call.
        default: whether the strategy runs without `--strategies`.
        default_models: the models it runs for by default (None: all); named in `--strategies`, it runs for all.
        runtime: `"torch"` (the model's `generate`), `"executorch"` (our `.pte`) or `"executorch-transformers"`
            (transformers' exported programs); see `executorch.py`.
        quantize: weight quantization: for the torch runtime `"int8"` runs a copy of the model quantized with
            `transformers_flexcache.quantize`; for ExecuTorch, `quantize_model_`'s modes before export.
        exact: whether its tokens must equal its reference's (a difference fails the run); otherwise their
            agreement is reported.
        reference: the strategy whose tokens it is compared with: DynamicCache's (`dynamic`), or for int8
            strategies the eager int8 model's (`dynamic-int8`).
    """

    name: str
    cache_implementation: str | None = None
    cache_config: dict = field(default_factory=dict)
    compile: bool = False
    dynamic: bool | None = False
    freezing: bool = True
    warm_up_every_shape: bool = False
    default: bool = True
    default_models: tuple[str, ...] | None = None
    runtime: str = "torch"
    quantize: str = "none"
    exact: bool = True
    reference: str = BASELINE

    @property
    def flexible(self) -> bool:
        return self.cache_implementation == FLEXIBLE_STATIC

    @property
    def bucketed(self) -> bool:
        return self.cache_config.get("shape_policy") == "bucketed"

    def compile_config(self, device: torch.device):
        """The strategy's `CompileConfig` on `device`, or None for an eager strategy."""
        if not self.compile:
            return None
        from transformers import CompileConfig

        from ..compile import compile_config_for_cpu  # imported here: the command line's help compiles nothing

        if device.type == "cpu":
            config = compile_config_for_cpu(freezing=self.freezing)
        else:  # CUDA graphs, as upstream's default
            config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        config.dynamic = self.dynamic
        return config

    def generate_kwargs(
        self, capacities: dict[str, int], *, device: torch.device, buckets: dict | None = None
    ) -> dict:
        kwargs = {}
        if self.cache_implementation is not None:
            kwargs["cache_implementation"] = self.cache_implementation
        if self.flexible:
            kwargs["cache_config"] = {**capacities, **self.cache_config}
            if self.bucketed and buckets:
                kwargs["cache_config"]["buckets"] = buckets
        if self.compile:
            kwargs["compile_config"] = self.compile_config(device)
        return kwargs


PADDED = {"shape_policy": "padded"}
BUCKETED = {"shape_policy": "bucketed"}
# The models the compiled fp32 strategies run for by default: every model of the default run.
COMPILED_MODELS = ("t5", "bart", "marian", "whisper", "llama")
INT8_MODELS = ("t5", "marian")  # the models the int8 strategies run for by default (CTranslate2's int8 row too)
STRATEGIES = (
    Strategy(BASELINE),
    Strategy("static", cache_implementation="static"),
    Strategy("flexible_static-exact", cache_implementation=FLEXIBLE_STATIC),
    Strategy("flexible_static-padded", cache_implementation=FLEXIBLE_STATIC, cache_config=PADDED, default=False),
    Strategy("flexible_static-bucketed", cache_implementation=FLEXIBLE_STATIC, cache_config=BUCKETED, default=False),
    # Upstream's static cache has a new shape at every call of the stream: with dynamic=False it would compile a graph
    # per call, past dynamo's limit. Dynamic shapes from the first call (dynamic=True): 2-3 graphs (batch 1, which
    # dynamo specializes, and the others); automatic dynamic shapes (dynamic=None) compiled 4 on the t5-small stream,
    # 136 s against 111 s. Freezing fails under dynamic shapes (a batch of 2 reached a linear packed for 3: "expected
    # size 2==3"), so it compiles without.
    Strategy(
        "static-compiled",
        cache_implementation="static",
        compile=True,
        dynamic=True,
        freezing=False,
        default_models=COMPILED_MODELS,
    ),
    Strategy(
        "flexible_static-padded-compiled",
        cache_implementation=FLEXIBLE_STATIC,
        cache_config=PADDED,
        compile=True,
        default_models=COMPILED_MODELS,
    ),
    Strategy(
        "flexible_static-bucketed-compiled",
        cache_implementation=FLEXIBLE_STATIC,
        cache_config=BUCKETED,
        compile=True,
        warm_up_every_shape=True,
        default_models=COMPILED_MODELS,
    ),
    # int8 (transformers_flexcache.quantize): the eager reference, then the compiled flexible modes.
    Strategy(DYNAMIC_INT8, quantize="int8", exact=False, default_models=INT8_MODELS),
    Strategy(
        "flexible_static-padded-compiled-int8",
        cache_implementation=FLEXIBLE_STATIC,
        cache_config=PADDED,
        compile=True,
        quantize="int8",
        exact=False,
        reference=DYNAMIC_INT8,
        default_models=INT8_MODELS,
    ),
    Strategy(
        "flexible_static-bucketed-compiled-int8",
        cache_implementation=FLEXIBLE_STATIC,
        cache_config=BUCKETED,
        compile=True,
        warm_up_every_shape=True,
        quantize="int8",
        exact=False,
        reference=DYNAMIC_INT8,
        default_models=INT8_MODELS,
    ),
    # Exported programs in ExecuTorch's runtime, XNNPACK: only when named.
    Strategy("executorch", runtime=EXECUTORCH, default=False),
    Strategy("executorch-8da4w", runtime=EXECUTORCH, quantize="8da4w", exact=False, default=False),
    Strategy("executorch-transformers", runtime=TRANSFORMERS_EXPORTER, exact=False, default=False),
)
STRATEGIES_BY_NAME = {strategy.name: strategy for strategy in STRATEGIES}


def strategies_for(model_name: str, strategies: list[Strategy], *, named: bool, quick: bool) -> list[Strategy]:
    """The strategies that run for `model_name`: all that were named; else the defaults for this model, without the
    compiled ones under `--quick` (compiling takes longer than the whole quick run)."""
    if named:
        return strategies
    return [
        strategy
        for strategy in strategies
        if (strategy.default_models is None or model_name in strategy.default_models)
        and not (quick and strategy.compile)
    ]


def with_references(strategies: list[Strategy]) -> list[Strategy]:
    """`strategies` with the reference of each added before it when it is missing (DynamicCache first)."""
    chosen = []
    for strategy in [STRATEGIES_BY_NAME[BASELINE], *strategies]:
        reference = STRATEGIES_BY_NAME[strategy.reference]
        for needed in (reference, strategy):
            if needed not in chosen:
                chosen.append(needed)
    return chosen


def default_strategy_names() -> str:
    return ",".join(s.name for s in STRATEGIES if s.default)
