"""Uploaded audio files as the float samples a feature extractor takes: decoded by FFmpeg's libraries through PyAV.

- Any container and codec FFmpeg reads: mp3, m4a/aac, ogg/opus, flac, webm, wav (PCM or float), at any rate and
  channel count. The first audio stream is decoded to 32-bit float at the processor's rate by FFmpeg's resampler
  (libswresample), and its channels are averaged (FFmpeg's own downmix weighs stereo by 1/sqrt(2), not 1/2).
- What cannot be served is a `ValueError` that names the problem: an empty file, one that is not audio (no audio
  stream, or data FFmpeg cannot read), one that is damaged or truncated (decoding fails part-way, a compressed stream
  ends before the duration its container declares, or a WAV file holds less data than its header states), one that
  decodes to no samples, or one longer than `max_seconds`.
- Why PyAV and not soundfile: see docs/serving.md ("Audio decoding"); in short, soundfile (libsndfile) reads no m4a/aac
  and no webm, and needs a resampler beside it.

PyAV is imported when the first file is decoded: importing the server imports no FFmpeg.
"""

from __future__ import annotations

import io
import struct

import numpy as np

TRUNCATION_TOLERANCE_S = 0.1  # a compressed stream may end this much before its declared duration (encoder padding)


def decode_audio(data: bytes, *, sampling_rate: int, max_seconds: float) -> np.ndarray:
    """The samples of an audio file: float32 in [-1, 1], one channel (the channels' mean), at `sampling_rate` Hz.

    Args:
        data (`bytes`): the file as uploaded.
        sampling_rate (`int`): the rate the samples are resampled to (the processor's).
        max_seconds (`float`): the longest audio decoded; a longer one is refused before it is all decoded.

    Returns:
        `np.ndarray` `[num_samples]`.

    Raises:
        ValueError: an empty, unreadable, damaged, truncated or silent-by-absence file, or one longer than
            `max_seconds` (the message says which, and what to send instead).
    """
    # -> samples: [num_samples]
    import av

    if not data:
        raise ValueError("the file is empty (0 bytes): send an audio file")
    _check_wav_length(data)
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except av.FFmpegError as error:
        raise ValueError(
            f"the file could not be read as audio ({error.strerror}): it is not audio, is truncated, or is in a "
            "format FFmpeg does not read; send mp3, m4a, ogg, opus, flac, webm or wav"
        ) from error
    with container:
        if not container.streams.audio:
            kinds = sorted({stream.type for stream in container.streams}) or ["none"]
            raise ValueError(
                f"the file holds no audio stream (its streams: {', '.join(kinds)}; format {container.format.name}): "
                "send an audio file"
            )
        stream = container.streams.audio[0]
        declared_s = _declared_seconds(container, stream)
        resampler = av.AudioResampler(format="fltp", rate=sampling_rate)  # planar float, the stream's own layout
        chunks, num_samples = [], 0
        max_samples = int(max_seconds * sampling_rate)
        try:
            for frame in container.decode(stream):
                for converted in resampler.resample(frame):
                    chunks.append(converted.to_ndarray().mean(axis=0, dtype=np.float32))  # [channels, n] -> [n]
                    num_samples += chunks[-1].size
                if num_samples > max_samples:
                    raise ValueError(
                        f"the audio lasts more than {max_seconds:.0f} s, the longest this server transcribes: send "
                        "it in parts"
                    )
            for converted in resampler.resample(None):
                chunks.append(converted.to_ndarray().mean(axis=0, dtype=np.float32))
        except av.FFmpegError as error:
            decoded_s = sum(chunk.size for chunk in chunks) / sampling_rate
            raise ValueError(
                f"the file is damaged or truncated: decoding its {stream.codec_context.name} stream failed after "
                f"{decoded_s:.2f} s ({error.strerror}); send the whole file"
            ) from error
    samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    if samples.size == 0:
        raise ValueError("the file's audio stream holds no samples: send a recording of some length")
    decoded_s = samples.size / sampling_rate
    if declared_s is not None and decoded_s < declared_s - TRUNCATION_TOLERANCE_S:
        raise ValueError(
            f"the file is truncated: its container declares {declared_s:.2f} s of audio but it holds "
            f"{decoded_s:.2f} s; send the whole file"
        )
    return samples


def _declared_seconds(container, stream) -> float | None:
    """The duration the container declares for `stream`, where one is stored in the file (not estimated from its
    size: a truncated file then looks whole)."""
    if stream.duration is not None and stream.time_base is not None and container.format.name not in ("wav", "ogg"):
        # WAV and Ogg durations are derived from what the file holds: FFmpeg computes them from its size or its last
        # page, so they cannot show truncation (WAV's header is checked by `_check_wav_length`).
        return float(stream.duration * stream.time_base)
    return None


def _check_wav_length(data: bytes) -> None:
    """Refuse a RIFF/WAVE file that holds fewer bytes than its header states (FFmpeg would decode the rest silently)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    (riff_size,) = struct.unpack("<I", data[4:8])
    if riff_size not in (0, 0xFFFFFFFF) and riff_size + 8 > len(data):  # 0 and ~0: written by streaming encoders
        raise ValueError(
            f"the WAV file is truncated: its header states {riff_size + 8} bytes but the file has {len(data)}; "
            "send the whole file"
        )
