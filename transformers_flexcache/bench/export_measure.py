"""Measurements of export: lowering time and decoding speed of our `.pte` against eager PyTorch and transformers' exporter.

`python -m transformers_flexcache.bench.export_measure --models t5 llama --json measure.json` prints a table and writes the
figures as JSON; `measure_model(name, ...)` returns them, for the benchmark to call.

Design decisions:
- Real-sized configs built from upstream config classes with seeded random weights (no downloads): t5-small,
  bart-base, whisper-tiny, a ~100M Llama. Output embeddings are untied, as in the benchmark's models, so that greedy
  tokens vary with the input.
- One seeded stream of calls per model (batch 1-8, input lengths 8-48, and one encoder length >= 128 for
  encoder-decoder models), greedy, a fixed number of new tokens (fewer when a row ends with EOS, as for `generate`).
  Every call's tokens are compared with upstream's eager `generate` (DynamicCache).
- Latency is per decoder step (one `text_decoder` / `forward` call, or one forward of the eager model inside its
  `generate`), on one thread (torch and ExecuTorch's threadpool), steps 2..N of each call: the first step of eager
  `generate` also projects the cross-attention keys/values, which our `encoder` method does. Wall time of whole calls
  is reported too.
- transformers' own exporter (`transformers.integrations.executorch`: `Seq2SeqLMExportableModule`,
  `TorchExportableModuleForDecoderOnlyLM`) fixes the batch at export. It is exported at batch 1 and at the stream's
  largest batch; a call of another batch runs on the larger program with its rows padded by copies of row 0. The
  JSON counts the exports that serving every batch exactly would take. Its decoder takes the encoder output each step
  and recomputes the cross-attention keys/values; its decoder-only module takes no attention mask, so padded prompts
  cannot be served exactly (counted as token mismatches).
- Nothing here imports the benchmark; it calls `export/` only. The benchmark's ExecuTorch strategies
  (`transformers-flexcache bench --strategies executorch,...`) reuse `lower_ours`, `lower_upstream`,
  `load_upstream_methods`, `upstream_program_batch` and `upstream_generate`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

NEW_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class RealSizedModel:
    """A real-sized random model: its upstream class, config, export capacities and stream."""

    name: str
    upstream_class: str
    build_config: Callable
    capacities: dict
    description: str
    max_batch_size: int = 8


def _real(model_type: str) -> Callable:
    """The zoo's real-sized config of `model_type` (the benchmark's models: one zoo)."""
    from ..zoo import real_config

    return lambda: real_config(model_type)


REAL_SIZED = {
    model.name: model
    for model in [
        RealSizedModel(
            "t5",
            "T5ForConditionalGeneration",
            _real("t5"),
            {"max_batch_size": 8, "max_cache_len": NEW_TOKENS, "max_encoder_len": 160},
            "t5-small (6+6 layers, d_model 512, 8 heads, d_ff 2048, vocab 32128), untied",
        ),
        RealSizedModel(
            "bart",
            "BartForConditionalGeneration",
            _real("bart"),
            {"max_batch_size": 8, "max_cache_len": NEW_TOKENS, "max_encoder_len": 160},
            "bart-base (6+6 layers, d_model 768, 12 heads, ffn 3072, vocab 50265), untied",
        ),
        RealSizedModel(
            "whisper",
            "WhisperForConditionalGeneration",
            _real("whisper"),
            {"max_batch_size": 2, "max_cache_len": NEW_TOKENS, "max_encoder_len": 1500},
            "whisper-tiny (4+4 layers, d_model 384, 6 heads, 1500 encoder positions), untied",
            max_batch_size=2,
        ),
        RealSizedModel(
            "llama",
            "LlamaForCausalLM",
            _real("llama"),
            {"max_batch_size": 8, "max_cache_len": 48 + NEW_TOKENS},
            "~100M Llama (8 layers, hidden 768, 12 heads / 4 kv heads, MLP 2048, vocab 32000)",
        ),
    ]
}


def build_models(model: RealSizedModel, *, seed: int = 0):
    """(upstream model, override model with the same weights), eval mode, fp32."""
    import transformers

    from ..models.registry import convert

    torch.manual_seed(seed)
    upstream = getattr(transformers, model.upstream_class)(model.build_config()).eval()
    return upstream, convert(copy.deepcopy(upstream)).eval()


def stream(model: RealSizedModel, config, *, seed: int = 0, num_calls: int = 6) -> list[dict]:
    """The seeded calls: generate inputs of batch 1..max, lengths 8..48, and one encoder length >= 128."""
    generator = torch.Generator().manual_seed(seed)
    batches = [min(b, model.max_batch_size) for b in (1, model.max_batch_size, 3, 2, model.max_batch_size // 2 or 1)]
    batches.append(model.max_batch_size)
    calls = []
    for index in range(num_calls):
        batch_size = batches[index % len(batches)]
        if config.model_type == "whisper":
            frames = 2 * config.max_source_positions
            calls.append({"input_features": torch.randn(batch_size, config.num_mel_bins, frames, generator=generator)})
            continue
        long_call = config.is_encoder_decoder and index == num_calls - 1
        length = 150 if long_call else int(torch.randint(8, 49, (1,), generator=generator))
        calls.append(_token_inputs(config, batch_size, length, generator))
    return calls


def _token_inputs(config, batch_size: int, length: int, generator: torch.Generator) -> dict:
    # input_ids, attention_mask: [B, length]; row 0 full, the others between length/2 and length; special ids avoided
    special = {
        getattr(config, n, None) for n in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
    }
    low = max(i for i in special | {2} if isinstance(i, int)) + 1
    input_ids = torch.randint(low, config.vocab_size, (batch_size, length), generator=generator)
    row_lens = torch.randint((length + 1) // 2, length + 1, (batch_size,), generator=generator)
    row_lens[0] = length
    positions = torch.arange(length)
    if config.is_encoder_decoder:
        attention_mask = (positions[None, :] < row_lens[:, None]).long()  # right padding
    else:
        attention_mask = (positions[None, :] >= length - row_lens[:, None]).long()  # left padding
    input_ids[attention_mask == 0] = config.pad_token_id
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class _Clock:
    """Wall and CPU seconds of a block."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


