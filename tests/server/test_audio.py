"""Audio decoding of `server/audio.py` (PyAV) against signals known in closed form: files of every served format made
in the test by PyAV's encoders, WAV files by the standard library; and the refusals of what cannot be served."""

from __future__ import annotations

import io

import numpy as np
import pytest

from transformers_flexcache.server.audio import decode_audio

from .helpers import wav_bytes

RATE = 16000


def tone(frequency: float, *, rate: int, seconds: float = 1.0) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * frequency * np.arange(round(rate * seconds)) / rate)


def encoded(container: str, codec: str, samples: np.ndarray, *, rate: int) -> bytes:
    """`samples` (`[N]` or `[N, channels]`, float in [-1, 1]) encoded by FFmpeg's `codec` into `container`."""
    import av

    samples = samples.reshape(samples.shape[0], -1).astype(np.float32)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=rate)
        stream.layout = "mono" if samples.shape[1] == 1 else "stereo"
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples.T), format="fltp", layout=stream.layout.name)
        frame.sample_rate = rate
        for packet in (*stream.encode(frame), *stream.encode(None)):
            output.mux(packet)
    return buffer.getvalue()


def decode(data: bytes, *, max_seconds: float = 60.0) -> np.ndarray:
    return decode_audio(data, sampling_rate=RATE, max_seconds=max_seconds)


def test_16_bit_wav_at_the_models_rate_reads_back_exactly():
    samples = tone(440, rate=RATE)
    decoded = decode(wav_bytes(samples, rate=RATE))
    assert decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded, (np.round(samples * 32767) / 32768).astype(np.float32))


def test_channels_are_averaged_to_one():
    left, right = tone(440, rate=RATE), tone(1000, rate=RATE)
    decoded = decode(wav_bytes(np.stack([left, right], axis=1), rate=RATE, channels=2))
    expected = (np.round(left * 32767) + np.round(right * 32767)) / 2 / 32768
    np.testing.assert_allclose(decoded, expected, atol=1e-7)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_other_rates_are_resampled_to_the_models_rate(rate):
    decoded = decode(wav_bytes(tone(440, rate=rate, seconds=2.0), rate=rate))
    expected = tone(440, rate=RATE, seconds=2.0)
    assert abs(decoded.size - expected.size) <= 2
    # away from the edges (the resampler's filter), the tone itself
    middle = slice(RATE // 4, expected.size - RATE // 4)
    np.testing.assert_allclose(decoded[middle], expected[middle], atol=2e-3)


@pytest.mark.parametrize(
    ("container", "codec", "rate", "atol"),
    [
        ("flac", "flac", 44100, 2e-3),  # lossless (16-bit), resampled
        ("mp3", "mp3", 44100, 0.05),
        ("ogg", "libopus", 48000, 0.05),
        ("webm", "libopus", 48000, 0.05),
        ("ipod", "aac", 44100, 0.05),  # .m4a
        ("wav", "pcm_f32le", 44100, 2e-3),  # float WAV
    ],
    ids=["flac", "mp3", "ogg-opus", "webm", "m4a-aac", "float-wav"],
)
def test_compressed_formats_decode_to_the_tone_they_hold(container, codec, rate, atol):
    stereo = np.stack([tone(440, rate=rate, seconds=2.0)] * 2, axis=1)
    decoded = decode(encoded(container, codec, stereo, rate=rate))
    expected = tone(440, rate=RATE, seconds=2.0)
    assert abs(decoded.size - expected.size) <= RATE // 20  # codecs pad a few ms
    # the tone, at its phase: lossy codecs shift the start by their delay, so compare magnitudes of the spectrum
    spectrum = np.abs(np.fft.rfft(decoded[: expected.size // 2 * 2]))
    peak_hz = np.argmax(spectrum) * RATE / (expected.size // 2 * 2)
    assert abs(peak_hz - 440) < 2
    if codec in ("flac", "pcm_f32le"):
        middle = slice(RATE // 4, expected.size - RATE // 4)
        np.testing.assert_allclose(decoded[middle], expected[middle], atol=atol)


def test_audio_longer_than_the_limit_is_refused_before_it_is_all_decoded():
    with pytest.raises(ValueError, match="lasts more than 2 s"):
        decode(wav_bytes(tone(440, rate=RATE, seconds=3.0), rate=RATE), max_seconds=2.0)


def whole_mp3() -> bytes:
    return encoded("mp3", "mp3", tone(440, rate=44100, seconds=2.0), rate=44100)


def whole_flac() -> bytes:
    return encoded("flac", "flac", tone(440, rate=44100, seconds=2.0), rate=44100)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (lambda: b"", "the file is empty"),
        (lambda: b"ID3 but no frames, only text", "could not be read as audio"),
        (lambda: b"\x89PNG\r\n\x1a\n" + bytes(64), "could not be read as audio|holds no audio stream"),
        (lambda: wav_bytes(tone(440, rate=RATE), rate=RATE)[:1000], "WAV file is truncated"),
        (lambda: wav_bytes(np.zeros(0), rate=RATE), "holds no samples"),
        (lambda: whole_mp3()[: len(whole_mp3()) // 2], "the file is truncated: its container declares 2.0"),
        (lambda: whole_flac()[: len(whole_flac()) // 2], "damaged or truncated|the file is truncated"),
        (lambda: encoded("ipod", "aac", tone(440, rate=44100), rate=44100)[:3000], "could not be read as audio"),
    ],
    ids=["empty", "not-audio", "image", "truncated-wav", "no-samples", "truncated-mp3", "truncated-flac", "cut-m4a"],
)
def test_what_is_not_whole_audio_is_refused_naming_the_problem(data, expected):
    with pytest.raises(ValueError, match=expected):
        decode(data())
