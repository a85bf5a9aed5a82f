"""`serve --compile --compile-cache DIR`, started twice on one folder as two processes: the first compiles while
`/health` says "warming" with its progress, the second loads every graph the first compiled (inductor compiles
nothing: its FX graph cache misses none) and both answer with upstream generate's tokens. And `serve --compiled DIR`
after `transformers-flexcache compile --out DIR`: the start traces nothing (its encoder is the artifact's too), and
answers the cold start's tokens.

The command runs as a user runs it (`python -m transformers_flexcache serve ...` on 127.0.0.1), stopped with SIGTERM;
every wait is bounded.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.helpers import new_tokens, reference, save_checkpoint

START_TIMEOUT = 300  # seconds for a cold start of the tiny model's three graphs on a busy 2-core machine
SLOW_START_TIMEOUT = 900  # the slow test's cold start and AOTInductor compile, on a 2-core machine others load too
PROMPTS = ("abcdef", "hello world")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CAPACITIES = ("--max-batch-size", "2", "--max-cache-len", "16", "--max-encoder-len", "16")
BUCKETS = ("--buckets", '{"max_batch_size": [2], "max_cache_len": [16], "max_encoder_len": [16]}')


def start_and_ask(folder, cache_dir, *, compiled=None, timeout: float = START_TIMEOUT) -> dict:
    """Start the command, poll `/health` until it is ready (every answer kept), ask for each prompt's tokens, stop it
    with SIGTERM; returns the answers seen."""
    port = free_port()
    command = [
        *(sys.executable, "-m", "transformers_flexcache", "serve", str(folder), "--port", str(port)),
        *("--compile", "--compile-cache", str(cache_dir), "--threads", "1", "--log-level", "warning"),
        *CAPACITIES,
        *BUCKETS,
        *(("--compiled", str(compiled)) if compiled is not None else ()),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = {"health": [], "tokens": []}
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert process.poll() is None, f"the server exited: {process.stdout.read()}"
            assert time.monotonic() < deadline, "the server was not ready in time"
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            except httpx.TransportError:  # the port is not open yet
                time.sleep(0.2)
                continue
            seen["health"].append((response.status_code, response.json()))
            if response.status_code == 200:
                break
            time.sleep(0.2)
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            seen["tokens"].append(answer.json()["choices"][0]["token_ids"])
        seen["after"] = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()  # once every answer is in
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    seen["returncode"] = process.returncode
    return seen


def test_a_second_start_loads_every_graph_the_first_compiled_and_answers_the_same_tokens(tmp_path):
    upstream = save_checkpoint("t5", tmp_path / "model")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    expected = [
        new_tokens(upstream, reference(upstream, tokenizer, prompt, max_new_tokens=8, do_sample=False), 0)[0]
        for prompt in PROMPTS
    ]

    first = start_and_ask(tmp_path / "model", tmp_path / "cache")
    second = start_and_ask(tmp_path / "model", tmp_path / "cache")

    # The port opened before the warm-up ended: the first answers said "warming", with the graphs in all.
    status, body = first["health"][0]
    assert status == 503 and body["status"] == "warming" and body["warmup"]["state"] == "warming"
    cold, warm = first["health"][-1][1]["warmup"], second["health"][-1][1]["warmup"]
    assert cold["state"] == warm["state"] == "ready" and cold["graphs_done"] == cold["graphs_total"] >= 2
    # First start: every graph compiled and written; second: dynamo traced them again, inductor loaded them all.
    assert cold["compile_cache"]["found"] == "cold" and cold["compile_cache"]["compiled"] >= 2
    assert warm["compile_cache"]["found"] == "warm"
    assert warm["compile_cache"]["compiled"] == 0
    assert warm["compile_cache"]["loaded"] == warm["compile_cache"]["traced"] == cold["compile_cache"]["compiled"]
    assert first["tokens"] == second["tokens"] == expected
    assert first["returncode"] == second["returncode"] == 0


@pytest.mark.slow
def test_a_start_from_a_compiled_artifact_traces_nothing_and_answers_the_cold_start_s_tokens(tmp_path):
    upstream = save_checkpoint("t5", tmp_path / "model")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    expected = [
        new_tokens(upstream, reference(upstream, tokenizer, prompt, max_new_tokens=8, do_sample=False), 0)[0]
        for prompt in PROMPTS
    ]
    cold = start_and_ask(tmp_path / "model", tmp_path / "cache", timeout=SLOW_START_TIMEOUT)
    command = [sys.executable, "-m", "transformers_flexcache", "compile", str(tmp_path / "model")]
    command += ["--out", str(tmp_path / "artifact"), "--threads", "1", *CAPACITIES, *BUCKETS]
    done = subprocess.run(command, capture_output=True, text=True, timeout=SLOW_START_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "wrote" in done.stdout and "2 graphs" in done.stdout  # the decode step's, the packed encoder's

    loaded = start_and_ask(tmp_path / "model", tmp_path / "cache", compiled=tmp_path / "artifact")

    warmup = loaded["after"]["warmup"]
    assert warmup["state"] == "ready" and warmup["artifact"]["refused"] is None
    assert warmup["artifact"]["graphs"] == warmup["artifact"]["loaded"] == 2 and warmup["artifact"]["damaged"] == []
    assert warmup["traced"] == 0  # dynamo traced nothing in the process: neither the warm-up nor the requests
    assert cold["after"]["warmup"]["traced"] >= 2  # the cold start traced its decode step and encoder
    assert loaded["tokens"] == cold["tokens"] == expected
    assert cold["returncode"] == loaded["returncode"] == 0
