"""`python -m transformers_flexcache export MODEL_DIR --out model.pte ...`: a saved checkpoint to one ExecuTorch `.pte`.

Design decisions:
- Every argument is checked before anything is loaded (the folder and its `config.json`, the model type, capacities
  against the model, backend, quantization and dtype, that executorch imports): a refused command costs no time.
- The checkpoint loads into upstream's class named by `config.architectures` (or the AutoModel class of its model
  type), then `transformers_flexcache.convert` turns it into the override in place: no global registration.
- Progress goes to stdout, one line per stage (load, quantize, export, lower, write) with its seconds, then a
  summary: methods, capacities, `.pte` size, planned memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# Upstream AutoModel class per supported model type, where `config.architectures` does not name the class.
_AUTO_CLASSES = {
    "whisper": "AutoModelForSpeechSeq2Seq",
    "pix2struct": "AutoModelForImageTextToText",
}  # others: AutoModelForSeq2SeqLM for encoder-decoder models, AutoModelForCausalLM for decoder-only ones
# Why a supported model type cannot be exported yet (checked before loading).
NOT_EXPORTABLE = {
    "jamba": (
        "its Mamba scan is a Python loop over the prompt length (`for index in range(seq_len)` in modeling_jamba.py's "
        "`mamba_selective_scan`, transformers 5.24 and 5.25; the associative-scan path is disabled under torch.export), "
        "so torch.export "
        "specializes the prompt length to the traced one; a one-token step does export, and a token-by-token "
        "prefill on it with the conv/ssm states as buffers is what would be needed (see docs/export.md, 'Jamba')"
    ),
}


class CommandError(ValueError):
    """A refused command: the message says what, the limit, and the fix."""


def _as_flags(message: str) -> str:
    """A library error in the command's words: `max_batch_size=0` -> `--max-batch-size=0`."""
    for name in ("max_batch_size", "max_cache_len", "max_encoder_len"):
        message = message.replace(name, "--" + name.replace("_", "-"))
    return message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a checkpoint folder written by save_pretrained")
    parser.add_argument("--out", required=True, help="the .pte file to write")
    parser.add_argument("--max-batch-size", type=int, required=True, help="rows of the cache (any batch up to it)")
    parser.add_argument("--max-cache-len", type=int, required=True, help="decoder positions per row")
    parser.add_argument(
        "--max-encoder-len",
        type=int,
        help="encoder positions per row (encoder-decoder models; Whisper's default is max_source_positions)",
    )
    parser.add_argument(
        "--encoder-input",
        help="what the encoder method takes (default: the model's main input; encoder_hidden_states for encoder "
        "outputs of any length)",
    )
    parser.add_argument("--backend", choices=("xnnpack", "portable"), default="xnnpack")
    parser.add_argument("--quantize", choices=("none", "8da4w", "int8"), default="none")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")


