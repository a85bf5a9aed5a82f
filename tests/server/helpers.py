"""What the server tests share: tiny checkpoints saved with a tokenizer (and Whisper's processor), servers on
127.0.0.1 in a thread of the test process, and the references they answer against.

A checkpoint is upstream's model with the seeded weights of a `ModelCase`, saved with `save_pretrained`; the server
loads the folder as the command does (`load_checkpoint`), and upstream's model in memory, with its DynamicCache, is
the reference of every answer. Every wait is bounded (`TIMEOUT`).
"""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
import wave
from pathlib import Path

import numpy as np
import torch

from tests.helpers import assert_within_float_noise
from tests.model_cases import MODEL_CASES
from tests.serving.test_engine import char_tokenizer

TIMEOUT = 60  # seconds: any wait longer than this is a hang
WHISPER_SAMPLING_RATE = 16000


def whisper_processor(config):
    """A processor for the tiny Whisper: 3 s of 16 kHz audio make the encoder's 24 frames (hop of 2000 samples)."""
    from transformers import WhisperFeatureExtractor, WhisperProcessor

    extractor = WhisperFeatureExtractor(
        feature_size=config.num_mel_bins,
        sampling_rate=WHISPER_SAMPLING_RATE,
        hop_length=3 * WHISPER_SAMPLING_RATE // (2 * config.max_source_positions),
        chunk_length=3,
        n_fft=400,
    )
    return WhisperProcessor(feature_extractor=extractor, tokenizer=char_tokenizer())


def save_checkpoint(name: str, folder: Path):
    """Save the tiny `name` model (upstream's class) and its tokenizer or processor to `folder`; returns upstream's
    model, the reference."""
    case = next(case for case in MODEL_CASES if case.name == name)
    upstream, _ = case.build("sdpa")
    upstream.save_pretrained(folder)
    if name == "whisper":
        whisper_processor(upstream.config).save_pretrained(folder)
    else:
        char_tokenizer().save_pretrained(folder)
    return upstream


def build_app(folder: Path, *, cache_config: dict, max_queue: int = 64, model_name: str = "tiny"):
    """The application the `serve` command builds on `folder`, with these capacities."""
    from transformers_flexcache.server.app import create_app
    from transformers_flexcache.server.cli import load_checkpoint
    from transformers_flexcache.serving import Engine

    model, tokenizer, processor = load_checkpoint(str(folder))
    engine = Engine(model, cache_config=cache_config, max_queue=max_queue, tokenizer=tokenizer)
    return create_app(engine, tokenizer=tokenizer, processor=processor, model_name=model_name)


