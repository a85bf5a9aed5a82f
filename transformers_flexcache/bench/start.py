"""The start benchmark: `serve --compile` started twice on one compile cache (a cold start and a warm-cache one),
then `transformers-flexcache compile` and a start from its artifact (`serve --compiled DIR`), each timed until it
answers (`transformers-flexcache bench-start`).

Design decisions:
- What a user waits for, measured from outside: each start is the `serve` command in a process of its own (as a
  restarted server or a new replica runs), on a real-sized random checkpoint of the bench's models saved with a
  word-level tokenizer over its whole vocabulary; `/health` is polled from the moment the process starts. Figures
  per start: seconds until the port answers, until `/health` says ready, until the first request (sent at ready)
  is answered; the warm-up's graphs traced, loaded from the compile cache and compiled (`compile/caching.py`).
- The first start's compile cache is a new, empty folder unless `--compile-cache` names one; the second start uses
  the same folder. Inductor's own caches elsewhere are not read (the entry's folder is inductor's cache during the
  warm-up), so a first start is a first start.
- The tokens of each request of the warm-cache and artifact starts must equal the cold start's (exit status 1 if
  not): a loaded graph computes what a compiled one does.
- The artifact is compiled by the `compile` command in a process of its own (timed: its seconds are a cold compile
  of the same graphs), then the artifact start runs; `--no-artifact` leaves both out.
- Not the other benches' comparison of strategies: one strategy (the server's defaults, or `--buckets`), two starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from .models import BENCH_MODELS, build_models
from .report import machine_info

START_MODELS = ("t5",)
POLL_S = 0.25
READY_TIMEOUT_S = 3600
PROMPT_LENGTHS = (12, 40, 7, 25)  # token ids of the requests sent at ready, one after the other
MAX_TOKENS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default=",".join(START_MODELS),
        help=f"comma-separated models, of {','.join(BENCH_MODELS)} (default: %(default)s)",
    )
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (default: %(default)s)")
    parser.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="the compile cache both starts use (default: a new empty folder, removed after the run)",
    )
    parser.add_argument("--buckets", help="the server's --buckets (JSON; default: the server's own)")
    parser.add_argument(
        "--no-artifact", action="store_true", help="leave out the compile command and the start from its artifact"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    parser.add_argument("--quick", action="store_true", help="tiny configs: a smoke test, its timings mean nothing")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")


def save_checkpoint(name: str, folder: str, seed: int, *, quick: bool = False) -> None:
    """The bench model `name`, real-sized with seeded random weights, saved to `folder` with a word-level tokenizer
    over its whole vocabulary (one word per id), which `serve` loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    upstream, _ = build_models(BENCH_MODELS[name], quick=quick, seed=seed, with_override=False)
    upstream.save_pretrained(folder)
    config = upstream.config.get_text_config(decoder=True)
    special = {
        getattr(upstream.generation_config, "pad_token_id", None): "<pad>",
        getattr(upstream.generation_config, "eos_token_id", None): "</s>",
    }
    vocab = {special.get(index, f"<t{index}>"): index for index in range(config.vocab_size)}
    vocab.setdefault("<unk>", config.vocab_size)  # never produced: the model's ids are all words
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    for role, word in (("pad_token", "<pad>"), ("eos_token", "</s>")):
        if word in vocab:
            setattr(tokenizer, role, word)
    tokenizer.save_pretrained(folder)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def compile_artifact(folder: str, out: str, args) -> float:
    """`transformers-flexcache compile` of `folder` into `out` with the server's flags, in a process of its own;
    returns its seconds."""
    command = [sys.executable, "-m", "transformers_flexcache", "compile", folder, "--out", out]
    command += ["--threads", str(args.threads)] + (["--buckets", args.buckets] if args.buckets else [])
    started = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"the compile command exited with {done.returncode}: {done.stderr[-2000:]}")
    return time.monotonic() - started


