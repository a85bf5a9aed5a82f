"""`transformers-flexcache serve PATH`: an OpenAI-compatible HTTP server on the in-flight engine.

Design decisions:
- The checkpoint loads into upstream's class (`config.architectures`, else the AutoModel class of its kind) and
  becomes its override with `transformers_flexcache.convert`: no global registration. Its own tokenizer
  (`AutoTokenizer`), or for a model that takes audio its processor (`AutoProcessor`), come from the same folder.
- Capacities: 8 seats; `max_cache_len` and `max_encoder_len` default to 512 positions, capped by the positions the
  model's config states (a learned position table); Whisper's encoder length is its own (`max_source_positions`).
  Memory is allocated once, when the engine is built.
- `--compile`: the bucketed shape policy, `compile_config_for_cpu()`, and `Engine.warmup()` once the port is open
  (`warmup.py`: `/health` says `"warming"` with the graphs done, requests get 503 until it ends, and a progress bar
  counts the graphs on the terminal), so that no request pays a compile; each combination of buckets is one graph.
  Without `--buckets`, the engine's default buckets (`serving/buckets.py`: one seat and half the seats, half of each
  length; 12 graphs at most).
- `--compiled DIR` (implies `--compile`): the decode steps and the compiled token encoder (with an int8 model's
  cross-attention projections) come from a compiled artifact folder that `transformers-flexcache compile` wrote
  (`compile/artifact.py`, `compile/encoder_artifact.py`): loaded in a fraction of a second, nothing traced. A folder compiled for other capacities, buckets, weights, torch or CPU, or a
  damaged one, is not used: a warning says why, and the server compiles as `--compile` does.
- `--compile-cache DIR` (default: the user's cache directory, `compile.caching.default_cache_dir()`; `none` for
  none): the graphs compiled by an earlier start with the same model, shapes, settings, versions and CPU are loaded
  instead of compiled, and a first start's are written there (`compile/caching.py`).
- Once the engine is built and warmed up, the garbage collector's heap is frozen (`compile.gc_heap.freeze_heap`, as vLLM
  does after its start): a full collection would otherwise walk the compiled graphs and the model (0.1-1 s on the
  benchmark's CPU) while requests wait. Objects made while serving are still collected.
- SIGTERM (or Ctrl-C): uvicorn closes the port and waits for the running requests to be answered; a new request on a
  connection still open gets 503; then the engine closes with `drain=True`, and the command exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from ..compile import freeze_heap
from ..serving.buckets import default_buckets

DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_LEN = 512
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class CommandError(ValueError):
    """A refused command: the message says what, the limit, and the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="PATH", help="a checkpoint folder (save_pretrained) with its tokenizer")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_MAX_BATCH_SIZE,
        help="seats: cache rows shared by the running requests, n per completion (default: %(default)s)",
    )
    parser.add_argument(
        "--max-cache-len",
        type=int,
        help=f"decoder positions per seat: prompt (decoder-only) plus max_tokens (default: {DEFAULT_MAX_LEN}, at "
        "most the model's decoder positions)",
    )
    parser.add_argument(
        "--max-encoder-len",
        type=int,
        help=f"encoder positions per seat, encoder-decoder models (default: {DEFAULT_MAX_LEN}, at most the model's "
        "encoder positions; Whisper's own)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for seats; more get 429 (default: %(default)s)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (inductor, bucketed shapes, every bucket compiled before serving)",
    )
    parser.add_argument(
        "--eager-encoder",
        action="store_true",
        help="with --compile, --compiled or the compile command: run the token encoder eagerly, compile the decode "
        "step only (compile_config_for_cpu(encoder=False)); for a model whose encoder cannot be exported into an "
        "artifact (a float16 BART or Marian)",
    )
    parser.add_argument(
        "--buckets",
        type=json.loads,
        help='with --compile: the sizes each shape is rounded up to, as JSON, e.g. \'{"max_batch_size": [4], '
        '"max_cache_len": [64]}\' (the capacity is always the last; default: one seat and half the seats, half of '
        "each length)",
    )
    parser.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="with --compile: where compiled graphs are kept between starts, keyed by model, shapes, settings, "
        "versions and CPU; 'none' for no such folder (default: ~/.cache/transformers-flexcache/compile, or under "
        "$XDG_CACHE_HOME)",
    )
    parser.add_argument(
        "--compiled",
        metavar="DIR",
        help="load the decode steps from a folder that `transformers-flexcache compile` wrote (implies --compile; "
        "the same capacities and --buckets); a folder for another model, weights, torch or CPU is refused with a "
        "warning and the steps are compiled",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: PATH as given)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="uvicorn's (default: %(default)s)")


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    """The `compile` command's flags: the checkpoint, the capacities and buckets of `serve --compile`, the folder."""
    parser.add_argument("model_dir", metavar="PATH", help="a checkpoint folder (save_pretrained) with its tokenizer")
    parser.add_argument("--out", metavar="DIR", required=True, help="the folder to write (replaced if an artifact)")
    for action in _serve_parser()._actions:
        if action.dest in (
            "max_batch_size",
            "max_cache_len",
            "max_encoder_len",
            "buckets",
            "threads",
            "eager_encoder",
        ):
            parser._add_action(action)


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser


