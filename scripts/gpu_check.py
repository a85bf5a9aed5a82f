"""GPU checks: CUDA graphs over a stream of generate calls of new shapes, and storage placed per layer across devices.

On one CUDA device, for a seeded random model (the benchmark's real-sized configs: t5-small, a ~100M Llama):
1. `flexible padded` (`cache_implementation="flexible_static"`, `shape_policy="padded"`): over the stream, the decode
   step compiles once, CUDA graphs are recorded during the first call only (one capture set, reused by every later
   batch and length) and never skipped, and the tokens equal those of upstream's DynamicCache run eagerly on the same
   device and dtype.
2. `static` (upstream `cache_implementation="static"` with the same `max_cache_len`): graphs compiled and CUDA graph
   recordings over the same stream (it builds a new cache, at new addresses, per call).
3. Decode-step latency of both, warm, on the largest shape: (time of N tokens - time of 1 token) / (N - 1), median
   of `--repeats` runs, exactly N tokens per call (`min_new_tokens`).
4. `flexible bucketed` (`shape_policy="bucketed"`, `check_bucketed`): `warmup()` compiles and records every bucket
   before the stream; over the stream, nothing more is compiled or recorded and nothing is skipped, with the tokens
   of the eager DynamicCache; and the decode step of the smallest call against padded mode's (which runs it at
   `max_batch_size` and the whole capacity).

Placement (`--check placement`), the model loaded with an accelerate `device_map` that splits its decoder layers:
with two CUDA devices, the first half on cuda:0 and the rest on cuda:1; with one, the first half on cuda:0 and the rest
mapped to "cpu" (accelerate offloads them; they run where their hooks say); on CPU (`--allow-cpu`), the rest offloaded
to disk. Over a stream of calls,
the flexible tokens equal DynamicCache's on the same model, the storage is allocated once, and each layer's storage is
on the device where that layer's key projection actually ran (recorded by forward hooks, not read from the placement
code under test); bytes per device are reported.

Exit status: 0 when every check holds, 1 when one does not, 2 when there is no CUDA device.

Run from the repository root, on a machine with a GPU:
    PYTHONPATH=. python scripts/gpu_check.py --model t5 --json gpu_check.json   # --model llama / all, --check ...
`--allow-cpu` runs the same steps on CPU (no CUDA graphs: recordings stay 0), only to smoke-test this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time

import torch
from transformers import CompileConfig

import transformers_flexcache
from transformers_flexcache import warmup
from transformers_flexcache.bench.models import BENCH_MODELS, build_models

# (batch, prompt or encoder length): every call a new batch and length.
STREAM = [(8, 24), (2, 9), (5, 17), (1, 30), (7, 12), (3, 21)]


def build_model(model_type: str):
    """The benchmark's real-sized seeded model of `model_type`, as our override (its generate runs DynamicCache
    unless told otherwise: the eager reference)."""
    _, flex = build_models(BENCH_MODELS[model_type], quick=False)
    return flex


def capacities(model, new_tokens: int) -> dict:
    """Capacities that fit every call of STREAM with `new_tokens` new tokens."""
    max_batch, max_len = max(b for b, _ in STREAM), max(n for _, n in STREAM)
    if model.config.is_encoder_decoder:
        return {"max_batch_size": max_batch, "max_cache_len": new_tokens + 1, "max_encoder_len": max_len}
    return {"max_batch_size": max_batch, "max_cache_len": max_len + new_tokens, "max_prompt_len": max_len}


def make_inputs(batch_size: int, length: int, generator: torch.Generator, *, model) -> dict:
    """Token inputs of `batch_size` rows of up to `length` tokens, padded as tokenizers pad them (bench models)."""
    return BENCH_MODELS[model.config.model_type].make_inputs(model.config, batch_size, length, generator)


@contextlib.contextmanager
def counting_cudagraph_recordings():
    """Count CUDA graph recordings of inductor's cudagraph trees (one per captured node)."""
    from torch._inductor import cudagraph_trees

    count = {"recordings": 0}
    original = cudagraph_trees.CUDAGraphNode._record

    def record(self, *args, **kwargs):
        count["recordings"] += 1
        return original(self, *args, **kwargs)

    cudagraph_trees.CUDAGraphNode._record = record
    try:
        yield count
    finally:
        cudagraph_trees.CUDAGraphNode._record = original