# --- lowering ------------------------------------------------------------------------------------------------------
def lower_ours(
    flex,
    capacities: dict,
    path: str,
    *,
    backend: str = "xnnpack",
    quantize: str = "none",
) -> dict:
    """Export and lower our program for `flex` (a copy is quantized if asked); returns times, sizes, memory.

    `quantized_linears` counts the linears quantized."""
    from .api import export_model
    from .lowering import lower_to_executorch
    from .quantize import quantize_model_

    model, quantized_linears = flex, 0
    if quantize != "none":
        model = copy.deepcopy(flex)
        quantized_linears = quantize_model_(model, quantize)
    with _Clock() as export_clock, torch.no_grad():
        programs = export_model(model, **capacities)
    with _Clock() as lower_clock:
        report = lower_to_executorch(programs, path, backend=backend)
    return {
        "export_s": export_clock.wall,
        "export_cpu_s": export_clock.cpu,
        "lower_s": lower_clock.wall,
        "lower_cpu_s": lower_clock.cpu,
        "stages_s": report.seconds,
        "pte_bytes": report.pte_bytes,
        "planned_bytes": report.planned_bytes,
        "cache_bytes": report.shared_bytes,
        "partitions": report.num_partitions,
        "quantized_linears": quantized_linears,
    }


def lower_upstream(upstream, capacities: dict, folder: str, *, batch_size: int) -> dict:
    """transformers' own ExecuTorch export of `upstream` at `batch_size`, lowered with XNNPACK as we lower ours."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with _Clock() as export_clock, torch.no_grad():
        programs = upstream_programs(upstream, capacities, batch_size)
    paths, seconds = {}, {}
    with _Clock() as lower_clock:
        for name, program in programs.items():
            started = time.perf_counter()
            executorch_program = to_edge_transform_and_lower(
                program, partitioner=[XnnpackPartitioner()]
            ).to_executorch()
            paths[name] = os.path.join(folder, f"upstream-{name}-b{batch_size}.pte")
            with open(paths[name], "wb") as file:
                executorch_program.write_to_file(file)
            seconds[name] = time.perf_counter() - started
    return {
        "export_s": export_clock.wall,
        "export_cpu_s": export_clock.cpu,
        "lower_s": lower_clock.wall,
        "lower_cpu_s": lower_clock.cpu,
        "stages_s": seconds,
        "pte_bytes": sum(os.path.getsize(p) for p in paths.values()),
        "paths": paths,
    }


def upstream_programs(upstream, capacities: dict, batch_size: int) -> dict:
    """transformers' exported programs of `upstream` at `batch_size` (method name -> `ExportedProgram`): `encoder`
    (batch 1) and `decoder` for encoder-decoder models, `forward` for decoder-only ones; torch.export only."""
    from transformers.integrations.executorch import Seq2SeqLMExportableModule, TorchExportableModuleForDecoderOnlyLM

    config = upstream.config
    if config.is_encoder_decoder:
        module = Seq2SeqLMExportableModule(
            upstream,
            batch_size=batch_size,
            max_hidden_seq_length=capacities["max_encoder_len"],
            max_cache_length=capacities["max_cache_len"],
        )
        d_model = config.d_model
        encoder_input = torch.ones(1, 10, dtype=torch.long)
        if config.model_type == "whisper":
            encoder_input = torch.zeros(1, config.num_mel_bins, 2 * config.max_source_positions)
        module.export(
            encoder_input_ids=encoder_input,
            decoder_input_ids=torch.zeros(batch_size, 1, dtype=torch.long),
            encoder_hidden_states=torch.zeros(batch_size, 10, d_model),
        )
        return {"encoder": module.exported_encoder, "decoder": module.exported_decoder}
    upstream.generation_config.cache_implementation = "static"
    module = TorchExportableModuleForDecoderOnlyLM(
        upstream, batch_size=batch_size, max_cache_len=capacities["max_cache_len"]
    )
    tokens = torch.export.Dim("tokens", min=1, max=capacities["max_cache_len"] - 1)
    program = module.export(
        input_ids=torch.zeros(batch_size, 2, dtype=torch.long),
        cache_position=torch.arange(2),
        dynamic_shapes={"input_ids": {1: tokens}, "cache_position": {0: tokens}},
        # Non-strict export (torch 2.13, transformers 5.24) lifts each StaticCache tensor twice, as a buffer and as a
        # constant: the decompositions of lowering then fail ("expected compiled_fn to be GraphModule").
        strict=True,
    )
    return {"forward": program}


# --- decoding ------------------------------------------------------------------------------------------------------
class _StepTimer:
    """Wall seconds of each call of `runner._run` for the step method, per generate call."""

    def __init__(self, runner, step_method: str):
        self.steps, self.other = [], []
        original = runner._run

        def run(method_name, inputs):
            started = time.perf_counter()
            try:
                return original(method_name, inputs)
            finally:
                (self.steps if method_name == step_method else self.other).append(time.perf_counter() - started)

        runner._run = run


def _eager_steps(upstream, inputs: dict) -> tuple[torch.Tensor, list[float], float]:
    """(tokens, seconds of each forward inside `generate` (DynamicCache), wall of the call)."""
    seconds, started = [], []
    pre = upstream.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    post = upstream.register_forward_hook(lambda *_: seconds.append(time.perf_counter() - started[-1]))
    try:
        with _Clock() as clock:
            tokens = upstream.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        pre.remove()
        post.remove()
    return tokens, seconds, clock.wall


def _generate_ids(upstream) -> dict:
    config = upstream.generation_config
    return {
        "decoder_start_token_id": config.decoder_start_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id if config.pad_token_id is not None else config.eos_token_id,
        "forced_eos_token_id": getattr(config, "forced_eos_token_id", None),
    }


def _suppressing_processors(upstream):
    """The token-suppressing processors that upstream's `generate` applies for this generation config (Whisper's
    `suppress_tokens` and `begin_suppress_tokens`, in upstream's order), for our `generate`; None when it has none."""
    from transformers import LogitsProcessorList, SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor

    config = upstream.generation_config
    processors = LogitsProcessorList()
    if config.suppress_tokens is not None:
        processors.append(SuppressTokensLogitsProcessor(config.suppress_tokens))
    if config.begin_suppress_tokens is not None:
        begin_index = 1 if upstream.config.is_encoder_decoder else 0  # after the decoder start token
        processors.append(SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin_index=begin_index))
    return processors or None


