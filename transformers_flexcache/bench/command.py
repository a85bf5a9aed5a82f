"""`transformers-flexcache bench`: one stream of generate calls, run under each cache strategy, side by side.

Design decisions:
- One seeded stream of calls per model, with varying batch sizes and prompt (or encoder) lengths, and a fixed
  number of new tokens: `min_new_tokens = max_new_tokens`, greedy, so every call of every strategy decodes exactly
  the same number of steps and the outputs can be compared token for token.
- Strategies are rows of `STRATEGIES`: a cache implementation, extra `cache_config` keys and whether generate
  compiles; adding a mode is one entry. Compiled strategies use `compile_config_for_cpu()` on CPU; upstream's static
  cache with dynamic shapes and without freezing (with `dynamic=False` it would compile one graph per batch and
  length of the stream, past dynamo's recompile limit, and frozen weights do not survive dynamic shapes). They run
  by default for T5 and Llama only (`default_models`): compiling on CPU takes tens of seconds per graph. Each
  strategy reports the graphs it compiled and the time it spent compiling, apart from its warm time.
- Inductor's on-disk cache is torch's own by default (`--inductor-cache`), so a second run on a machine reuses the
  kernels of the first, as a restarted server would; the header says how many files it held at the start, and
  `--inductor-cache new` measures a first start.
- The bucketed strategy compiles every bucket before the stream (`warmup()`), as a server would. Its buckets
  (`bench_buckets`): half the capacity and the capacity for rows and for encoder or decoder lengths, 4 graphs per
  model, a compile cost the default run can afford; decoder-only prompts also at a quarter and three quarters of
  their capacity, which costs no graph (the prefill runs eagerly) and shortens the prefill of short prompts.
- Upstream strategies run on the upstream model, ours on the override model; both hold the same weights.
- Strategies are interleaved per call, in an order that rotates from call to call, so that a slow moment of a
  shared machine falls on every strategy alike. Each strategy first makes one untimed warm-up call; its
  allocations and compiled graphs count, its time does not.
- The reference is upstream's DynamicCache: every strategy's tokens are compared with its tokens on every call,
  the command says whether they were all equal, and exits with 1 when they were not. Strategies that cannot be
  exact (`exact=False`: quantized weights, transformers' exported programs, which take no padding mask) report
  how far their tokens agree instead, and never fail the run.
- ExecuTorch strategies (`executorch.py`) run exported programs on the same stream, interleaved like the others:
  ours (`executorch`, `executorch-8da4w`) and transformers' exporter (`executorch-transformers`). They run only
  when named (exporting and lowering a real-sized model takes minutes), for every model that export supports (a
  refused one gets a note), and report their export and lowering time apart from the warm time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig, LogitsProcessorList
from transformers.utils import logging as hf_logging

from ..compilation import compile_config_for_cpu, compile_settings, warmup
from ..request import FLEXIBLE_STATIC
from .executorch import OURS as EXECUTORCH
from .executorch import TRANSFORMERS as TRANSFORMERS_EXPORTER
from .measure import (
    CacheStorageTracker,
    CallRecord,
    DecodeStepBytes,
    ForwardTimer,
    PeakRss,
    StepTimer,
    compile_seconds,
    compiled_graph_count,
    ratios,
    read_bandwidth,
    returned_cache,
    summarize,
)
from .models import (
    BENCH_MODELS,
    DEFAULT_MODELS,
    BenchModel,
    bench_model_for_checkpoint,
    build_models,
)

BASELINE = "dynamic"


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
        quantize: torchao weight quantization before export (`quantize_model_` modes; ExecuTorch only).
        exact: whether its tokens must equal DynamicCache's (a difference fails the run); otherwise their
            agreement is reported.
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

    @property
    def flexible(self) -> bool:
        return self.cache_implementation == FLEXIBLE_STATIC

    @property
    def bucketed(self) -> bool:
        return self.cache_config.get("shape_policy") == "bucketed"

    def compile_config(self, device: torch.device) -> CompileConfig | None:
        if not self.compile:
            return None
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
COMPILED_MODELS = ("t5", "llama")  # the models the compiled strategies run for by default
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
    # Exported programs in ExecuTorch's runtime, XNNPACK: only when named.
    Strategy("executorch", runtime=EXECUTORCH, default=False),
    Strategy("executorch-8da4w", runtime=EXECUTORCH, quantize="8da4w", exact=False, default=False),
    Strategy("executorch-transformers", runtime=TRANSFORMERS_EXPORTER, exact=False, default=False),
)
STRATEGIES_BY_NAME = {strategy.name: strategy for strategy in STRATEGIES}


@dataclass(frozen=True)
class Call:
    batch_size: int
    length: int  # prompt length (decoder-only) or input length (encoder-decoder)
    encoder_len: int | None = None  # encoder positions (encoder-decoder), set once the model is known


def make_stream(*, num_calls: int, max_batch_size: int, min_len: int, max_len: int, seed: int) -> list[Call]:
    """A seeded stream of calls whose batch sizes cycle through 1..max and whose lengths spread evenly over
    min..max, each shuffled: large and small shapes alternate, and both maxima appear when there are enough calls.
    """
    rng = random.Random(seed)
    batches = [1 + i % max_batch_size for i in range(num_calls)]
    steps = max(num_calls - 1, 1)
    lengths = [min_len + round(i * (max_len - min_len) / steps) for i in range(num_calls)]
    rng.shuffle(batches)
    rng.shuffle(lengths)
    return [Call(batch, length) for batch, length in zip(batches, lengths, strict=True)]


class TorchRunner:
    """Runs one strategy on one model and measures its calls."""

    def __init__(self, strategy: Strategy, model, capacities: dict[str, int], *, buckets: dict | None = None):
        self.name = strategy.name
        self.strategy = strategy
        self.model = model
        self.device = model.device
        self.generate_kwargs = strategy.generate_kwargs(capacities, device=self.device, buckets=buckets)
        self.tracker = CacheStorageTracker()

    def _on_device(self, inputs: dict) -> dict:
        return {
            key: value.to(self.device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()
        }

    def run(self, inputs: dict, new_tokens: int) -> CallRecord:
        inputs = self._on_device(inputs)
        rss = PeakRss()
        timer = StepTimer(rss)
        self.tracker.start_call()
        # A hook inside a compiled forward would be traced into the graph: compiled runs are inspected at the end.
        hook = (
            None
            if self.strategy.compile
            else self.model.register_forward_hook(self.tracker.forward_hook, with_kwargs=True)
        )
        graphs_before, compile_before = compiled_graph_count(), compile_seconds()
        forwards = ForwardTimer(self.model, compiled=self.strategy.compile)
        try:
            rss.start()
            start = time.perf_counter()
            # Upstream's generate (the static strategies) does not apply freezing from compile_config.options by
            # itself (see compile_settings); ours does. Applied here to every strategy, so that all compile alike.
            with compile_settings(self.generate_kwargs.get("compile_config")), forwards:
                out = self.model.generate(
                    **inputs,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    num_beams=1,
                    return_dict_in_generate=True,
                    logits_processor=LogitsProcessorList([timer]),
                    **self.generate_kwargs,
                )
            _synchronize(self.device)
            wall_s = time.perf_counter() - start
            rss.sample()
        finally:
            if hook is not None:
                hook.remove()
        hook_s = self.tracker.hook_s
        self.tracker.observe(returned_cache(out))
        tokens = out.sequences[:, -new_tokens:].cpu()
        first_token_s = timer.first_token_s(start)
        if first_token_s is not None and hook_s:
            first_token_s -= hook_s[0]
        return CallRecord(
            wall_s=wall_s - sum(hook_s),
            num_tokens=tokens.numel(),
            tokens=tokens,
            first_token_s=first_token_s,
            step_s=timer.step_s(hook_s),
            forward_s=forwards.decode_forwards(len(timer.stamps), hook_s),
            cache_allocations=self.tracker.allocations,
            cache_bytes_allocated=self.tracker.bytes_allocated,
            peak_cache_bytes=self.tracker.peak_bytes,
            peak_rss_growth_bytes=rss.growth_bytes,
            compiled_graphs=compiled_graph_count() - graphs_before,
            compile_s=compile_seconds() - compile_before,
            batch_size=tokens.shape[0],
        )

    def warm_up_every_shape(self, make_inputs, new_tokens: int) -> CallRecord:
        """Compile every shape the strategy's policy can run the stream at (`warmup()`): one record for all."""
        kwargs = {key: value for key, value in self.generate_kwargs.items() if key != "cache_implementation"}
        self.tracker.start_call()
        graphs_before, compile_before = compiled_graph_count(), compile_seconds()
        start = time.perf_counter()
        shapes = warmup(
            self.model, lambda b, n: self._on_device(make_inputs(b, n)), max_new_tokens=new_tokens, **kwargs
        )
        _synchronize(self.device)
        wall_s = time.perf_counter() - start
        self.tracker.observe(self.model.flexible_cache)
        return CallRecord(
            wall_s=wall_s,
            num_tokens=0,
            tokens=torch.empty(0, 0, dtype=torch.long),
            cache_allocations=self.tracker.allocations,
            cache_bytes_allocated=self.tracker.bytes_allocated,
            peak_cache_bytes=self.tracker.peak_bytes,
            compiled_graphs=compiled_graph_count() - graphs_before,
            compile_s=compile_seconds() - compile_before,
            batch_size=max(shape.batch_size for shape in shapes),
        )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_buckets(capacities: dict[str, int], *, encoder_decoder: bool, new_tokens: int) -> dict[str, list[int]]:
    """The bucketed strategy's buckets, then each capacity: half the capacity of rows; half the encoder length
    (encoder-decoder models); for decoder-only models, prompts at a quarter, a half and three quarters of the
    capacity, and the decoder length that a prompt of half the capacity reaches (prompt + new tokens - 1).

    Generate compiles one decode graph per rows and decoder (or encoder) length bucket: 4 graphs per model. Prompt
    buckets add none (the prefill runs eagerly), they only shorten the prefill of short prompts: on the ~100M Llama
    at 2 threads the stream took 0.97x DynamicCache's time with these three, 1.04x with the half alone (first token
    183 ms against 236 ms)."""
    if encoder_decoder:
        return {name: [(capacities[name] + 1) // 2] for name in ("max_batch_size", "max_encoder_len")}
    prompt = capacities["max_prompt_len"]
    half = (prompt + 1) // 2
    return {
        "max_batch_size": [(capacities["max_batch_size"] + 1) // 2],
        "max_prompt_len": sorted({max(1, prompt // 4), half, max(1, 3 * prompt // 4)} - {prompt}),
        "max_cache_len": [half + new_tokens - 1],
    }


def capacities_for(config, stream: list[Call], new_tokens: int) -> dict[str, int]:
    """The `cache_config` capacities that fit every call of `stream`: allocated once, never grown."""
    max_batch = max(call.batch_size for call in stream)
    if config.is_encoder_decoder:
        # The decoder holds its start token and the new tokens; the cross-attention cache the encoder output.
        return {
            "max_batch_size": max_batch,
            "max_cache_len": new_tokens + 1,
            "max_encoder_len": max(call.encoder_len for call in stream),
        }
    max_prompt = max(call.length for call in stream)
    # max_prompt_len only shapes the padded policy's prefill (decoder-only prompts are left-padded to it).
    return {"max_batch_size": max_batch, "max_cache_len": max_prompt + new_tokens, "max_prompt_len": max_prompt}


@dataclass
class ModelResult:
    name: str
    description: str
    num_parameters: int = 0
    new_tokens: int = 0
    stream: list[Call] = field(default_factory=list)
    capacities: dict = field(default_factory=dict)
    buckets: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    records: dict[str, list[CallRecord]] = field(default_factory=dict)
    warm_ups: dict[str, CallRecord] = field(default_factory=dict)
    mismatches: dict[str, list[int]] = field(default_factory=dict)  # strategy -> calls whose tokens differ
    agreement_only: set[str] = field(default_factory=set)  # strategies not held to DynamicCache's tokens
    lowering: dict[str, dict] = field(default_factory=dict)  # ExecuTorch strategy -> export and lowering figures
    decode_step_bytes: dict = field(default_factory=dict)  # weights and cache read by a decode step at the max batch
    floor_step_ms: float | None = None  # those bytes over the measured read bandwidth

    def add_call(self, records: dict[str, CallRecord]) -> None:
        """The records of one call of the stream, one per strategy: kept, and compared with DynamicCache's."""
        index = len(self.records.get(BASELINE, ()))
        expected = records[BASELINE].tokens
        for name, record in records.items():
            self.records.setdefault(name, []).append(record)
            if not torch.equal(record.tokens, expected):
                self.mismatches.setdefault(name, []).append(index)

    @property
    def failing_mismatches(self) -> dict[str, list[int]]:
        """The mismatches that fail the run: those of strategies held to DynamicCache's tokens."""
        return {name: calls for name, calls in self.mismatches.items() if calls and name not in self.agreement_only}

    def call_agreement(self, name: str) -> list[dict]:
        """Per call of `name`: its tokens and rows equal to DynamicCache's, out of how many."""
        agreement = []
        for record, reference in zip(self.records[name], self.records.get(BASELINE, []), strict=True):
            if record.tokens.shape == reference.tokens.shape:
                equal = record.tokens == reference.tokens  # [B, N]
            else:
                equal = torch.zeros(reference.tokens.shape, dtype=torch.bool)
            agreement.append(
                {
                    "tokens_equal": int(equal.sum()),
                    "num_tokens": equal.numel(),
                    "rows_equal": int(equal.all(dim=-1).sum()),
                    "num_rows": equal.shape[0],
                }
            )
        return agreement

    def summary(self) -> dict[str, dict]:
        """Figures per strategy, each with its ratios to DynamicCache, whether its tokens matched and how far."""
        figures = {name: summarize(records, warm_up=self.warm_ups.get(name)) for name, records in self.records.items()}
        baseline = figures.get(BASELINE)
        for name, values in figures.items():
            values["vs_dynamic"] = ratios(values, baseline) if baseline else None
            for figure in ("step", "forward"):
                value = values[f"largest_batch_{figure}_ms"]
                values[f"largest_batch_{figure}_vs_floor"] = (
                    value / self.floor_step_ms if value and self.floor_step_ms else None
                )
            values["outputs_equal"] = not self.mismatches.get(name)
            values["exact"] = name not in self.agreement_only
            agreement = self.call_agreement(name) if baseline else []
            num_tokens = sum(call["num_tokens"] for call in agreement)
            equal_tokens = sum(call["tokens_equal"] for call in agreement)
            values["token_agreement"] = equal_tokens / num_tokens if num_tokens else None
            values["calls_equal"] = len(self.records[name]) - len(self.mismatches.get(name, ()))
            values["lowering"] = self.lowering.get(name)
        return figures


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


def run_model(model: BenchModel, args, strategies: list[Strategy], log) -> ModelResult:
    """Run the stream on `model` under every strategy (and CTranslate2 for T5 and Marian when installed)."""
    description = args.model or (f"tiny {model.name} (--quick)" if args.quick else model.description)
    result = ModelResult(model.name, description)
    strategies = strategies_for(model.name, strategies, named=args.strategies_named, quick=args.quick)
    needs_override = any(strategy.flexible or strategy.runtime == EXECUTORCH for strategy in strategies)
    upstream, flex = build_models(
        model, quick=args.quick, checkpoint=args.model, seed=args.seed, with_override=needs_override
    )
    config = upstream.config
    result.num_parameters = sum(p.numel() for p in upstream.parameters())
    min_len = max(1, min(args.min_length, args.max_length))
    max_batch_size = args.max_batch_size
    if max_batch_size is None:
        defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
        max_batch_size = (not args.quick and model.default_max_batch_size) or defaults["max_batch_size"]
    result.stream = make_stream(
        num_calls=args.calls,
        max_batch_size=max_batch_size,
        min_len=min_len,
        max_len=args.max_length,
        seed=args.seed,
    )
    if config.is_encoder_decoder:
        result.stream = [
            dataclasses.replace(call, encoder_len=model.encoder_len(config, call.length)) for call in result.stream
        ]
    result.new_tokens = args.new_tokens
    result.capacities = capacities_for(config, result.stream, args.new_tokens)
    result.buckets = bench_buckets(
        result.capacities, encoder_decoder=config.is_encoder_decoder, new_tokens=args.new_tokens
    )

    peer = None
    if model.ctranslate2_peer and not args.no_ctranslate2:
        # Converted before the torch models move: CTranslate2 reads the fp32 weights on the CPU.
        peer, note = _ctranslate2_runner(upstream, args.threads, device=args.device, dtype=args.dtype)
        if note:
            result.notes.append(note)
    # Exported and lowered before the torch models move: ExecuTorch runs the fp32 weights on the CPU.
    exported = _executorch_runners(
        [strategy for strategy in strategies if strategy.runtime != "torch"], upstream, flex, result, args, log
    )
    dtype = getattr(torch, args.dtype)
    upstream.to(device=args.device, dtype=dtype)
    if flex is not None:
        flex.to(device=args.device, dtype=dtype)

    # Each flexible strategy gets its own model object (a shallow copy: the same weights) and so its own pool: a pool
    # holds one cache by default, and a change of shape policy rebuilds it, which interleaving would do per call.
    runners = [
        TorchRunner(
            strategy,
            copy.copy(flex) if strategy.flexible else upstream,
            result.capacities,
            buckets=result.buckets,
        )
        for strategy in strategies
        if strategy.runtime == "torch"
    ]
    runners += exported
    if peer is not None:
        runners.append(peer)

    generator = torch.Generator().manual_seed(args.seed + 1)
    warm_up = model.make_inputs(config, 1, min_len, generator)
    for runner in list(runners):
        try:
            if isinstance(runner, TorchRunner) and runner.strategy.warm_up_every_shape:
                record = runner.warm_up_every_shape(
                    lambda b, n: model.make_inputs(config, b, n, generator), args.new_tokens
                )
            else:
                record = runner.run(warm_up, min(2, args.new_tokens))
            result.warm_ups[runner.name] = record
        except Exception as error:
            message = f"{runner.name} failed on the warm-up call: {type(error).__name__}: {error}"
            runners.remove(runner)
            ours = runner.strategy.flexible if isinstance(runner, TorchRunner) else getattr(runner, "ours", False)
            (result.failures if ours or runner.name == BASELINE else result.notes).append(message)
            log(f"[{model.name}] {message}")
    if not any(runner.name == BASELINE for runner in runners):
        return result

    progress = _progress(result.stream, model.name, args.no_progress)
    for index, call in enumerate(progress):
        inputs = model.make_inputs(config, call.batch_size, call.length, generator)
        order = runners[index % len(runners) :] + runners[: index % len(runners)]
        result.add_call({runner.name: runner.run(inputs, args.new_tokens) for runner in order})

    result.decode_step_bytes = _decode_step_bytes(model, upstream, result, generator, args.device)
    if args.bandwidth:
        result.floor_step_ms = 1e3 * sum(result.decode_step_bytes.values()) / args.bandwidth
    torch._dynamo.reset()  # compiled graphs and frozen weights of this model are not needed any more
    return result


def _executorch_runners(strategies: list[Strategy], upstream, flex, result: ModelResult, args, log) -> list:
    """The runners of the ExecuTorch `strategies`, exported and lowered. A row that cannot run here gets a note; one
    of ours that fails to export or lower a model that export supports, a failure (transformers' exporter: a note)."""
    from .executorch import Unavailable, build_runner, check_runnable

    runners = []
    for strategy in strategies:
        if not strategy.exact:
            result.agreement_only.add(strategy.name)
        try:
            check_runnable(strategy, upstream=upstream, device=args.device, dtype=args.dtype)
        except Unavailable as reason:
            result.notes.append(f"no {strategy.name} row: {reason}")
            continue
        log(f"[{result.name}] {strategy.name}: exporting and lowering (XNNPACK)")
        try:
            runner = build_runner(strategy, upstream=upstream, flex=flex, capacities=result.capacities)
        except Exception as error:
            message = f"{strategy.name} failed to export or lower: {type(error).__name__}: {error}"
            (result.failures if strategy.runtime == EXECUTORCH else result.notes).append(message)
            log(f"[{result.name}] {message}")
            continue
        result.lowering[strategy.name] = lowering = runner.lowering
        seconds = f"exported in {lowering['export_s']:.1f} s, lowered in {lowering['lower_s']:.1f} s"
        log(f"[{result.name}] {strategy.name}: {seconds}")
        runners.append(runner)
    return runners


def _decode_step_bytes(model: BenchModel, upstream, result: ModelResult, generator, device) -> dict:
    """Weights and cache bytes that DynamicCache's decode step reads at the middle of a call at the stream's largest
    batch (the longest such call: the most cache), measured on the upstream model (see `DecodeStepBytes`)."""
    largest = max(result.stream, key=lambda call: (call.batch_size, call.length))
    inputs = model.make_inputs(upstream.config, largest.batch_size, largest.length, generator)
    inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
    step = max(2, result.new_tokens // 2 + 1)  # forward 1 is the prefill
    with DecodeStepBytes(upstream, step=step) as counted:
        upstream.generate(
            **inputs, max_new_tokens=result.new_tokens, min_new_tokens=result.new_tokens, do_sample=False
        )
    return {"weights": counted.weight_bytes, "cache": counted.cache_bytes}


def _ctranslate2_runner(upstream, threads: int, *, device: str, dtype: str):
    if device != "cpu":
        return None, f"CTranslate2 row runs on the CPU only here (--device {device}): no CTranslate2 row"
    try:
        from .ctranslate2 import CTranslate2Runner
    except ImportError:
        return (
            None,
            "ctranslate2 is not installed: no CTranslate2 row (pip install transformers-flexcache[ctranslate2])",
        )
    if dtype != "float32":
        return None, f"no CTranslate2 row with --dtype {dtype}: it is compared at float32"
    try:
        return CTranslate2Runner.from_model(upstream, threads=threads), None
    except Exception as error:  # a converter that refuses this checkpoint costs the row, not the run
        return None, f"CTranslate2 could not convert the model: {type(error).__name__}: {error}"


def _progress(stream, name: str, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(stream, desc=f"{name} calls", unit="call", disable=disable, file=sys.stderr)


# --- command line ----------------------------------------------------------------------------------------------


def default_strategy_names() -> str:
    return ",".join(s.name for s in STRATEGIES if s.default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench` subcommand's options."""
    default_strategies = default_strategy_names()
    compiled = ",".join(s.name for s in STRATEGIES if s.default and s.default_models)
    executorch = ",".join(s.name for s in STRATEGIES if s.runtime != "torch")
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated models to run, of {','.join(BENCH_MODELS)} (default: {','.join(DEFAULT_MODELS)})",
    )
    parser.add_argument("--model", metavar="PATH", help="a local checkpoint folder to run instead of built-in configs")
    parser.add_argument(
        "--strategies",
        default=None,
        help=f"comma-separated strategies, of {','.join(STRATEGIES_BY_NAME)} (default: {default_strategies}; "
        f"{compiled} only for {','.join(COMPILED_MODELS)}, and not with --quick; named ones run for every model); "
        f"{BASELINE} always runs, as the reference. {executorch} run only when named: exported programs in "
        "ExecuTorch's runtime (XNNPACK, CPU, float32), for every model that export supports: ours in fp32 (tokens "
        "must equal DynamicCache's), ours with torchao 8da4w weights and transformers' own exporter (exported at "
        "batch 1 and the largest batch, other batches padded; exports counted), whose token agreement is reported, "
        "not required. Exporting and lowering take minutes per real-sized model and are reported apart from the "
        "warm time",
    )
    parser.add_argument("--calls", type=int, default=None, help="generate calls per model (default 12; --quick: 6)")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="largest batch in the stream (default 8, Whisper 2; --quick: 4)",
    )
    parser.add_argument("--min-length", type=int, default=None, help="shortest prompt/input (default 8; --quick: 4)")
    parser.add_argument("--max-length", type=int, default=None, help="longest prompt/input (default 48; --quick: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per call (default 12; --quick: 8)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch and CTranslate2 (default: torch's, i.e. OMP_NUM_THREADS or the cores)",
    )
    parser.add_argument("--device", default="cpu", help="torch device of the models (default cpu; e.g. cuda)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the models (default float32; bfloat16 on CPUs with native bf16 matmuls: AVX512-BF16 or AMX)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the stream and the inputs")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny configs, a short stream, no compiled strategy unless named: a smoke test, its timings mean nothing",
    )
    parser.add_argument(
        "--inductor-cache",
        metavar="DIR|new",
        help="inductor's on-disk cache of compiled kernels and graphs: a folder to use and keep, or `new` for an "
        "empty one, removed after the run, so that compile times are those of a first start; default: torch's own "
        "(TORCHINDUCTOR_CACHE_DIR, else a folder under the temp dir), as a server restarted on the machine would "
        "find it. The header says how many files it held at the start",
    )
    parser.add_argument("--no-ctranslate2", action="store_true", help="skip the CTranslate2 row for T5 and Marian")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", metavar="PATH", help="write every figure, per strategy and per call, as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of time and cache memory per call (matplotlib)")


INDUCTOR_CACHE_NEW = "new"


def inductor_cache_state(*, fresh: bool) -> dict:
    """Where inductor's on-disk cache is (TORCHINDUCTOR_CACHE_DIR as set for the run) and how many files it held at
    the start: compile times with a filled cache are a restart's, with an empty one a first start's."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = cache_dir()
    files = sum(len(names) for _, _, names in os.walk(folder)) if os.path.isdir(folder) else 0
    return {"dir": folder, "new": fresh, "files_at_start": files}


QUICK_DEFAULTS = {"calls": 6, "max_batch_size": 4, "min_length": 4, "max_length": 16, "new_tokens": 8}
FULL_DEFAULTS = {"calls": 12, "max_batch_size": 8, "min_length": 8, "max_length": 48, "new_tokens": 12}


def _resolve(args, parser: argparse.ArgumentParser) -> tuple[list[BenchModel], list[Strategy]]:
    for key, value in (QUICK_DEFAULTS if args.quick else FULL_DEFAULTS).items():
        if getattr(args, key) is None and key != "max_batch_size":  # its default depends on the model
            setattr(args, key, value)
    for key in ("calls", "max_batch_size", "min_length", "max_length", "new_tokens"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be at least 1")
    if args.threads is None:
        args.threads = torch.get_num_threads()
    elif args.threads < 1:
        parser.error(f"--threads={args.threads} must be at least 1")

    args.strategies_named = args.strategies is not None
    try:
        args.device = str(torch.device(args.device))
    except RuntimeError as error:
        parser.error(f"--device {args.device}: {error}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device} needs CUDA, and torch.cuda.is_available() is False")
    if args.dtype == "bfloat16" and args.device == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        parser.error("--dtype bfloat16 needs a CPU with native bf16 (AVX512-BF16 or AMX): this one would emulate it")
    if args.dtype == "float16" and args.device == "cpu":
        parser.error("--dtype float16 is for GPUs; on CPU use bfloat16 (where supported) or float32")
    names = [name.strip() for name in (args.strategies or default_strategy_names()).split(",") if name.strip()]
    unknown = [name for name in names if name not in STRATEGIES_BY_NAME]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {list(STRATEGIES_BY_NAME)}")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    strategies = [STRATEGIES_BY_NAME[name] for name in names]

    if args.model is not None:
        if not os.path.isdir(args.model):
            parser.error(f"--model {args.model} is not a folder; pass a local checkpoint folder")
        try:
            return [bench_model_for_checkpoint(args.model)], strategies
        except ValueError as error:
            parser.error(str(error))
    model_names = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in model_names if name not in BENCH_MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(BENCH_MODELS)}")
    return [BENCH_MODELS[name] for name in model_names], strategies


def _write_json(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def _executorch_threads(strategies: list[Strategy], threads: int):
    """ExecuTorch's threadpool at the bench's threads while ExecuTorch strategies run (where it is installed)."""
    from .executorch import executorch_available, executorch_threads

    if all(strategy.runtime == "torch" for strategy in strategies) or executorch_available():
        return contextlib.nullcontext()
    return executorch_threads(threads)


@contextlib.contextmanager
def _quiet_transformers():
    # generate's per-call notices (e.g. "max_new_tokens and max_length both set") would bury the progress bar.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # weight loading and saving (CTranslate2 conversion)
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(level)


def run(args, parser: argparse.ArgumentParser) -> int:
    """Run the `bench` subcommand; returns the exit status (0: all outputs equal to DynamicCache's)."""
    from .report import format_footer, format_header, format_model, machine_info, to_json, write_plot

    models, strategies = _resolve(args, parser)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install transformers-flexcache[bench]")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    log = print
    selected = list(strategies)
    fresh_cache = args.inductor_cache == INDUCTOR_CACHE_NEW
    cache_dir = tempfile.mkdtemp(prefix="flexcache-bench-inductor-") if fresh_cache else args.inductor_cache
    cache_dir_before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir

    args.bandwidth = read_bandwidth(device=args.device)
    machine = machine_info(args.threads)
    machine["read_bandwidth_bytes_per_s"] = args.bandwidth
    machine["inductor_cache"] = inductor_cache_state(fresh=fresh_cache)
    print(format_header(machine, args))
    results = []
    started = time.perf_counter()
    try:
        # The strategies of one model compile one function (the model's `__call__`) into several graphs (and
        # several models the same code): more than dynamo's default of 8 per function would run the rest eagerly.
        with (
            _quiet_transformers(),
            torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512),
            _executorch_threads(selected, args.threads),
        ):
            for model in models:
                results.append(run_model(model, args, selected, log))
                report = to_json(results, args=args, machine=machine, elapsed_s=time.perf_counter() - started)
                print(format_model(model.name, report["models"][model.name], bandwidth=args.bandwidth), flush=True)
                if args.json:  # written after each model, so that an interrupted run keeps what it measured
                    _write_json(report, args.json)
    finally:
        torch.set_num_threads(threads_before)
        if cache_dir_before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir_before
        if fresh_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    report["complete"] = True
    print(format_footer(report))
    if args.json:
        _write_json(report, args.json)
        print(f"figures written to {args.json}")
    if args.plot:
        print(write_plot(results, args.plot))
    return 0 if report["outputs_equal"] and not report["failures"] else 1
