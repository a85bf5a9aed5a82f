"""`/v1/audio/transcriptions` on a tiny Whisper through OpenAI's own client: a WAV file made in the test is
transcribed as upstream's `generate` (DynamicCache) transcribes the features its processor makes of the same
samples; other rates and channel counts are resampled and mixed; what cannot be served is refused."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from transformers_flexcache.server.audio import resample

from .helpers import TIMEOUT, WHISPER_SAMPLING_RATE, build_app, openai_client, save_checkpoint, serving, wav_bytes


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """`(base_url, upstream model, processor)` of a server on the tiny Whisper."""
    from transformers import AutoProcessor

    folder = tmp_path_factory.mktemp("whisper")
    upstream = save_checkpoint("whisper", folder)
    with serving(build_app(folder, cache_config={"max_batch_size": 2, "max_cache_len": 64})) as base_url:
        yield base_url, upstream, AutoProcessor.from_pretrained(folder)


def speech(seconds: float, *, rate: int = WHISPER_SAMPLING_RATE, seed: int = 0) -> np.ndarray:
    """A seeded stand-in for speech: a few tones under noise, in [-0.5, 0.5]."""
    generator = np.random.default_rng(seed)
    time = np.arange(round(seconds * rate)) / rate
    tones = sum(np.sin(2 * np.pi * frequency * time) for frequency in generator.uniform(100, 3000, 4))
    return 0.1 * tones + 0.1 * generator.uniform(-1, 1, time.size)


def quantized(samples: np.ndarray) -> np.ndarray:
    """What a 16-bit WAV file of `samples` holds, read back as floats."""
    return np.round(samples * 32767) / 32768


def transcribe(upstream, processor, samples: np.ndarray) -> str:
    features = processor(samples, sampling_rate=WHISPER_SAMPLING_RATE, return_tensors="pt")["input_features"]
    with torch.no_grad():
        sequences = upstream.generate(input_features=features, do_sample=False)
    return processor.tokenizer.batch_decode(sequences, skip_special_tokens=True)[0]


def test_a_wav_file_is_transcribed_as_generate_transcribes_its_features(whisper):
    base_url, upstream, processor = whisper
    samples = speech(2.0)
    expected = transcribe(upstream, processor, quantized(samples).astype(np.float32))
    client = openai_client(base_url)
    audio = ("speech.wav", wav_bytes(samples, rate=WHISPER_SAMPLING_RATE), "audio/wav")
    assert client.audio.transcriptions.create(model="tiny", file=audio).text == expected
    assert client.audio.transcriptions.create(model="tiny", file=audio, response_format="text") == expected
    assert expected  # the tiny model says something


def test_audio_at_another_rate_and_in_stereo_is_mixed_and_resampled(whisper):
    base_url, upstream, processor = whisper
    left, right = speech(1.5, rate=8000, seed=1), speech(1.5, rate=8000, seed=2)
    mono = (quantized(left) + quantized(right)) / 2
    expected = transcribe(upstream, processor, resample(mono.astype(np.float32), 8000, WHISPER_SAMPLING_RATE))
    audio = ("stereo.wav", wav_bytes(np.stack([left, right], axis=1), rate=8000, channels=2), "audio/wav")
    assert openai_client(base_url).audio.transcriptions.create(model="tiny", file=audio).text == expected


def post_audio(base_url: str, data: bytes, **form) -> httpx.Response:
    files = {"file": ("audio.wav", data, "audio/wav")}
    return httpx.post(f"{base_url}/v1/audio/transcriptions", files=files, data=form, timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("data", "form", "param", "expected"),
    [
        (wav_bytes(speech(4.0), rate=16000), {}, "file", "lasts 4.0 s, longer than the model's window of 3.0 s"),
        (b"ID3\x04 not a wav file", {}, "file", "not a PCM WAV file"),
        (wav_bytes(speech(1.0), rate=16000), {"response_format": "srt"}, "response_format", "pass one of"),
        (wav_bytes(speech(1.0), rate=16000), {"temperature": "hot"}, "temperature", "valid number"),
        (wav_bytes(speech(1.0), rate=16000), {"prompt": "hello"}, "prompt", "not supported"),
    ],
    ids=["too-long", "not-wav", "format", "temperature", "prompt"],
)
def test_audio_that_cannot_be_served_gets_400_saying_why(whisper, data, form, param, expected):
    base_url, _, _ = whisper
    response = post_audio(base_url, data, **form)
    assert response.status_code == 400
    error = response.json()["error"]
    assert expected in error["message"] and error["param"] == param


def test_an_argument_that_generate_refuses_gets_400_with_its_reason(whisper):
    base_url, _, _ = whisper
    # The tiny Whisper's generation config has no languages: Whisper's generate raises a ValueError for one.
    response = post_audio(base_url, wav_bytes(speech(1.0), rate=16000), language="en")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("generate refused the request: ")


def test_a_speech_model_refuses_completions_and_names_its_route(whisper):
    base_url, _, _ = whisper
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hello"}, timeout=TIMEOUT)
    assert response.status_code == 400
    assert "/v1/audio/transcriptions" in response.json()["error"]["message"]