def run_compile(args, parser=None) -> int:
    """The `compile` command: the engine `serve --compile` builds with these flags, its decode steps and compiled
    encoder side written to `--out` (`Engine.save_artifact`); returns the exit status."""
    import time

    import torch

    args.compile, args.max_queue, args.compile_cache, args.compiled = True, 1, None, None
    try:
        for flag in ("max_batch_size", "max_cache_len", "max_encoder_len", "threads"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise CommandError(f"--{flag.replace('_', '-')}={value} must be a positive int")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        model, tokenizer, _ = load_checkpoint(args.model_dir)
        engine = build_engine(args, model, tokenizer)
    except CommandError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    shapes = engine.decode_shapes()
    encoder = engine.steps.encoder_graph_names()
    encoder = f" and {', '.join(encoder)}" if encoder else ""
    print(f"compiling {len(shapes)} decode shapes{encoder} of {args.model_dir} into {args.out}", flush=True)
    try:
        manifest = engine.save_artifact(args.out, progress=lambda done, total: print(f"  {done}/{total}", flush=True))
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    size = sum(entry["bytes"] for entry in manifest["files"].values())
    print(
        f"wrote {args.out}: {len(manifest['files'])} graphs, {size / 2**20:.0f} MiB, in {time.perf_counter() - started:.1f} s"
    )
    return 0


def _check_arguments(args) -> None:
    if args.compiled is not None:
        args.compile = True
    for flag in ("port", "max_batch_size", "max_cache_len", "max_encoder_len", "max_queue", "threads"):
        value = getattr(args, flag)
        if value is not None and (value < 1 or (flag == "port" and value > 65535)):
            name = "--" + flag.replace("_", "-")
            raise CommandError(f"{name}={value} must be a positive int{' up to 65535' if flag == 'port' else ''}")
    if args.buckets is not None and not args.compile:
        raise CommandError("--buckets sets the compiled shapes: pass --compile with it, or leave it out")
    if args.compile_cache is not None and not args.compile:
        raise CommandError("--compile-cache keeps compiled graphs: pass --compile with it, or leave it out")
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import python_multipart  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise CommandError(
            f'serve needs its extra ({error.name} is missing): pip install "transformers-flexcache[serve]"'
        ) from error


def load_checkpoint(path: str):
    """`(model, tokenizer, processor)` of a checkpoint folder: the override model in eval mode, the folder's tokenizer,
    and its processor for a model that takes audio (else None).

    Raises:
        CommandError: no loadable config, model or tokenizer in `path`.
    """
    import transformers
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES

    from ..models.registry import convert

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise CommandError(
            f"{path} is not a checkpoint folder ({error}): pass a folder written by save_pretrained"
        ) from error
    names = config.architectures or []
    upstream_class = next((getattr(transformers, name) for name in names if hasattr(transformers, name)), None)
    if upstream_class is None:  # a folder saved from an override class names it
        if config.model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
            upstream_class = transformers.AutoModelForSpeechSeq2Seq
        elif config.is_encoder_decoder:
            upstream_class = transformers.AutoModelForSeq2SeqLM
        else:
            upstream_class = transformers.AutoModelForCausalLM
    model = convert(upstream_class.from_pretrained(path)).eval()
    try:
        if model.main_input_name == "input_ids":
            return model, AutoTokenizer.from_pretrained(path), None
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        raise CommandError(
            f"{path} has no tokenizer or processor that loads ({error}): save the checkpoint's own beside the model "
            "(tokenizer.save_pretrained(PATH), or the processor's)"
        ) from error
    if not hasattr(processor, "feature_extractor") or not hasattr(processor, "tokenizer"):
        raise CommandError(
            f"{type(model).__name__} takes {model.main_input_name}: serve answers text models (/v1/completions) and "
            "speech models with a feature extractor (/v1/audio/transcriptions)"
        )
    return model, processor.tokenizer, processor


def engine_cache_config(args, config) -> dict:
    """The engine's `cache_config` from the flags, with the defaults of the module docstring."""

    def positions(config, names) -> int | None:
        return next((getattr(config, name) for name in names if isinstance(getattr(config, name, None), int)), None)

    decoder = config.get_text_config(decoder=True)
    limit = positions(decoder, ("max_target_positions", "max_position_embeddings", "n_positions"))
    cache_config = {
        "max_batch_size": args.max_batch_size,
        "max_cache_len": args.max_cache_len or min(DEFAULT_MAX_LEN, limit or DEFAULT_MAX_LEN),
    }
    if config.is_encoder_decoder:
        if args.max_encoder_len is not None:
            cache_config["max_encoder_len"] = args.max_encoder_len
        elif getattr(config, "max_source_positions", None) is None:  # else the engine takes the encoder's own
            limit = positions(config, ("max_position_embeddings", "n_positions"))
            cache_config["max_encoder_len"] = min(DEFAULT_MAX_LEN, limit or DEFAULT_MAX_LEN)
    if args.compile:
        cache_config["shape_policy"] = "bucketed"
        cache_config["buckets"] = args.buckets if args.buckets is not None else default_buckets(cache_config)
    return cache_config


def compile_cache_dir(args):
    """The compile cache folder of the flags: `--compile-cache`, the default one, or None (`none`, or no
    `--compile`)."""
    from ..compile import default_cache_dir

    if not args.compile or (args.compile_cache or "").lower() == "none":
        return None
    return args.compile_cache or default_cache_dir()


def build_engine(args, model, tokenizer):
    """The engine of the flags; under `--compile` with dynamo's limits raised to its decode shapes (the warm-up runs
    once the server is up: `warmup_of`)."""
    from ..compile import compile_config_for_cpu, raise_recompile_limits
    from ..serving import Engine

    compile_config = compile_config_for_cpu(encoder=not args.eager_encoder) if args.compile else None
    try:
        engine = Engine(
            model,
            cache_config=engine_cache_config(args, model.config),
            compile_config=compile_config,
            max_queue=args.max_queue,
            tokenizer=tokenizer,
        )
    except (ValueError, TypeError) as error:
        raise CommandError(
            f"the engine refused these settings: {error} (--max-batch-size, --max-cache-len, --max-encoder-len and "
            "--buckets make its cache_config)"
        ) from error
    if args.compile:
        # The whole process serves one engine: let dynamo keep a graph per decode shape.
        raise_recompile_limits(len(engine.decode_shapes()))
    return engine


def warmup_of(args, engine, *, on_done=None):
    """The server's warm-up of a compiled engine (None without `--compile`), with a progress bar of its graphs on
    stderr, a line when it ends, and the garbage collector's heap frozen after it; `on_done(warmup)` then too."""
    from tqdm.auto import tqdm

    from .warmup import Warmup

    if not args.compile:
        return None
    cache_dir = compile_cache_dir(args)
    bar = tqdm(desc="compiling", unit="graph", file=sys.stderr, dynamic_ncols=True)

    def progress(done: int, total: int) -> None:
        if bar.total != total:
            bar.reset(total=total)
        bar.n = done
        bar.refresh()

    def finished(warmup) -> None:
        bar.close()
        if warmup.state == "ready":
            line = f"compiled {warmup.total} graphs in {warmup.seconds:.1f} s"
            if engine.artifact is not None:
                line = f"{engine.artifact.describe()}; ready in {warmup.seconds:.1f} s"
            elif engine.warm_start is not None:
                line += f" ({engine.warm_start.describe()})"
            print(line, flush=True)
            print(f"garbage collector: {freeze_heap()} objects of the start frozen (gc.freeze)", flush=True)
        else:
            print(f"error: the warm-up failed: {warmup.body()['error']}", file=sys.stderr, flush=True)
        if on_done is not None:
            on_done(warmup)

    return Warmup(engine, cache_dir=cache_dir, artifact=args.compiled, progress=progress, on_done=finished)


def run(args, parser=None) -> int:
    """Run the command; returns the exit status (2 for a refused command, as argparse)."""
    try:
        _check_arguments(args)
        import torch

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        model, tokenizer, processor = load_checkpoint(args.model_dir)
        engine = build_engine(args, model, tokenizer)
    except CommandError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import uvicorn

    from .app import create_app

    name = args.served_model_name or args.model_dir
    server = None
    failed = threading.Event()

    def warmup_done(warmup) -> None:
        if warmup.state == "failed":  # the server cannot serve: it stops, and the command exits with 1
            failed.set()
            if server is not None:
                server.should_exit = True

    warmup = warmup_of(args, engine, on_done=warmup_done)
    app = create_app(engine, tokenizer=tokenizer, processor=processor, model_name=name, warmup=warmup)
    capacities = f"{engine.max_batch_size} seats, max_cache_len={engine.max_cache_len}"
    if engine.is_encoder_decoder:
        capacities += f", max_encoder_len={engine.max_encoder_len}"
    print(
        f"serving {name} ({type(model).__name__}; {capacities}, max_queue={engine.max_queue}, "
        f"{'compiled' if args.compile else 'eager'}) at http://{args.host}:{args.port}/v1",
        flush=True,
    )
    if warmup is None:
        print(f"garbage collector: {freeze_heap()} objects of the start frozen (gc.freeze)", flush=True)
    else:
        cache_dir = compile_cache_dir(args)
        print(
            f"compiling {len(engine.decode_shapes())} decode shapes and the encoder's graphs (fewer with --buckets; "
            f"compile cache: {cache_dir or 'none'}); /health says 'warming' until they are done",
            flush=True,
        )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    server = _draining_server_class()(config, served=app.state.served)  # the warm-up starts as it serves
    # uvicorn installs its handlers while it serves, then restores these and raises the signal again (so that a
    # process killed by SIGTERM looks killed): with the server's own handler here, that second delivery is a no-op
    # and the command exits 0 after a graceful shutdown. Installed first, it also covers a signal during startup.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    server.run()
    return 1 if failed.is_set() else 0


def _draining_server_class():
    import uvicorn  # the `serve` extra's: imported when serving, so that `--help` needs no extra

    class DrainingServer(uvicorn.Server):
        """uvicorn's server; on SIGTERM/SIGINT the application answers new requests 503 at once (`draining`)."""

        def __init__(self, config, *, served):
            super().__init__(config)
            self.served = served

        def handle_exit(self, sig, frame) -> None:
            self.served.draining = True
            super().handle_exit(sig, frame)

    return DrainingServer
