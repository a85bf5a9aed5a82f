"""Benchmark: a stream of generate calls of different shapes under `torch.compile`, end to end, compilation included.

Compares, on one seeded model and in one run:
- `dynamic (eager)`: upstream's default DynamicCache, not compiled. Its tokens are the reference.
- `flexible padded`: `cache_implementation="flexible_static"` with `shape_policy="padded"`: every call is padded to
  the capacities, so the decode step compiles once for the whole stream.
- `static`: upstream's `cache_implementation="static"`, given the same `max_cache_len` so that only the batch and
  the encoder length change between calls. It builds a new cache per call; dynamo recompiles for new shapes (after a
  few, with dynamic shapes).
Both compiled runs use generate's own `compile_config` (the decode step is compiled, the prefill runs eagerly) with
the same backend, and start from a reset dynamo. Inductor's on-disk caches are disabled, so that neither run reuses
kernels that the other compiled, and a small unrelated function is compiled first, so that one-time start-up costs
of the backend land on neither run (the flexible run goes first: anything left warm favours upstream). Models are
random, seeded, "small real-ish" configs built from upstream config classes (no download).

Run: `OMP_NUM_THREADS=2 python -m transformers_flexcache.compile_bench --model t5 --json compile_bench.json`.
Prints a table (seconds over the whole stream, graphs compiled, tokens equal to the reference) and the ratio
static / flexible padded, and writes the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import transformers
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import CompileConfig, LlamaConfig, T5Config

# (batch, prompt or encoder length): every call a new shape; `--new-tokens` tokens are generated per call.
STREAM = [(8, 24), (2, 9), (5, 17), (1, 30), (7, 12), (3, 21)]
VOCAB = 2000


def build_model(model_type: str, seed: int = 0):
    """A seeded random override model (and its config) of a small but not toy size."""
    from model_overrides.llama import FlexLlamaForCausalLM
    from model_overrides.t5 import FlexT5ForConditionalGeneration

    if model_type == "t5":
        config = T5Config(
            vocab_size=VOCAB, d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_heads=8, decoder_start_token_id=0
        )
        model_class = FlexT5ForConditionalGeneration
    elif model_type == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        model_class = FlexLlamaForCausalLM
    else:
        raise ValueError(f"--model {model_type!r} is not one of ('t5', 'llama')")
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return model_class(config).eval()


def make_inputs(batch_size: int, length: int, generator: torch.Generator, *, padding_side: str) -> dict:
    """Random tokens with a mask; row 0 is padded to half its length, as a tokenizer would pad a batch."""
    input_ids = torch.randint(3, VOCAB, (batch_size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if batch_size > 1:
        pad = slice(0, length // 2) if padding_side == "left" else slice(length - length // 2, length)
        attention_mask[0, pad] = 0
        input_ids[0, pad] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def capacities(model, new_tokens: int) -> dict:
    max_batch = max(batch for batch, _ in STREAM)
    max_len = max(length for _, length in STREAM)
    if model.config.is_encoder_decoder:
        return {"max_batch_size": max_batch, "max_cache_len": new_tokens, "max_encoder_len": max_len}
    return {"max_batch_size": max_batch, "max_cache_len": max_len + new_tokens, "max_prompt_len": max_len}


def run_stream(model, inputs: list[dict], *, new_tokens: int, backend: str | None, **generate_kwargs) -> dict:
    """Time every call of the stream; compile with `backend` through generate's `compile_config` unless None."""
    torch._dynamo.reset()
    counter = None
    if backend is not None:
        counter = CompileCounterWithBackend(backend)

        def counting_backend(graph_module, example_inputs, **kwargs):  # generate passes `mode=`
            return counter(graph_module, example_inputs)

        compile_config = CompileConfig(backend=counting_backend, mode=None)
        compile_config._compile_all_devices = True  # generate compiles on CPU only when asked to
        generate_kwargs["compile_config"] = compile_config
    calls_s, sequences = [], []
    for call_inputs in inputs:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**call_inputs, max_new_tokens=new_tokens, do_sample=False, **generate_kwargs)
        calls_s.append(time.perf_counter() - start)
        sequences.append(out)
    return {
        "total_s": sum(calls_s),
        "first_call_s": calls_s[0],
        "calls_s": calls_s,
        "graphs": counter.frame_count if counter is not None else 0,
        "sequences": sequences,
    }


