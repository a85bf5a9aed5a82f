"""The load benchmark: an open-loop stream of independent requests against each way of serving them, side by side.

`transformers-flexcache bench-serve` (or `python -m transformers_flexcache bench-serve`).

Design decisions:
- One seeded stream per model: requests of one source each (lengths uniform in 8-128 tokens, ids that avoid special
  tokens), each with its own `max_new_tokens` (uniform in 8-64; EOS ends some sooner), arriving as a Poisson process.
  The same requests run at several offered loads (only the arrival times scale), open loop: a request arrives when
  its time comes, whether or not the server keeps up, so an overloaded strategy shows it in its latency.
- Strategies, each given every request at its arrival time, in one process, one after the other per load:
  - `one-at-a-time`: a queue and one `generate` at a time with upstream's DynamicCache (what `transformers serve`
    does). Its tokens are the reference of every other strategy: upstream on the request alone.
  - `static-batching`: collect up to `max_batch_size` requests or `--batch-timeout` seconds after the first, then
    one `generate` call on the flexible cache (sources right-padded and masked), run until its longest row ends; each
    request's tokens are its row cut at its own `max_new_tokens`.
  - `in-flight` and `in-flight-compiled`: the serving engine (`transformers_flexcache.serving.Engine`), eager, and
    compiled with `compile_config_for_cpu()` over a bucketed policy after `warmup()` (compile time reported apart).
  - `ctranslate2`: CTranslate2's `translate_batch` (fp32, the same weights, the same threads) with the same static
    batching.
- The stream is greedy by default; `--num-beams B --num-hypotheses K` makes it the beam-search translation stream:
  every request asks for the K best of B beams with their scores (`/v1/completions` with `n=K` and `num_beams=B`;
  CTranslate2's `beam_size`, `num_hypotheses` and `return_scores`), and a batching strategy takes
  `max_batch_size // B` requests per batch, the rows of the engine's seats. Each torch strategy's hypotheses must
  equal one-at-a-time's, and their scores are compared (`scores` in the notes); CTranslate2's beam search is its own
  (its length normalization and stopping differ from `generate`'s), so its hypotheses are counted, not required equal.
  Static batching is left out of the beam stream by default: a batch decodes to its longest request's
  `max_new_tokens`, and a beam search's hypotheses depend on where it must stop, so a batch's hypotheses are not each
  request's own (greedy tokens are: cut at the request's own limit, they are the same). Named with `--strategies`,
  it runs, unchecked. Nothing streams a beam search's tokens: the time to first token is left out. The goals read
  each strategy's capacity and the p99 at the lowest load (`beam_goals`).
- Figures per strategy and load: completed requests/s and tokens/s over the span from the first arrival to the last
  completion, p50/p95/p99 latency (arrival to completion), p50 time to first token (the first decoded token; for
  batched strategies the batch's first step), mean seats in use (the engine's, sampled at every arrival and
  completion; the batch size for the batching strategies), cache storage allocated during the stream (the bench's
  allocation counter on the caches each forward sees; not available for CTranslate2 and compiled forwards, whose
  caches are checked by address instead), and how many requests' tokens equal the reference.
- The garbage collector's heap is frozen once a model's strategies are built and warmed up, for its loads
  (`compile.gc_heap.frozen_heap`), as `serve` freezes it before it opens its port; the collections seen during them are
  reported (`gc`).
- `--models whisper` runs a transcription stream instead (recordings of mixed lengths, some over Whisper's 30 s window)
  against upstream's generate one at a time and faster-whisper: `bench/serve_audio.py`.
- Goals, read off the table: at the offered load where static batching saturates (its completed rate falls below
  90% of the offered one), the compiled engine's request throughput over static batching's (goal: at least 1.5x) and
  its p99 latency over static batching's (at most 0.5x); against CTranslate2 at that load, at least its throughput
  at an equal or lower p99.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from ..compile import Collections, frozen_heap
from .models import BENCH_MODELS, _special_ids, build_models
from .report import gc_line, machine_info
from .serve_strategies import STRATEGIES, Decoding, LoadRequest, Strategy, build_strategies

SERVE_MODELS = ("t5", "marian")
LOAD_MULTIPLES = (1.0, 2.0, 4.0, 8.0)  # offered loads, in multiples of one-at-a-time's service rate


@dataclass
class LoadRow:
    """One strategy at one offered load."""

    model: str
    strategy: str
    offered_rps: float
    completed_rps: float = 0.0
    tokens_per_s: float = 0.0
    p50_s: float = math.nan
    p95_s: float = math.nan
    p99_s: float = math.nan
    ttft_p50_s: float = math.nan
    mean_seats: float = math.nan
    cache_allocations: int | None = None
    tokens_equal: int = 0
    num_requests: int = 0
    failed: int = 0
    compile_s: float | None = None
    notes: list = field(default_factory=list)


def make_stream(
    config, *, num_requests: int, seed: int, quick: bool, max_new_tokens: int | None = None
) -> list[LoadRequest]:
    """Seeded requests: source lengths 8-128 (4-12 with `quick`), 8-64 new tokens (2-8, and at most
    `max_new_tokens`, the capacity's), Poisson arrivals at 1/s."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(config.vocab_size) if i not in _special_ids(config)])
    low, high = (4, 12) if quick else (8, 128)
    new_low, new_high = (2, 8) if quick else (8, 64)
    if max_new_tokens is not None:
        new_low, new_high = min(new_low, max_new_tokens), min(new_high, max_new_tokens)
    arrival, stream = 0.0, []
    for index in range(num_requests):
        arrival += float(torch.empty(()).exponential_(generator=generator))
        length = int(torch.randint(low, high + 1, (), generator=generator))
        ids = allowed[torch.randint(len(allowed), (1, length), generator=generator)]
        new_tokens = int(torch.randint(new_low, new_high + 1, (), generator=generator))
        stream.append(LoadRequest(index, arrival, ids, new_tokens))
    return stream


# --- running a stream -------------------------------------------------------------------------------------------
def run_stream(strategy: Strategy, stream: list[LoadRequest], rate: float, *, timeout: float) -> None:
    """Submit every request at its arrival time (open loop), then wait (at most `timeout` s) for every outcome.

    Raises:
        RuntimeError: the strategy's server stopped (its cause is what stopped it), raised as soon as it is seen.
        TimeoutError: the stream did not finish within `timeout` seconds.
    """
    strategy.start()
    start = time.perf_counter()
    try:
        for request in stream:
            wait = start + request.arrival / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            _raise_failure(strategy)
            strategy.submit(request, time.perf_counter())
        deadline = time.perf_counter() + timeout
        while any(math.isnan(outcome.done) for outcome in list(strategy.outcomes.values())):
            _raise_failure(strategy)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{strategy.name}: the stream did not finish within {timeout} s")
            time.sleep(0.005)
        _raise_failure(strategy)
    finally:
        strategy.stop()


def _raise_failure(strategy: Strategy) -> None:
    if strategy.failure is not None:
        raise RuntimeError(f"{strategy.name}: its server stopped with {strategy.failure!r}") from strategy.failure


def summarize(
    model: str, strategy: Strategy, rate: float, reference: dict | None, reference_scores: dict | None = None
) -> LoadRow:
    outcomes = [strategy.outcomes[index] for index in sorted(strategy.outcomes)]
    served = [outcome for outcome in outcomes if outcome.error is None]
    span = max(outcome.done for outcome in outcomes) - min(outcome.arrival for outcome in outcomes)
    latencies = sorted(outcome.done - outcome.arrival for outcome in served)
    first = [outcome.first_token - outcome.arrival for outcome in served if not math.isnan(outcome.first_token)]
    tokens = sum(outcome.num_tokens for outcome in served)
    equal = sum(
        reference is None or (outcome.tokens == reference.get(index))
        for index, outcome in sorted(strategy.outcomes.items())
        if outcome.error is None
    )
    return LoadRow(
        model=model,
        strategy=strategy.name,
        offered_rps=rate,
        completed_rps=len(served) / span if span > 0 else math.nan,
        tokens_per_s=tokens / span if span > 0 else math.nan,
        p50_s=_percentile(latencies, 50),
        p95_s=_percentile(latencies, 95),
        p99_s=_percentile(latencies, 99),
        ttft_p50_s=_percentile(sorted(first), 50),
        mean_seats=statistics.fmean(strategy.seats) if strategy.seats else math.nan,
        cache_allocations=strategy.allocations(),
        tokens_equal=equal,
        num_requests=len(outcomes),
        failed=len(outcomes) - len(served),
        compile_s=strategy.compile_s,
        notes=list(strategy.notes) + _first_error(outcomes, strategy.name) + _score_note(strategy, reference_scores),
    )


def _score_note(strategy: Strategy, reference_scores: dict | None) -> list[str]:
    """Beam search: how far a torch strategy's hypothesis scores are from one-at-a-time's (same hypotheses only)."""
    if not reference_scores or strategy.name in ("one-at-a-time", "ctranslate2"):
        return []
    gaps = [
        abs(score - expected)
        for index, outcome in strategy.outcomes.items()
        if outcome.scores is not None and reference_scores.get(index) is not None
        for score, expected in zip(outcome.scores, reference_scores[index], strict=True)
    ]
    return [f"{strategy.name}: scores within {max(gaps):.1e} of one-at-a-time's"] if gaps else []


def _first_error(outcomes: list, name: str) -> list[str]:
    """A failed request is a row of the report, not a crash: the note says why the first one failed."""
    errors = [outcome.error for outcome in outcomes if outcome.error is not None]
    return [f"{name}: {len(errors)} request(s) failed, the first with {errors[0]}"] if errors else []


def _percentile(values: list[float], percent: float) -> float:
    if not values:
        return math.nan
    rank = min(len(values) - 1, max(0, math.ceil(percent / 100 * len(values)) - 1))
    return values[rank]


def goals(rows: list[LoadRow]) -> list[str]:
    """The issue's goals, read off the rows of one model."""
    by = {(row.strategy, row.offered_rps): row for row in rows}
    loads = sorted({row.offered_rps for row in rows})
    static = [by.get(("static-batching", load)) for load in loads]
    if not any(static) or not any(("in-flight-compiled", load) in by for load in loads):
        return ["goals need the static-batching and in-flight-compiled strategies"]
    saturated = next((row for row in static if row and row.completed_rps < 0.9 * row.offered_rps), None)
    where = saturated or static[-1]
    lines = [
        f"static batching saturates at {where.offered_rps:.2f} req/s offered "
        f"({where.completed_rps:.2f} completed)" + ("" if saturated else " (did not saturate: highest load)")
    ]
    engine = by.get(("in-flight-compiled", where.offered_rps))
    if not (where.completed_rps > 0 and engine.completed_rps > 0):
        return [*lines, "goals: a strategy completed no request at that load (see the notes)"]
    lines.append(
        f"in-flight compiled / static batching there: throughput {engine.completed_rps / where.completed_rps:.2f}x "
        f"(goal >= 1.5x), p99 {engine.p99_s / where.p99_s:.2f}x (goal <= 0.5x)"
    )
    peer = by.get(("ctranslate2", where.offered_rps))
    if peer is not None and peer.completed_rps > 0:
        lines.append(
            f"in-flight compiled / CTranslate2 there: throughput {engine.completed_rps / peer.completed_rps:.2f}x "
            f"(goal >= 1x), p99 {engine.p99_s / peer.p99_s:.2f}x (goal <= 1x)"
        )
    # At one offered load no strategy completes more than it is offered: where static batching just saturates (90%
    # of the offered rate) a ratio of 1.5x cannot be reached there. Each strategy's capacity, its highest completed
    # rate over all loads, is the figure that can show it.
    peaks = {
        name: max((row.completed_rps for row in rows if row.strategy == name), default=0.0)
        for name in ("static-batching", "in-flight-compiled", "ctranslate2")
    }
    if peaks["static-batching"] > 0:
        line = (
            f"capacity (highest completed req/s over the loads): in-flight compiled {peaks['in-flight-compiled']:.2f}, "
            f"static batching {peaks['static-batching']:.2f} "
            f"({peaks['in-flight-compiled'] / peaks['static-batching']:.2f}x)"
        )
        if peaks["ctranslate2"] > 0:
            line += (
                f", CTranslate2 {peaks['ctranslate2']:.2f} ({peaks['in-flight-compiled'] / peaks['ctranslate2']:.2f}x)"
            )
        lines.append(line)
    return lines


def beam_goals(rows: list[LoadRow]) -> list[str]:
    """The beam-search stream's figures against one-at-a-time and CTranslate2: each strategy's capacity (its highest
    completed rate over the loads), and the p99 latencies at the lowest load."""
    peaks = {}
    for row in rows:
        peaks[row.strategy] = max(peaks.get(row.strategy, 0.0), row.completed_rps)
    engine = peaks.get("in-flight-compiled", peaks.get("in-flight"))
    name = "in-flight compiled" if "in-flight-compiled" in peaks else "in-flight"
    if not engine:
        return ["beam goals need an in-flight strategy"]
    parts = [f"{name} {engine:.2f}"]
    for other, title in (("one-at-a-time", "one-at-a-time"), ("ctranslate2", "CTranslate2")):
        if peaks.get(other):
            parts.append(f"{title} {peaks[other]:.2f} ({engine / peaks[other]:.2f}x)")
    lines = ["capacity (highest completed req/s over the loads): " + ", ".join(parts)]
    lowest = min(row.offered_rps for row in rows)
    p99 = {row.strategy: row.p99_s for row in rows if row.offered_rps == lowest}
    lines.append(
        f"p99 at the lowest load ({lowest:.2f} req/s): "
        + ", ".join(f"{strategy} {seconds:.2f} s" for strategy, seconds in p99.items())
    )
    return lines


COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("offered_rps", "offered req/s", "{:.2f}"),
    ("completed_rps", "req/s", "{:.2f}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("p50_s", "p50 s", "{:.2f}"),
    ("p95_s", "p95 s", "{:.2f}"),
    ("p99_s", "p99 s", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("mean_seats", "seats", "{:.1f}"),
    ("cache_allocations", "cache allocs", "{}"),
    ("tokens_equal", "tokens equal", "{}"),
]


def format_table(rows: list[LoadRow]) -> str:
    header = [title for _, title, _ in COLUMNS]
    cells = [
        [
            (
                "-"
                if getattr(row, key) is None or getattr(row, key) != getattr(row, key)
                else fmt.format(getattr(row, key))
            )
            + (f"/{row.num_requests}" if key == "tokens_equal" else "")
            for key, _, fmt in COLUMNS
        ]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    lines = [
        " | ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)) for line in [header, *cells]
    ]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default=",".join(SERVE_MODELS),
        help="comma-separated: t5, marian, whisper (a transcription stream of recordings of 5-75 s)",
    )
    parser.add_argument(
        "--strategies",
        default=None,
        help="comma-separated, from " + ", ".join(STRATEGIES) + " (default: all; with --num-beams all but "
        "static-batching)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, a short stream (tests, a first look)")
    parser.add_argument("--requests", type=int, default=None, help="requests per load (default 48, --quick 8)")
    parser.add_argument(
        "--loads",
        default=None,
        help="offered loads in req/s, comma-separated (default: 1, 2, 4 and 8 times one-at-a-time's measured rate)",
    )
    parser.add_argument("--max-batch-size", type=int, default=8, help="seats, and the static batches' rows")
    parser.add_argument(
        "--num-beams", type=int, default=1, help="beam search of this many beams (the beam-search translation stream)"
    )
    parser.add_argument(
        "--num-hypotheses", type=int, default=1, help="with --num-beams: hypotheses returned per request, with scores"
    )
    parser.add_argument("--max-new-tokens", type=int, default=None, help="the largest max_new_tokens (64, quick 8)")
    parser.add_argument("--batch-timeout", type=float, default=0.05, help="static batching: seconds to wait for more")
    parser.add_argument("--max-queue", type=int, default=1024, help="the engine's queue (the stream never overflows)")
    parser.add_argument("--threads", type=int, default=1, help="torch (and CTranslate2) intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a stream may take before it fails")
    parser.add_argument("--json", default=None, help="write every row and the goals to this JSON file")


def run(args, parser=None) -> int:
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        # The compiled engine's default buckets make 12 decode graphs (`serving/buckets.py`); dynamo keeps 8 of one
        # function by default. Raised for this command only, as `bench` does.
        from ..compile import recompile_limits

        with recompile_limits(64, 512):
            return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # as `bench` does: a caller in the same process keeps its threads


def _run(args) -> int:
    if not 1 <= args.num_hypotheses <= args.num_beams <= args.max_batch_size:
        raise SystemExit(
            f"--num-hypotheses {args.num_hypotheses}, --num-beams {args.num_beams}, --max-batch-size "
            f"{args.max_batch_size}: pass 1 <= hypotheses <= beams <= max batch size"
        )
    decoding = Decoding(num_beams=args.num_beams, num_return_sequences=args.num_hypotheses)
    args.requests = args.requests or (8 if args.quick else 48)
    args.max_new_tokens = args.max_new_tokens or (8 if args.quick else 64)
    default = [name for name in STRATEGIES if not (decoding.beams and name == "static-batching")]
    names = [name.strip() for name in args.strategies.split(",") if name.strip()] if args.strategies else default
    if "one-at-a-time" not in names:
        names.insert(0, "one-at-a-time")  # its tokens are the reference of the others
    machine = machine_info(args.threads)
    print(
        f"machine: {_isa()}, {machine['cpu_count']} cores, {args.threads} thread(s), load average "
        f"{machine['load_average_at_start']}; torch {machine['torch']}, transformers {machine['transformers']}, "
        f"ctranslate2 {machine['ctranslate2']}; decoding: {decoding.describe()}"
    )
    report = {
        "command": {k: v for k, v in vars(args).items() if k not in ("handler", "subparser")},
        "machine": machine,
    }
    report["models"] = {}
    all_equal = True
    # CTranslate2 decodes its own way; a static batch's beam search runs to the batch's longest max_new_tokens, and a
    # beam search's hypotheses depend on where it must stop (see the module docstring)
    unchecked = {"ctranslate2"} | ({"static-batching"} if decoding.beams else set())
    for model_name in [name.strip() for name in args.models.split(",") if name.strip()]:
        if model_name == "whisper":  # a transcription stream (`bench/serve_audio.py`)
            from .serve_audio import run as run_transcriptions

            report["models"]["whisper"] = part = run_transcriptions(args, serve=sys.modules[__name__])
            all_equal &= all(
                row["tokens_equal"] == row["num_requests"]
                for row in part["rows"]
                if row["strategy"] != "faster-whisper"
            )
            continue
        bench_model = BENCH_MODELS[model_name]
        upstream, flex = build_models(bench_model, quick=args.quick, seed=args.seed)
        stream = make_stream(
            upstream.config,
            num_requests=args.requests,
            seed=args.seed,
            quick=args.quick,
            max_new_tokens=args.max_new_tokens,
        )
        max_encoder_len = max(request.input_ids.shape[1] for request in stream)
        # Dynamo counts graphs per function, across models: every model's decode step is `FlexModelMixin.__call__`,
        # so the previous model's graphs (its strategies are closed) would count against this one's limit.
        torch.compiler.reset()
        strategies = build_strategies(
            names, upstream, flex, args=args, max_encoder_len=max_encoder_len, decoding=decoding
        )
        base_rate = _service_rate(strategies[0], stream)
        loads = (
            [float(load) for load in args.loads.split(",")]
            if args.loads
            else [round(base_rate * multiple, 3) for multiple in LOAD_MULTIPLES]
        )
        rows = []
        with frozen_heap() as frozen, Collections() as collections:
            for rate in loads:
                reference = reference_scores = None
                for strategy in strategies:
                    run_stream(strategy, stream, rate, timeout=args.timeout)
                    row = summarize(model_name, strategy, rate, reference, reference_scores)
                    if strategy.name == "one-at-a-time":
                        reference = {index: outcome.tokens for index, outcome in strategy.outcomes.items()}
                        reference_scores = {index: outcome.scores for index, outcome in strategy.outcomes.items()}
                        row.tokens_equal = row.num_requests - row.failed
                    rows.append(row)
                    all_equal &= row.tokens_equal == row.num_requests or strategy.name in unchecked
        collector = {"frozen_objects": frozen, **collections.summary()}
        for strategy in strategies:
            strategy.close()
        print(
            f"\n{model_name} ({bench_model.description if not args.quick else 'tiny'}): {len(stream)} requests per "
            f"load, one-at-a-time serves {base_rate:.2f} req/s"
        )
        print(format_table(rows))
        compile_s = {row.strategy: row.compile_s for row in rows if row.compile_s is not None}
        if compile_s:
            print(
                "compile and warm-up (excluded from the rows): "
                + ", ".join(f"{k} {v:.0f} s" for k, v in compile_s.items())
            )
        print(gc_line(collector, during="the loads"))
        notes = sorted({note for row in rows for note in row.notes})
        for note in notes:
            print(f"note: {note}")
        verdict = beam_goals(rows) if decoding.beams else goals(rows)
        for line in verdict:
            print(line)
        report["models"][model_name] = {
            "rows": [asdict(row) for row in rows],
            "goals": verdict,
            "loads": loads,
            "gc": collector,
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if all_equal else 1


def _isa() -> str:
    """The CPU and the vector extensions it has that matter to the figures (AVX2, AVX-512, VNNI, bf16, AMX)."""
    from ..compile import cpu_facts

    return cpu_facts().describe()


def _service_rate(one_at_a_time: Strategy, stream: list[LoadRequest]) -> float:
    """Requests per second that one-at-a-time serves, from its first three requests run back to back."""
    sample = stream[:3]
    start = time.perf_counter()
    run_stream(
        one_at_a_time,
        [LoadRequest(i, 0.0, r.input_ids, r.max_new_tokens) for i, r in enumerate(sample)],
        1.0,
        timeout=600,
    )
    return len(sample) / (time.perf_counter() - start)
