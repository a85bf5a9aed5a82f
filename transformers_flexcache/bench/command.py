"""`transformers-flexcache bench`: one stream of generate calls, run under each cache strategy, side by side.

The command line: its options (`add_arguments`), their defaults and checks, and the run over the models, which
prints and writes the report. The rest of the benchmark sits beside it: `stream.py` (the calls), `strategies.py`
(the ways to run them), `torch_runner.py` (one strategy through `generate`), `model_run.py` (one model's run,
compared with DynamicCache), `measure.py`, `report.py`, `models.py`, `ctranslate2.py`, `executorch.py`.

Design decisions:
- Inductor's on-disk cache is torch's own by default (`--inductor-cache`), so a second run on a machine reuses the
  kernels of the first, as a restarted server would; the header says how many files it held at the start, and
  `--inductor-cache new` measures a first start.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time

import torch
from transformers.utils import logging as hf_logging

from ..compile import cpu_facts
from .measure import read_bandwidth
from .models import (
    BENCH_MODELS,
    DEFAULT_MODELS,
    BenchModel,
    bench_model_for_checkpoint,
)
from .strategies import (
    BASELINE,
    DYNAMIC_INT8,
    INT8_MODELS,
    STRATEGIES,
    STRATEGIES_BY_NAME,
    Strategy,
    default_strategy_names,
    with_references,
)
from .stream import FULL_DEFAULTS, QUICK_DEFAULTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench` subcommand's options."""
    default_strategies = default_strategy_names()
    compiled = ",".join(s.name for s in STRATEGIES if s.default and s.compile and s.quantize == "none")
    int8 = ",".join(s.name for s in STRATEGIES if s.default and s.quantize == "int8")
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
        f"{compiled} not with --quick; {int8} (quantize(model, 'int8'), torchao) only for "
        f"{','.join(INT8_MODELS)}, the compiled ones not with --quick; named ones run for every model); {BASELINE} "
        f"always runs, as the reference ({DYNAMIC_INT8} for int8 rows, with CTranslate2's int8 row). {executorch} "
        "run only when named: exported programs in "
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
    parser.add_argument(
        "--compile-cache",
        metavar="DIR|none",
        help="where compiled graphs are kept between runs (compile/caching.py: one entry per model and settings, "
        "keyed by versions and CPU too): a second run loads them instead of compiling, and the compile column shows "
        "it; `none` for no such folder (inductor's cache as --inductor-cache says). Default: "
        "~/.cache/transformers-flexcache/compile (under $XDG_CACHE_HOME), or none with --inductor-cache",
    )
    parser.add_argument(
        "--artifact",
        metavar="DIR|none",
        help="compiled artifacts (docs/compile.md): every compiled flexible strategy warms up from the folder "
        "DIR/<model>/<strategy> (warmup(..., artifact=)): its graphs loaded (encoder, first and later decode "
        "steps), nothing traced; where it holds none for this run's settings (the first run, other versions, CPU, "
        "weights or buckets), they are built into it first (torch.export and AOTInductor) and then loaded. "
        "Upstream's static-compiled strategy compiles as without it. Default: the folder `artifacts` of the compile "
        "cache (--compile-cache), so that a second run loads what the first built; `none` (or no compile cache): "
        "those strategies compile with torch.compile, as generate(compile_config=...) does",
    )
    parser.add_argument("--no-ctranslate2", action="store_true", help="skip the CTranslate2 row for T5 and Marian")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the garbage collector's heap unfrozen during the timed stream (by default it is frozen after the "
        "warm-ups, as `serve` freezes it before opening its port: docs/performance.md)",
    )
    add_isa_argument(parser)
    parser.add_argument("--json", metavar="PATH", help="write every figure, per strategy and per call, as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of time and cache memory per call (matplotlib)")


def add_isa_argument(parser: argparse.ArgumentParser) -> None:
    """`--isa`, shared by `bench` and `bench-profile` (`isa.py`)."""
    from .isa import ISA_CHOICES, ISA_ENVIRONMENTS

    parser.add_argument(
        "--isa",
        default="native",
        choices=ISA_CHOICES,
        help="instructions the kernels may use: native (the CPU's), or avx2: the run in a child process with "
        f"{', '.join(f'{k}={v}' for k, v in ISA_ENVIRONMENTS['avx2'].items())}, so that torch, oneDNN, MKL, FBGEMM, "
        "inductor and CTranslate2 dispatch as on an AVX2 CPU (an emulation: this CPU's caches, memory bandwidth "
        "and clock) and the report's CPU line says so",
    )