def warm_up_backend(backend: str) -> float:
    """Compile and run a small unrelated function, so that the backend's one-time start-up is paid here."""
    start = time.perf_counter()
    torch._dynamo.reset()
    torch.compile(lambda x: (x @ x).softmax(-1).sum(), backend=backend)(torch.randn(16, 16))
    return time.perf_counter() - start


def benchmark(model_type: str, *, new_tokens: int, backend: str, seed: int = 0) -> dict:
    torch._inductor.config.force_disable_caches = True
    warm_up_s = warm_up_backend(backend)
    model = build_model(model_type, seed)
    generator = torch.Generator().manual_seed(seed)
    padding_side = "right" if model.config.is_encoder_decoder else "left"
    inputs = [make_inputs(batch, length, generator, padding_side=padding_side) for batch, length in STREAM]
    flexible = {
        "cache_implementation": "flexible_static",
        "cache_config": {**capacities(model, new_tokens), "shape_policy": "padded"},
    }
    max_cache_len = capacities(model, new_tokens)["max_cache_len"]
    runs = {
        "dynamic (eager)": run_stream(model, inputs, new_tokens=new_tokens, backend=None),
        "flexible padded": run_stream(model, inputs, new_tokens=new_tokens, backend=backend, **flexible),
        "static": run_stream(
            model,
            inputs,
            new_tokens=new_tokens,
            backend=backend,
            cache_implementation="static",
            max_cache_len=max_cache_len,
        ),
    }
    reference = runs["dynamic (eager)"]["sequences"]
    for run in runs.values():
        run["tokens_equal"] = all(torch.equal(a, b) for a, b in zip(reference, run.pop("sequences"), strict=True))
    return {
        "model": model_type,
        "config": model.config.to_diff_dict(),
        "stream": [{"batch": batch, "length": length, "new_tokens": new_tokens} for batch, length in STREAM],
        "backend": backend,
        "backend_warm_up_s": warm_up_s,
        "threads": torch.get_num_threads(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "runs": runs,
        "static_over_flexible_padded": runs["static"]["total_s"] / runs["flexible padded"]["total_s"],
    }


def format_table(result: dict) -> str:
    lines = [
        f"model={result['model']} backend={result['backend']} threads={result['threads']} "
        f"calls={len(result['stream'])} new_tokens={result['stream'][0]['new_tokens']} "
        f"(backend warm-up, not counted: {result['backend_warm_up_s']:.1f} s)",
        f"{'run':<18} {'graphs':>6} {'first call s':>12} {'stream s':>9} {'tokens = eager':>14}",
    ]
    for name, run in result["runs"].items():
        lines.append(
            f"{name:<18} {run['graphs']:>6} {run['first_call_s']:>12.2f} {run['total_s']:>9.2f} "
            f"{'yes' if run['tokens_equal'] else 'NO':>14}"
        )
    for name, run in result["runs"].items():
        lines.append(f"{name} per call s: " + " ".join(f"{seconds:.2f}" for seconds in run["calls_s"]))
    lines.append(f"static / flexible padded (stream time): {result['static_over_flexible_padded']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("t5", "llama"), default="t5")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, eager)")
    parser.add_argument("--json", default="compile_bench.json", help="where to write the results")
    args = parser.parse_args(argv)
    result = benchmark(args.model, new_tokens=args.new_tokens, backend=args.backend)
    print(format_table(result))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
