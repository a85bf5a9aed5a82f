"""`POST /v1/audio/transcriptions` and `POST /v1/audio/translations`: a recording transcribed (or translated to
English) by a speech model (Whisper), as OpenAI's audio API does it.

How a request becomes one engine request (docs/serving.md lists every OpenAI field, served or refused, and why):
- `file`: any audio FFmpeg reads (`audio.py`), mixed to one channel and resampled to the processor's rate, then made
  into log-mel features by the checkpoint's processor: one window's worth (padded) for audio up to the window (30 s),
  the whole recording (`truncation=False`, `padding="longest"`) for longer audio, as upstream documents long-form
  input.
- The recording is one engine request running Whisper's own `generate` on it: audio longer than the window is
  upstream's sequential long-form transcription (30 s windows, timestamp tokens, seek, temperature fallback,
  conditioning on previous text), whose windows' encoder, prefill and decode steps the engine batches with every
  other request's. What it returns is what `generate` returns for the recording alone.
- `language` -> `language` (a code or a name, as Whisper's generate takes it); left out, Whisper's generate detects it
  on the first window (multilingual checkpoints), and `verbose_json` says which. Translations pass `task="translate"`,
  transcriptions `task="transcribe"` (where the checkpoint names tasks).
- `prompt` -> `prompt_ids` (the tokenizer's `get_prompt_ids`): text Whisper reads as what came before.
- `temperature` -> `temperature`; the extra field `fallback_temperatures` (comma-separated, vLLM-style extra field)
  makes it upstream's tuple `(temperature, *fallback_temperatures)`, tried in turn where a window fails
  `compression_ratio_threshold` / `logprob_threshold` (extra fields, as upstream names them, as are
  `no_speech_threshold` and `condition_on_prev_tokens`); `seed` seeds the sampling as `torch.manual_seed(seed)`
  before `generate` would.
- `response_format`: `json`, `text`, `verbose_json`, `srt`, `vtt` (`transcript.py`). Segments need timestamps:
  `verbose_json`, `srt`, `vtt`, a stream and long audio run with `return_timestamps=True`; `json` and `text` of audio
  within one window run as upstream's generate does by default (no timestamp tokens).
- `timestamp_granularities[]`: `segment`; `word` is refused (see `WORD_TIMESTAMPS`).
- `stream=true` (transcriptions): server-sent events as OpenAI sends them: a `transcript.text.delta` per segment as
  each window is transcribed (Whisper's generate tells them through its `segment_listener`), then
  `transcript.text.done` with the whole text and usage.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from typing import Annotated

import torch
from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from . import bridge
from .audio import decode_audio
from .schemas import APIError
from .transcript import RESPONSE_FORMATS, SEGMENT_FORMATS, Transcript, render, usage

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
MAX_FILE_BYTES = 25 * 2**20  # OpenAI's limit
MAX_AUDIO_S = 3 * 3600.0  # a compressed file of 25 MB can hold days of audio: decoding stops past this
WORD_TIMESTAMPS = (
    "word timestamps are not served: upstream computes them (generate's return_token_timestamps) from the "
    "cross-attention weights of every decode step, with the whole model switched to eager attention, and the "
    "engine's batched steps neither return one request's attention weights nor may switch the model's attention "
    "under the other requests; pass timestamp_granularities[]=segment"
)
router = APIRouter()


async def _audio_form(
    file: Annotated[UploadFile, File()],
    model: Annotated[str | None, Form()] = None,
    prompt: Annotated[str | None, Form()] = None,
    response_format: Annotated[str, Form()] = "json",
    temperature: Annotated[float, Form(ge=0, le=1)] = 0.0,
    # beyond OpenAI's fields: upstream generate's, under its names (vLLM-style extra fields)
    fallback_temperatures: Annotated[str | None, Form()] = None,
    compression_ratio_threshold: Annotated[float | None, Form(gt=0)] = None,
    logprob_threshold: Annotated[float | None, Form()] = None,
    no_speech_threshold: Annotated[float | None, Form(ge=0, le=1)] = None,
    condition_on_prev_tokens: Annotated[bool | None, Form()] = None,
    seed: Annotated[int | None, Form(ge=-(2**63), le=2**64 - 1)] = None,
) -> dict:
    """The form fields both routes take, parsed and checked by FastAPI (a bad value is a 400 naming its field)."""
    return dict(locals())


AudioForm = Annotated[dict, Depends(_audio_form)]
SHARED_FIELDS = frozenset(inspect.signature(_audio_form).parameters)
# A transcription's own fields (form names) with what a translation, which takes none of them, runs with.
TRANSCRIPTION_ONLY = {
    "language": None,
    "stream": False,
    "timestamp_granularities[]": None,
    "include[]": None,
    "chunking_strategy": None,
}


@router.post(TRANSCRIPTIONS)
async def create_transcription(
    request: Request,
    form: AudioForm,
    language: Annotated[str | None, Form()] = None,
    stream: Annotated[bool, Form()] = False,
    timestamp_granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
    include: Annotated[list[str] | None, Form(alias="include[]")] = None,
    chunking_strategy: Annotated[str | None, Form()] = None,
):
    own = dict(locals())  # this route's own fields
    del own["request"], own["form"]
    return await _serve(request, route=TRANSCRIPTIONS, task="transcribe", fields={**form, **own})


@router.post(TRANSLATIONS)
async def create_translation(request: Request, form: AudioForm):
    defaults = {name.removesuffix("[]"): value for name, value in TRANSCRIPTION_ONLY.items()}
    return await _serve(request, route=TRANSLATIONS, task="translate", fields={**form, **defaults})


# --- the request --------------------------------------------------------------------------------------------------
async def _serve(request: Request, *, route: str, task: str, fields: dict):
    started = time.perf_counter()
    served = request.app.state.served
    served.check_request(fields["model"], route=route, needs="audio")
    await _refuse_unknown_fields(request, route)
    _check_fields(served, fields, task)
    data = await fields["file"].read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise APIError(413, f"the file exceeds {MAX_FILE_BYTES} bytes: send a shorter recording", param="file")
    extractor = served.processor.feature_extractor
    samples = await run_in_threadpool(_samples, data, extractor.sampling_rate)
    features, long_form = await run_in_threadpool(_features, extractor, samples)
    duration_s = samples.size / extractor.sampling_rate
    job = TranscriptionJob(served, fields, task=task, long_form=long_form, duration_s=duration_s, route=route)
    job.submit(features.to(served.engine.model.dtype))
    if fields["stream"]:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(job.stream(started), media_type="text/event-stream", headers=headers)
    if not await served.wait([job.handle], request):
        served.metrics.client_gone(route, generated_tokens=0)
        return JSONResponse({}, status_code=499)
    transcript = job.transcript()
    job.answered(started, transcript)
    body, media_type = render(
        transcript, fields["response_format"], task=task, duration_s=duration_s, temperature=job.segment_temperature
    )
    if isinstance(body, dict):
        return JSONResponse(body)
    return (PlainTextResponse if media_type == "text/plain" else Response)(body, media_type=media_type)


async def _refuse_unknown_fields(request: Request, route: str) -> None:
    """Refuse a form field this route does not take, as OpenAI's API does: a misspelt one is never ignored."""
    known = SHARED_FIELDS | (TRANSCRIPTION_ONLY.keys() if route == TRANSCRIPTIONS else set())
    unknown = sorted(set((await request.form()).keys()) - known)
    if unknown:
        raise APIError(
            400, f"Unrecognized request argument supplied: {', '.join(unknown)} ({route} takes {sorted(known)})"
        )