def fresh_compiler() -> None:
    torch._dynamo.reset()
    with contextlib.suppress(Exception):
        torch._inductor.cudagraph_trees.reset_cudagraph_trees()
    torch._dynamo.utils.counters.clear()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_stream(model, inputs: list[dict], *, new_tokens: int, **generate_kwargs) -> dict:
    """Generate every call of the stream; count graphs, recordings and cudagraph skips."""
    fresh_compiler()
    sequences, calls_s, recordings = [], [], []
    with counting_cudagraph_recordings() as count:
        for call_inputs in inputs:
            synchronize(model.device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(**call_inputs, max_new_tokens=new_tokens, do_sample=False, **generate_kwargs)
            synchronize(model.device)
            calls_s.append(time.perf_counter() - start)
            sequences.append(out)
            recordings.append(count["recordings"])
    counters = torch._dynamo.utils.counters
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "cudagraph_recordings": count["recordings"],
        "cudagraph_recordings_after_each_call": recordings,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "stream_s": sum(calls_s),
        "calls_s": calls_s,
        "sequences": sequences,
    }


def decode_step_latency(model, call_inputs: dict, *, tokens: int, repeats: int, **generate_kwargs) -> float:
    """Seconds per decode step, warm: the prefill and per-call work cancel out in the difference."""

    def timed(num_tokens: int) -> float:
        synchronize(model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                **call_inputs,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                **generate_kwargs,
            )
        synchronize(model.device)
        return time.perf_counter() - start

    timed(tokens)  # warm: compiles and records what this shape needs
    long = statistics.median(timed(tokens) for _ in range(repeats))
    short = statistics.median(timed(1) for _ in range(repeats))
    return (long - short) / (tokens - 1)


def check(
    model_type: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    new_tokens: int,
    tokens: int,
    repeats: int,
    backend: str = "inductor",
):
    model = build_model(model_type).to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    inputs = [{k: v.to(device) for k, v in make_inputs(b, n, generator, model=model).items()} for b, n in STREAM]
    compile_config = CompileConfig(backend=backend, mode="reduce-overhead", fullgraph=True)
    if device.type != "cuda":
        compile_config._compile_all_devices = True  # the CPU smoke run: generate compiles on CPU only when asked to
    cache_len = max(capacities(model, tokens)["max_cache_len"], capacities(model, new_tokens)["max_cache_len"])
    flexible = {
        "cache_implementation": "flexible_static",
        "cache_config": {**capacities(model, new_tokens), "max_cache_len": cache_len, "shape_policy": "padded"},
        "compile_config": compile_config,
    }
    static = {"cache_implementation": "static", "max_cache_len": cache_len, "compile_config": compile_config}

    reference = run_stream(model, inputs, new_tokens=new_tokens)["sequences"]
    runs = {"flexible padded": run_stream(model, inputs, new_tokens=new_tokens, **flexible)}
    runs["static"] = run_stream(model, inputs, new_tokens=new_tokens, **static)
    for run in runs.values():
        run["tokens_equal"] = all(torch.equal(a, b) for a, b in zip(reference, run.pop("sequences"), strict=True))
    largest = max(inputs, key=lambda call: call["input_ids"].numel())
    for name, kwargs in (("flexible padded", flexible), ("static", static)):
        runs[name]["decode_step_ms"] = 1e3 * decode_step_latency(
            model, largest, tokens=tokens, repeats=repeats, **kwargs
        )
    padded = runs["flexible padded"]
    after_each_call = padded["cudagraph_recordings_after_each_call"]
    recorded_once = (
        after_each_call[0] > 0 and after_each_call[-1] == after_each_call[0] if device.type == "cuda" else True
    )
    passed = padded["graphs"] == 1 and recorded_once and padded["cudagraph_skips"] == 0 and padded["tokens_equal"]
    return {"model": model_type, "device": str(device), "dtype": str(dtype), "runs": runs, "passed": passed}


