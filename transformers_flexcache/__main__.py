"""The `transformers-flexcache` command (also `python -m transformers_flexcache`).

Subcommands:
    bench        run a stream of generate calls under each cache strategy and compare time, memory and outputs
    bench-serve  an open-loop stream of requests against one-at-a-time, static batching, the in-flight engine and
                 CTranslate2: throughput and latency at several offered loads
    bench-profile  the compiled fp32 decode step of a t5-small-sized T5, kernel by kernel, beside CTranslate2's
    bench-start  `serve --compile` started cold, on a warm compile cache, and from a compiled artifact: seconds until
                 each start answers
    compile      compile a checkpoint's served decode steps once into a folder that `serve --compiled` loads
    export  export a saved checkpoint to one ExecuTorch .pte that serves every batch and length up to its capacities
    serve   an OpenAI-compatible HTTP server on the in-flight engine (completions, transcriptions, metrics)
"""

from __future__ import annotations

import argparse
import sys

from .log import quiet_dependencies


def build_parser() -> argparse.ArgumentParser:
    from .bench import command as bench

    parser = argparse.ArgumentParser(
        prog="transformers-flexcache",
        description="A static KV cache for Hugging Face transformers, allocated once, serving any smaller shape.",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench_parser = subcommands.add_parser(
        "bench",
        help="benchmark DynamicCache, static and flexible_static caches (and CTranslate2, ExecuTorch programs) on one "
        "stream of calls",
        description=(
            "Run one seeded stream of generate calls (varying batch and input length, fixed new tokens) under each "
            "cache strategy, interleaved, on real-sized random models; print time, tokens/s, step latency, cache "
            "allocations and memory with their ratios to DynamicCache, and check that every strategy generates "
            "DynamicCache's tokens (exit status 1 if not). With --strategies executorch,executorch-8da4w,"
            "executorch-transformers, also exported programs in ExecuTorch's runtime, with their export and "
            "lowering time."
        ),
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(handler=bench.run, subparser=bench_parser)
    from .bench import serve as bench_serve

    serve_bench_parser = subcommands.add_parser(
        "bench-serve",
        help="load benchmark: one-at-a-time, static batching, the in-flight engine (eager, compiled) and CTranslate2",
        description=(
            "Run one seeded open-loop stream of independent requests (Poisson arrivals, sources of 8-128 tokens, "
            "8-64 new tokens) at several offered loads against each way of serving them; print requests/s, tokens/s, "
            "p50/p95/p99 latency, time to first token, seats in use and cache allocations, check every request's "
            "tokens against upstream's DynamicCache on the request alone (exit status 1 if one differs), and read "
            "the goals off the table."
        ),
    )
    bench_serve.add_arguments(serve_bench_parser)
    serve_bench_parser.set_defaults(handler=bench_serve.run, subparser=serve_bench_parser)
    from .bench import profile as bench_profile

    profile_parser = subcommands.add_parser(
        "bench-profile",
        help="profile the compiled fp32 decode step of a t5-small-sized T5 per kernel, beside CTranslate2's",
        description=(
            "Compile the t5-small-sized T5 (random weights) bucketed at the given batches, time its decode step, "
            "profile one call per batch with torch.profiler and group the kernels' time per step (linears by shape, "
            "the output layer, attention, layer norms, the rest; Python and dispatch: the step less the kernels); "
            "then CTranslate2's step on the same weights, sampled with perf where it can run. --isa avx2 runs it "
            "capped at AVX2 (an emulation on this CPU)."
        ),
    )
    bench_profile.add_arguments(profile_parser)
    profile_parser.set_defaults(handler=bench_profile.run, subparser=profile_parser)
    from .bench import start as bench_start

    start_bench_parser = subcommands.add_parser(
        "bench-start",
        help="start `serve --compile` cold, on a warm compile cache and from a compiled artifact; time each start",
        description=(
            "Save a real-sized random checkpoint of each model, start `serve --compile` on it in a new process, poll "
            "/health and time the port, the end of the warm-up and the first answer; then start it again on the same "
            "compile cache (--compile-cache of serve); then run `transformers-flexcache compile` (timed) and start "
            "`serve --compiled` on its artifact. Prints the graphs each warm-up traced, loaded and compiled; exit "
            "status 1 if a later start's tokens differ from the cold start's."
        ),
    )
    bench_start.add_arguments(start_bench_parser)
    start_bench_parser.set_defaults(handler=bench_start.run, subparser=start_bench_parser)
    from .export import cli as export_cli

    export_parser = subcommands.add_parser(
        "export",
        help="export a saved checkpoint to one ExecuTorch .pte (flexible cache as buffers)",
        description=(
            "Export a checkpoint folder (save_pretrained) of a supported model type to one ExecuTorch .pte whose "
            "methods serve every batch up to --max-batch-size and every length up to the capacities, on one planned "
            "cache. Prints each stage with its seconds, then the methods, capacities, file size and planned memory."
        ),
    )
    export_cli.add_arguments(export_parser)
    export_parser.set_defaults(handler=export_cli.run, subparser=export_parser)
    from .server import cli as serve_cli

    serve_parser = subcommands.add_parser(
        "serve",
        help="serve a checkpoint over HTTP, OpenAI-compatible, on the in-flight engine",
        description=(
            "Serve a checkpoint folder (save_pretrained, with its tokenizer or processor) over HTTP with OpenAI's "
            "API: POST /v1/completions (text models; for encoder-decoder models the prompt is the source text), POST "
            "/v1/audio/transcriptions (Whisper), GET /v1/models, GET /health, GET /metrics (Prometheus). Requests "
            "join a running batch on one cache allocated at start. SIGTERM finishes the running requests, refuses "
            'new ones, then exits 0. Needs the serve extra: pip install "transformers-flexcache[serve]".'
        ),
    )
    serve_cli.add_arguments(serve_parser)
    serve_parser.set_defaults(handler=serve_cli.run, subparser=serve_parser)
    compile_parser = subcommands.add_parser(
        "compile",
        help="compile the decode steps `serve --compile` would compile into a folder that `serve --compiled` loads",
        description=(
            "Compile a checkpoint's decode step at every bucket that `serve --compile` (with the same capacities and "
            "--buckets) would compile, with AOTInductor, into a folder: one shared library per bucket with its frozen "
            "weights, and a manifest keyed by the model, its weights, the shapes, the settings, the versions of torch "
            "and transformers and the CPU. `serve --compiled DIR` loads it in a fraction of a second, tracing "
            "nothing; a folder compiled for another key is refused with a warning that says which, and compiled again."
        ),
    )
    serve_cli.add_compile_arguments(compile_parser)
    compile_parser.set_defaults(handler=serve_cli.run_compile, subparser=compile_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the process arguments), run the subcommand, return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for a rerun in a child (bench --isa)
    with quiet_dependencies():  # lines of torchao and torch that concern no user, printed before ours (log.py)
        return args.handler(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