def _check_fields(served, fields: dict, task: str) -> None:
    """Refuse, before the file is read, what cannot be served (the value, and the fix)."""
    response_format = fields["response_format"]
    if response_format not in RESPONSE_FORMATS:
        raise APIError(
            400,
            f"response_format={response_format!r} is not served: pass one of {list(RESPONSE_FORMATS)}",
            param="response_format",
        )
    granularities = fields["timestamp_granularities"] or []
    for granularity in granularities:
        if granularity == "word":
            raise APIError(400, WORD_TIMESTAMPS, param="timestamp_granularities[]")
        if granularity != "segment":
            raise APIError(
                400,
                f"timestamp_granularities[]={granularity!r} is not a granularity: pass 'segment'",
                param="timestamp_granularities[]",
            )
    if granularities and response_format != "verbose_json":
        raise APIError(
            400,
            "timestamp_granularities[] needs response_format='verbose_json' (as in OpenAI's API)",
            param="timestamp_granularities[]",
        )
    if fields["include"]:
        raise APIError(
            400,
            f"include[]={fields['include']} is not served: token log probabilities are not returned (upstream's "
            "Whisper generate returns none for long-form audio); leave include[] out",
            param="include[]",
        )
    if fields["chunking_strategy"] not in (None, "auto"):
        raise APIError(
            400,
            f"chunking_strategy={fields['chunking_strategy']!r} is not served: audio is cut as Whisper's long-form "
            "generate cuts it (30 s windows, moved on by the timestamps it predicts); leave it out",
            param="chunking_strategy",
        )
    if fields["stream"] and response_format not in ("json", "text"):
        raise APIError(
            400,
            f"stream=true sends text events: response_format={response_format!r} is not streamed; pass json or "
            "text, or leave stream out",
            param="stream",
        )
    generation_config = served.engine.model.generation_config
    if not hasattr(generation_config, "task_to_id") and task == "translate":
        raise APIError(
            400,
            f"{served.model_name} has no translate task (its generation config names no tasks): it cannot serve "
            "/v1/audio/translations",
        )
    fields["temperatures"] = _temperatures(fields["temperature"], fields["fallback_temperatures"])


