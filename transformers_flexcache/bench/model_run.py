"""One model's run of the benchmark: its stream under every strategy, interleaved, compared with DynamicCache.

Design decisions:
- Upstream strategies run on the upstream model, ours on the override model; both hold the same weights.
- Strategies are interleaved per call, in an order that rotates from call to call, so that a slow moment of a
  shared machine falls on every strategy alike. Each strategy first makes one untimed warm-up call; its
  allocations and compiled graphs count, its time does not.
- The reference is upstream's DynamicCache: every strategy's tokens are compared with its tokens on every call,
  the command says whether they were all equal, and exits with 1 when they were not. int8 strategies are compared
  with `dynamic-int8` (the same int8 model, eager, DynamicCache) instead. Strategies that cannot be exact
  (`exact=False`: other weights, transformers' exported programs, which take no padding mask) report how far their
  tokens agree instead, and never fail the run; so are compiled rows in bf16, where scores often tie exactly (a
  margin of 0 on the t5-small-sized T5; upstream's static-compiled parts from DynamicCache there too). Where tokens
  differ, the report gives the reference's margin (top-1 minus top-2 score) at the first differing step of each
  row: a near tie, or not.
- int8 and bf16 are also measured where tokens say little: the logits of the largest call, teacher-forced on one
  seeded continuation, against the fp32 model's (`logits_error`), before the models are cast or quantized.
- Each decode step is compared with the bandwidth floor of its own weights: fp32 (or the run's dtype), and for int8
  rows the bytes of an int8 step (int8 data and scales of the linears, the rest in float).
- The garbage collector's heap is frozen for the timed stream, after the warm-ups (`compile.gc_heap.frozen_heap`), as a
  server freezes it after its start (`serve` does): else a full collection over the compiled graphs (0.1-1 s) lands
  on whichever call runs then. The collections seen during the stream are reported (`gc`), those that ran while
  torch compiled apart (`compile.gc_heap.Collections`: their time leaves the timings with the compile's; upstream's
  static-compiled compiles during the stream: in T5's default stream on an AMD EPYC Zen 3, 1206 collections (6 full)
  ran in compiles, 22 outside them, none full, the longest 1.2 ms), `--no-gc-freeze` runs it unfrozen.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass, field

import torch

from ..compile import Collections, frozen_heap, quantize
from .executorch import OURS as EXECUTORCH
from .measure import CallRecord, DecodeStepBytes, ratios, same_prefix_score_diff, summarize
from .models import BenchModel, build_models
from .strategies import BASELINE, DYNAMIC_INT8, Strategy, strategies_for
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
    differences: dict[str, list[dict]] = field(default_factory=dict)  # strategy -> differing rows, with margins
    # strategy -> per call, the largest |score difference| at steps with the same prefix, against its reference and
    # against fp32 DynamicCache (`same_prefix_score_diff`)
    score_diffs: dict[str, list[float]] = field(default_factory=dict)
    fp32_score_diffs: dict[str, list[float]] = field(default_factory=dict)
    agreement_only: set[str] = field(default_factory=set)  # strategies not held to their reference's tokens
    references: dict[str, str] = field(default_factory=dict)  # strategy -> the strategy it is compared with
    int8: set[str] = field(default_factory=set)  # strategies whose weights are int8 (their floor is int8's)
    lowering: dict[str, dict] = field(default_factory=dict)  # ExecuTorch strategy -> export and lowering figures
    decode_step_bytes: dict = field(default_factory=dict)  # weights and cache read by a decode step at the max batch
    floor_step_ms: float | None = None  # those bytes over the measured read bandwidth
    int8_decode_step_bytes: dict = field(default_factory=dict)  # the same for the int8 model
    int8_floor_step_ms: float | None = None
    logits_error: dict[str, dict] = field(default_factory=dict)  # "int8"/"bfloat16" -> error against fp32 logits
    gc: dict = field(
        default_factory=dict
    )  # the collector during the timed stream (`compile.gc_heap.Collections.summary`)
    compile_cache: dict | None = None  # what the run found in the compile cache (`compile.caching.WarmStart`)

    def reference_of(self, name: str) -> str:
        return self.references.get(name, BASELINE)

    def add_call(self, records: dict[str, CallRecord]) -> None:
        """The records of one call of the stream, one per strategy: kept, and compared with their references'."""
        index = len(self.records.get(BASELINE, ()))
        for name, record in records.items():
            self.records.setdefault(name, []).append(record)
        for name, record in records.items():
            reference = records.get(self.reference_of(name))
            if name == BASELINE or reference is None:
                continue
            _append(self.score_diffs, name, same_prefix_score_diff(record, reference))
            if self.reference_of(name) != BASELINE and BASELINE in records:
                _append(self.fp32_score_diffs, name, same_prefix_score_diff(record, records[BASELINE]))
            if not torch.equal(record.tokens, reference.tokens):
                self.mismatches.setdefault(name, []).append(index)
                self.differences.setdefault(name, []).extend(_differing_rows(index, record, reference))
        for record in records.values():
            record.scores = None  # compared: [B, N, V] per call and strategy is too much to keep

    @property
    def failing_mismatches(self) -> dict[str, list[int]]:
        """The mismatches that fail the run: those of strategies held to DynamicCache's tokens."""
        return {name: calls for name, calls in self.mismatches.items() if calls and name not in self.agreement_only}

    def call_agreement(self, name: str) -> list[dict]:
        """Per call of `name`: its tokens and rows equal to its reference's, out of how many."""
        agreement = []
        references = self.records.get(self.reference_of(name), [])
        if len(references) != len(self.records[name]):
            return []
        for record, reference in zip(self.records[name], references, strict=True):
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
            floor = self.int8_floor_step_ms if name in self.int8 else self.floor_step_ms
            values["floor_step_ms"] = floor
            for figure in ("step", "forward"):
                value = values[f"largest_batch_{figure}_ms"]
                values[f"largest_batch_{figure}_vs_floor"] = value / floor if value and floor else None
            values["reference"] = None if name == BASELINE else self.reference_of(name)
            values["max_score_diff"] = max(self.score_diffs.get(name) or [None], key=lambda v: -1 if v is None else v)
            fp32 = self.fp32_score_diffs.get(name) or self.score_diffs.get(name) if name in self.int8 else None
            values["max_score_diff_vs_fp32"] = max(fp32 or [None], key=lambda v: -1 if v is None else v)
            values["int8"] = name in self.int8
            values["outputs_equal"] = not self.mismatches.get(name)
            values["differences"] = self.differences.get(name, [])
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
        result.capacities,
        encoder_decoder=config.is_encoder_decoder,
        new_tokens=args.new_tokens,
        min_encoder_len=min(call.encoder_len for call in result.stream) if config.is_encoder_decoder else None,
    )

    int8 = [s for s in strategies if s.quantize == "int8" and s.runtime == "torch"]
    no_int8 = None
    if int8 and args.device != "cpu":
        no_int8 = f"no int8 rows on --device {args.device}: quantize(model, 'int8') is for the CPU"
    elif int8 and importlib.util.find_spec("torchao") is None:
        no_int8 = "no int8 rows: torchao is not installed (pip install transformers-flexcache[int8])"
    if no_int8:
        result.notes.append(no_int8)
        strategies, int8 = [s for s in strategies if s not in int8], []
    peers = []
    if model.ctranslate2_peer and not args.no_ctranslate2:
        # Converted before the torch models move: CTranslate2 reads the fp32 weights on the CPU.
        peers, notes = _ctranslate2_runners(
            upstream, args.threads, device=args.device, dtype=args.dtype, int8=bool(int8)
        )
        result.notes += notes
    # Exported and lowered before the torch models move: ExecuTorch runs the fp32 weights on the CPU.
    exported = _executorch_runners(
        [strategy for strategy in strategies if strategy.runtime != "torch"], upstream, flex, result, args, log
    )
    probe = _logits_probe(model, upstream, result, torch.Generator().manual_seed(args.seed + 2))
    fp32_logits = teacher_forced_logits(upstream, probe) if probe and (int8 or args.dtype != "float32") else None
    dtype = getattr(torch, args.dtype)
    upstream.to(device=args.device, dtype=dtype)
    if flex is not None:
        flex.to(device=args.device, dtype=dtype)
    if fp32_logits is not None and args.dtype != "float32":
        result.logits_error[args.dtype] = logits_error(fp32_logits, teacher_forced_logits(upstream, probe))
    # int8 copies (transformers_flexcache.quantize), in the run's dtype: the upstream one for the eager reference.
    quantized = {}
    if int8:
        quantized[upstream] = quantize(copy.deepcopy(upstream), "int8")
        if flex is not None:
            quantized[flex] = quantize(copy.deepcopy(flex), "int8")
        if fp32_logits is not None:
            result.logits_error["int8"] = logits_error(fp32_logits, teacher_forced_logits(quantized[upstream], probe))

    # Each flexible strategy gets its own model object (a shallow copy: the same weights) and so its own pool: a pool
    # holds one cache by default, and a change of shape policy rebuilds it, which interleaving would do per call.
    references = {strategy.reference for strategy in strategies} | {DYNAMIC_INT8}  # CTranslate2's int8 row's too
    runners = []
    for strategy in strategies:
        if strategy.runtime != "torch":
            continue
        base = flex if strategy.flexible else upstream
        base = quantized[base] if strategy.quantize == "int8" else base
        runner_model = copy.copy(base) if strategy.flexible else base
        runners.append(
            TorchRunner(
                strategy,
                runner_model,
                result.capacities,
                buckets=result.buckets,
                keep_margins=strategy.name in references,
                artifact=(
                    os.path.join(args.artifact, model.name, strategy.name) if getattr(args, "artifact", None) else None
                ),
            )
        )
    for strategy in strategies:
        result.references[strategy.name] = strategy.reference
        # In bf16 the scores often tie exactly (top-1 minus top-2 is 0), and which of two tied tokens argmax takes
        # depends on each kernel's rounding: compiled rows, upstream's included, are held to agreement there.
        if not strategy.exact or (strategy.compile and args.dtype != "float32"):
            result.agreement_only.add(strategy.name)
        if strategy.quantize == "int8" and strategy.runtime == "torch":
            result.int8.add(strategy.name)
    runners += exported
    for peer in peers:
        result.references[peer.name] = DYNAMIC_INT8 if peer.int8 and int8 else BASELINE
        if peer.int8:
            result.int8.add(peer.name)
        if not peer.exact:
            result.agreement_only.add(peer.name)
        runners.append(peer)

    generator = torch.Generator().manual_seed(args.seed + 1)
    warm_up = model.make_inputs(config, 1, min_len, generator)
    for runner in list(runners):
        try:
            if isinstance(runner, TorchRunner) and runner.warms_up_every_shape:
                record = runner.warm_up_every_shape(
                    lambda b, n: model.make_inputs(config, b, n, generator), args.new_tokens
                )
                if record.artifact is not None:
                    result.notes.append(artifact_note(runner.name, record.artifact))
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
    frozen = contextlib.nullcontext(0) if args.no_gc_freeze else frozen_heap()
    with frozen as frozen_objects, Collections() as collections:
        for index, call in enumerate(progress):
            inputs = model.make_inputs(config, call.batch_size, call.length, generator)
            order = runners[index % len(runners) :] + runners[: index % len(runners)]
            result.add_call({runner.name: runner.run(inputs, args.new_tokens) for runner in order})
    result.gc = {"frozen_objects": frozen_objects, **collections.summary()}

    result.decode_step_bytes = _decode_step_bytes(model, upstream, result, generator, args.device)
    if int8:
        result.int8_decode_step_bytes = _decode_step_bytes(model, quantized[upstream], result, generator, args.device)
    if args.bandwidth:
        result.floor_step_ms = 1e3 * sum(result.decode_step_bytes.values()) / args.bandwidth
        if result.int8_decode_step_bytes:
            result.int8_floor_step_ms = 1e3 * sum(result.int8_decode_step_bytes.values()) / args.bandwidth
    torch.compiler.reset()  # compiled graphs and frozen weights of this model are not needed any more
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


