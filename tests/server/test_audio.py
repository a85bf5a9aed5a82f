"""WAV decoding and resampling of `server/audio.py` against signals known in closed form."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from transformers_flexcache.server.audio import read_wav, resample

from .helpers import wav_bytes


def tone(frequency: float, *, rate: int, seconds: float = 1.0) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * frequency * np.arange(round(rate * seconds)) / rate)


@pytest.mark.parametrize("width", [1, 2, 3, 4], ids=["8-bit", "16-bit", "24-bit", "32-bit"])
def test_pcm_wav_of_every_sample_width_reads_back_within_its_quantization(width):
    samples = tone(440, rate=8000)
    decoded, rate = read_wav(wav_bytes(samples, rate=8000, width=width))
    assert rate == 8000 and decoded.dtype == np.float32 and decoded.shape == samples.shape
    quantization = 1.5 / 2 ** (8 * width - 1)
    assert np.abs(decoded - samples).max() <= max(quantization, np.finfo(np.float32).eps)  # float32 holds 24 bits


def test_channels_are_averaged_to_one():
    left, right = tone(440, rate=8000), tone(1000, rate=8000)
    decoded, _ = read_wav(wav_bytes(np.stack([left, right], axis=1), rate=8000, channels=2))
    np.testing.assert_allclose(decoded, (left + right) / 2, atol=1e-4)


def float_wav(samples: np.ndarray, rate: int) -> bytes:
    """A WAV file of 32-bit float samples (format 3), which `wave` does not write."""
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, 4 * rate, 4, 32)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (float_wav(tone(440, rate=8000), 8000), "not a PCM WAV file"),
        (b"fLaC\x00\x00\x00\x22", "not a PCM WAV file"),
        (wav_bytes(np.zeros(0), rate=8000), "has no samples"),
    ],
    ids=["float", "flac", "empty"],
)
def test_what_is_not_pcm_wav_is_refused_with_how_to_convert_it(data, expected):
    with pytest.raises(ValueError, match=expected) as raised:
        read_wav(data)
    assert "ffmpeg" in str(raised.value) or expected == "has no samples"


@pytest.mark.parametrize(("source", "target"), [(8000, 16000), (44100, 16000), (16000, 16000)])
def test_resampling_a_band_limited_signal_gives_its_samples_at_the_new_rate(source, target):
    # Whole periods in one second and below both Nyquist frequencies: the signal is known exactly at any rate.
    signal = tone(440, rate=source) + tone(3000, rate=source)
    expected = tone(440, rate=target) + tone(3000, rate=target)
    np.testing.assert_allclose(resample(signal.astype(np.float32), source, target), expected, atol=1e-4)


def test_downsampling_removes_what_the_new_rate_cannot_hold():
    # 6 kHz is above 8 kHz's Nyquist frequency: it would alias to 2 kHz; it is filtered out instead.
    signal = tone(440, rate=16000) + tone(6000, rate=16000)
    np.testing.assert_allclose(resample(signal.astype(np.float32), 16000, 8000), tone(440, rate=8000), atol=1e-4)
