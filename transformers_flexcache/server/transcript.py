"""What Whisper's `generate` returns for one recording, as OpenAI's audio API answers it: text, segments, subtitles.

- `Transcript.of(result, ...)` reads `generate`'s output for one recording: a tensor of token ids (short audio without
  timestamps), or with `return_segments=True` a dict whose `segments[0]` are upstream's segment dicts (`tokens`,
  `start`, `end`, `result`). Each segment's text is `tokenizer.decode(tokens, skip_special_tokens=True)` (Whisper's
  tokenizer drops the timestamp tokens); the text of the whole is the segments' texts joined, so that a stream of
  segments adds up to it.
- The language is the token after the start-of-transcript token in the decoder prompt of the first window (upstream
  keeps it in each segment's `result`): the one asked for, or the one Whisper's generate detected.
- `render(...)` answers each `response_format`: `json` (`{"text", "usage"}`), `text`, `verbose_json` (task, language,
  duration, text, segments, usage), `srt` and `vtt` (one cue per segment).
- Segment fields that upstream's generate does not compute for the served settings are null, never made up:
  `avg_logprob` and `no_speech_prob` (upstream computes them only to decide a fallback, and returns neither), and
  `temperature` when a fallback could have changed it (upstream does not record which temperature decoded a window).
  `compression_ratio` is OpenAI's (the segment text's UTF-8 length over its zlib-compressed length), and `seek` is
  the window's start in feature frames.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
SEGMENT_FORMATS = ("verbose_json", "srt", "vtt")  # the formats that need segments, hence timestamps


@dataclass
class Segment:
    start: float
    end: float
    text: str
    tokens: list[int]
    seek: int | None = None


@dataclass
class Transcript:
    text: str
    segments: list[Segment] = field(default_factory=list)
    language: str | None = None  # the language code ("en"), as Whisper's tokens name it

    @classmethod
    def of(cls, result, *, tokenizer, generation_config, window_starts: list[float], frame_s: float) -> Transcript:
        """The transcript of `generate`'s `result` for one recording.

        Args:
            result: `generate`'s output (see the module docstring).
            tokenizer: the checkpoint's tokenizer.
            generation_config: the model's (its `decoder_start_token_id` and `lang_to_id` name the language).
            window_starts (`list[float]`): each segment's window start in seconds, in order (from the
                `segment_listener`), or empty.
            frame_s (`float`): seconds per feature frame (`hop_length / sampling_rate`), for `seek`.
        """
        if isinstance(result, torch.Tensor) or "segments" not in result:
            sequences = result if isinstance(result, torch.Tensor) else result["sequences"]
            return cls(text=tokenizer.decode(sequences[0], skip_special_tokens=True))
        found = result["segments"][0]
        segments = []
        for index, segment in enumerate(found):
            tokens = segment["tokens"].tolist()
            seek = round(window_starts[index] / frame_s) if index < len(window_starts) else None
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            segments.append(Segment(float(segment["start"]), float(segment["end"]), text, tokens, seek))
        language = _language(found[0]["result"], generation_config) if found else None
        return cls(text="".join(segment.text for segment in segments), segments=segments, language=language)


def _language(row, generation_config) -> str | None:
    """The language code of the token after the start-of-transcript token in `row` (a window's whole sequence)."""
    sequence = row["sequences"] if isinstance(row, dict) else row
    ids = sequence.tolist()
    start = generation_config.decoder_start_token_id
    lang_to_id = getattr(generation_config, "lang_to_id", None) or {}
    if start not in ids or ids.index(start) + 1 >= len(ids):
        return None
    token = ids[ids.index(start) + 1]
    codes = {value: key.strip("<|>") for key, value in lang_to_id.items()}
    return codes.get(token)


def language_name(code: str | None) -> str | None:
    """OpenAI names languages in full ("english"): Whisper's table of codes."""
    if code is None:
        return None
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES.get(code, code)


def compression_ratio(text: str) -> float:
    """OpenAI Whisper's measure of repetition: UTF-8 bytes over zlib-compressed bytes."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def usage(duration_s: float) -> dict:
    return {"type": "duration", "seconds": math.ceil(duration_s)}


def render(
    transcript: Transcript, response_format: str, *, task: str, duration_s: float, temperature: float | None
) -> tuple[str | dict, str]:
    """`(body, media type)` of the answer in `response_format` (see the module docstring)."""
    if response_format == "text":
        return transcript.text, "text/plain"
    if response_format == "json":
        return {"text": transcript.text, "usage": usage(duration_s)}, "application/json"
    if response_format == "srt":
        return _cues(transcript, srt=True), "application/x-subrip"
    if response_format == "vtt":
        return "WEBVTT\n\n" + _cues(transcript, srt=False), "text/vtt"
    segments = [
        {
            "id": index,
            "seek": segment.seek,
            "start": segment.start,
            "end": segment.end,
            "text": segment.text,
            "tokens": segment.tokens,
            "temperature": temperature,
            "avg_logprob": None,
            "compression_ratio": compression_ratio(segment.text),
            "no_speech_prob": None,
        }
        for index, segment in enumerate(transcript.segments)
    ]
    body = {
        "task": task,
        "language": language_name(transcript.language),
        "duration": duration_s,
        "text": transcript.text,
        "segments": segments,
        "usage": usage(duration_s),
    }
    return body, "application/json"


def _cues(transcript: Transcript, *, srt: bool) -> str:
    cues = []
    for index, segment in enumerate(transcript.segments, start=1):
        timing = f"{timestamp(segment.start, srt=srt)} --> {timestamp(segment.end, srt=srt)}"
        cues.append((f"{index}\n" if srt else "") + f"{timing}\n{segment.text.strip()}\n")
    return "\n".join(cues)


def timestamp(seconds: float, *, srt: bool) -> str:
    """`HH:MM:SS,mmm` (SubRip) or `HH:MM:SS.mmm` (WebVTT)."""
    milliseconds = round(seconds * 1000)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    seconds, milliseconds = divmod(milliseconds, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{',' if srt else '.'}{milliseconds:03d}"