def _ctranslate2_runners(upstream, threads: int, *, device: str, dtype: str, int8: bool) -> tuple[list, list[str]]:
    """CTranslate2's rows of the run (its float compute type, and int8 when the run has int8 strategies) and notes on
    what could not run."""
    if device != "cpu":
        return [], [f"CTranslate2 row runs on the CPU only here (--device {device}): no CTranslate2 row"]
    try:
        from .ctranslate2 import COMPUTE_TYPES, INT8_NAME, NAME, CTranslate2Runner, supported_compute_types
    except ImportError:
        return [], [
            "ctranslate2 is not installed: no CTranslate2 row (pip install transformers-flexcache[ctranslate2])"
        ]
    if dtype not in COMPUTE_TYPES:
        return [], [f"no CTranslate2 row with --dtype {dtype}"]
    notes = []
    supported = supported_compute_types()
    wanted = dict(zip((NAME, INT8_NAME), COMPUTE_TYPES[dtype], strict=True))
    if not int8:
        del wanted[INT8_NAME]
    for name, compute_type in list(wanted.items()):
        if compute_type not in supported:
            fallback = "float32" if name == NAME else "int8"
            notes.append(
                f"{name} runs compute_type={fallback!r}: CTranslate2 has no {compute_type!r} on this CPU (it supports "
                f"{', '.join(sorted(supported))})"
            )
            wanted[name] = fallback
    try:
        runners = CTranslate2Runner.from_model(upstream, threads=threads, compute_types=wanted)
    except Exception as error:  # a converter that refuses this checkpoint costs the row, not the run
        return [], [f"CTranslate2 could not convert the model: {type(error).__name__}: {error}"]
    for runner in runners:
        runner.int8 = runner.name == INT8_NAME
        # Held to its reference's tokens only where it computes in the run's own dtype (fp32 against fp32).
        runner.exact = not runner.int8 and runner.compute_type == dtype
    return runners, notes