def _temperatures(temperature: float, fallback: str | None) -> tuple[float, ...]:
    if not fallback:
        return (temperature,)
    try:
        values = [float(value) for value in fallback.split(",")]
    except ValueError as error:
        raise APIError(
            400,
            f"fallback_temperatures={fallback!r} is not a comma-separated list of numbers (e.g. '0.2,0.4,0.6')",
            param="fallback_temperatures",
        ) from error
    temperatures = (temperature, *values)
    if any(not 0 <= value <= 1 for value in values) or list(temperatures) != sorted(temperatures):
        raise APIError(
            400,
            f"fallback_temperatures={fallback!r}: each must be in [0, 1] and above the one before (temperature="
            f"{temperature} first)",
            param="fallback_temperatures",
        )
    return temperatures


def _samples(data: bytes, sampling_rate: int):
    try:
        return decode_audio(data, sampling_rate=sampling_rate, max_seconds=MAX_AUDIO_S)
    except ValueError as error:
        raise APIError(400, str(error), param="file") from error


def _features(extractor, samples) -> tuple[torch.Tensor, bool]:
    """`(input_features [1, mel, frames], long_form)`: one padded window, or the whole recording when longer."""
    long_form = samples.size > extractor.n_samples
    kwargs = {"truncation": False, "padding": "longest"} if long_form else {}
    features = extractor(samples, sampling_rate=extractor.sampling_rate, return_tensors="pt", **kwargs)
    return features["input_features"], long_form