def decode_ours(runner, upstream, calls: list[dict], expected: list[torch.Tensor]) -> dict:
    """Run the stream on our program; per-step latency and token agreement with `expected`."""
    from .decoding import generate

    step_method = "text_decoder" if runner.is_encoder_decoder else "forward"  # the first is the prompt's: dropped
    timer = _StepTimer(runner, step_method)
    steps, walls, equal = [], [], 0
    for inputs, want in zip(calls, expected, strict=True):
        timer.steps.clear()
        with _Clock() as clock:
            tokens = generate(
                runner,
                **inputs,
                max_new_tokens=NEW_TOKENS,
                logits_processor=_suppressing_processors(upstream),
                **_generate_ids(upstream),
            )
        walls.append(clock.wall)
        steps.extend(timer.steps[1:])
        if upstream.config.model_type == "whisper":
            tokens = tokens[:, 1:]  # Whisper's generate returns its sequences without the decoder start token
        equal += int(torch.equal(tokens, want))
    return {"step_ms": 1e3 * statistics.mean(steps), "call_s": walls, "calls_equal": equal, "calls": len(calls)}


def load_upstream_methods(paths: dict[int, dict[str, str]]) -> dict[int, dict]:
    """Program batch -> method name -> ExecuTorch method, from the `.pte` paths of `lower_upstream` per batch."""
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    return {
        batch: {name: runtime.load_program(path).load_method("forward") for name, path in by_name.items()}
        for batch, by_name in paths.items()
    }


