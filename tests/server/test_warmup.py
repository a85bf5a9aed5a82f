"""The server while its engine warms up: the port is open, `/health` answers 503 "warming" with the graphs done and
in all, requests get 503 `warming_up` with `Retry-After`; then it serves. A failed warm-up says so and serves nothing.

The engine's warm-up is replaced by one that reports progress and waits for the test (no compile here: the real
one runs in test_warm_start.py).
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server.helpers import TIMEOUT, save_checkpoint, serving, wait_until
from transformers_flexcache.server.cli import load_checkpoint
from transformers_flexcache.server.warmup import Warmup


@pytest.fixture
def app_with_warmup(tmp_path):
    """`(app, release, fail)`: an application whose engine's warm-up reports 1 graph of 3 done, then waits until
    `release` is set; with `fail` set it raises instead."""
    from transformers_flexcache.server.app import create_app
    from transformers_flexcache.serving import Engine

    save_checkpoint("t5", tmp_path)
    model, tokenizer, processor = load_checkpoint(str(tmp_path))
    engine = Engine(
        model, cache_config={"max_batch_size": 2, "max_cache_len": 16, "max_encoder_len": 16}, tokenizer=tokenizer
    )
    release, fail = threading.Event(), threading.Event()

    def warmup(*, cache_dir=None, artifact=None, progress=None):
        progress(0, 3)
        progress(1, 3)
        assert release.wait(TIMEOUT)
        if fail.is_set():
            raise RuntimeError("inductor failed to build a kernel")
        progress(3, 3)
        return 3

    engine.warmup = warmup
    app = create_app(engine, tokenizer=tokenizer, processor=processor, model_name="tiny", warmup=Warmup(engine))
    return app, release, fail


def health(base_url: str) -> tuple[int, dict]:
    response = httpx.get(f"{base_url}/health", timeout=TIMEOUT)
    return response.status_code, response.json()


def complete(base_url: str) -> httpx.Response:
    body = {"prompt": "abc", "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=TIMEOUT)


def test_while_warming_health_says_how_far_and_requests_are_refused_with_retry_after_then_served(app_with_warmup):
    app, release, _ = app_with_warmup
    with serving(app) as base_url:
        status, body = wait_until(
            lambda: (answer := health(base_url))[1]["warmup"]["graphs_done"] == 1 and answer, what="progress"
        )
        assert status == 503 and body["status"] == "warming"
        assert body["warmup"]["state"] == "warming" and body["warmup"]["graphs_total"] == 3
        refused = complete(base_url)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "warming_up"
        assert "1 of 3 done" in refused.json()["error"]["message"] and int(refused.headers["Retry-After"]) >= 1
        release.set()
        wait_until(lambda: health(base_url)[0] == 200, what="the end of the warm-up")
        status, body = health(base_url)
        assert body["status"] == "ok" and body["warmup"]["state"] == "ready" and body["warmup"]["graphs_done"] == 3
        assert complete(base_url).status_code == 200


def test_a_failed_warm_up_is_reported_and_nothing_is_served(app_with_warmup):
    app, release, fail = app_with_warmup
    with serving(app) as base_url:
        fail.set()
        release.set()
        wait_until(lambda: health(base_url)[1]["warmup"]["state"] == "failed", what="the failure")
        status, body = health(base_url)
        assert status == 503 and body["status"] == "failed"
        assert "inductor failed to build a kernel" in body["warmup"]["error"]
        refused = complete(base_url)
        assert refused.status_code == 503 and "warm-up failed" in refused.json()["error"]["message"]


def test_the_warm_up_thread_compiles_under_the_torch_settings_of_the_thread_that_built_it(tmp_path):
    """torch's config is per thread (a ContextVar): `serve` raises dynamo's recompile limit to its decode shapes in
    the main thread, and the warm-up, which runs in its own thread, must see the raised limit (with torch's default
    of 8, a default `serve --compile` of 12 decode shapes refused to warm up)."""
    import torch

    seen = []

    class StandIn:
        warm_start = None

        def warmup(self, *, cache_dir=None, artifact=None, progress=None):
            seen.append(torch._dynamo.config.recompile_limit)

    default = torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=default + 5):
        warmup = Warmup(StandIn())
    warmup.start()
    warmup.join(TIMEOUT)
    assert warmup.state == "ready" and seen == [default + 5]