class TranscriptionJob:
    """One recording: its engine request, and its answer or stream."""

    def __init__(self, served, fields: dict, *, task: str, long_form: bool, duration_s: float, route: str):
        self.served, self.fields, self.task, self.route = served, fields, task, route
        self.duration_s = duration_s
        self.extractor = served.processor.feature_extractor
        self.timestamps = long_form or fields["stream"] or fields["response_format"] in SEGMENT_FORMATS
        if self.timestamps and not hasattr(served.engine.model.generation_config, "no_timestamps_token_id"):
            why = (
                f"the audio lasts {duration_s:.1f} s, longer than the model's window of "
                f"{self.extractor.chunk_length} s (long-form transcription predicts timestamps)"
                if long_form
                else "segments (verbose_json, srt, vtt, stream=true) come from predicted timestamps"
            )
            raise APIError(
                400,
                f"{why}, but {served.model_name}'s generation config names no timestamp tokens "
                "(no_timestamps_token_id): send shorter audio as json or text, or serve a checkpoint whose "
                "generation config has them",
                param="file" if long_form else "response_format",
            )
        self.window_starts: list[float] = []
        self.listeners: list = []  # called in the request's thread with each window's segments
        temperatures = fields["temperatures"]
        # Which temperature decoded a window is not recorded by upstream's generate: known only without fallback.
        self.segment_temperature = temperatures[0] if len(temperatures) == 1 else None
        self.handle = None

    def generate_kwargs(self) -> dict:
        fields, served = self.fields, self.served
        temperatures = fields["temperatures"]
        kwargs: dict = {"temperature": temperatures[0] if len(temperatures) == 1 else temperatures}
        generation_config = served.engine.model.generation_config
        if hasattr(generation_config, "task_to_id"):
            kwargs["task"] = self.task
        if fields["language"] is not None:
            kwargs["language"] = fields["language"]
        for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold"):
            if fields[name] is not None:
                kwargs[name] = fields[name]
        if fields["condition_on_prev_tokens"] is not None:
            kwargs["condition_on_prev_tokens"] = fields["condition_on_prev_tokens"]
        if fields["prompt"]:
            kwargs["prompt_ids"] = self._prompt_ids(fields["prompt"])
        if self.timestamps:
            # A timestamp token per `input_stride` frames: seconds per encoder position, and per feature frame.
            frame_s = self.extractor.hop_length / self.extractor.sampling_rate
            kwargs.update(
                return_timestamps=True,
                return_segments=True,
                time_precision=2 * frame_s,
                time_precision_features=frame_s,
                segment_listener=self._heard,
            )
        return kwargs

    def _prompt_ids(self, prompt: str) -> torch.Tensor:
        tokenizer = self.served.tokenizer
        if not hasattr(tokenizer, "get_prompt_ids"):
            raise APIError(
                400, f"{self.served.model_name}'s tokenizer makes no Whisper prompt: leave prompt out", param="prompt"
            )
        try:
            return torch.as_tensor(tokenizer.get_prompt_ids(prompt, return_tensors="np"))
        except ValueError as error:
            raise APIError(400, f"prompt={prompt!r} cannot be a prompt: {error}", param="prompt") from error

    def _heard(self, row: int, segments: list, window_start_s: float) -> None:
        self.window_starts.extend([window_start_s] * len(segments))
        for listener in self.listeners:
            listener([(segment["tokens"].tolist(), window_start_s) for segment in segments])

    def submit(self, features: torch.Tensor) -> None:
        hints = {"max_cache_len": ("file", ""), "max_encoder_len": ("file", ""), "max_batch_size": ("file", "")}
        self.handle = self.served.submit(
            seed=self.fields["seed"], hints=hints, input_features=features, **self.generate_kwargs()
        )

    def transcript(self) -> Transcript:
        return Transcript.of(
            self.handle.result(timeout=0),
            tokenizer=self.served.tokenizer,
            generation_config=self.served.engine.model.generation_config,
            window_starts=self.window_starts,
            frame_s=self.extractor.hop_length / self.extractor.sampling_rate,
        )

    def answered(self, started: float, transcript: Transcript) -> None:
        tokens = sum(len(segment.tokens) for segment in transcript.segments)
        self.served.metrics.answered(
            self.route,
            seconds=time.perf_counter() - started,
            prompt_tokens=0,
            generated_tokens=tokens,
            handles=[self.handle],
        )

    async def stream(self, started: float):
        """OpenAI's transcription events: a `transcript.text.delta` per segment as its window is done, then
        `transcript.text.done`; an error event if the request fails."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self.listeners.append(lambda found: loop.call_soon_threadsafe(queue.put_nowait, ("segments", found)))
        bridge.follow(self.handle, "end", queue, loop, steps=False)
        sent, answered = [], False
        try:
            while True:
                kind, found = await queue.get()
                if kind == "segments":
                    for tokens, _ in found:
                        text = self.served.tokenizer.decode(tokens, skip_special_tokens=True)
                        sent.append(text)
                        yield _event({"type": "transcript.text.delta", "delta": text})
                    continue
                error = self.handle.exception(timeout=0)
                if error is not None:
                    failure = self.served.failure(error)
                    self.served.metrics.refused(self.route, failure.status_code)
                    answered = True
                    yield _event({"type": "error", **failure.body()})
                    return
                transcript = self.transcript()
                self.answered(started, transcript)
                answered = True
                yield _event(
                    {"type": "transcript.text.done", "text": transcript.text, "usage": usage(self.duration_s)}
                )
                return
        finally:
            self.handle.cancel()  # a no-op for a finished one
            if not answered:
                self.served.metrics.client_gone(self.route, generated_tokens=0)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
