"""`/v1/audio/transcriptions` and `/v1/audio/translations` on a tiny random Whisper with a real checkpoint's special
tokens (`zoo.whisper_checkpoint_parts("tiny")`: 3 s windows, 13 timestamps of 0.25 s), through HTTP and OpenAI's own
client. Every answer is checked against upstream's `generate` (DynamicCache) on the features its processor makes of
the samples the server decodes, with the arguments the route documents: long-form text, segments and times, the
detected language, prompts, translation, sampled fallbacks; and what cannot be served is a 400 saying why.
"""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
import torch
from transformers import WhisperForConditionalGeneration

from transformers_flexcache import zoo
from transformers_flexcache.server.audio import decode_audio

from .helpers import TIMEOUT, build_app, openai_client, serving, wav_bytes

RATE = zoo.WHISPER_SAMPLING_RATE
TIMES = {"time_precision": 0.25, "time_precision_features": 0.125}  # the tiny window's steps
SEGMENTS = {"return_timestamps": True, "return_segments": True, **TIMES}


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """`(base_url, upstream model, processor)` of a server on the tiny transcribing Whisper."""
    folder = tmp_path_factory.mktemp("whisper-transcribing")
    config, generation_config, processor = zoo.whisper_checkpoint_parts("tiny")
    torch.manual_seed(0)
    upstream = WhisperForConditionalGeneration(config).eval()
    upstream.generation_config = generation_config
    upstream.save_pretrained(folder)
    processor.save_pretrained(folder)
    with serving(build_app(folder, cache_config={"max_batch_size": 3, "max_cache_len": 64})) as base_url:
        yield base_url, upstream, processor


def speech(seconds: float, *, seed: int = 0) -> np.ndarray:
    """A seeded stand-in for speech at 16 kHz, as a 16-bit WAV file holds it (so the server decodes it exactly)."""
    generator = np.random.default_rng(seed)
    time = np.arange(round(seconds * RATE)) / RATE
    tones = sum(np.sin(2 * np.pi * frequency * time) for frequency in generator.uniform(100, 3000, 4))
    samples = 0.1 * tones + 0.1 * generator.uniform(-1, 1, time.size)
    return (np.round(samples * 32767) / 32768).astype(np.float32)


def wav(samples: np.ndarray) -> bytes:
    return wav_bytes(samples, rate=RATE)


def expected(upstream, processor, samples: np.ndarray, *, seed: int | None = None, temperature=0.0, **kwargs):
    """Upstream's generate on the recording's features (long-form features when it is longer than the window)."""
    extractor = processor.feature_extractor
    long_form = samples.size > extractor.n_samples
    padding = {"truncation": False, "padding": "longest"} if long_form else {}
    features = extractor(samples, sampling_rate=RATE, return_tensors="pt", **padding)["input_features"]
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return upstream.generate(input_features=features, temperature=temperature, **kwargs)


def texts(processor, result) -> list[str]:
    return [processor.tokenizer.decode(s["tokens"], skip_special_tokens=True) for s in result["segments"][0]]


def post(base_url: str, data: bytes, *, route: str = "transcriptions", name: str = "audio.wav", **form):
    files = {"file": (name, data, "application/octet-stream")}
    return httpx.post(f"{base_url}/v1/audio/{route}", files=files, data=form, timeout=TIMEOUT)


LONG = speech(8.3, seed=0)  # three windows of the tiny model


def test_long_audio_is_transcribed_as_upstreams_long_form_generate_with_its_segments(whisper):
    base_url, upstream, processor = whisper
    want = expected(upstream, processor, LONG, task="transcribe", **SEGMENTS)
    assert len(want["segments"][0]) > 2
    body = post(base_url, wav(LONG), response_format="verbose_json").json()
    assert body["text"] == "".join(texts(processor, want))
    assert body["text"] == processor.tokenizer.batch_decode(want["sequences"], skip_special_tokens=True)[0]
    assert [(s["start"], s["end"]) for s in body["segments"]] == [
        (float(s["start"]), float(s["end"])) for s in want["segments"][0]
    ]
    assert [s["tokens"] for s in body["segments"]] == [s["tokens"].tolist() for s in want["segments"][0]]
    assert [s["text"] for s in body["segments"]] == texts(processor, want)
    assert body["segments"][-1]["seek"] > body["segments"][0]["seek"] == 0  # later windows start later
    assert body["task"] == "transcribe" and body["duration"] == pytest.approx(8.3)
    # no language was given: Whisper's generate detects it on the first window, as upstream's detect_language does
    features = processor.feature_extractor(LONG[: 3 * RATE], sampling_rate=RATE, return_tensors="pt")
    detected = upstream.detect_language(features["input_features"]).item()
    code = {v: k for k, v in upstream.generation_config.lang_to_id.items()}[detected].strip("<|>")
    assert body["language"] == {"en": "english", "de": "german", "fr": "french"}[code]
    # json and text carry the same text
    assert post(base_url, wav(LONG)).json()["text"] == body["text"]
    assert post(base_url, wav(LONG), response_format="text").text == body["text"]