@contextlib.contextmanager
def serving(app):
    """Run `app` with uvicorn on a free port of 127.0.0.1 in a thread; yields its base URL. On exit the server shuts
    down as on SIGTERM (the engine drains and closes)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@contextlib.contextmanager
def tiny_server(name: str, tmp_path_factory, *, cache_config: dict):
    """A server on the tiny `name` model saved in a fresh folder (for a module's fixture); yields `(base_url, upstream
    model, tokenizer)`, upstream's model being the reference of its answers."""
    folder = tmp_path_factory.mktemp(name)
    upstream = save_checkpoint(name, folder)
    with serving(build_app(folder, cache_config=cache_config)) as base_url:
        yield base_url, upstream, char_tokenizer()


@contextlib.contextmanager
def slowed(model, seconds_per_call: float):
    """Every forward of `model` (each batched step of the engine) takes `seconds_per_call` longer: a request of many
    tokens then surely runs while a test looks at it, on any machine."""
    hook = model.register_forward_pre_hook(lambda module, args: time.sleep(seconds_per_call))
    try:
        yield
    finally:
        hook.remove()


def openai_client(base_url: str):
    from openai import OpenAI

    # No retries: a refused request must show as refused, not be sent again.
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def wait_until(predicate, *, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def metrics(base_url: str) -> dict[str, float]:
    """`GET /metrics` as `{"name{label=value,...}": value}` (labels sorted), parsed by prometheus-client."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=TIMEOUT).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


# --- references -------------------------------------------------------------------------------------------------
def reference(upstream, tokenizer, prompt, /, *, seed: int | None = None, **generate_kwargs) -> torch.Tensor:
    """Upstream's `generate` (DynamicCache) on one prompt (text or token ids), seeded as the engine seeds."""
    if isinstance(prompt, str):
        inputs = tokenizer(prompt, return_tensors="pt")
    else:
        input_ids = torch.tensor([prompt])
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if seed is not None:
        torch.manual_seed(seed)
    return upstream.generate(**inputs, **generate_kwargs)


def new_tokens(upstream, sequences: torch.Tensor, prompt_len: int) -> list[list[int]]:
    """Each sequence's own new tokens: after the prompt (decoder-only) or the decoder start token, up to its EOS."""
    skip = 1 if upstream.config.is_encoder_decoder else prompt_len
    eos = upstream.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in sequences[:, skip:].tolist():
        ends = [index for index, token in enumerate(row) if token in eos]
        rows.append(row[: ends[0] + 1] if ends else row)
    return rows


def assert_answers_within_float_noise(answered: list[float], expected: torch.Tensor, exact: torch.Tensor) -> None:
    """The server's answered numbers (log probabilities or scores: JSON floats, float32 values) equal `expected`,
    upstream's float32 values of the same quantities, bit for bit or within `NOISE_MARGIN` times their float noise:
    their distance from `exact`, the same quantities computed in float64 (`in_double(upstream)`), on this machine
    (`tests/helpers.assert_within_float_noise`, with its floor of 16 float32 ulps)."""
    actual = torch.tensor(answered, dtype=torch.float64)
    assert_within_float_noise(actual, expected.double(), exact.double())


def assert_sequence_scores_within_float_noise(upstream, answered: list[float], expected, exact, *, prompt_len: int):
    """The server's `sequence_score`s equal upstream's beam search `expected.sequences_scores` (float32), within their
    float noise: their distance from `exact.sequences_scores`, the same `generate` (arguments and seed) run by
    `in_double(upstream)`.

    A hypothesis's score is defined by its own tokens alone (the sum of its tokens' log probabilities, each given the
    tokens before it, over its length to the power of the length penalty), so the float64 run's score of the same
    tokens is the exact value of the float32 one. In float64 the beam search can choose other hypotheses (a near tie
    decided the other way): the noise is then measured on the hypotheses both runs returned, by their tokens, and
    bounds every answered score, all of which are compared. Where the runs share no hypothesis there is no such
    measure, and the test says so rather than guess one. (Upstream's generate casts each step's logits to float32,
    so the float64 run's scores carry float32 rounding of their log-softmax and sums: a few ulps, which only add to
    the measured noise; `ulp_floor` bounds it from below where the two runs agree bit for bit.)"""
    rows, exact_rows = (new_tokens(upstream, output.sequences, prompt_len) for output in (expected, exact))
    want = expected.sequences_scores.double()
    # a hypothesis the float64 run did not return adds no noise: its own expected value stands in for its exact one
    reference = want.clone()
    shared = [index for index, row in enumerate(rows) if row in exact_rows]
    assert shared, f"the float64 beam search returned none of the float32 hypotheses {rows}: {exact_rows}"
    for index in shared:
        reference[index] = exact.sequences_scores[exact_rows.index(rows[index])].item()
    assert_answers_within_float_noise(answered, want, reference)


def wav_bytes(samples: np.ndarray, *, rate: int, width: int = 2, channels: int = 1) -> bytes:
    """A PCM WAV file of float `samples` in [-1, 1] (`[N]`, or `[N, channels]`)."""
    scale = {1: 127, 2: 32767, 3: 2**23 - 1, 4: 2**31 - 1}[width]
    ints = np.round(np.asarray(samples, dtype=np.float64) * scale).astype(np.int64).reshape(-1)
    if width == 1:
        data = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        data = b"".join(int(value).to_bytes(3, "little", signed=True) for value in ints)
    else:
        data = ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(width)
        writer.setframerate(rate)
        writer.writeframes(data)
    return buffer.getvalue()
