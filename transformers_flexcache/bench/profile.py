"""`transformers-flexcache bench-profile`: where the time of a compiled fp32 decode step goes, kernel by kernel, beside
CTranslate2's same step.

Design decisions:
- The step profiled is the benchmark's: the t5-small-sized T5 (random seeded weights, `bench/models.py`), bucketed and
  compiled (`flexible_static-bucketed-compiled`, with buckets at exactly the profiled batches, so that a batch runs at
  its own rows), one call of `--length` source tokens and `--new-tokens` new tokens per batch, greedy, EOS
  suppressed. A step is what the bench's step timer calls a step: from one logits processor call to the next (the
  forward, upstream's loop around it, the processors).
- The step's time without a profiler is the median of `--rounds` calls (stamped as the bench stamps them). Then one
  call under `torch.profiler`, inductor's generated kernels recorded each (`cpp.enable_kernel_profile`, set for the
  compile of this command only), each step a range of its own: the self time of every kernel inside the ranges,
  grouped (`categorize`): linears by weight shape (oneDNN's, MKL's, eager), the output layer, inductor's one-row
  dot products, attention, layer norms, the graph's other kernels, generate's own tensor ops outside the graph.
  "Python and dispatch" is the unprofiled step less the sum of those kernels: the profiler's own cost falls on
  neither.
- Inductor's C++ backend writes consecutive fused loops into one C++ function until an external call (a library
  linear) ends it: at one row, where no library call remains, the whole step is one function and one profiler
  range. For this command's compile only, each fused group is a function of its own (`CppScheduling`'s
  `MAX_FUSED_KERNEL_ARGS_NUM` at 0 ends a function after every group: the same loops, a call each). Inductor names a
  kernel after the operations it fuses (`descriptive_names="original_aten"`), which `categorize` reads (first rule
  that matches); the last one-row dot product of a step is its output layer.
- The profiler's own cost per recorded op lands in the self time of the small tensor ops around the graph, so those
  are shown apart and not subtracted: "Python, dispatch and small ops" is the unprofiled step less the kernels.
- CTranslate2 has no profiler in its CPU wheels (`init_profiling` is not built); where `perf record` can sample this
  process (a software clock: `perf stat -e instructions` is not supported on a VM without PMU access), the CT2 calls
  are sampled and their samples grouped by symbol (`ct2_categorize`), oneDNN's JIT kernels named through its perf
  map (`ONEDNN_JIT_PROFILE=1`); the shares times CTranslate2's unprofiled step. Its encoder runs inside the sampled
  calls too: the share of the first token is said.
- `--isa avx2` reruns the command in a child capped at AVX2 (`isa.py`, an emulation on this CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict

import torch
from transformers import LogitsProcessor, LogitsProcessorList

STRATEGY = "flexible_static-bucketed-compiled"
DEFAULT_BATCHES = "1,4,8"
ENCODER_CAPACITY = 48  # the bench's default stream: encoder lengths 8..48


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .command import add_isa_argument

    parser.add_argument(
        "--batches", default=DEFAULT_BATCHES, help=f"batch sizes to profile (default {DEFAULT_BATCHES})"
    )
    parser.add_argument("--length", type=int, default=32, help="source tokens of each row (default 32)")
    parser.add_argument("--new-tokens", type=int, default=12, help="new tokens per call (default 12, the bench's)")
    parser.add_argument("--rounds", type=int, default=5, help="unprofiled calls per batch for the step (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads, torch and CTranslate2 (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the tiny T5: a smoke test, timings mean nothing")
    parser.add_argument("--no-ctranslate2", action="store_true", help="profile our step alone")
    add_isa_argument(parser)
    parser.add_argument("--json", metavar="PATH", help="write the tables as JSON")


class StepRanges(LogitsProcessor):
    """Stamps each step (as the bench's step timer) and, under a profiler, opens a `decode_step` range from one call to
    the next."""

    def __init__(self, ranges: bool):
        self.ranges = ranges
        self.stamps: list[float] = []
        self._open = None

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        if self.ranges:
            self.close()
            self._open = torch.autograd.profiler.record_function("decode_step")
            self._open.__enter__()
        return scores

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


ONE_ROW = "one-row linears (inductor dot products)"
OUTPUT_ONE_ROW = "output layer (inductor dot products)"
SMALL_OPS = ("generate's tensor ops (outside the graph)", "graph's other tensor ops")
# Inductor kernel names -> group, first match wins (a fused kernel goes where its heaviest work is).
_KERNEL_RULES = (
    ("attention", re.compile(r"amax|_softmax|\bexp\b|_exp_|scaled_dot|bmm|flash")),
    (ONE_ROW, re.compile(r"_mm_|_mm$|_sum_|_sum$")),
    ("layer norms", re.compile(r"rsqrt|_mean_|native_layer_norm|_var_")),
)
_LINEAR_OPS = {"mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::addmm", "aten::mm", "aten::linear"}


def _linear_shape(event, linear_shapes=frozenset()) -> tuple[int, int, int] | None:
    """(rows, K, N) of a linear event from its recorded input shapes, read by the op's signature (positions, not the
    non-empty shapes: an MKL-packed weight is recorded as `[packed size, 1]`, and reading it as the weight made
    "linear 512x1"):

    - `mkldnn::_linear_pointwise(x [..., K], w [N, K], ...)` and `aten::linear(x, w [N, K], b)`: N from the weight;
    - `mkl::_mkl_linear(x [..., K], packed, w [N, K], b, batch_size)`: N from the original weight (third);
    - `aten::mm(a [M, K], b [K, N])` and `aten::addmm(bias, a, b)`: a product whose operands may come in either
      order: inductor writes a linear as `mm(W [N, K], x^T [K, M])` where it chose the transposed product, which
      read as (rows N, K, N = M) made "linear 512x4" at 4 rows. Where `linear_shapes` (the model's (K, N) of its
      linears) holds (K, M's N) it is the linear as given; where it holds (K, a's M) but not (K, N) it is the
      transposed one: (rows N, K, a's M).
    """
    shapes = [list(s) if s else [] for s in (event.input_shapes or [])]
    name = event.name
    if name in ("mkldnn::_linear_pointwise", "aten::linear") and len(shapes) >= 2:
        x, w = shapes[0], shapes[1]
        if not x or len(w) != 2:
            return None
        return _rows(x), x[-1], w[0]
    if name == "mkl::_mkl_linear" and len(shapes) >= 3:
        x, w = shapes[0], shapes[2]
        if not x or len(w) != 2:
            return None
        return _rows(x), x[-1], w[0]
    if name in ("aten::mm", "aten::addmm"):
        operands = shapes[1:3] if name == "aten::addmm" else shapes[:2]
        if len(operands) < 2 or len(operands[0]) != 2 or len(operands[1]) != 2:
            return None
        (m, k), (_, n) = operands
        if (k, n) not in linear_shapes and (k, m) in linear_shapes:
            return n, k, m  # the transposed product: W [N, K] @ x^T [K, rows]
        return m, k, n
    return None


def _rows(x: list) -> int:
    rows = 1
    for size in x[:-1]:
        rows *= size
    return rows


def categorize(event, vocab_size: int, in_graph: bool, linear_shapes=frozenset()) -> str | None:
    """The group of one profiler event's self time (None: not a kernel: Python ranges, the graph's call).
    `linear_shapes`: the model's (in, out) features of its linears, which tell a transposed product apart."""
    name = event.name
    if name in _LINEAR_OPS:
        shape = _linear_shape(event, linear_shapes)
        if shape is None:
            return "linears (shape not recorded)"
        rows, k, n = shape
        if n == vocab_size:
            return f"output layer {k}x{n}"
        if linear_shapes and (k, n) not in linear_shapes:
            return f"matmul {rows}x{k}x{n}" + ("" if in_graph else " (eager)")
        return f"linear {k}x{n}" + ("" if in_graph else " (eager)")
    if "cpp_fused" in name or name.startswith("graph_"):
        for group, rule in _KERNEL_RULES:
            if rule.search(name):
                return group
        return "other graph kernels (cache writes, residuals, copies)"
    if "scaled_dot_product" in name:
        return "attention"
    if name.startswith(("aten::", "mkldnn::", "mkl::", "quantized::", "transformers_flexcache::")):
        return "graph's other tensor ops" if in_graph else "generate's tensor ops (outside the graph)"
    return None