def check_bucketed(
    model_type: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    new_tokens: int,
    tokens: int,
    repeats: int,
    backend: str = "inductor",
):
    """The bucketed policy under CUDA graphs: `warmup()` compiles and records every bucket; the stream then compiles
    and records nothing more, skips nothing, and gives the eager DynamicCache's tokens. Also the warm decode step of
    the smallest call of the stream, bucketed against padded."""
    model = build_model(model_type).to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    inputs = [{k: v.to(device) for k, v in make_inputs(b, n, generator, model=model).items()} for b, n in STREAM]
    compile_config = CompileConfig(backend=backend, mode="reduce-overhead", fullgraph=True, dynamic=False)
    if device.type != "cuda":
        compile_config._compile_all_devices = True
    cache_len = max(capacities(model, tokens)["max_cache_len"], capacities(model, new_tokens)["max_cache_len"])
    # Two buckets per shape, so that warmup stays short on the GPU's time: rows 2 and 8, lengths 12 and the longest,
    # and one decoder length for the stream (the latency calls below, longer, compile their own).
    length_name = "max_encoder_len" if model.config.is_encoder_decoder else "max_prompt_len"
    buckets = {
        "max_batch_size": [2],
        length_name: [12],
        "max_cache_len": [capacities(model, new_tokens)["max_cache_len"]],
    }
    cache_config = {
        **capacities(model, new_tokens),
        "max_cache_len": cache_len,
        "shape_policy": "bucketed",
        "buckets": buckets,
    }
    bucketed = {
        "cache_implementation": "flexible_static",
        "cache_config": cache_config,
        "compile_config": compile_config,
    }

    reference = run_stream(model, inputs, new_tokens=new_tokens)["sequences"]
    fresh_compiler()
    counters = torch._dynamo.utils.counters
    with counting_cudagraph_recordings() as count:
        start = time.perf_counter()
        shapes = warmup(
            model,
            lambda b, n: {k: v.to(device) for k, v in make_inputs(b, n, generator, model=model).items()},
            max_new_tokens=max(new_tokens, tokens),
            cache_config=cache_config,
            compile_config=compile_config,
        )
        synchronize(device)
        warmup_s = time.perf_counter() - start
        warm = {"graphs": counters["stats"]["unique_graphs"], "recordings": count["recordings"]}
        sequences, calls_s = [], []
        for call_inputs in inputs:
            synchronize(device)
            start = time.perf_counter()
            with torch.inference_mode():
                sequences.append(model.generate(**call_inputs, max_new_tokens=new_tokens, do_sample=False, **bucketed))
            synchronize(device)
            calls_s.append(time.perf_counter() - start)
        run = {
            "shapes": len(shapes),
            "warmup_s": warmup_s,
            "graphs_after_warmup": warm["graphs"],
            "graphs": counters["stats"]["unique_graphs"],
            "cudagraph_recordings_after_warmup": warm["recordings"],
            "cudagraph_recordings": count["recordings"],
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
            "stream_s": sum(calls_s),
            "calls_s": calls_s,
            "tokens_equal": all(torch.equal(a, b) for a, b in zip(reference, sequences, strict=True)),
        }
    smallest = min(inputs, key=lambda call: call["input_ids"].numel())
    padded_config = {key: value for key, value in cache_config.items() if key != "buckets"}
    padded = {**bucketed, "cache_config": {**padded_config, "shape_policy": "padded"}}
    for name, kwargs in (("bucketed", bucketed), ("padded", padded)):
        run[f"smallest_call_decode_step_ms_{name}"] = 1e3 * decode_step_latency(
            model, smallest, tokens=tokens, repeats=repeats, **kwargs
        )
    recorded = run["cudagraph_recordings_after_warmup"] > 0 if device.type == "cuda" else True
    passed = (
        run["graphs"] == run["graphs_after_warmup"] <= run["shapes"]
        and run["cudagraph_recordings"] == run["cudagraph_recordings_after_warmup"]
        and recorded
        and run["cudagraph_skips"] == 0
        and run["tokens_equal"]
    )
    return {"model": model_type, "device": str(device), "dtype": str(dtype), "bucketed": run, "passed": passed}