def _check_arguments(args) -> dict:
    """Check everything that can be checked without loading weights; returns the config and resolved options."""
    from ..models.registry import GENERIC_MODEL_TYPES, SUPPORTED_MODEL_TYPES
    from .lowering import check_backend
    from .modules import ENCODER_INPUTS, check_capacities
    from .quantize import check_quantize

    config_path = os.path.join(args.model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CommandError(
            f"{args.model_dir} has no config.json: MODEL_DIR must be a folder written by save_pretrained"
        )
    with open(config_path) as file:
        config = json.load(file)
    model_type = config.get("model_type")
    supported = SUPPORTED_MODEL_TYPES + GENERIC_MODEL_TYPES
    if model_type not in supported:
        raise CommandError(f"model_type={model_type!r} of {args.model_dir} is not one of {supported}")
    if model_type in NOT_EXPORTABLE:
        raise CommandError(f"model_type={model_type!r} cannot be exported: {NOT_EXPORTABLE[model_type]}")
    from .lowering import NOT_LOWERABLE

    if model_type in NOT_LOWERABLE:
        raise CommandError(
            f"model_type={model_type!r} does not lower to a .pte: {NOT_LOWERABLE[model_type]}; its torch programs "
            "serve every shape in Python (transformers_flexcache.export.export_model)"
        )
    try:
        check_capacities(max_batch_size=args.max_batch_size, max_cache_len=args.max_cache_len)
        check_backend(args.backend)
        check_quantize(args.quantize, args.backend)
    except ValueError as error:
        raise CommandError(_as_flags(str(error))) from error
    encoder_decoder = _is_encoder_decoder(args.model_dir)
    max_encoder_len, encoder_input = args.max_encoder_len, args.encoder_input
    if not encoder_decoder:
        if max_encoder_len is not None or encoder_input is not None:
            raise CommandError(f"{model_type} is decoder-only: drop --max-encoder-len and --encoder-input")
    else:
        if encoder_input is not None and encoder_input not in ENCODER_INPUTS:
            raise CommandError(f"--encoder-input={encoder_input} is not one of {ENCODER_INPUTS}")
        fixed = config.get("max_source_positions") if model_type == "whisper" else None
        if fixed is not None and encoder_input in (None, "input_features"):
            if max_encoder_len not in (None, fixed):
                raise CommandError(
                    f"--max-encoder-len={max_encoder_len}, but Whisper's log-mel features always give "
                    f"max_source_positions={fixed} encoder positions; drop --max-encoder-len, or pass "
                    "--encoder-input encoder_hidden_states for encoder outputs of any length"
                )
            max_encoder_len = fixed
        if max_encoder_len is None:
            raise CommandError(f"{model_type} is an encoder-decoder model: pass --max-encoder-len N")
        try:
            check_capacities(max_encoder_len=max_encoder_len)
        except ValueError as error:
            raise CommandError(_as_flags(str(error))) from error
    if args.dtype == "bf16":
        _check_bf16(args.backend)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise CommandError(f"--out {args.out}: the folder {out_dir} does not exist; create it first")
    try:
        import executorch.exir  # noqa: F401
    except ImportError as error:
        raise CommandError('export needs executorch: pip install "transformers-flexcache[executorch]"') from error
    return {"config": config, "max_encoder_len": max_encoder_len, "encoder_input": encoder_input}


def _is_encoder_decoder(model_dir: str) -> bool:
    """What upstream's config class of the checkpoint says (a saved `config.json` may leave the default out)."""
    from transformers import AutoConfig

    return bool(AutoConfig.from_pretrained(model_dir).is_encoder_decoder)


def _check_bf16(backend: str) -> None:
    from .lowering import bf16_unsupported_reason

    reason = bf16_unsupported_reason(backend)
    if reason:
        raise CommandError(f"--dtype bf16: {reason}; pass --dtype fp32")


def load_model(model_dir: str, config: dict, dtype: str):
    """The checkpoint in `model_dir` as its override model, in eval mode."""
    import torch
    import transformers

    from ..models.registry import convert

    names = config.get("architectures") or []
    upstream_class = next((getattr(transformers, name) for name in names if hasattr(transformers, name)), None)
    if upstream_class is None:
        default = "AutoModelForSeq2SeqLM" if config.get("is_encoder_decoder") else "AutoModelForCausalLM"
        upstream_class = getattr(transformers, _AUTO_CLASSES.get(config["model_type"], default))
    model = upstream_class.from_pretrained(model_dir, dtype=getattr(torch, DTYPES[dtype]))
    return convert(model).eval()


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def run(args, parser=None) -> int:
    """Run the command; returns the exit status (2 for a refused command, as argparse)."""
    try:
        resolved = _check_arguments(args)
    except CommandError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import torch

    from .api import export_model
    from .lowering import lower_to_executorch
    from .quantize import quantize_model_

    total = time.perf_counter()

    def report(stage: str, seconds: float, detail: str = "") -> None:
        print(f"{stage:>13}  {seconds:7.1f} s  {detail}".rstrip(), flush=True)

    started = time.perf_counter()
    model = load_model(args.model_dir, resolved["config"], args.dtype)
    num_parameters = sum(p.numel() for p in model.parameters())
    report("load", time.perf_counter() - started, f"{type(model).__name__}, {num_parameters:,} parameters")
    if args.quantize != "none":
        started = time.perf_counter()
        count = quantize_model_(model, args.quantize)
        report("quantize", time.perf_counter() - started, f"{args.quantize}: {count} linear layers")
    started = time.perf_counter()
    capacities = {"max_batch_size": args.max_batch_size, "max_cache_len": args.max_cache_len}
    if model.config.is_encoder_decoder:
        capacities["max_encoder_len"] = resolved["max_encoder_len"]
    with torch.no_grad():
        programs = export_model(model, **capacities, encoder_input=resolved["encoder_input"])
    report("export", time.perf_counter() - started, f"methods {', '.join(programs.programs)}")
    lowering = lower_to_executorch(
        programs,
        args.out,
        backend=args.backend,
        on_stage=lambda name, seconds: report(name, seconds, f"backend {args.backend}" if name == "lower" else ""),
    )
    print(f"{'total':>13}  {time.perf_counter() - total:7.1f} s")
    print(f"wrote {lowering.path} ({_megabytes(lowering.pte_bytes)})")
    print(f"  methods: {', '.join(programs.programs)} (+ metadata: {', '.join(sorted(lowering.metadata))})")
    print(f"  capacities: {', '.join(f'{k}={v}' for k, v in capacities.items())}")
    print(f"  cache buffers (planned once, shared): {_megabytes(lowering.shared_bytes)}")
    for name, num_bytes in lowering.planned_bytes.items():
        partitions = f" ({lowering.num_partitions[name]} XNNPACK partitions)" if args.backend == "xnnpack" else ""
        print(f"  planned memory of {name}: {_megabytes(num_bytes)}{partitions}")
    return 0
