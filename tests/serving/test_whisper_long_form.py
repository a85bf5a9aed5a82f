"""Long-form Whisper on the in-flight engine: audio longer than the encoder's window is one engine request whose
generate (upstream's sequential long-form loop: windows, timestamp tokens, seek, temperature fallback, conditioning
on previous text) runs each window's encoder, prefill and decode steps in the engine's batched steps, beside short
requests. Its tokens, segments and times equal upstream's `generate` (DynamicCache) on the same features and
settings, sampled fallbacks included (seeded as the engine seeds).

The model is a tiny random Whisper with a real checkpoint's special tokens (`zoo.whisper_checkpoint_parts("tiny")`:
3 s windows, 13 timestamps of 0.25 s).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperForConditionalGeneration

from transformers_flexcache import convert, zoo
from transformers_flexcache.serving import Engine

TIMEOUT = 120
# what the server passes: the tiny window's timestamp step (3 s over 12 positions) and its frame step (hop / rate)
TIMES = {"time_precision": 0.25, "time_precision_features": 0.125}


@pytest.fixture(scope="module")
def whisper():
    """`(upstream, flex, processor)`: one seeded tiny transcribing Whisper, upstream's and the override."""
    config, generation_config, processor = zoo.whisper_checkpoint_parts("tiny")
    torch.manual_seed(0)
    upstream = WhisperForConditionalGeneration(config).eval()
    upstream.generation_config = generation_config
    flex = convert(WhisperForConditionalGeneration(config).eval())
    flex.load_state_dict(upstream.state_dict())
    flex.generation_config = generation_config
    return upstream, flex, processor


def speech(seconds: float, seed: int) -> np.ndarray:
    """A seeded stand-in for speech: tones under noise."""
    generator = np.random.default_rng(seed)
    time = np.arange(round(seconds * zoo.WHISPER_SAMPLING_RATE)) / zoo.WHISPER_SAMPLING_RATE
    tones = sum(np.sin(2 * np.pi * frequency * time) for frequency in generator.uniform(100, 3000, 4))
    return (0.1 * tones + 0.1 * generator.uniform(-1, 1, time.size)).astype(np.float32)


def features(processor, samples: np.ndarray) -> torch.Tensor:
    """`[1, mel, frames]`: the whole recording's features when it is longer than the window, as upstream's docs say
    long-form features are made."""
    extractor = processor.feature_extractor
    long_form = samples.size > extractor.n_samples
    kwargs = {"truncation": False, "padding": "longest"} if long_form else {}
    return extractor(samples, sampling_rate=extractor.sampling_rate, return_tensors="pt", **kwargs)["input_features"]


def reference(upstream, inputs: torch.Tensor, kwargs: dict, seed: int) -> dict:
    torch.manual_seed(seed)
    with torch.no_grad():
        return upstream.generate(input_features=inputs, **kwargs)


def assert_same_transcription(got: dict, want: dict) -> None:
    assert torch.equal(got["sequences"], want["sequences"])
    assert len(got["segments"][0]) == len(want["segments"][0])
    for mine, theirs in zip(got["segments"][0], want["segments"][0], strict=True):
        assert torch.equal(mine["tokens"], theirs["tokens"])
        assert float(mine["start"]) == float(theirs["start"]) and float(mine["end"]) == float(theirs["end"])


SETTINGS = {
    "greedy": {},
    "conditioned": {"condition_on_prev_tokens": True},
    # fallback: every window whose tokens compress too well (a random model's repetitions) is decoded again, sampled
    "fallback": {
        "temperature": (0.0, 0.4, 0.8),
        "compression_ratio_threshold": 1.2,
        "logprob_threshold": -1.0,
        "condition_on_prev_tokens": True,
    },
    "language-and-prompt": {"language": "de", "prompt_ids": None},  # the prompt is made in the test
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_long_audio_is_transcribed_as_upstreams_long_form_generate_beside_short_requests(whisper, name):
    upstream, flex, processor = whisper
    settings = dict(SETTINGS[name])
    if "prompt_ids" in settings:
        settings["prompt_ids"] = torch.as_tensor(processor.tokenizer.get_prompt_ids("abc def", return_tensors="np"))
    kwargs = {"return_timestamps": True, "return_segments": True, **TIMES, **settings}
    recordings = [speech(seconds, seed) for seed, seconds in enumerate([8.3, 2.0, 6.8, 1.0])]
    inputs = [features(processor, samples) for samples in recordings]
    assert [x.shape[-1] > 24 for x in inputs] == [True, False, True, False]  # two long, two short
    seeds = [11, 12, 13, 14]
    expected = [reference(upstream, x, kwargs, seed) for x, seed in zip(inputs, seeds, strict=True)]
    assert any(len(result["segments"][0]) > 2 for result in expected)  # several windows, several segments
    with Engine(flex, cache_config={"max_batch_size": 3, "max_cache_len": 64}) as engine:
        handles = [engine.submit(seed=seed, input_features=x, **kwargs) for x, seed in zip(inputs, seeds, strict=True)]
        results = [handle.result(timeout=TIMEOUT) for handle in handles]
        assert engine.stats["rows"] > engine.stats["decode_steps"]  # decode steps held several requests' rows
    for got, want in zip(results, expected, strict=True):
        assert_same_transcription(got, want)


def test_a_segment_listener_hears_each_windows_segments_as_generate_returns_them(whisper):
    upstream, flex, processor = whisper
    inputs = features(processor, speech(8.3, 0))
    heard = []
    kwargs = {"return_timestamps": True, "return_segments": True, **TIMES}
    with Engine(flex, cache_config={"max_batch_size": 2, "max_cache_len": 64}) as engine:
        listener = lambda row, segments, start: heard.append((row, start, segments))  # noqa: E731
        result = engine.submit(input_features=inputs, segment_listener=listener, **kwargs).result(timeout=TIMEOUT)
    assert_same_transcription(result, reference(upstream, inputs, kwargs, 0))
    assert [segment for _, _, segments in heard for segment in segments] == result["segments"][0]
    starts = [start for _, start, _ in heard]
    assert starts[0] == 0.0 and starts == sorted(starts) and len(set(starts)) == len(starts) > 1
    assert {row for row, _, _ in heard} == {0}