def format_bucketed_table(result: dict) -> str:
    run = result["bucketed"]
    return "\n".join(
        [
            f"bucketed: model={result['model']} shapes={run['shapes']} warmup {run['warmup_s']:.1f} s",
            f"{'':<16} {'graphs':>6} {'recordings':>10} {'skips':>5} {'stream s':>9} {'tokens=eager':>12}",
            f"{'after warmup':<16} {run['graphs_after_warmup']:>6} {run['cudagraph_recordings_after_warmup']:>10}",
            f"{'after stream':<16} {run['graphs']:>6} {run['cudagraph_recordings']:>10} {run['cudagraph_skips']:>5} "
            f"{run['stream_s']:>9.2f} {'yes' if run['tokens_equal'] else 'NO':>12}",
            f"smallest call, decode step ms: bucketed {run['smallest_call_decode_step_ms_bucketed']:.3f}, "
            f"padded {run['smallest_call_decode_step_ms_padded']:.3f}",
            "PASS" if result["passed"] else "FAIL: after warmup the stream should compile, record and skip nothing",
        ]
    )


def format_table(result: dict) -> str:
    lines = [
        f"model={result['model']} device={result['device']} dtype={result['dtype']} calls={len(STREAM)}",
        f"{'run':<16} {'graphs':>6} {'recordings':>10} {'skips':>5} {'stream s':>9} {'decode ms':>9} {'tokens=eager':>12}",
    ]
    for name, run in result["runs"].items():
        lines.append(
            f"{name:<16} {run['graphs']:>6} {run['cudagraph_recordings']:>10} {run['cudagraph_skips']:>5} "
            f"{run['stream_s']:>9.2f} {run['decode_step_ms']:>9.3f} {'yes' if run['tokens_equal'] else 'NO':>12}"
        )
    lines.append("PASS" if result["passed"] else "FAIL: flexible padded should compile once, record once, skip none")
    return "\n".join(lines)


# --- placement across devices --------------------------------------------------------------------------------------
def split_devices() -> tuple[object, object, str]:
    """(device of the first half of the decoder layers, of the second half, what the split is)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return 0, 1, "two CUDA devices: layers on cuda:0 and cuda:1"
    if count == 1:
        return 0, "cpu", "one CUDA device: half the layers on cuda:0, the rest mapped to the CPU (accelerate offload)"
    return "cpu", "disk", "CPU only: half the layers on the CPU, the rest offloaded to disk (run on the CPU)"


def split_device_map(model_type: str, num_layers: int, first, second) -> dict:
    """A device_map with decoder layers [0, num_layers / 2) on `first` and the rest on `second`. Embeddings stay on
    one real device: upstream's loader cannot compare tied weights offloaded to disk."""
    half = num_layers // 2
    home = first if first != "disk" else "cpu"
    last = second if second not in ("cpu", "disk") else home  # lm_head runs where the last layer's output arrives
    if model_type == "llama":
        layers = {f"model.layers.{i}": first if i < half else second for i in range(num_layers)}
        return {"model.embed_tokens": home, **layers, "model.norm": last, "model.rotary_emb": home, "lm_head": last}
    layers = {f"decoder.block.{i}": first if i < half else second for i in range(num_layers)}
    return {
        "shared": home,
        "encoder": home,
        "decoder.embed_tokens": home,
        **layers,
        "decoder.final_layer_norm": last,
        "decoder.dropout": last,
        "lm_head": last,
    }


def record_key_devices(model) -> dict[int, torch.device]:
    """Forward hooks that record, per decoder layer, the device of its self-attention keys as they are computed."""
    from transformers_flexcache.cache.placement import KEY_PROJECTION_NAMES, attention_modules

    seen: dict[int, torch.device] = {}
    own, _ = attention_modules(model)
    for layer_idx, module in own.items():
        projection = next(getattr(module, name) for name in KEY_PROJECTION_NAMES if hasattr(module, name))

        def hook(_module, _inputs, output, layer_idx=layer_idx):
            seen[layer_idx] = output.device

        projection.register_forward_hook(hook)
    return seen


