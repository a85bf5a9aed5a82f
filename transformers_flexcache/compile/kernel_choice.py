"""Which kernel runs an fp32 linear of a given shape on this CPU, decided by measuring the candidates once.

Design decisions:
- The candidates are the exact fp32 kernels that exist in this torch build: oneDNN's packed linear
  (`mkldnn._linear_pointwise`, what `OneDNNLinears` makes), MKL's packed linear (`mkl._mkl_linear`, inductor's own
  choice under freezing) and, at one row, inductor's generated dot products (`OneRowLinears`). Not candidates:
  FBGEMM's packed GEMMs in torch take fp16 weights only (`fbgemm_linear_fp16_weight`: not fp32's outputs), and
  inductor's C++ GEMM templates (`max_autotune`) tune at compile time, a compile per shape and bucket (not measured
  here: docs/performance.md says what that would cost).
- A linear in a decode step reads its weight from memory, not from the cache: each candidate runs over copies of the
  weight that together exceed twice the last-level cache, in turn, so that every call reads cold weights as a step
  does; the candidates are interleaved round by round and each one's median kept (a shared machine's slow moments
  fall on all of them).
- The choice is the CPU's and the shape's: a table per CPU (`environment_facts()`: vendor, family, model, the
  instruction sets the kernels may use, so `bench --isa avx2` has its own; torch's version; the threads), in a JSON
  file beside the compile cache (`default_cache_dir()/../kernel-choices/<key>.json`), measured once and read by every
  later process. `prepare` fills it before a compile, for the model's linear shapes at the rows its decode graphs
  run (`warmup()` with every bucket's rows, `Engine.warmup()` with its decode shapes', a flexible compiled call with
  its padded rows, from `hooks.CompileHooks.call_padded`); the graph passes only read it (`choice`, through
  `passes.fp32_linears.LinearPlan`), and a shape not measured keeps the rule by vendor.
- The table of a CPU, once a shape is in it, is not measured again (delete the file to measure anew). The passes'
  cache identity (`uuid`, which inductor's FX graph cache and the package's compile cache key on) holds
  `table_digest()` of the choices that change what the plan runs (`LinearPlan.key`: the shapes whose measured kernel
  differs from the plan's rule), and the CPU key, so that a graph compiled on other choices (another table, a table
  measured anew) is never loaded for this one. Two tables that differ only in shapes measured to keep the rule run
  every linear on the same kernel, and key their graphs alike: a table that grows as other models' or buckets'
  shapes are measured no longer keys every earlier graph anew (a warm compile cache recompiled most graphs of
  `bench`'s default run for that: the cold run measured each model's shapes as it went).
- With the compile artifact (`compile/artifact.py`, not changed here): the choices its graphs were compiled on are
  the table at `table_path()` (file name `table_key()`, a hash of the CPU facts, torch and threads; folder
  `TRANSFORMERS_FLEXCACHE_KERNEL_CHOICES` or `default_cache_dir()/../kernel-choices`); its graphs hold the kernels
  already, so an artifact that carries the table does so for a later compile of shapes it lacks, keyed by
  `table_digest()`.
- A candidate only wins by a margin (`MARGIN`) and in most rounds (`ROUNDS_WON`, each round running every candidate
  in turn): otherwise the incumbent (the vendor rule) stays, so that noise does
  not flip a choice from run to run.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import threading
import time
import types
from pathlib import Path

import torch

MARGIN = 0.05  # a challenger must be 5% faster than the rule's kernel
ROUNDS_WON = 0.8  # ... and faster in this share of the rounds (paired: each round runs every candidate in turn)
CANDIDATES_MANY = ("onednn", "mkl")
CANDIDATES_ONE = ("inductor", "onednn", "mkl")
_LOCK = threading.Lock()
_TABLES: dict[str, dict] = {}


def choices_dir() -> Path:
    from .caching import default_cache_dir

    return Path(
        os.environ.get("TRANSFORMERS_FLEXCACHE_KERNEL_CHOICES") or default_cache_dir().parent / "kernel-choices"
    )


def table_key() -> str:
    """This process's table name: a hash of the CPU (vendor, family, model, flags, kernel capability), torch's version
    and the threads."""
    return _key()


def table_digest(choices: dict | None = None) -> str:
    """`"<table_key()>-<hash of choices>"`: what the passes' cache identity holds (module docstring). `choices`:
    `{shape_key: kernel}` (by default every shape's choice of the table; `LinearPlan.key` gives those where the
    table changes what the plan runs)."""
    if choices is None:
        choices = {key: entry.get("choice") for key, entry in _table().items()}
    contents = hashlib.sha256(json.dumps(choices, sort_keys=True).encode()).hexdigest()[:16]
    return f"{table_key()}-{contents}"


def measured_shapes() -> list[tuple[int, int, int]]:
    """`(rows, in_features, out_features)` of every shape in this process's table."""
    return [tuple(int(size) for size in key.split("x")) for key in sorted(_table())]