def _in_graph(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("## Call CompiledFxGraph") or "Compiled Region" in parent.name:
            return True
        parent = parent.cpu_parent
    return False


def group_profile(events, vocab_size: int, linear_shapes=frozenset()) -> tuple[dict[str, float], int, dict[str, set]]:
    """(`{group: microseconds summed over the steps}`, steps, `{group: kernel names}`) of the events inside
    `decode_step` ranges; `linear_shapes` as for `categorize`."""
    steps = [e for e in events if e.name == "decode_step"]
    spans = sorted((e.time_range.start, e.time_range.end) for e in steps)
    totals: dict[str, float] = defaultdict(float)
    names: dict[str, set] = defaultdict(set)
    last_dot: dict[int, tuple] = {}
    for event in events:
        if event.name == "decode_step":
            continue
        start = event.time_range.start
        if not any(a <= start <= b for a, b in spans):
            continue
        group = categorize(event, vocab_size, _in_graph(event), linear_shapes)
        if group is None:
            continue
        totals[group] += event.self_cpu_time_total
        names[group].add(event.name)
        if group == ONE_ROW:
            step = next(i for i, (a, b) in enumerate(spans) if a <= start <= b)
            if start >= last_dot.get(step, (-1, None))[0]:
                last_dot[step] = (start, event)
    for _, event in last_dot.values():  # the step's last dot product: its output layer
        totals[ONE_ROW] -= event.self_cpu_time_total
        totals[OUTPUT_ONE_ROW] += event.self_cpu_time_total
        names[OUTPUT_ONE_ROW].add(event.name)
    return dict(totals), len(steps), names


# CTranslate2's samples: symbol -> group, first match wins.
_CT2_RULES = (
    ("GEMMs (oneDNN sgemm / JIT)", re.compile(r"gemm|jit|dnnl|matmul|inner_product|brg|\[unknown\]|^0x", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
    ("layer norms", re.compile(r"layer_?norm|rms_?norm", re.I)),
    ("attention (other)", re.compile(r"attention|transpose|split_heads|combine_heads|dot_product", re.I)),
    ("memory (alloc, copy, fill)", re.compile(r"malloc|free|memcpy|memmove|memset|alloc|copy|fill", re.I)),
    ("elementwise and other ops", re.compile(r"ctranslate2|primitives|add|relu|gelu|exp|max", re.I)),
)


def ct2_categorize(symbol: str) -> str:
    for group, rule in _CT2_RULES:
        if rule.search(symbol):
            return group
    return "runtime, Python and the rest"


def perf_available() -> bool:
    """Whether `perf record` can sample a process of this user (a software clock is enough)."""
    if shutil.which("perf") is None:
        return False
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            ["perf", "record", "-q", "-e", "cpu-clock", "-o", os.path.join(folder, "p.data"), "--", "true"],
            capture_output=True,
            timeout=60,
        )
    return done.returncode == 0


@contextlib.contextmanager
def perf_samples(result: dict):
    """Samples this process with `perf record` while the context runs; `result["symbols"]` is then
    `{symbol: share}` (perf's percentages / 100)."""
    folder = tempfile.mkdtemp(prefix="flexcache-perf-")
    path = os.path.join(folder, "perf.data")
    recorder = subprocess.Popen(
        ["perf", "record", "-q", "-e", "cpu-clock", "-F", "2000", "-p", str(os.getpid()), "-o", path],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # perf attaches
    try:
        yield result
    finally:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=120)
        report = subprocess.run(
            ["perf", "report", "-i", path, "--stdio", "--sort", "sym", "--percent-limit", "0.05"],
            capture_output=True,
            text=True,
            timeout=600,
        ).stdout
        symbols = {}
        for line in report.splitlines():
            match = re.match(r"\s*([\d.]+)%\s+\[[.k]\]\s+(.*\S)", line)
            if match:
                symbols[match.group(2)] = symbols.get(match.group(2), 0.0) + float(match.group(1)) / 100
        result["symbols"] = symbols
        shutil.rmtree(folder, ignore_errors=True)


def _torch_rows(args, model, config, batches: list[int], log) -> dict:
    from ..compile import compile_settings, kernel_profile_compile, model_linear_shapes
    from .models import BENCH_MODELS
    from .strategies import STRATEGIES_BY_NAME
    from .torch_runner import TorchRunner

    bench_model = BENCH_MODELS["t5"]
    capacities = {"max_batch_size": max(batches), "max_cache_len": args.new_tokens + 1}
    capacities["max_encoder_len"] = max(args.length, ENCODER_CAPACITY if not args.quick else args.length)
    buckets = {"max_batch_size": sorted(batches), "max_encoder_len": [capacities["max_encoder_len"]]}
    runner = TorchRunner(STRATEGIES_BY_NAME[STRATEGY], model, capacities, buckets=buckets)
    generator = torch.Generator().manual_seed(args.seed + 1)
    started = time.perf_counter()
    with kernel_profile_compile():
        runner.warm_up_every_shape(lambda b, n: bench_model.make_inputs(config, b, n, generator), args.new_tokens)
    log(f"compiled {len(batches)} decode graphs and the encoder in {time.perf_counter() - started:.0f} s")
    kwargs = runner.generate_kwargs
    rows = {}
    for batch in batches:
        inputs = bench_model.make_inputs(config, batch, args.length, generator)

        def call(stamps: StepRanges, inputs=inputs):
            with compile_settings(kwargs.get("compile_config")):
                return model.generate(
                    **inputs,
                    max_new_tokens=args.new_tokens,
                    do_sample=False,
                    num_beams=1,
                    logits_processor=LogitsProcessorList([runner.no_eos, stamps]),
                    **kwargs,
                )

        steps = []
        for _ in range(args.rounds):
            stamps = StepRanges(ranges=False)
            call(stamps)
            steps += stamps.steps()
        step_ms = 1e3 * statistics.median(steps)
        stamps = StepRanges(ranges=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            call(stamps)
            stamps.close()
        totals, n_steps, names = group_profile(prof.events(), config.vocab_size, frozenset(model_linear_shapes(model)))
        groups = {group: us / 1e3 / max(n_steps, 1) for group, us in totals.items()}
        kernels = sum(ms for group, ms in groups.items() if group not in SMALL_OPS)
        rows[batch] = {
            "step_ms": step_ms,
            "profiled_step_ms": 1e3 * statistics.median(stamps.steps()),
            "groups_ms": groups,
            "kernels_ms": kernels,
            "python_and_dispatch_ms": step_ms - kernels,
            "kernels": {group: sorted(n)[:8] for group, n in names.items()},
        }
        log(f"B={batch}: step {step_ms:.2f} ms, kernels {kernels:.2f} ms")
    return rows


def _ct2_rows(args, upstream, batches: list[int], log) -> dict:
    from .ctranslate2 import CTranslate2Runner
    from .models import BENCH_MODELS

    (runner,) = CTranslate2Runner.from_model(upstream, threads=args.threads)
    bench_model = BENCH_MODELS["t5"]
    generator = torch.Generator().manual_seed(args.seed + 1)
    sampled = perf_available()
    rows = {}
    for batch in batches:
        inputs = bench_model.make_inputs(upstream.config, batch, args.length, generator)
        runner.run(inputs, 2)
        records = [runner.run(inputs, args.new_tokens) for _ in range(args.rounds)]
        step_ms = 1e3 * statistics.median([s for r in records for s in r.step_s])
        first_ms = 1e3 * statistics.median([r.first_token_s for r in records])
        row = {"step_ms": step_ms, "first_token_ms": first_ms}
        if sampled:
            perf: dict = {}
            calls = max(3, args.rounds * 2)
            with perf_samples(perf):
                started = time.perf_counter()
                for _ in range(calls):
                    runner.run(inputs, args.new_tokens)
                busy_s = time.perf_counter() - started
            shares: dict[str, float] = defaultdict(float)
            for symbol, share in perf.get("symbols", {}).items():
                shares[ct2_categorize(symbol)] += share
            total = sum(shares.values()) or 1.0
            # the sampled seconds are the calls' (plus perf's attach); each call is a first token and the steps
            call_s = busy_s / calls
            encoder_share = (first_ms / 1e3) / call_s if call_s else 0.0
            row["perf_shares"] = {group: share / total for group, share in shares.items()}
            row["encoder_share_of_samples"] = encoder_share
            row["top_symbols"] = sorted(perf.get("symbols", {}).items(), key=lambda kv: -kv[1])[:15]
        rows[batch] = row
        log(f"CTranslate2 B={batch}: step {step_ms:.2f} ms")
    return rows


def format_tables(report: dict) -> str:
    lines = [
        f"bench-profile: {report['model']}, {report['threads']} thread(s); CPU: {report['cpu_line']}",
        f"load average at the start {report['load_average']}; torch {report['torch_version']}",
    ]
    torch_rows, ct2_rows = report["torch"], report.get("ctranslate2") or {}
    batches = sorted(torch_rows, key=int)
    groups = sorted({g for row in torch_rows.values() for g in row["groups_ms"]} - set(SMALL_OPS))
    header = "| ms per step | " + " | ".join(f"B={b}" for b in batches) + " |"
    lines += ["", "Ours (" + STRATEGY + "), torch.profiler self time per step:", "", header]
    lines.append("|---|" + "---|" * len(batches))
    for group in groups:
        cells = [f"{torch_rows[b]['groups_ms'].get(group, 0.0):.2f}" for b in batches]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    lines.append("| **kernels** | " + " | ".join(f"**{torch_rows[b]['kernels_ms']:.2f}**" for b in batches) + " |")
    for group in SMALL_OPS:
        cells = [f"{torch_rows[b]['groups_ms'].get(group, 0.0):.2f}" for b in batches]
        lines.append(f"| ({group}, as profiled: inflated by the profiler) | " + " | ".join(cells) + " |")
    lines.append(
        "| Python, dispatch and small ops (step less kernels) | "
        + " | ".join(f"{torch_rows[b]['python_and_dispatch_ms']:.2f}" for b in batches)
        + " |"
    )
    lines.append(
        "| **step (unprofiled median)** | " + " | ".join(f"**{torch_rows[b]['step_ms']:.2f}**" for b in batches) + " |"
    )
    if ct2_rows:
        lines += ["", "CTranslate2 (float32): step, and perf's shares of its calls' samples:", "", header]
        lines.append("|---|" + "---|" * len(batches))
        lines.append(
            "| **step (unprofiled median)** | "
            + " | ".join(f"**{ct2_rows[b]['step_ms']:.2f}**" for b in batches)
            + " |"
        )
        lines.append(
            "| step / ours | "
            + " | ".join(f"{ct2_rows[b]['step_ms'] / torch_rows[b]['step_ms']:.2f}x" for b in batches)
            + " |"
        )
        shared = sorted({g for b in batches for g in ct2_rows[b].get("perf_shares", {})})
        for group in shared:
            cells = []
            for b in batches:
                share = ct2_rows[b]["perf_shares"].get(group, 0.0)
                cells.append(f"{100 * share:.0f}% ({share * ct2_rows[b]['step_ms']:.2f})")
            lines.append(f"| {group} | " + " | ".join(cells) + " |")
        if shared:
            lines.append(
                "| encoder's share of the samples | "
                + " | ".join(f"{100 * ct2_rows[b]['encoder_share_of_samples']:.0f}%" for b in batches)
                + " |"
            )
    return "\n".join(lines)


def run(args, parser: argparse.ArgumentParser) -> int:
    from .command import rerun_for_isa

    try:
        batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        parser.error(f"--batches {args.batches!r}: comma-separated integers, e.g. {DEFAULT_BATCHES}")
    if not batches or min(batches) < 1:
        parser.error(f"--batches {args.batches!r}: batch sizes of at least 1")
    for name in ("length", "new_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.new_tokens < 3:
        parser.error(f"--new-tokens={args.new_tokens}: a profile needs at least 3 (two decode steps)")
    status = rerun_for_isa(args)
    if status is not None:
        return status

    from ..compile import cpu_facts, recompile_limits
    from .models import BENCH_MODELS, build_models

    torch.set_num_threads(args.threads)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    upstream, flex = build_models(BENCH_MODELS["t5"], quick=args.quick, seed=args.seed)
    report = {
        "model": "tiny T5 (--quick)" if args.quick else BENCH_MODELS["t5"].description,
        "threads": args.threads,
        "cpu_line": cpu_facts().describe(),
        "load_average": "/".join(f"{v:.1f}" for v in load) if load else "-",
        "torch_version": torch.__version__,
        "batches": batches,
    }
    with recompile_limits(64, 512):
        report["torch"] = _torch_rows(args, flex, upstream.config, batches, print)
    if not args.no_ctranslate2:
        try:
            import ctranslate2  # noqa: F401
        except ImportError:
            report["ctranslate2"] = None
            print("no CTranslate2 rows: pip install transformers-flexcache[ctranslate2]")
        else:
            os.environ.setdefault("ONEDNN_JIT_PROFILE", "1")  # oneDNN's JIT kernels named in perf's map
            report["ctranslate2"] = _ct2_rows(args, upstream, batches, print)
    report["torch"] = {str(b): row for b, row in report["torch"].items()}
    if report.get("ctranslate2"):
        report["ctranslate2"] = {str(b): row for b, row in report["ctranslate2"].items()}
    print(format_tables(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"written to {args.json}")
    return 0
