"""What a running server does over time: a client that disconnects frees its seats, `/health` and `/metrics` say what
runs and what ran, and SIGTERM (on the `serve` command, in a process of its own) finishes the running request,
refuses new ones and exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .helpers import TIMEOUT, build_app, metrics, openai_client, save_checkpoint, serving, slowed, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "helloWorld42"
LONG = {"max_tokens": 900, "min_tokens": 900}  # with the model slowed, 18 s: it runs while the test looks at it


@pytest.fixture
def llama(tmp_path):
    """`(base_url, app)` of a tiny Llama server with 2 seats of 1000 positions, each model call slowed by 20 ms."""
    save_checkpoint("llama", tmp_path)
    app = build_app(tmp_path, cache_config={"max_batch_size": 2, "max_cache_len": 1000})
    with serving(app) as base_url, slowed(app.state.served.engine.model, 0.02):
        yield base_url, app


def health(base_url: str) -> dict:
    return httpx.get(f"{base_url}/health", timeout=TIMEOUT).json()


def test_a_client_that_disconnects_mid_stream_frees_its_seats(llama):
    base_url, app = llama
    stream = openai_client(base_url).completions.create(
        model="tiny", prompt=PROMPT, n=2, temperature=1.0, stream=True, extra_body=LONG
    )
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert health(base_url)["seats_in_use"] == 2
    stream.close()
    wait_until(lambda: health(base_url)["seats_in_use"] == 0, what="the seats to be free")
    engine = app.state.served.engine
    assert engine.stats["cancelled"] == 1 and engine.stats["finished"] == 0
    assert engine.stats["decode_steps"] < 900  # it stopped long before its end
    assert metrics(base_url)["flexcache_http_requests_total{route=/v1/completions,status=499}"] == 1


def test_a_client_that_gives_up_waiting_frees_its_seats(llama):
    base_url, app = llama
    with pytest.raises(httpx.ReadTimeout):  # the client closes the connection
        httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT, **LONG}, timeout=1.0)
    wait_until(lambda: health(base_url)["seats_in_use"] == 0, what="the seats to be free")
    assert app.state.served.engine.stats["cancelled"] == 1


def test_metrics_count_requests_tokens_latencies_and_seats(tmp_path):
    save_checkpoint("t5", tmp_path)
    app = build_app(tmp_path, cache_config={"max_batch_size": 3, "max_cache_len": 32, "max_encoder_len": 16})
    with serving(app) as base_url:
        client = openai_client(base_url)
        answers = [
            client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
            for prompt in ("abc", "hello")
        ]
        refused = httpx.post(f"{base_url}/v1/completions", json={"prompt": "abc", "n": 9}, timeout=TIMEOUT)
        assert health(base_url) == {
            "status": "ok",
            "model": "tiny",
            "seats_in_use": 0,
            "max_batch_size": 3,
            "running": 0,
            "queued": 0,
        }
        values = metrics(base_url)
    assert refused.status_code == 400
    route = "route=/v1/completions"
    assert values["flexcache_generated_tokens_total"] == sum(answer.usage.completion_tokens for answer in answers)
    assert values["flexcache_prompt_tokens_total"] == sum(answer.usage.prompt_tokens for answer in answers)
    assert values[f"flexcache_http_requests_total{{{route},status=200}}"] == 2
    assert values[f"flexcache_http_requests_total{{{route},status=400}}"] == 1
    assert values[f"flexcache_request_latency_seconds_count{{{route}}}"] == 2
    assert values[f"flexcache_request_latency_seconds_bucket{{le=+Inf,{route}}}"] == 2
    assert values[f"flexcache_request_latency_seconds_sum{{{route}}}"] > 0
    assert values["flexcache_time_to_first_token_seconds_count"] == 2
    assert values["flexcache_seats"] == 3 and values["flexcache_seats_in_use"] == 0
    assert values["flexcache_requests_queued"] == 0 and values["flexcache_requests_running"] == 0
    assert values["flexcache_engine_requests_total{outcome=finished}"] == 2
    assert values["flexcache_engine_submitted_total"] == 2 and values["flexcache_decode_steps_total"] >= 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_finishes_the_running_request_refuses_new_ones_and_exits_0(tmp_path):
    save_checkpoint("llama", tmp_path / "tiny-llama")
    port, base_url = free_port(), None
    command = [sys.executable, "-m", "transformers_flexcache", "serve", str(tmp_path / "tiny-llama")]
    command += ["--port", str(port), "--max-cache-len", "640", "--served-model-name", "tiny", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        base_url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert process.poll() is None, process.stdout.read()
            try:
                return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, what="the server to start", timeout=120)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 600, "min_tokens": 600, "temperature": 0}
        body.update(stream=True, stream_options={"include_usage": True})
        first, events, done_at = threading.Event(), [], []

        def read() -> None:
            with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        first.set()
            done_at.append(time.monotonic())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(TIMEOUT)
        process.send_signal(signal.SIGTERM)
        try:  # a new request, right after the signal: refused (503 while the port closes, then no connection)
            refused = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT}, timeout=TIMEOUT).status_code
        except httpx.TransportError:
            refused = "no connection"
        refused_at = time.monotonic()
        wait_until(lambda: not reader.is_alive(), what="the running request to finish")
        assert process.wait(TIMEOUT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(TIMEOUT)
    output = process.stdout.read()
    assert refused in (503, "no connection"), output
    assert done_at and refused_at < done_at[0]  # refused while the running request still streamed
    assert events[-1] == "data: [DONE]", output
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 600  # the running request ran to its end
    assert "serving tiny" in output
    # nothing of torchao's or torch's import-time noise (issue 58; transformers_flexcache/log.py)
    noise = ("Failed to load", "register_constant()", "script_method")
    assert not [line for line in output.splitlines() if any(word in line for word in noise)], output
    frozen = re.search(r"garbage collector: (\d+) objects of the start frozen", output)
    assert frozen and int(frozen.group(1)) > 10_000, output  # the model, transformers' and torch's modules
    with pytest.raises(httpx.TransportError):  # and the port is closed
        httpx.get(f"{base_url}/health", timeout=1)