def table_path() -> Path:
    """This process's table: `choices_dir() / f"{table_key()}.json"`, `{shape_key: {"choice", "ms", "rule"}}`."""
    return _path()


def _key() -> str:
    from .caching import environment_facts

    facts = environment_facts()
    facts = {key: facts[key] for key in ("cpu", "torch", "threads")}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def _path() -> Path:
    return choices_dir() / f"{_key()}.json"


def _table() -> dict:
    path = _path()
    with _LOCK:
        if str(path) not in _TABLES:
            try:
                _TABLES[str(path)] = json.loads(path.read_text())
            except (OSError, ValueError):
                _TABLES[str(path)] = {}
        return _TABLES[str(path)]


def _save(table: dict) -> None:
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    os.replace(tmp, path)


def shape_key(rows: int, k: int, n: int) -> str:
    return f"{rows}x{k}x{n}"


def choice(rows, k: int, n: int) -> str | None:
    """The measured kernel for a linear of `rows` (an int; None or symbolic: not measured) x `k` -> `n` on this CPU,
    or None where it was not measured."""
    if not isinstance(rows, int):
        return None
    entry = _table().get(shape_key(rows, k, n))
    return entry["choice"] if entry else None


def _rule(rows: int) -> str:
    from .cpu import cpu_facts

    if cpu_facts().is_intel:
        return "mkl"
    return "inductor" if rows == 1 else "onednn"