def rerun_for_isa(args) -> int | None:
    """The exit status of the command rerun in a child under `args.isa`'s caps, or None where this process runs it
    (`--isa native`, or the caps already set: the child itself)."""
    from .isa import applied, run_in_child

    if getattr(args, "isa", "native") == "native" or applied(args.isa):
        return None
    argv = getattr(args, "argv", None)
    if argv is None:
        raise ValueError(f"--isa {args.isa} reruns the command line, and this call has none (args.argv)")
    return run_in_child(argv, args.isa)


INDUCTOR_CACHE_NEW = "new"
COMPILE_CACHE_NONE = "none"
ARTIFACTS = "artifacts"  # the compiled artifacts' folder in the compile cache's


def compile_cache_root(args) -> str | None:
    """The compile cache folder of the run: `--compile-cache`, the default one, or None (`none`, or
    `--inductor-cache` given alone)."""
    from ..compile import default_cache_dir

    if args.compile_cache is None:
        return None if args.inductor_cache is not None else str(default_cache_dir())
    return None if args.compile_cache.lower() == COMPILE_CACHE_NONE else args.compile_cache


def artifact_root(args, compile_cache: str | None) -> str | None:
    """The compiled artifacts' folder of the run: `--artifact`, else `artifacts` in the compile cache folder; None for
    `none`, or with no compile cache."""
    if args.artifact is None:
        return None if compile_cache is None else os.path.join(compile_cache, ARTIFACTS)
    return None if args.artifact.lower() == COMPILE_CACHE_NONE else args.artifact


def _model_compile_cache(root: str | None, model, args):
    """The compile cache entry of one model's run (`compile.caching.compile_cache`), or a null context."""
    if root is None:
        return contextlib.nullcontext()
    from ..compile import compile_cache

    settings = ("model", "quick", "dtype", "device", "calls", "min_length", "max_length", "new_tokens", "seed")
    facts = {"bench": {"name": model.name, **{key: getattr(args, key) for key in settings}}}
    facts["bench"]["max_batch_size"] = args.max_batch_size
    return compile_cache(root, facts)


def inductor_cache_state(*, fresh: bool) -> dict:
    """Where inductor's on-disk cache is (TORCHINDUCTOR_CACHE_DIR as set for the run) and how many files it held at
    the start: compile times with a filled cache are a restart's, with an empty one a first start's."""
    from ..compile import inductor_cache_dir

    folder = inductor_cache_dir()
    files = sum(len(names) for _, _, names in os.walk(folder)) if os.path.isdir(folder) else 0
    return {"dir": folder, "new": fresh, "files_at_start": files}


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
    if args.dtype == "bfloat16" and args.device == "cpu" and not cpu_facts().bf16:
        parser.error(
            "--dtype bfloat16 needs a CPU with native bf16 (AVX512-BF16 or AMX): this one would emulate it "
            f"({cpu_facts().describe()}); use --dtype float32"
        )
    if args.compile_cache is not None and args.inductor_cache is not None:
        parser.error(
            "--compile-cache keeps inductor's cache in its own folder: pass it or --inductor-cache, not both "
            "(--compile-cache none --inductor-cache new measures a first start)"
        )
    if args.dtype == "float16" and args.device == "cpu":
        parser.error("--dtype float16 is for GPUs; on CPU use bfloat16 (where supported) or float32")
    names = [name.strip() for name in (args.strategies or default_strategy_names()).split(",") if name.strip()]
    unknown = [name for name in names if name not in STRATEGIES_BY_NAME]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {list(STRATEGIES_BY_NAME)}")
    strategies = with_references([STRATEGIES_BY_NAME[name] for name in names])

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
    from ..compile import recompile_limits
    from .model_run import run_model  # the model stack, imported when the command runs (not for --help)
    from .report import format_footer, format_header, format_model, machine_info, to_json, write_plot

    models, strategies = _resolve(args, parser)  # bad options refused before a child starts
    status = rerun_for_isa(args)
    if status is not None:
        return status
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
    root = compile_cache_root(args)
    machine["compile_cache"] = root
    args.artifact = machine["artifacts"] = artifact_root(args, root)
    print(format_header(machine, args))
    results = []
    started = time.perf_counter()
    try:
        # The strategies of one model compile one function (the model's `__call__`) into several graphs (and
        # several models the same code): more than dynamo's default of 8 per function would run the rest eagerly.
        with (
            _quiet_transformers(),
            recompile_limits(64, 512),
            _executorch_threads(selected, args.threads),
        ):
            for model in models:
                with _model_compile_cache(root, model, args) as warm_start:
                    result = run_model(model, args, selected, log)
                result.compile_cache = dataclasses.asdict(warm_start) if warm_start is not None else None
                results.append(result)
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
