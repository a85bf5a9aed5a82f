"""The benchmark's outputs: the JSON document, the plain-text table and the PNG plot.

The JSON holds, per model and per strategy, every figure of `measure.FIGURES` over the stream, the same figures per
call, and each figure's ratio to DynamicCache's (`vs_dynamic`); per model the bytes of a decode step and its floor.
Per strategy also: whether its tokens must equal DynamicCache's (`exact`), whether they did (`outputs_equal`), the
fraction that did (`token_agreement`, per call too), and for ExecuTorch strategies the export and lowering figures
(`lowering`). The text prints three tables per model (time, decode step, cache memory), and a fourth for ExecuTorch
strategies (export and lowering), each readable in 100 columns.
"""

from __future__ import annotations

import os
import platform
import textwrap

import torch
import transformers

from ..compile import cpu_facts
from .measure import FIGURES

MB = 1e6


def machine_info(threads: int) -> dict:
    """What the figures were measured on."""
    facts = cpu_facts()
    info = {
        "cpu": facts.model_name or platform.processor() or platform.machine(),
        "cpu_line": facts.describe(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import ctranslate2

        info["ctranslate2"] = ctranslate2.__version__
    except ImportError:
        info["ctranslate2"] = None
    info["isa"] = isa_info()
    return info


# The CPU flags that decide which kernels can run: AVX-512, VNNI (int8 dot products), bf16 and AMX.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def isa_info() -> dict:
    """The CPU's vendor and the instruction sets that matter here that its kernels may use (`cpu.cpu_facts()`: the
    effective ones, after the caps of `bench --isa`; `hardware_flags` the CPU's own), the kernels the compiled linears
    use (`compile_config_for_cpu`'s `"auto"`) and CTranslate2's compute types on this CPU."""
    from ..compile import resolve_int8_linears, resolve_linear_kernels, resolve_one_row_linears

    facts = cpu_facts()
    try:
        from .ctranslate2 import supported_compute_types

        compute_types = sorted(supported_compute_types())
    except ImportError:
        compute_types = None
    return {
        "vendor": facts.vendor,
        "family": facts.family,
        "model": facts.model,
        "flags": [flag for flag in ISA_FLAGS if flag in facts.flags],  # those the kernels may use (capped)
        "hardware_flags": [flag for flag in ISA_FLAGS if flag in (facts.hardware_flags or facts.flags)],
        "isa_limit": facts.isa_limit,  # the variables that capped them (bench --isa), empty where none did
        "torch_capability": facts.capability,
        "vnni": facts.vnni,
        "amx": facts.amx,
        "bf16_native": facts.bf16,
        "physical_cores": facts.physical_cores,
        "linear_kernels": resolve_linear_kernels("auto"),
        "one_row_linears": resolve_one_row_linears("auto"),
        "int8_linears": resolve_int8_linears("auto"),
        # the kernels measured per linear shape on this CPU so far (compile.kernel_choice), the rule above elsewhere
        "kernel_choices": _kernel_choices(),
        "ctranslate2_compute_types": compute_types,
        "int8_bits": _int8_bits(),
    }


def _kernel_choices() -> dict:
    """`{"table": path, "choices": {"RxKxN": kernel}}` of this CPU's measured kernel table (`compile.kernel_choice`)."""
    from ..compile import measured_linear_kernels

    return measured_linear_kernels()


def _int8_bits() -> int | None:
    """The bits of `quantize(model, "int8")` on this CPU (7 without VNNI), or None without torchao."""
    try:
        import torchao  # noqa: F401  (quantize needs it)
    except ImportError:
        return None
    from ..compile import int8_bits

    return int8_bits()


def _stream_json(result) -> list[dict]:
    return [
        {"batch_size": call.batch_size, "length": call.length, "encoder_len": call.encoder_len}
        for call in result.stream
    ]


def _distinct_tokens_per_row(result) -> float | None:
    # How varied DynamicCache's outputs are: equal outputs of a model that repeats one token would prove little.
    rows = [row for record in result.records.get("dynamic", []) for row in record.tokens.tolist()]
    return sum(len(set(row)) for row in rows) / len(rows) if rows else None


def _model_json(result) -> dict:
    document = {
        "description": result.description,
        "num_parameters": result.num_parameters,
        "notes": result.notes,
        "failures": result.failures,
        "capacities": result.capacities,
        "buckets": result.buckets,
        "decode_step_bytes": result.decode_step_bytes,
        "floor_step_ms": result.floor_step_ms,
        "int8_decode_step_bytes": result.int8_decode_step_bytes,
        "int8_floor_step_ms": result.int8_floor_step_ms,
        "logits_error": result.logits_error,
        "gc": result.gc,
        "compile_cache": result.compile_cache,
        "new_tokens": result.new_tokens,
        "reference_distinct_tokens_per_row": _distinct_tokens_per_row(result),
        "stream": _stream_json(result),
        "strategies": {},
    }
    for name, figures in result.summary().items():
        mismatched = set(result.mismatches.get(name, ()))
        agreement = result.call_agreement(name) if "dynamic" in result.records else [{}] * len(result.records[name])
        calls = [
            {**record.figures(), "outputs_equal": index not in mismatched, **agreed}
            for index, (record, agreed) in enumerate(zip(result.records[name], agreement, strict=True))
        ]
        warm_up = result.warm_ups.get(name)
        document["strategies"][name] = {
            **figures,
            "warm_up": warm_up.figures() if warm_up else None,
            "calls": calls,
        }
    return document


def to_json(results, *, args, machine: dict, elapsed_s: float) -> dict:
    """The whole report as a JSON-ready dict."""
    models = {result.name: _model_json(result) for result in results}
    num_compared = sum(
        len(records)
        for result in results
        for name, records in result.records.items()
        if name != "dynamic" and name not in result.agreement_only
    )
    agreement = [
        {
            "model": model_name,
            "strategy": name,
            "reference": figures["reference"],
            "token_agreement": figures["token_agreement"],
            "calls_equal": figures["calls_equal"],
            "calls": len(figures["calls"]),
        }
        for model_name, model in models.items()
        for name, figures in model["strategies"].items()
        if not figures["exact"]
    ]
    failures = [f"{result.name}: {failure}" for result in results for failure in result.failures]
    machine = {**machine, "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None}
    return {
        "settings": {
            "models": [result.name for result in results],
            "checkpoint": args.model,
            "quick": args.quick,
            "calls": args.calls,
            "max_batch_size": args.max_batch_size,  # None: each model's default (see each model's stream)
            "min_length": args.min_length,
            "max_length": args.max_length,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "device": args.device,
            "dtype": args.dtype,
            "seed": args.seed,
        },
        "machine": machine,
        "elapsed_s": elapsed_s,
        "figures": list(FIGURES),
        "models": models,
        "num_compared_calls": num_compared,  # calls of strategies held to DynamicCache's tokens
        "outputs_equal": not any(result.failing_mismatches for result in results),
        "agreement_only": agreement,  # strategies whose token agreement is reported, not required
        "failures": failures,
        "complete": False,  # set when every model has run
    }


# --- the tables ------------------------------------------------------------------------------------------------
# Three tables per model, each under 100 columns: time over the stream, the decode step, cache memory.

STRATEGY_WIDTH = 33  # "flexible_static-bucketed-compiled": the narrowest first column


def _name_width(model: dict) -> int:
    return max([STRATEGY_WIDTH, *map(len, model["strategies"])])


PEERS = ("ctranslate2", "ctranslate2-int8")  # CTranslate2's rows: compared with, not ours


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _divide(a, b):
    return a / b if a is not None and b else None


def _render(title: str, headers: list[str], rows: list[list[str]], *, name_width: int = 0) -> list[str]:
    """A table whose first column (strategy names) is at least `name_width` wide, so that a model's tables align."""
    rows = [[title, *headers], *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    widths[0] = max(widths[0], name_width)
    return [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]


def _same(name: str, figures: dict) -> str:
    if name == "dynamic":
        return "ref"
    if not figures["exact"]:  # agreement reported, not required
        return _percent(figures["token_agreement"])
    return "yes" if figures["outputs_equal"] else "NO"


def _percent(fraction) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _time_table(model: dict) -> list[str]:
    headers = ["compile s", "graphs", "wall s", "wall/dyn", "tok/s", "1st ms", "same"]
    rows = []
    for name, f in model["strategies"].items():
        vs = f["vs_dynamic"] or {}
        rows.append(
            [
                name,
                _cell(f["compile_s"] if f["compile_s"] else None, "{:.1f}"),
                _cell(f["compiled_graphs"], "{:d}"),
                _cell(f["warm_wall_s"], "{:.2f}"),
                _ratio(vs.get("warm_wall_s")),
                _cell(f["tokens_per_s"], "{:.0f}"),
                _cell(f["first_token_ms"], "{:.0f}"),
                _same(name, f),
            ]
        )
    return _render("time (stream)", headers, rows, name_width=_name_width(model))


def _largest_batch(model: dict) -> str:
    return f"B={max((call['batch_size'] for call in model['stream']), default=0)}"


def _latency_cells(figures: dict, median: str, largest: str) -> list[str]:
    """A median over all steps and over the largest batch's, each with its ratio to DynamicCache's."""
    vs = figures["vs_dynamic"] or {}
    return [
        _cell(figures[median], "{:.1f}"),
        _ratio(vs.get(median)),
        _cell(figures[largest], "{:.1f}"),
        _ratio(vs.get(largest)),
    ]


def _peer(model: dict, figures: dict) -> dict:
    """CTranslate2's row in the same compute type as `figures`' (int8 rows: `ctranslate2-int8`), or {}."""
    return model["strategies"].get(PEERS[1] if figures.get("int8") else PEERS[0], {})


def _step_table(model: dict) -> list[str]:
    big = _largest_batch(model)
    headers = ["step ms", "step/dyn", f"{big} ms", f"{big}/dyn", f"{big}/ct2", f"{big}/floor"]
    rows = [
        [
            name,
            *_latency_cells(f, "step_latency_ms", "largest_batch_step_ms"),
            _ratio(_divide(f["largest_batch_step_ms"], _peer(model, f).get("largest_batch_step_ms"))),
            _ratio(f["largest_batch_step_vs_floor"]),
        ]
        for name, f in model["strategies"].items()
    ]
    return _render("decode step (median)", headers, rows, name_width=_name_width(model))


def _shown_batches(model: dict) -> list[int]:
    """The batch sizes of the per-batch tables: all of the stream's up to 8 of them, else powers of two and the
    largest (the tables stay within 100 columns)."""
    batches = sorted({call["batch_size"] for call in model["stream"]})
    if len(batches) <= 8:
        return batches
    return [b for b in batches if b & (b - 1) == 0 or b == batches[-1]]


def _by_batch(figures: dict, name: str, batch: int):
    values = figures.get(name) or {}
    return values.get(batch, values.get(str(batch)))  # int keys in memory, str keys once through JSON


def _batch_tables(model: dict) -> list[str]:
    """The median decode step at each batch size, and its ratio to CTranslate2's in the same compute type."""
    batches = _shown_batches(model)
    headers = [f"B={b}" for b in batches]
    rows = [
        [name, *(_cell(_by_batch(f, "step_ms_by_batch", b), "{:.1f}") for b in batches)]
        for name, f in model["strategies"].items()
    ]
    lines = _render("decode step by batch (median ms)", headers, rows, name_width=_name_width(model))
    peers = [name for name in PEERS if name in model["strategies"]]
    if peers:
        ratio_rows = []
        for name, f in model["strategies"].items():
            peer = _peer(model, f)
            if not peer or name in PEERS:
                continue
            cells = [
                _ratio(_divide(_by_batch(f, "step_ms_by_batch", b), _by_batch(peer, "step_ms_by_batch", b)))
                for b in batches
            ]
            ratio_rows.append([name, *cells])
        lines += _render("step by batch / CTranslate2 (same type)", headers, ratio_rows, name_width=_name_width(model))
    return lines


def _forward_table(model: dict) -> list[str]:
    """The model's forward alone on decode steps: the step less generate's own work (logits processors, stopping
    criteria, picking the token)."""
    big = _largest_batch(model)
    headers = ["fwd ms", "fwd/dyn", f"{big} fwd ms", f"{big}/dyn", f"{big}/floor", "fwd/step"]
    rows = [
        [
            name,
            *_latency_cells(f, "forward_ms", "largest_batch_forward_ms"),
            _ratio(f["largest_batch_forward_vs_floor"]),
            _percent(_divide(f["largest_batch_forward_ms"], f["largest_batch_step_ms"])),
        ]
        for name, f in model["strategies"].items()
    ]
    if all(row[1] == "-" for row in rows):
        return []
    return _render("model forward (median, decode steps)", headers, rows, name_width=_name_width(model))


def _memory_table(model: dict) -> list[str]:
    headers = ["allocs", "alloc MB", "MB/dyn", "peak cache MB", "peak RSS+ MB"]
    rows = []
    for name, f in model["strategies"].items():
        vs = f["vs_dynamic"] or {}
        rows.append(
            [
                name,
                _cell(f["cache_allocations"], "{:d}"),
                _cell(None if f["cache_bytes_allocated"] is None else f["cache_bytes_allocated"] / MB, "{:.1f}"),
                _ratio(vs.get("cache_bytes_allocated")),
                _cell(None if f["peak_cache_bytes"] is None else f["peak_cache_bytes"] / MB, "{:.1f}"),
                _cell(None if f["peak_rss_growth_bytes"] is None else f["peak_rss_growth_bytes"] / MB, "{:.0f}"),
            ]
        )
    return _render("cache memory", headers, rows, name_width=_name_width(model))


def _executorch_table(model: dict) -> list[str]:
    headers = ["export s", "lower s", ".pte MB", "exports", "needed", "calls =", "tokens ="]
    rows = []
    for name, f in model["strategies"].items():
        lowering = f.get("lowering")
        if not lowering:
            continue
        rows.append(
            [
                name,
                _cell(lowering["export_s"], "{:.1f}"),
                _cell(lowering["lower_s"], "{:.1f}"),
                _cell(lowering["pte_bytes"] / MB, "{:.1f}"),
                _cell(lowering["exports"], "{:d}"),
                _cell(lowering["exports_for_every_batch"], "{:d}"),
                f"{f['calls_equal']}/{len(f['calls'])}",
                _percent(f["token_agreement"]),
            ]
        )
    return _render("executorch (export, lowering)", headers, rows, name_width=_name_width(model)) if rows else []


def _stream_line(model: dict) -> str:
    stream = model["stream"]
    batches = [call["batch_size"] for call in stream]
    if stream[0]["encoder_len"] is not None:
        kind, lengths = "encoder length", [call["encoder_len"] for call in stream]
    else:
        kind, lengths = "prompt length", [call["length"] for call in stream]
    return (
        f"{len(stream)} calls, batch {min(batches)}-{max(batches)}, {kind} {min(lengths)}-{max(lengths)}, "
        f"{model['new_tokens']} new tokens each ({model['reference_distinct_tokens_per_row']:.1f} distinct per row)"
    )


def _floor_line(model: dict, bandwidth: float | None) -> str | None:
    counted = model.get("decode_step_bytes") or {}
    if not counted or model.get("floor_step_ms") is None or not bandwidth:
        return None
    batch = max(call["batch_size"] for call in model["stream"])
    line = (
        f"floor: a decode step at B={batch} reads {counted['weights'] / MB:.1f} MB of weights + "
        f"{counted['cache'] / MB:.1f} MB of cache: {model['floor_step_ms']:.3g} ms at {bandwidth / 1e9:.1f} GB/s"
    )
    int8 = model.get("int8_decode_step_bytes") or {}
    if int8 and model.get("int8_floor_step_ms"):
        line += (
            f"\n  int8 floor: {int8['weights'] / MB:.1f} MB of weights + {int8['cache'] / MB:.1f} MB of cache: "
            f"{model['int8_floor_step_ms']:.3g} ms"
        )
    return line


def _logits_lines(model: dict) -> list[str]:
    """The logits of the cast or quantized model against the fp32 model's, on one teacher-forced continuation."""
    lines = []
    for kind, error in (model.get("logits_error") or {}).items():
        lines.append(
            f"{kind} logits vs fp32: max |diff| {error['max_abs_diff']:.3g} (largest |logit| "
            f"{error['max_abs_logit']:.3g}), mean {error['mean_abs_diff']:.2g}, top-1 equal "
            f"{_percent(error['top1_agreement'])}"
        )
    return lines


def _score_notes(model: dict) -> list[str]:
    """For int8 rows, and rows that should equal their reference but did not: the largest score difference at steps
    where both runs had the same prefix (the same input), against the reference and against fp32."""
    notes = []
    for name, f in model["strategies"].items():
        if f.get("max_score_diff") is None or not (f.get("int8") or (f["exact"] and not f["outputs_equal"])):
            continue
        note = (
            f"{name}: scores at steps with the same prefix differ from {f['reference']}'s by {f['max_score_diff']:.3g}"
        )
        if f.get("max_score_diff_vs_fp32") is not None and f["reference"] != "dynamic":
            note += f", from fp32 DynamicCache's by {f['max_score_diff_vs_fp32']:.3g}"
        notes.append(note + " at most")
    return notes


def _difference_notes(model: dict) -> list[str]:
    """Per strategy whose tokens differ from its reference's: how many rows, and how near a tie each was."""
    notes = []
    for name, f in model["strategies"].items():
        differences = f.get("differences") or []
        if not differences:
            continue
        margins = sorted(d["reference_margin"] for d in differences if d["reference_margin"] is not None)
        shown = ", ".join(f"{m:.3g}" for m in margins[:6]) + (", ..." if len(margins) > 6 else "")
        notes.append(
            f"{name}: {len(differences)} row(s) of {len(f['calls']) - f['calls_equal']} call(s) differ from "
            f"{f['reference']}"
            + (f"; its top-1 minus top-2 score at the first differing step: {shown}" if shown else "")
        )
    return notes


def _verdict(model: dict) -> str | None:
    """Which strategy was fastest, warm, over the stream and per decode step at the largest batch (in float; and in
    int8 where int8 rows ran)."""
    strategies = {name: f for name, f in model["strategies"].items() if f["outputs_equal"] or not f["exact"]}
    lines = []
    for kind, int8 in (("", False), (" (int8)", True)):
        ours = {n: f for n, f in strategies.items() if n not in PEERS and bool(f.get("int8")) == int8}
        if not ours or (not int8 and "dynamic" not in ours):
            continue
        stream = min(ours, key=lambda name: ours[name]["warm_wall_s"])
        step = min(ours, key=lambda name: ours[name]["largest_batch_step_ms"] or float("inf"))
        wall = ours[stream]["vs_dynamic"]["warm_wall_s"]
        step_ratio = ours[step]["vs_dynamic"]["largest_batch_step_ms"]
        lines.append(
            f"fastest warm stream{kind}: {stream} ({wall:.2f}x dynamic); fastest step at the largest batch: {step} "
            f"({_ratio(step_ratio)} dynamic)"
        )
    return "\n".join(lines) or None


def format_header(machine: dict, args) -> str:
    mode = (
        "quick: tiny models, TIMINGS ARE NOT MEANINGFUL (a smoke test)" if args.quick else "real-sized random models"
    )
    bandwidth = machine.get("read_bandwidth_bytes_per_s")
    return (
        f"transformers-flexcache bench: {mode}\n"
        f"{machine['cpu']}, {machine['threads']} thread(s) of {machine['cpu_count']} CPUs, "
        f"{args.device}, {args.dtype}\n"
        + _isa_line(machine)
        + f"torch {machine['torch']}, transformers {machine['transformers']}; load average {_load(machine)}"
        + (f"; read bandwidth {bandwidth / 1e9:.1f} GB/s" if bandwidth else "")
        + (
            f"\ncompile cache: {machine['compile_cache']} (per model: graphs loaded and compiled)"
            if machine.get("compile_cache")
            else _inductor_cache_line(machine.get("inductor_cache"))
        )
        + (
            f"\ncompiled artifacts: {machine['artifacts']} (the compiled flexible strategies' graphs: notes say "
            "whether each was built or loaded)"
            if machine.get("artifacts")
            else ""
        )
    )


def _isa_line(machine: dict) -> str:
    """What the CPU runs natively (the instructions that bf16 and int8 kernels need), and which kernels ran."""
    isa = machine.get("isa") or {}
    if not isa:
        return ""
    flags = " ".join(isa.get("flags", [])) or "none of avx2/avx512/vnni/bf16/amx"
    cpu_line = f"{isa.get('vendor') or '?'}, {flags}; torch {isa.get('torch_capability')}"  # reports before cpu_line
    bf16 = "native bf16 matmuls" if isa.get("bf16_native") else "no native bf16 (emulated)"
    ct2 = isa.get("ctranslate2_compute_types")
    ct2 = f"; CTranslate2 compute types: {', '.join(ct2)}" if ct2 else ""
    bits = isa.get("int8_bits")
    int8 = f"; our int8 at {bits} bits" + (" (no VNNI: 8 would saturate)" if bits == 7 else "") if bits else ""
    if bits and isa.get("int8_linears") == "library":
        int8 += ", on oneDNN's int8 kernels (VNNI)"
    elif bits and isa.get("int8_linears") == "inductor":
        int8 += ", its decode steps as inductor's dot products, its encoder as float32 GEMMs up to 128 positions"
    elif bits and isa.get("int8_linears") == "fbgemm":
        int8 += ", on FBGEMM's int8 GEMMs (decode steps of 1-2 rows: inductor's dot products, but the output layer)"
    one_row = " (one-row graphs: inductor's dot products)" if isa.get("one_row_linears") == "inductor" else ""
    return (
        f"CPU: {machine.get('cpu_line') or cpu_line}; {bf16}\n"
        f"fp32 linears compiled on the kernel measured per shape on this CPU (compile/kernel_choice.py), else "
        f"{isa.get('linear_kernels')}{one_row}{int8}{ct2}\n"
    )


def _inductor_cache_line(cache: dict | None) -> str:
    if not cache:
        return ""
    if cache["new"]:
        return "\ninductor cache: new and empty (compile times of a first start)"
    held = cache["files_at_start"]
    state = "empty at the start: compile times of a first start" if not held else f"{held} files at the start"
    return f"\ninductor cache: {cache['dir']} ({state})"


def _load(machine: dict) -> str:
    load = machine.get("load_average_at_start") or machine.get("load_average_at_end")
    return "-" if not load else "/".join(f"{value:.1f}" for value in load)


def format_model(name: str, model: dict, *, bandwidth: float | None = None) -> str:
    """One model's block: its stream, three tables of the strategies, and its notes."""
    lines = ["", f"{name}: {model['description']}, {model['num_parameters'] / 1e6:.1f}M parameters"]
    if model["stream"]:
        lines.append("  " + _stream_line(model))
        lines.append(f"  capacities {model['capacities']}")
        buckets = ", ".join(f"{name} {' '.join(map(str, sizes))}" for name, sizes in model["buckets"].items())
        lines.append(f"  bucketed: {buckets}, then each capacity")
        floor = _floor_line(model, bandwidth)
        if floor:
            lines.append("  " + floor)
        lines += ["  " + line for line in _logits_lines(model)]
        if model.get("gc"):
            lines += _wrapped("", [gc_line(model["gc"])])
        if model.get("compile_cache"):
            lines += _wrapped("", [compile_cache_line(model["compile_cache"])])
    if model["strategies"]:
        tables = (_time_table, _step_table, _batch_tables, _forward_table, _memory_table, _executorch_table)
        for table in tables:
            lines += ["  " + line for line in table(model)]
        verdict = _verdict(model)
        if verdict:
            lines += _wrapped("", verdict.splitlines())
    lines += _wrapped("note: ", model["notes"] + _score_notes(model) + _difference_notes(model))
    lines += _wrapped("FAILED: ", model["failures"])
    return "\n".join(lines)


def compile_cache_line(figures: dict) -> str:
    """What the model's run found in the compile cache and did (`compile.caching.WarmStart`'s fields)."""
    found = {"warm": "warm", "cold": "empty", "discarded": f"discarded ({figures.get('reason')})"}[figures["found"]]
    line = (
        f"compile cache: {found}; {figures['hits']} graphs loaded, {figures['misses']} compiled "
        f"({figures['directory']})"
    )
    if figures.get("bypasses"):
        line += f"; {figures['bypasses']} not cacheable"
    if figures.get("aot_hits"):
        line += f"; AOT autograd: {figures['aot_hits']} loaded"
    return line


def gc_line(figures: dict, during: str = "the stream") -> str:
    """The collector's figures (`{"frozen_objects": n, **gc_heap.Collections.summary()}`) as one line."""
    frozen = figures["frozen_objects"]
    return (
        f"garbage collector during {during}: {f'{frozen} objects frozen' if frozen else 'not frozen (--no-gc-freeze)'}"
        f", {figures['collections']} collections ({figures['full']} full), longest {figures['longest_ms']:.1f} ms, "
        f"{figures['total_ms']:.0f} ms in all{_compiling(figures.get('compiling'))}"
    )


def _compiling(figures: dict | None) -> str:
    """The collections during compiles (taken out of the timings with the compile), when there were any."""
    if not figures or not figures["collections"]:
        return ""
    return (
        f"; during compiles (out of the timings): {figures['collections']} ({figures['full']} full), "
        f"{figures['total_ms']:.0f} ms"
    )


def _wrapped(label: str, paragraphs: list[str], width: int = 100, indent: str = "  ") -> list[str]:
    """Each paragraph as lines of at most `width` columns, `label` first, the rest under it (a path or a word longer
    than that is kept whole)."""
    lines = []
    for paragraph in paragraphs:
        lines += textwrap.wrap(
            paragraph,
            width,
            initial_indent=indent + label,
            subsequent_indent=indent + " " * len(label),
            break_long_words=False,
            break_on_hyphens=False,
        )
    return lines


def format_footer(report: dict) -> str:
    """The legend and the verdict: whether every strategy generated DynamicCache's tokens on every call."""
    lines = [
        "",
        "compile s: time spent compiling (warm-up and stream); wall s: the stream's wall time minus that;",
        "X/dyn: ratio to DynamicCache's (lower is better); tok/s: new tokens / wall s; step ms: median step;",
        "B=n: calls at the largest batch; /ct2: ratio to CTranslate2's in the same compute type (int8 rows:",
        "ctranslate2-int8); /floor: to the bandwidth floor of the row's weights (int8 rows: int8 bytes);",
        "same: tokens equal to the row's reference (int8 rows: dynamic-int8, the same int8 model, eager,",
        "DynamicCache), or N%: agreement, reported, not required;",
        "fwd: the model's forward alone (the step less generate's logits processing and token choice);",
        "allocs: cache storages allocated, warm-up included; peak RSS+: rough RSS growth in a call (docs).",
    ]
    if any(figures.get("lowering") for model in report["models"].values() for figures in model["strategies"].values()):
        lines += [
            "executorch: export s, lower s: torch.export and lowering to .pte (not in wall s); exports: the",
            "model's torch.export runs; needed: exports that serve every batch of the stream exactly; calls =,",
            "tokens =: equal to DynamicCache's. N% in same: token agreement, reported, not required (strategies",
            "not exact: quantized weights; transformers' programs take no padding mask).",
        ]
    lines += [
        f"Total time {report['elapsed_s']:.0f} s; load average at the end {_load(report['machine'])}.",
    ]
    if report["settings"].get("quick"):
        lines.append("quick run: tiny models, timings are not meaningful.")
    int8 = any(
        f.get("int8") and f["exact"] for model in report["models"].values() for f in model["strategies"].values()
    )
    reference = "DynamicCache's tokens" + (" (int8 rows: the eager int8 model's)" if int8 else "")
    if report["outputs_equal"]:
        held = "exact strategies" if report["agreement_only"] else "every strategy"
        outputs = (
            f"Outputs: {held} generated exactly {reference} on every call "
            f"({report['num_compared_calls']} calls compared)."
        )
        lines += _wrapped("", [outputs], indent="")
    else:
        differing = [
            f"{model_name} {name} (calls {[i for i, c in enumerate(figures['calls']) if not c['outputs_equal']]})"
            for model_name, model in report["models"].items()
            for name, figures in model["strategies"].items()
            if figures["exact"] and not figures["outputs_equal"]
        ]
        lines += _wrapped("", [f"OUTPUTS DIFFER from {reference}: " + "; ".join(differing)], indent="")
    if report["agreement_only"]:
        lines.append("Agreement with the reference's tokens (reported, not required):")
        lines += [
            f"  {a['model']} {a['strategy']} against {a['reference']}: {_percent(a['token_agreement'])} of tokens, "
            f"{a['calls_equal']}/{a['calls']} calls equal"
            for a in report["agreement_only"]
        ]
    if report["failures"]:
        lines += _wrapped("FAILED: ", ["; ".join(report["failures"])], indent="")
    return "\n".join(lines)


# --- the plot ------------------------------------------------------------------------------------------------


def write_plot(results, path: str) -> str:
    """Write a PNG with, per model: the warm wall time of the stream and the compile time of each strategy; the
    decode step at the largest batch against the bandwidth floor; and the cache bytes allocated per call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    shown = [result for result in results if result.records]
    if not shown:
        return "no model ran: no plot written"
    figure, axes = plt.subplots(len(shown), 3, figsize=(16, 3.6 * len(shown)), squeeze=False)
    for (wall_axis, step_axis, memory_axis), result in zip(axes, shown, strict=True):
        summary = result.summary()
        names = list(summary)
        positions = range(len(names))
        warm = [summary[name]["warm_wall_s"] for name in names]
        bars = wall_axis.barh(positions, warm, color="tab:blue", label="warm (compile excluded)")
        for bar, name in zip(bars, names, strict=True):
            compile_s = summary[name]["compile_s"]
            lowering = summary[name]["lowering"]
            label = f" + {compile_s:.0f} s compile" if compile_s else None
            if lowering:
                label = f" + {lowering['lowering_s']:.0f} s export and lowering"
            if label:
                wall_axis.annotate(
                    label,
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    va="center",
                    fontsize=7,
                )
        wall_axis.set_yticks(list(positions), names, fontsize=7)
        wall_axis.invert_yaxis()
        wall_axis.set_title(f"{result.name}: stream wall time (s), warm")
        wall_axis.set_xlabel("seconds")

        steps = [summary[name]["largest_batch_step_ms"] or 0 for name in names]
        step_axis.barh(positions, steps, color="tab:green")
        if result.floor_step_ms:
            step_axis.axvline(result.floor_step_ms, color="black", linestyle="--", label="bandwidth floor")
            step_axis.legend(fontsize=7)
        step_axis.set_yticks(list(positions), [""] * len(names))
        step_axis.invert_yaxis()
        batch = max(call.batch_size for call in result.stream)
        step_axis.set_title(f"{result.name}: decode step at batch {batch} (ms, median)")
        step_axis.set_xlabel("ms")

        for name, records in result.records.items():
            warm_up = result.warm_ups.get(name)
            if records[0].cache_bytes_allocated is not None and warm_up is not None:
                # Call 0 is the untimed warm-up: where the flexible cache makes its one allocation.
                memory_axis.plot(
                    range(len(records) + 1),
                    [r.cache_bytes_allocated / MB for r in [warm_up, *records]],
                    marker="o",
                    markersize=3,
                    label=name,
                )
        memory_axis.set_title(f"{result.name}: cache MB allocated per call (0: warm-up)")
        memory_axis.set_xlabel("call")
        memory_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        memory_axis.legend(fontsize=6)
        for axis in (wall_axis, step_axis, memory_axis):
            axis.grid(alpha=0.3)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"plot written to {path}"
