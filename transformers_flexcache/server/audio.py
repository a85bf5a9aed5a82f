"""WAV files as the float samples a feature extractor takes: the standard library's `wave`, and numpy.

- PCM WAV of 8, 16, 24 or 32 bits and any number of channels (averaged to one) at any sample rate. Other encodings
  (float WAV, compressed formats) are refused with a fix: convert them to PCM WAV first.
- Resampling to the processor's rate is band-limited: the signal's spectrum, cut (or zero-extended) at the new
  Nyquist frequency, back to samples (numpy's FFT). Equal rates pass through unchanged.
"""

from __future__ import annotations

import io
import wave

import numpy as np

CONVERT_HINT = "convert it first, e.g. `ffmpeg -i input -ar 16000 -ac 1 -c:a pcm_s16le output.wav`"


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """`(samples, sample_rate)` of a PCM WAV file: float32 samples in [-1, 1], channels averaged.

    Raises:
        ValueError: not a PCM WAV file, or one without samples.
    """
    # -> samples: [num_samples]
    try:
        with wave.open(io.BytesIO(data), "rb") as reader:
            num_channels, width, rate = reader.getnchannels(), reader.getsampwidth(), reader.getframerate()
            frames = reader.readframes(reader.getnframes())
    except (wave.Error, EOFError) as error:
        raise ValueError(f"the file is not a PCM WAV file ({error}); {CONVERT_HINT}") from error
    if width not in (1, 2, 3, 4):
        raise ValueError(f"the WAV file has {8 * width}-bit samples; 8, 16, 24 and 32 bits are read: {CONVERT_HINT}")
    if width == 1:  # unsigned
        samples = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # little-endian 24-bit: placed in the high bytes of an int32, which keeps the sign
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3)
        padded = np.zeros((raw.shape[0], 4), dtype=np.uint8)
        padded[:, 1:] = raw
        samples = padded.view("<i4").reshape(-1).astype(np.float32) / 2.0**31
    else:
        dtype = {2: "<i2", 4: "<i4"}[width]
        samples = np.frombuffer(frames, dtype=dtype).astype(np.float32) / 2.0 ** (8 * width - 1)
    if samples.size < num_channels:
        raise ValueError("the WAV file has no samples: send a recording of some length")
    samples = samples[: samples.size - samples.size % num_channels]
    return samples.reshape(-1, num_channels).mean(axis=1, dtype=np.float32), rate


def resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """`samples` at `source_rate` Hz, band-limited to and sampled at `target_rate` Hz."""
    # samples: [N] -> [round(N * target_rate / source_rate)]
    if source_rate == target_rate:
        return samples
    num_samples = max(1, round(samples.size * target_rate / source_rate))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    resized = np.zeros(num_samples // 2 + 1, dtype=np.complex128)
    kept = min(spectrum.size, resized.size)
    resized[:kept] = spectrum[:kept]
    return (np.fft.irfft(resized, n=num_samples) * (num_samples / samples.size)).astype(np.float32)
