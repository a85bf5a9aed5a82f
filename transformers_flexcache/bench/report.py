"""The benchmark's outputs: the JSON document, the plain-text table and the PNG plot.

The JSON holds, per model and per strategy, every figure of `bench_measure.FIGURES` over the stream, the same
figures per call, and each figure's ratio to DynamicCache's (`vs_dynamic`). The table prints the main ones.
"""

from __future__ import annotations

import os
import platform

import torch
import transformers

from .measure import FIGURES

MB = 1e6


def machine_info(threads: int) -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import ctranslate2

        info["ctranslate2"] = ctranslate2.__version__
    except ImportError:
        info["ctranslate2"] = None
    return info


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
        "new_tokens": result.new_tokens,
        "reference_distinct_tokens_per_row": _distinct_tokens_per_row(result),
        "stream": _stream_json(result),
        "strategies": {},
    }
    for name, figures in result.summary().items():
        mismatched = set(result.mismatches.get(name, ()))
        calls = [
            {**record.figures(), "outputs_equal": index not in mismatched}
            for index, record in enumerate(result.records[name])
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
        len(records) for result in results for name, records in result.records.items() if name != "dynamic"
    )
    failures = [f"{result.name}: {failure}" for result in results for failure in result.failures]
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
            "seed": args.seed,
        },
        "machine": machine,
        "elapsed_s": elapsed_s,
        "figures": list(FIGURES),
        "models": models,
        "num_compared_calls": num_compared,
        "outputs_equal": not any(result.mismatches for result in results),
        "failures": failures,
        "complete": False,  # set when every model has run
    }


# --- the table -----------------------------------------------------------------------------------------------

_COLUMNS = [
    # (header, figure, scale, format, with ratio)
    ("wall s", "wall_s", 1, "{:.2f}", True),
    ("tok/s", "tokens_per_s", 1, "{:.0f}", True),
    ("1st tok ms", "first_token_ms", 1, "{:.1f}", False),
    ("step ms", "step_latency_ms", 1, "{:.2f}", True),
    ("allocs", "cache_allocations", 1, "{:d}", False),
    ("alloc MB", "cache_bytes_allocated", MB, "{:.1f}", True),
    ("peak cache MB", "peak_cache_bytes", MB, "{:.1f}", False),
    ("peak RSS+ MB", "peak_rss_growth_bytes", MB, "{:.0f}", False),
    ("graphs", "compiled_graphs", 1, "{:d}", False),
]


def _cell(value, scale, fmt) -> str:
    if value is None:
        return "-"
    return fmt.format(value / scale if scale != 1 else value)


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _table(model: dict) -> list[str]:
    headers = ["strategy"]
    for header, _, _, _, with_ratio in _COLUMNS:
        headers += [header, "x dyn"] if with_ratio else [header]
    headers.append("same tokens")
    rows = [headers]
    for name, figures in model["strategies"].items():
        row = [name]
        for _, figure, scale, fmt, with_ratio in _COLUMNS:
            row.append(_cell(figures[figure], scale, fmt))
            if with_ratio:
                row.append(_ratio((figures["vs_dynamic"] or {}).get(figure)))
        row.append("reference" if name == "dynamic" else ("yes" if figures["outputs_equal"] else "NO"))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    return [
        "  ".join(
            cell.rjust(width) if i else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


def _stream_line(model: dict) -> str:
    stream = model["stream"]
    batches = [call["batch_size"] for call in stream]
    if stream[0]["encoder_len"] is not None:
        kind, lengths = "encoder length", [call["encoder_len"] for call in stream]
    else:
        kind, lengths = "prompt length", [call["length"] for call in stream]
    return (
        f"{len(stream)} calls, batch {min(batches)}-{max(batches)}, {kind} {min(lengths)}-{max(lengths)}, "
        f"{model['new_tokens']} new tokens each ({model['reference_distinct_tokens_per_row']:.1f} distinct per row); "
        f"flexible capacities {model['capacities']}"
    )


def format_header(machine: dict, args) -> str:
    mode = "quick (tiny configs)" if args.quick else "real-sized random models"
    return (
        f"transformers-flexcache bench: {mode}; {machine['cpu']}, {machine['threads']} thread(s) of "
        f"{machine['cpu_count']} CPUs; torch {machine['torch']}, transformers {machine['transformers']}"
    )


def format_model(name: str, model: dict) -> str:
    """One model's block: its stream, a row per strategy, and its notes."""
    lines = ["", f"{name}: {model['description']}, {model['num_parameters'] / 1e6:.1f}M parameters"]
    if model["stream"]:
        lines.append("  " + _stream_line(model))
    if model["strategies"]:
        lines += ["  " + line for line in _table(model)]
    lines += [f"  note: {note}" for note in model["notes"]]
    lines += [f"  FAILED: {failure}" for failure in model["failures"]]
    return "\n".join(lines)


def format_footer(report: dict) -> str:
    """The legend and the verdict: whether every strategy generated DynamicCache's tokens on every call."""
    lines = [
        "",
        "x dyn: ratio to DynamicCache (wall s, step ms, alloc MB: lower is better; tok/s: higher). allocs: cache "
        "storages allocated, warm-up call included. peak RSS+: rough RSS growth during a call (see docs).",
        f"Total time {report['elapsed_s']:.0f} s.",
    ]
    if report["outputs_equal"]:
        lines.append(
            f"Outputs: every strategy generated exactly DynamicCache's tokens on every call "
            f"({report['num_compared_calls']} calls compared)."
        )
    else:
        differing = [
            f"{model_name} {name} (calls {[i for i, call in enumerate(figures['calls']) if not call['outputs_equal']]})"
            for model_name, model in report["models"].items()
            for name, figures in model["strategies"].items()
            if not figures["outputs_equal"]
        ]
        lines.append("OUTPUTS DIFFER from DynamicCache's: " + "; ".join(differing))
    if report["failures"]:
        lines.append("FAILED: " + "; ".join(report["failures"]))
    return "\n".join(lines)


# --- the plot ------------------------------------------------------------------------------------------------


def write_plot(results, path: str) -> str:
    """Write a PNG with, per model, the wall time and the cache bytes allocated of each call, per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    shown = [result for result in results if result.records]
    if not shown:
        return "no model ran: no plot written"
    figure, axes = plt.subplots(len(shown), 2, figsize=(12, 3.2 * len(shown)), squeeze=False)
    for (time_axis, memory_axis), result in zip(axes, shown, strict=True):
        for name, records in result.records.items():
            calls = range(1, len(records) + 1)
            time_axis.plot(calls, [r.wall_s for r in records], marker="o", markersize=3, label=name)
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
        time_axis.set_title(f"{result.name}: wall time per call")
        time_axis.set_ylabel("seconds")
        memory_axis.set_title(f"{result.name}: cache memory allocated per call (0: warm-up)")
        memory_axis.set_ylabel("MB")
        for axis in (time_axis, memory_axis):
            axis.set_xlabel("call")
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
            axis.grid(alpha=0.3)
        time_axis.legend(fontsize=7)
        memory_axis.legend(fontsize=7)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"plot written to {path}"