def upstream_program_batch(batch_size: int, program_batches) -> int:
    """The batch of transformers' program that serves a call of `batch_size` rows: its own when exported at
    batch 1, else the largest, with the rows padded (see `upstream_generate`)."""
    if batch_size == 1 and 1 in program_batches:
        return 1
    if batch_size > max(program_batches):
        raise ValueError(
            f"batch_size={batch_size} exceeds the largest exported batch {max(program_batches)}; export "
            f"transformers' program at batch_size={batch_size}"
        )
    return max(program_batches)


def decode_upstream_exported(upstream, programs: dict, calls: list[dict], expected: list[torch.Tensor]) -> dict:
    """Run the stream on transformers' exported programs (ExecuTorch), batch 1 or padded to the larger batch."""
    loaded = load_upstream_methods(programs)
    steps, walls, equal = [], [], 0
    for inputs, want in zip(calls, expected, strict=True):
        batch_size = next(iter(inputs.values())).shape[0]
        program_batch = upstream_program_batch(batch_size, loaded)
        with _Clock() as clock:
            tokens, call_steps = upstream_generate(upstream, loaded[program_batch], inputs, program_batch)
        walls.append(clock.wall)
        steps.extend(call_steps[1:])
        equal += int(tokens.shape == want.shape and torch.equal(tokens, want))
    return {
        "step_ms": 1e3 * statistics.mean(steps),
        "call_s": walls,
        "calls_equal": equal,
        "calls": len(calls),
        "exports_used": sorted(loaded),
        "exports_for_every_batch": len({next(iter(c.values())).shape[0] for c in calls}),
    }


