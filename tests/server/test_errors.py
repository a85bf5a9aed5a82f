"""Refusals and failures over HTTP, each in OpenAI's error body: a request over a capacity (400 with the value, the
limit and the server flag that fits), invalid parameters (400 naming the field), another model (404), a full queue
(429 with Retry-After), and a request that fails in the model (500, and the server serves on)."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from .helpers import TIMEOUT, build_app, metrics, openai_client, save_checkpoint, serving, slowed, wait_until

PROMPT = "helloWorld42"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """`(base_url, app)` of a tiny Llama server with 2 seats of 32 positions."""
    folder = tmp_path_factory.mktemp("llama")
    save_checkpoint("llama", folder)
    app = build_app(folder, cache_config={"max_batch_size": 2, "max_cache_len": 32})
    with serving(app) as base_url:
        yield base_url, app


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t5")
    save_checkpoint("t5", folder)
    app = build_app(folder, cache_config={"max_batch_size": 2, "max_cache_len": 32, "max_encoder_len": 16})
    with serving(app) as base_url:
        yield base_url, app


def post(base_url: str, body: dict | bytes, route: str = "/v1/completions") -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json"}
        return httpx.post(f"{base_url}{route}", content=body, headers=headers, timeout=TIMEOUT)
    return httpx.post(f"{base_url}{route}", json=body, timeout=TIMEOUT)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("model", "body", "param", "expected"),
    [
        ("llama", {"n": 3, "temperature": 1.0}, "n", "needs max_batch_size=3 but the server has max_batch_size=2"),
        # 12 prompt tokens + 30 new tokens - 1 = 41 positions
        ("llama", {"max_tokens": 30}, "max_tokens", "needs max_cache_len=41 but the server has max_cache_len=32"),
        ("t5", {"prompt": "x" * 20}, "prompt", "needs max_encoder_len=20 but the server has max_encoder_len=16"),
    ],
    ids=["seats", "decoder-positions", "encoder-positions"],
)
def test_a_request_over_a_capacity_gets_400_with_the_value_the_limit_and_the_flag_that_fits(
    request, model, body, param, expected
):
    base_url, app = request.getfixturevalue(model)
    response = post(base_url, {"prompt": PROMPT, "max_tokens": 4, **body})
    assert response.status_code == 400
    error = error_of(response)
    assert expected in error["message"]
    flag = "--" + expected.split(" has ")[1].split("=")[0].replace("_", "-")
    value = expected.split("needs ")[1].split("=")[1].split(" ")[0]
    assert f"start the server with {flag} {value} or more" in error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert app.state.served.engine.stats["submitted"] == app.state.served.engine.stats["finished"]  # nothing queued


def test_the_openai_client_raises_its_bad_request_error_with_the_message(llama):
    base_url, _ = llama
    with pytest.raises(openai.BadRequestError, match="--max-cache-len 41") as raised:
        openai_client(base_url).completions.create(model="tiny", prompt=PROMPT, max_tokens=30)
    assert raised.value.status_code == 400 and raised.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "param", "expected"),
    [
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens", "valid integer"),
        ({"prompt": PROMPT, "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"prompt": PROMPT, "bogus": 1}, "bogus", "Extra inputs are not permitted"),
        ({"max_tokens": 4}, "prompt", "Field required"),
        ({"prompt": PROMPT, "n": 2, "temperature": 0}, "n", "pass temperature > 0"),
        ({"prompt": [5, 200]}, "prompt", "outside the model's vocabulary ([200]; vocab_size=99)"),
        ({"prompt": []}, "prompt", "holds no prompt"),
        ({"prompt": PROMPT, "suffix": "end"}, "suffix", "not supported"),
        ({"prompt": PROMPT, "min_tokens": 9, "max_tokens": 4}, "min_tokens", "pass min_tokens <= max_tokens"),
        ({"prompt": PROMPT, "stop": ["", "a"]}, "stop", "every stop sequence needs text"),
        (b"{not json", None, "JSON decode error"),
    ],
    ids=["type", "range", "unknown", "missing", "greedy-n", "vocab", "empty", "unsupported", "min", "stop", "json"],
)
def test_invalid_parameters_get_400_naming_what_is_wrong(llama, body, param, expected):
    base_url, _ = llama
    response = post(base_url, body)
    assert response.status_code == 400
    error = error_of(response)
    assert expected in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_another_model_name_gets_404_and_an_unknown_route_an_openai_error_body(llama):
    base_url, _ = llama
    response = post(base_url, {"model": "gpt-4", "prompt": PROMPT})
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found" and "'tiny'" in error_of(response)["message"]
    assert error_of(httpx.get(f"{base_url}/v1/chat", timeout=TIMEOUT))["code"] == "not_found"
    assert error_of(httpx.get(f"{base_url}/v1/models/gpt-4", timeout=TIMEOUT))["code"] == "model_not_found"
    assert metrics(base_url)["flexcache_http_requests_total{route=other,status=404}"] >= 2  # one label for them all


def test_a_text_model_refuses_transcriptions_and_names_its_route(llama):
    base_url, _ = llama
    files = {"file": ("a.wav", b"RIFF", "audio/wav")}
    response = httpx.post(f"{base_url}/v1/audio/transcriptions", files=files, timeout=TIMEOUT)
    assert response.status_code == 400 and "/v1/completions" in error_of(response)["message"]


def test_a_request_that_fails_in_the_model_gets_500_and_the_server_serves_on(llama):
    base_url, app = llama
    poison = 97

    def fail_on_poison(module, args, output):
        (input_ids,) = args
        if input_ids.shape[-1] > 1 and (input_ids == poison).any():  # prefills only: decoded tokens never fail
            raise RuntimeError("a fault injected by the test")

    embeddings = app.state.served.engine.model.get_input_embeddings()
    hook = embeddings.register_forward_hook(fail_on_poison)
    try:
        failed = post(base_url, {"prompt": [5, poison, 7], "max_tokens": 4, "temperature": 0})
        served = post(base_url, {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
    finally:
        hook.remove()
    assert failed.status_code == 500
    error = error_of(failed)
    assert error["type"] == "server_error" and "RuntimeError: a fault injected by the test" in error["message"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] >= 1
    assert app.state.served.engine.stats["failed"] >= 1
    assert metrics(base_url)["flexcache_http_requests_total{route=/v1/completions,status=500}"] >= 1


def test_a_stream_whose_request_fails_in_the_model_ends_with_an_error_event_and_done(llama):
    base_url, app = llama

    def fail_on_prefill(module, args, output):
        if args[0].shape[-1] > 1:
            raise RuntimeError("a fault injected by the test")

    hook = app.state.served.engine.model.get_input_embeddings().register_forward_hook(fail_on_prefill)
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT) as response:
            events = [line for line in response.iter_lines() if line]
    finally:
        hook.remove()
    assert response.status_code == 200  # the stream had begun: the error comes as an event
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "a fault injected by the test" in error["message"]
    with pytest.raises(openai.APIError, match="a fault injected by the test"):
        hook = app.state.served.engine.model.get_input_embeddings().register_forward_hook(fail_on_prefill)
        try:
            list(openai_client(base_url).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, stream=True))
        finally:
            hook.remove()


def test_a_full_queue_gets_429_with_retry_after(tmp_path):
    save_checkpoint("llama", tmp_path)
    app = build_app(tmp_path, cache_config={"max_batch_size": 1, "max_cache_len": 1000}, max_queue=1)
    long = {"prompt": PROMPT, "max_tokens": 900, "min_tokens": 900, "temperature": 0, "stream": True}
    model = app.state.served.engine.model
    with serving(app) as base_url, httpx.Client(timeout=TIMEOUT) as client, slowed(model, 0.02):
        with client.stream("POST", f"{base_url}/v1/completions", json=long) as running:
            lines = running.iter_lines()  # held: a generator dropped mid-stream closes the connection
            next(lines)  # the request holds the one seat
            waiting = {}
            queued = threading.Thread(
                target=lambda: waiting.update(response=post(base_url, {"prompt": PROMPT, "max_tokens": 3})),
                daemon=True,
            )
            queued.start()
            wait_until(lambda: metrics(base_url)["flexcache_requests_queued"] == 1, what="a queued request")
            refused = post(base_url, {"prompt": PROMPT, "max_tokens": 3})
        # Leaving the stream disconnects it: its seat goes to the queued request.
        queued.join(TIMEOUT)
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    error = error_of(refused)
    assert error["type"] == "rate_limit_error" and "--max-queue is 1" in error["message"]
    assert waiting["response"].status_code == 200