def _logits_probe(model: BenchModel, upstream, result: ModelResult, generator: torch.Generator) -> dict | None:
    """Inputs of the stream's largest call and a seeded continuation of `new_tokens` decoder tokens, to compare the
    logits of a cast or quantized model with the fp32 model's (None for inputs that are not token ids or features)."""
    config = upstream.config
    largest = max(result.stream, key=lambda call: (call.batch_size, call.length))
    inputs = model.make_inputs(config, largest.batch_size, largest.length, generator)
    low = 3 if config.vocab_size > 3 else 0
    tokens = torch.randint(low, config.vocab_size, (largest.batch_size, result.new_tokens), generator=generator)
    if config.is_encoder_decoder:
        start = upstream.generation_config.decoder_start_token_id
        if start is None:
            return None
        tokens[:, 0] = start
    return {"inputs": inputs, "decoder_tokens": tokens}


def teacher_forced_logits(model, probe: dict) -> torch.Tensor:
    """The logits `model` gives the probe's continuation, fed all at once: [B, N, V], float32, on the CPU."""
    # inputs: the call's; decoder_tokens: [B, N]
    device = model.device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in probe["inputs"].items()}
    tokens = probe["decoder_tokens"].to(device)
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            logits = model(**inputs, decoder_input_ids=tokens).logits
        else:
            ids = torch.cat([inputs["input_ids"], tokens], dim=1)
            mask = torch.cat([inputs["attention_mask"], torch.ones_like(tokens)], dim=1)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -tokens.shape[1] :]
    return logits.float().cpu()


