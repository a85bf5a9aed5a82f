"""One model's run of the benchmark: its stream under every strategy, interleaved, compared with DynamicCache.

Design decisions:
- Upstream strategies run on the upstream model, ours on the override model; both hold the same weights.
- Strategies are interleaved per call, in an order that rotates from call to call, so that a slow moment of a
  shared machine falls on every strategy alike. Each strategy first makes one untimed warm-up call; its
  allocations and compiled graphs count, its time does not.
- The reference is upstream's DynamicCache: every strategy's tokens are compared with its tokens on every call,
  the command says whether they were all equal, and exits with 1 when they were not. Strategies that cannot be
  exact (`exact=False`: quantized weights, transformers' exported programs, which take no padding mask) report
  how far their tokens agree instead, and never fail the run.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from dataclasses import dataclass, field

import torch

from .executorch import OURS as EXECUTORCH
from .measure import CallRecord, DecodeStepBytes, ratios, summarize
from .models import BenchModel, build_models
from .strategies import BASELINE, Strategy, strategies_for
from .stream import FULL_DEFAULTS, QUICK_DEFAULTS, Call, bench_buckets, capacities_for, make_stream
from .torch_runner import TorchRunner


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