def start_once(folder: str, cache_dir: str, args, prompts: list[list[int]], *, artifact: str | None = None) -> dict:
    """One start of `serve --compile` on `folder`: the seconds until its port answers, until it is ready, until the
    first request is answered; its warm-up as `/health` reports it; each request's tokens."""
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "transformers_flexcache", "serve", folder, "--port", str(port), "--compile"]
    command += ["--compile-cache", cache_dir, "--threads", str(args.threads), "--log-level", "warning"]
    command += ["--compiled", artifact] if artifact is not None else []
    if args.buckets:
        command += ["--buckets", args.buckets]
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    figures = {"port_open_s": None, "ready_s": None, "first_answer_s": None, "tokens": [], "traced_after": None}
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}: {process.stderr.read()[-2000:]}")
            if time.monotonic() - started > READY_TIMEOUT_S:
                raise RuntimeError(f"the server was not ready within {READY_TIMEOUT_S} s")
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
            except httpx.TransportError:
                time.sleep(POLL_S)
                continue
            figures["port_open_s"] = figures["port_open_s"] or time.monotonic() - started
            if health.status_code == 200:
                figures["ready_s"] = time.monotonic() - started
                figures["warmup"] = health.json()["warmup"]
                break
            time.sleep(POLL_S)
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)
            answer.raise_for_status()
            figures["first_answer_s"] = figures["first_answer_s"] or time.monotonic() - started
            figures["tokens"].append(answer.json()["choices"][0]["token_ids"])
        after = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()["warmup"]
        figures["traced_after"] = after["traced"]
        if after.get("artifact") is not None:  # its graphs load lazily: how many had loaded after the answers
            figures["artifact_loaded_after"] = after["artifact"]["loaded"]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
    return figures


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size - 1, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def format_table(rows: list[dict]) -> str:
    header = (
        f"  {'model':<8} {'start':<7} {'port s':>7} {'ready s':>8} {'1st answer s':>13} {'warm-up s':>10} "
        f"{'traced':>7} {'loaded':>7} {'compiled':>9}  tokens"
    )
    lines = [header]
    for row in rows:
        if row["start"] == "compile":
            lines.append(f"  {row['model']:<8} {'compile':<7} (the compile command: {row['seconds']:.1f} s)")
            continue
        cache = row["warmup"].get("compile_cache") or {}
        artifact = row["warmup"].get("artifact")
        traced, loaded, compiled = cache.get("traced", "-"), cache.get("loaded", "-"), cache.get("compiled", "-")
        if artifact is not None:
            loaded = row.get("artifact_loaded_after", artifact["loaded"])
            traced, compiled = row["traced_after"], 0 if loaded else "-"
        lines.append(
            f"  {row['model']:<8} {row['start']:<7} {row['port_open_s']:>7.1f} {row['ready_s']:>8.1f} "
            f"{row['first_answer_s']:>13.1f} {row['warmup']['seconds']:>10.1f} {traced:>7} "
            f"{loaded:>7} {compiled:>9}  {row['same_tokens']}"
        )
    return "\n".join(lines)


def run(args, parser: argparse.ArgumentParser | None = None) -> int:
    """Run the `bench-start` subcommand; returns the exit status (0: the second start's tokens equal the first's)."""
    names = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in names if name not in BENCH_MODELS or BENCH_MODELS[name].input_kind != "tokens"]
    if unknown:
        choices = [name for name, model in BENCH_MODELS.items() if model.input_kind == "tokens"]
        message = f"models {unknown} cannot be started here; choose from {choices}"
        if parser is not None:
            parser.error(message)
        raise ValueError(message)
    machine = machine_info(args.threads)
    print(
        "transformers-flexcache bench-start: serve --compile, a cold and a warm-cache start on one compile cache, then "
        f"the compile command and a start from its artifact\n{machine['cpu_line']}"
    )
    print(f"torch {machine['torch']}, transformers {machine['transformers']}; server threads {args.threads}")
    work = tempfile.mkdtemp(prefix="flexcache-bench-start-")
    rows, failures = [], []
    try:
        for name in names:
            folder = os.path.join(work, name)
            save_checkpoint(name, folder, args.seed, quick=args.quick)
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(folder).get_text_config(decoder=True)
            prompts = _prompts(config.vocab_size, args.seed)
            cache_dir = args.compile_cache or os.path.join(work, f"{name}-compile-cache")
            artifact = os.path.join(work, f"{name}-artifact")
            first = None
            for start in ("cold", "warm", "compile", "artifact"):
                if start in ("compile", "artifact") and args.no_artifact:
                    continue
                print(f"[{name}] {start} ...", flush=True)
                if start == "compile":
                    rows.append({"model": name, "start": start, "seconds": compile_artifact(folder, artifact, args)})
                    continue
                figures = start_once(
                    folder, cache_dir, args, prompts, artifact=artifact if start == "artifact" else None
                )
                first = first or figures
                same = figures["tokens"] == first["tokens"]
                if not same:
                    failures.append(f"{name}: the {start} start's tokens differ from the cold start's")
                rows.append(
                    {"model": name, "start": start, **figures, "same_tokens": "ref" if first is figures else same}
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(format_table(rows))
    for failure in failures:
        print(f"FAILED: {failure}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "rows": rows, "failures": failures}, f, indent=2)
        print(f"figures written to {args.json}")
    return 1 if failures else 0