def logits_error(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """How far `other`'s logits lie from the fp32 `reference`'s ([B, N, V] each)."""
    diff = (other - reference).abs()
    return {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "max_abs_logit": reference.abs().max().item(),
        "top1_agreement": (other.argmax(-1) == reference.argmax(-1)).float().mean().item(),
    }


def _append(lists: dict[str, list], name: str, value) -> None:
    if value is not None:
        lists.setdefault(name, []).append(value)


def _differing_rows(index: int, record: CallRecord, reference: CallRecord) -> list[dict]:
    """Rows of call `index` whose tokens differ from the reference's: the first differing step of each, and the
    reference's top-1 minus top-2 score there (None when the reference kept no margins)."""
    if record.tokens.shape != reference.tokens.shape:
        return [{"call": index, "row": None, "step": None, "reference_margin": None}]
    rows = []
    differ = record.tokens != reference.tokens  # [B, N]
    for row in differ.any(dim=-1).nonzero().flatten().tolist():
        step = int(differ[row].nonzero()[0])
        margin = reference.margins[row, step].item() if reference.margins is not None else None
        rows.append({"call": index, "row": row, "step": step, "reference_margin": margin})
    return rows


def artifact_note(name: str, artifact: dict) -> str:
    """The note of a strategy that warmed up from its compiled artifact (`bench --artifact`)."""
    done = "built and loaded" if artifact["built"] else "loaded"
    return (
        f"{name}: compiled artifact {done} in {artifact['seconds']:.1f} s ({artifact['graphs']} graphs, nothing "
        f"traced; {artifact['directory']})"
    )


def _progress(stream, name: str, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(stream, desc=f"{name} calls", unit="call", disable=disable, file=sys.stderr)