def upstream_generate(
    upstream, methods: dict, inputs: dict, program_batch: int, *, new_tokens: int = NEW_TOKENS, logits_processor=None
):
    """Greedy decoding with transformers' exported programs, as their `generate` helpers do, for a batch.

    Args:
        upstream: the upstream model (its generation config gives the decoder start token).
        methods: method name -> ExecuTorch method of one program batch (`load_upstream_methods`).
        inputs: `input_ids` and `attention_mask` `[B, L]`, or Whisper's `input_features`; `B <= program_batch`.
        program_batch: the batch the methods were exported at; rows `B..program_batch` are copies of row 0.
        new_tokens: tokens to decode, exactly (no stop at EOS, as transformers' helpers).
        logits_processor: upstream logits processors applied to each step's scores `[program_batch, V]` with the
            tokens so far, before the argmax (e.g. `MinNewTokensLengthLogitsProcessor`).

    Returns:
        (`[B, 1 + new_tokens]` decoder tokens (start token first) or `[B, P + new_tokens]` prompt and new tokens,
        seconds of each decoder call after the first).
    """
    ids = _generate_ids(upstream)
    config = upstream.config
    first = next(iter(inputs.values()))
    batch_size = first.shape[0]
    pad_rows = program_batch - batch_size
    step_seconds = []

    def append_next(tokens, logits):  # tokens: [B_p, T], logits: [B_p, S, V] -> [B_p, T + 1]
        scores = logits[:, -1]
        if logits_processor is not None:
            scores = logits_processor(tokens, scores)
        return torch.cat([tokens, scores.argmax(-1, keepdim=True)], dim=-1)

    if config.is_encoder_decoder:
        # Its encoder is exported at batch 1 and without a mask: one call per row, on the row's real tokens.
        states = []
        for row in range(batch_size):
            if "input_features" in inputs:
                row_input = inputs["input_features"][row : row + 1]
            else:
                row_input = inputs["input_ids"][row : row + 1, inputs["attention_mask"][row].bool()]
            states.append(methods["encoder"].execute([row_input.contiguous()])[0])
        max_len = max(s.shape[1] for s in states)
        # Rows of other lengths are padded with zeros: its decoder takes no encoder mask (a mismatch, counted).
        states = torch.cat([torch.nn.functional.pad(s, (0, 0, 0, max_len - s.shape[1])) for s in states])
        states = torch.cat([states, states[:1].expand(pad_rows, -1, -1)]) if pad_rows else states.contiguous()
        tokens = torch.full((program_batch, 1), ids["decoder_start_token_id"], dtype=torch.long)
        for position in range(new_tokens):
            started = time.perf_counter()
            step = [tokens[:, -1:].contiguous(), states, torch.tensor([position])]
            logits = methods["decoder"].execute(step)[0]
            step_seconds.append(time.perf_counter() - started)
            tokens = append_next(tokens, logits)
        return tokens[:batch_size], step_seconds
    input_ids = inputs["input_ids"]
    input_ids = torch.cat([input_ids, input_ids[:1].expand(pad_rows, -1)]) if pad_rows else input_ids
    logits = methods["forward"].execute([input_ids.contiguous(), torch.arange(input_ids.shape[1])])[0]
    tokens = append_next(input_ids, logits)
    for _ in range(new_tokens - 1):
        started = time.perf_counter()
        logits = methods["forward"].execute([tokens[:, -1:].contiguous(), torch.tensor([tokens.shape[1] - 1])])[0]
        step_seconds.append(time.perf_counter() - started)
        tokens = append_next(tokens, logits)
    return tokens[:batch_size], step_seconds