def clock(seconds: float, separator: str) -> str:
    whole = int(seconds)
    return f"{whole // 3600:02d}:{whole % 3600 // 60:02d}:{whole % 60:02d}{separator}{round(seconds % 1 * 1000):03d}"


@pytest.mark.parametrize("response_format", ["srt", "vtt"])
def test_subtitles_have_one_cue_per_segment_at_upstreams_times(whisper, response_format):
    base_url, upstream, processor = whisper
    want = expected(upstream, processor, LONG, task="transcribe", **SEGMENTS)
    response = post(base_url, wav(LONG), response_format=response_format)
    assert response.status_code == 200
    separator = "," if response_format == "srt" else "."
    cues = []
    for index, (segment, text) in enumerate(zip(want["segments"][0], texts(processor, want), strict=True), 1):
        timing = f"{clock(float(segment['start']), separator)} --> {clock(float(segment['end']), separator)}"
        cues.append((f"{index}\n" if response_format == "srt" else "") + f"{timing}\n{text.strip()}\n")
    header = "WEBVTT\n\n" if response_format == "vtt" else ""
    assert response.text == header + "\n".join(cues)


def test_short_audio_as_json_is_generates_default_transcription_without_timestamps(whisper):
    base_url, upstream, processor = whisper
    samples = speech(2.0, seed=1)
    want = expected(upstream, processor, samples, task="transcribe")
    text = processor.tokenizer.batch_decode(want, skip_special_tokens=True)[0]
    assert openai_client(base_url).audio.transcriptions.create(model="tiny", file=("a.wav", wav(samples))).text == text


def test_language_and_prompt_are_generates_language_and_prompt_ids(whisper):
    base_url, upstream, processor = whisper
    prompt_ids = torch.as_tensor(processor.tokenizer.get_prompt_ids("abc def", return_tensors="np"))
    want = expected(upstream, processor, LONG, task="transcribe", language="de", prompt_ids=prompt_ids, **SEGMENTS)
    body = post(base_url, wav(LONG), response_format="verbose_json", language="de", prompt="abc def").json()
    assert [s["tokens"] for s in body["segments"]] == [s["tokens"].tolist() for s in want["segments"][0]]
    assert body["language"] == "german"


def test_translations_run_the_translate_task(whisper):
    base_url, upstream, processor = whisper
    want = expected(upstream, processor, LONG, task="translate", **SEGMENTS)
    body = post(base_url, wav(LONG), route="translations", response_format="verbose_json").json()
    assert body["task"] == "translate"
    assert [s["tokens"] for s in body["segments"]] == [s["tokens"].tolist() for s in want["segments"][0]]
    transcribed = expected(upstream, processor, LONG, task="transcribe", **SEGMENTS)
    assert not torch.equal(want["sequences"], transcribed["sequences"])  # the task token changes the decoding


def test_sampled_fallback_is_upstreams_temperature_tuple_seeded_as_generate(whisper):
    base_url, upstream, processor = whisper
    settings = {"compression_ratio_threshold": 1.2, "logprob_threshold": -1.0, "condition_on_prev_tokens": True}
    want = expected(
        upstream, processor, LONG, seed=7, temperature=(0.0, 0.5, 1.0), task="transcribe", **SEGMENTS, **settings
    )
    form = {"fallback_temperatures": "0.5,1.0", "seed": "7", "response_format": "verbose_json"}
    form.update({name: str(value) for name, value in settings.items()})
    body = post(base_url, wav(LONG), **form).json()
    assert [s["tokens"] for s in body["segments"]] == [s["tokens"].tolist() for s in want["segments"][0]]
    assert all(s["temperature"] is None for s in body["segments"])  # upstream does not record which decoded each