def check_placement(model_type: str, *, new_tokens: int) -> dict:
    """The flexible cache on a model split by a device_map: same tokens as DynamicCache, storage beside each layer."""
    first, second, split = split_devices()
    with tempfile.TemporaryDirectory() as folder:
        built = build_model(model_type)
        built.save_pretrained(folder)
        num_layers = (
            built.config.num_decoder_layers if built.config.is_encoder_decoder else built.config.num_hidden_layers
        )
        device_map = split_device_map(model_type, num_layers, first, second)
        model = type(built).from_pretrained(folder, device_map=device_map, offload_folder=f"{folder}/offload").eval()
        key_devices = record_key_devices(model)
        generator = torch.Generator().manual_seed(0)
        config = {**capacities(model, new_tokens), "shape_policy": "exact"}
        calls, pointers, tokens_equal = [], set(), True
        for batch, length in STREAM[:3]:
            inputs = make_inputs(batch, length, generator, model=model)
            kwargs = {"max_new_tokens": new_tokens, "do_sample": False}
            with torch.inference_mode():
                expected = model.generate(**inputs, **kwargs)
                actual = model.generate(
                    **inputs,
                    **kwargs,
                    cache_implementation="flexible_static",
                    cache_config=config,
                    return_dict_in_generate=True,
                )
            tokens_equal &= torch.equal(expected.cpu(), actual.sequences.cpu())
            pointers.add(tuple(actual.cache.data_ptrs()))
            calls.append({"batch": batch, "length": length})
        cache = actual.cache
        self_cache = getattr(cache, "self_attention_cache", cache)
        storage_devices = [str(layer.storages()[0].device) for layer in self_cache.layers]
        layers = [
            {"layer": i, "keys_computed_on": str(key_devices.get(i)), "storage": storage_devices[i]}
            for i in range(len(storage_devices))
        ]
        beside = all(layer["keys_computed_on"] == layer["storage"] for layer in layers)
        held = transformers_flexcache.held_nbytes(model)
        freed = transformers_flexcache.release(model)
    passed = tokens_equal and beside and len(pointers) == 1 and freed == sum(held.values())
    return {
        "model": model_type,
        "split": split,
        "device_map": {key: str(value) for key, value in device_map.items()},
        "calls": calls,
        "tokens_equal": tokens_equal,
        "storages_over_stream": len(pointers),
        "layers": layers,
        "held_nbytes": held,
        "released_nbytes": freed,
        "passed": passed,
    }


def format_placement(result: dict) -> str:
    lines = [f"placement model={result['model']}: {result['split']}"]
    for layer in result["layers"]:
        lines.append(
            f"  layer {layer['layer']}: keys computed on {layer['keys_computed_on']}, storage on {layer['storage']}"
        )
    lines.append(
        f"  tokens equal DynamicCache: {'yes' if result['tokens_equal'] else 'NO'}; storages over the stream: "
        f"{result['storages_over_stream']}; held per device: {result['held_nbytes']}; released: {result['released_nbytes']}"
    )
    lines.append("  PASS" if result["passed"] else "  FAIL: storage should sit beside each layer, allocated once")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("t5", "llama", "all"), default="t5")
    parser.add_argument("--check", choices=("compile", "placement", "all"), default="all")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per call of the stream")
    parser.add_argument("--latency-tokens", type=int, default=64, help="N of the decode-step latency")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="gpu_check.json")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (CUDA graphs need inductor)")
    parser.add_argument("--allow-cpu", action="store_true", help="smoke-test this script on CPU (no CUDA graphs)")
    args = parser.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64  # static and padded/bucketed runs of two models compile one function
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "gpu_check needs a CUDA device (torch.cuda.is_available() is False with torch "
            f"{torch.__version__}); run it on a machine with a GPU and a CUDA build of torch",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = ("t5", "llama") if args.model == "all" else (args.model,)
    results = []
    for model_type in models:
        if args.check in ("compile", "all"):
            options = {
                "device": device,
                "dtype": getattr(torch, args.dtype),
                "new_tokens": args.new_tokens,
                "tokens": args.latency_tokens,
                "repeats": args.repeats,
                "backend": args.backend,
            }
            for run_check, format_result in ((check, format_table), (check_bucketed, format_bucketed_table)):
                result = run_check(model_type, **options)
                print(format_result(result), flush=True)
                results.append(result)
        if args.check in ("placement", "all"):
            result = check_placement(model_type, new_tokens=args.new_tokens)
            print(format_placement(result), flush=True)
            results.append(result)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.json}")
    return 0 if all(result["passed"] for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