def measure_model(
    name: str,
    *,
    quantize_modes: tuple[str, ...] = ("none",),
    upstream_exporter: bool = True,
    decode: bool = True,
    folder: str | None = None,
    num_calls: int = 6,
) -> dict:
    """Every figure for one real-sized model (see the module docstring); JSON-serializable."""
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    from .runners import ExecuTorchPrograms

    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)
    model = REAL_SIZED[name]
    folder = folder or tempfile.mkdtemp(prefix=f"measure-{name}-")
    os.makedirs(folder, exist_ok=True)
    upstream, flex = build_models(model)
    result = {"model": name, "description": model.description, "capacities": model.capacities, "ours": {}}
    for mode in quantize_modes:
        path = os.path.join(folder, f"ours-{mode}.pte")
        result["ours"][mode] = lower_ours(flex, model.capacities, path, quantize=mode)
        result["ours"][mode]["path"] = path
    if upstream_exporter:
        batches = sorted({1, model.max_batch_size})
        try:
            result["upstream"] = {
                str(b): lower_upstream(copy.deepcopy(upstream), model.capacities, folder, batch_size=b)
                for b in batches
            }
        except Exception as error:  # transformers' exporter failing costs its rows, not ours (measured: Whisper)
            result["upstream_error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            upstream_exporter = False
    if not decode:
        return result
    calls = stream(model, upstream.config, num_calls=num_calls)
    expected, eager_steps, eager_walls = [], [], []
    for inputs in calls:
        tokens, seconds, wall = _eager_steps(upstream, inputs)
        expected.append(tokens)
        eager_steps.extend(seconds[1:])
        eager_walls.append(wall)
    result["stream"] = [{k: list(v.shape) for k, v in c.items()} for c in calls]
    result["eager"] = {"step_ms": 1e3 * statistics.mean(eager_steps), "call_s": eager_walls}
    for mode in quantize_modes:
        runner = ExecuTorchPrograms(result["ours"][mode]["path"])
        result["ours"][mode]["decode"] = decode_ours(runner, upstream, calls, expected)
    if upstream_exporter:
        programs = {int(b): r["paths"] for b, r in result["upstream"].items()}
        result["upstream_decode"] = decode_upstream_exported(upstream, programs, calls, expected)
    return result


def _table(results: list[dict]) -> str:
    lines = [
        "| model | program | export s | lower s (cpu) | .pte MiB | planned MiB | step ms | x eager | calls = eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("upstream_error"):
            lines.append(f"| {r['model']} | transformers' exporter failed: {r['upstream_error']} | | | | | | | |")
        eager = r.get("eager", {}).get("step_ms")
        if eager:
            lines.append(f"| {r['model']} | eager PyTorch, DynamicCache | | | | | {eager:.1f} | 1.00 | - |")
        for mode, o in r["ours"].items():
            d = o.get("decode", {})
            step = d.get("step_ms")
            ratio = f"{step / eager:.2f}" if step and eager else ""
            planned = sum(o["planned_bytes"].values()) / 2**20
            lines.append(
                f"| {r['model']} | ours, XNNPACK {'fp32' if mode == 'none' else mode} | {o['export_s']:.0f} | "
                f"{o['lower_s']:.0f} ({o['lower_cpu_s']:.0f}) | {o['pte_bytes'] / 2**20:.0f} | {planned:.0f} | "
                f"{f'{step:.1f}' if step else ''} | {ratio} | {d.get('calls_equal', '')}/{d.get('calls', '')} |"
            )
        for batch, u in r.get("upstream", {}).items():
            d = r.get("upstream_decode", {}) if batch == max(r["upstream"], key=int) else {}
            step = d.get("step_ms")
            ratio = f"{step / eager:.2f}" if step and eager else ""
            lines.append(
                f"| {r['model']} | transformers' exporter, batch {batch} | {u['export_s']:.0f} | "
                f"{u['lower_s']:.0f} ({u['lower_cpu_s']:.0f}) | {u['pte_bytes'] / 2**20:.0f} | | "
                f"{f'{step:.1f}' if step else ''} | {ratio} | {d.get('calls_equal', '')}/{d.get('calls', '')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m transformers_flexcache.bench.export_measure", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--models", nargs="+", choices=tuple(REAL_SIZED), default=["t5", "llama"])
    parser.add_argument("--quantize", nargs="+", choices=("none", "8da4w", "int8"), default=["none", "8da4w"])
    parser.add_argument("--no-upstream", action="store_true", help="skip transformers' exporter")
    parser.add_argument("--no-decode", action="store_true", help="lowering figures only")
    parser.add_argument("--calls", type=int, default=6, help="calls in the stream")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--folder", help="keep the .pte files here (default: a temporary folder)")
    args = parser.parse_args(argv)
    results = []
    for name in args.models:
        results.append(
            measure_model(
                name,
                quantize_modes=tuple(args.quantize),
                upstream_exporter=not args.no_upstream,
                decode=not args.no_decode,
                folder=args.folder and os.path.join(args.folder, name),
                num_calls=args.calls,
            )
        )
        if args.json:
            with open(args.json, "w") as file:
                json.dump(results, file, indent=1, default=str)
        print(_table(results[-1:]), flush=True)
    print(_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