def _copies(k: int, n: int) -> int:
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    last_level = max(int(caps.get("l3_cache_size") or 0), int(caps.get("l2_cache_size") or 0), 32 << 20)
    return max(2, min(64, -(-2 * last_level // (4 * k * n))))


def _runners(rows: int, k: int, n: int, candidates: tuple[str, ...]):
    """`{candidate: callable()}` each running one linear over the next cold copy of the weight."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) for _ in range(_copies(k, n))]
    x = torch.randn(rows, k, generator=generator)
    runners = {}
    if "onednn" in candidates:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        runners["onednn"] = _cycle(lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), packed)
    if "mkl" in candidates and torch.backends.mkl.is_available():
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        pairs = list(zip(packed, weights, strict=True))
        runners["mkl"] = _cycle(lambda pw: torch.ops.mkl._mkl_linear(x, pw[0], pw[1], None, rows), pairs)
    if "inductor" in candidates and rows == 1:

        def dot(x, w):
            return (x.unsqueeze(-2) * w).sum(-1)

        # a code object per shape: dynamo keeps graphs per code object, and a process measuring more shapes than
        # its recompile limit would otherwise time the eager product for the last ones
        dot = types.FunctionType(dot.__code__.replace(co_name=f"dot_{k}x{n}"), dot.__globals__, f"dot_{k}x{n}")
        compiled = torch.compile(dot, dynamic=False, fullgraph=True)
        runners["inductor"] = _cycle(lambda w: compiled(x, w), weights)
    return runners


def _cycle(fn, items):
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % len(items)
        return fn(items[state["i"]])

    return run


def measure(rows: int, k: int, n: int, *, rounds: int = 7, calls: int = 8) -> dict:
    """`{"choice": ..., "ms": {candidate: median ms a call}, "rule": ...}` for one shape (measured now)."""
    candidates = CANDIDATES_ONE if rows == 1 else CANDIDATES_MANY
    runners = _runners(rows, k, n, candidates)
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.no_grad():
        for fn in runners.values():
            for _ in range(3):
                fn()  # warm-up (the inductor candidate compiles here)
        for _ in range(rounds):
            for name, fn in runners.items():
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - start) / calls)
    ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    rule = _rule(rows) if _rule(rows) in ms else min(ms, key=ms.get)
    best = min(ms, key=ms.get)
    # paired by round (the candidates ran one after the other in each): the challenger must be ahead in most rounds
    # too, not only by its median; on a loaded machine a median alone flipped from shape to shape
    wins = sum(b < r for b, r in zip(times[best], times[rule], strict=True))
    steady = wins >= ROUNDS_WON * len(times[rule])
    chosen = best if ms[best] < (1 - MARGIN) * ms[rule] and steady else rule
    return {"choice": chosen, "ms": ms, "rule": rule, "rounds_won": wins, "rounds": len(times[rule])}


def measure_linears(shapes, rows_list, *, log=None) -> dict:
    """Measures every (rows, k, n) of `rows_list` x `shapes` ((k, n) pairs) not yet in this CPU's table, saves the
    table, and returns it (`{shape_key: entry}`)."""
    table = _table()
    todo = [
        (r, k, n) for r in sorted(set(rows_list)) for k, n in sorted(set(shapes)) if shape_key(r, k, n) not in table
    ]
    for rows, k, n in todo:
        entry = measure(rows, k, n)
        table[shape_key(rows, k, n)] = entry
        if log:
            log(f"kernel choice {shape_key(rows, k, n)}: {entry['choice']} {entry['ms']}")
    if todo:
        _save(table)
    return table


def model_linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The (in, out) features of `model`'s fp32 linear layers (the output embedding included)."""
    shapes = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and weight is not None and weight.dtype == torch.float32:
            shapes.add((module.in_features, module.out_features))
    return sorted(shapes)


def uses_measured_choices(compile_config) -> bool:
    """Whether `compile_config`'s fp32 linear passes read this table (`compile_config_for_cpu(linear_kernels="auto")`)."""
    options = getattr(compile_config, "options", None) or {}
    passes = [*(options.get("joint_custom_post_pass") or ()), *(options.get("post_grad_custom_post_pass") or ())]
    return any(getattr(getattr(graph_pass, "plan", None), "measured", False) for graph_pass in passes)


def prepare(model, compile_config, rows, *, log=None) -> None:
    """Measures, where `compile_config`'s passes read the table, each fp32 linear shape of `model` at each of `rows`
    not yet measured on this CPU (at most once a CPU: later calls only read the table). Call it before the graphs
    of those rows compile."""
    if not uses_measured_choices(compile_config):
        return
    shapes = model_linear_shapes(model)
    rows = [r for r in sorted({int(r) for r in rows}) if any(shape_key(r, k, n) not in _table() for k, n in shapes)]
    if rows and shapes:
        with _MEASURING:
            measure_linears(shapes, rows, log=log)


_MEASURING = threading.Lock()
prepare_linear_kernels = prepare  # the name the compile wing's face gives it


def measured_linear_kernels() -> dict:
    """`{"table": path, "choices": {"RxKxN": kernel}}` of this CPU's measured kernel table (the bench's report)."""
    return {
        "table": str(table_path()),
        "choices": {key: entry.get("choice") for key, entry in sorted(_table().items())},
    }