def test_a_stream_sends_each_segment_as_a_delta_then_the_whole_text(whisper):
    base_url, upstream, processor = whisper
    want = expected(upstream, processor, LONG, task="transcribe", **SEGMENTS)
    files = {"file": ("audio.wav", wav(LONG), "audio/wav")}
    events = []
    with httpx.stream(
        "POST", f"{base_url}/v1/audio/transcriptions", files=files, data={"stream": "true"}, timeout=TIMEOUT
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert [event["type"] for event in events] == ["transcript.text.delta"] * len(want["segments"][0]) + [
        "transcript.text.done"
    ]
    assert [event["delta"] for event in events[:-1]] == texts(processor, want)
    assert events[-1]["text"] == "".join(texts(processor, want))


def test_openai_clients_verbose_json_has_the_segments_and_the_language(whisper):
    base_url, upstream, processor = whisper
    want = expected(upstream, processor, LONG, task="transcribe", **SEGMENTS)
    answer = openai_client(base_url).audio.transcriptions.create(
        model="tiny", file=("long.wav", wav(LONG)), response_format="verbose_json", timestamp_granularities=["segment"]
    )
    assert answer.text == "".join(texts(processor, want))
    assert [(s.start, s.end) for s in answer.segments] == [
        (float(s["start"]), float(s["end"])) for s in want["segments"][0]
    ]
    assert answer.language in ("english", "german", "french") and answer.duration == pytest.approx(8.3)


def test_compressed_audio_is_decoded_and_transcribed(whisper):
    import av

    base_url, upstream, processor = whisper
    samples = speech(4.5, seed=3)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp3") as output:
        stream = output.add_stream("mp3", rate=44100)
        frame = av.AudioFrame.from_ndarray(
            np.interp(np.arange(round(4.5 * 44100)) / 44100, np.arange(samples.size) / RATE, samples)[None].astype(
                np.float32
            ),
            format="fltp",
            layout="mono",
        )
        frame.sample_rate = 44100
        for packet in (*stream.encode(frame), *stream.encode(None)):
            output.mux(packet)
    data = buffer.getvalue()
    decoded = decode_audio(data, sampling_rate=RATE, max_seconds=60)
    want = expected(upstream, processor, decoded, task="transcribe", **SEGMENTS)
    body = post(base_url, data, name="speech.mp3", response_format="verbose_json").json()
    assert [s["tokens"] for s in body["segments"]] == [s["tokens"].tolist() for s in want["segments"][0]]


@pytest.mark.parametrize(
    ("data", "form", "param", "message"),
    [
        (b"", {}, "file", "the file is empty"),
        (b"this is a text file, not audio", {}, "file", "could not be read as audio"),
        (wav_bytes(speech(1.0), rate=RATE)[:5000], {}, "file", "WAV file is truncated"),
        (wav_bytes(speech(1.0), rate=RATE), {"response_format": "xml"}, "response_format", "pass one of"),
        (
            wav_bytes(speech(1.0), rate=RATE),
            {"response_format": "verbose_json", "timestamp_granularities[]": "word"},
            "timestamp_granularities[]",
            "word timestamps are not served: upstream computes them",
        ),
        (
            wav_bytes(speech(1.0), rate=RATE),
            {"timestamp_granularities[]": "segment"},
            "timestamp_granularities[]",
            "needs response_format='verbose_json'",
        ),
        (wav_bytes(speech(1.0), rate=RATE), {"temperature": "hot"}, "temperature", "valid number"),
        (wav_bytes(speech(1.0), rate=RATE), {"stream": "true", "response_format": "srt"}, "stream", "not streamed"),
        (wav_bytes(speech(1.0), rate=RATE), {"include[]": "logprobs"}, "include[]", "not served"),
        (wav_bytes(speech(1.0), rate=RATE), {"fallback_temperatures": "0.5,0.2"}, "fallback_temperatures", "above"),
        (wav_bytes(speech(1.0), rate=RATE), {"temprature": "0.2"}, None, "Unrecognized request argument"),
    ],
    ids=[
        "empty",
        "not-audio",
        "truncated",
        "format",
        "word",
        "granularity-json",
        "temperature",
        "stream-srt",
        "logprobs",
        "fallback-order",
        "misspelt",
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_problem(whisper, data, form, param, message):
    base_url, _, _ = whisper
    response = post(base_url, data, **form)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_a_language_generate_does_not_know_is_a_400_with_generates_reason(whisper):
    base_url, _, _ = whisper
    response = post(base_url, wav(speech(1.0)), language="klingon")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("generate refused the request: Unsupported language")


def test_a_speech_model_refuses_completions_and_names_its_route(whisper):
    base_url, _, _ = whisper
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hello"}, timeout=TIMEOUT)
    assert response.status_code == 400
    assert "/v1/audio/transcriptions" in response.json()["error"]["message"]
