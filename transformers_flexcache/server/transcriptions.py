"""`POST /v1/audio/transcriptions`: a WAV file transcribed by a speech model (Whisper), as OpenAI's API does it.

- The form takes OpenAI's fields: `file` (PCM WAV, see `audio.py`), `model`, `language` (passed to Whisper's
  `generate`), `temperature` (0, the default, is greedy; above 0 samples at it), `response_format` (`json`: `{"text":
  ...}`, or `text`). A `prompt` and `stream=true` are refused: neither is served.
- The audio is resampled to the checkpoint's processor's rate and turned into features by the processor itself;
  the text is `batch_decode(generate's sequences, skip_special_tokens=True)`, as `transformers serve` does.
- Audio longer than the processor's window (Whisper's 30 s) is refused, not cut: long-form transcription runs several
  windows one after another, which one engine request does not.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from .audio import read_wav, resample
from .schemas import APIError
from .text import own_tokens

ROUTE = "/v1/audio/transcriptions"
MAX_FILE_BYTES = 25 * 2**20  # OpenAI's limit
RESPONSE_FORMATS = ("json", "text")
router = APIRouter()


@router.post(ROUTE)
async def create_transcription(
    request: Request,
    file: Annotated[UploadFile, File()],
    model: Annotated[str | None, Form()] = None,
    language: Annotated[str | None, Form()] = None,
    prompt: Annotated[str | None, Form()] = None,
    response_format: Annotated[str, Form()] = "json",
    temperature: Annotated[float, Form(ge=0, le=1)] = 0.0,
    stream: Annotated[bool, Form()] = False,
):
    started = time.perf_counter()
    served = request.app.state.served
    served.check_request(model, route=ROUTE, needs="audio")
    if response_format not in RESPONSE_FORMATS:
        raise APIError(
            400,
            f"response_format={response_format!r} is not served: pass one of {list(RESPONSE_FORMATS)}",
            param="response_format",
        )
    if prompt:
        raise APIError(400, "prompt is not supported by this server: leave it out", param="prompt")
    if stream:
        raise APIError(400, "stream=true is not supported for transcriptions: leave it out", param="stream")
    data = await file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise APIError(413, f"the file exceeds {MAX_FILE_BYTES} bytes: send a shorter recording", param="file")
    features = await run_in_threadpool(_features, served.processor, data)
    kwargs = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    if language is not None:
        kwargs["language"] = language
    hints = {"max_cache_len": ("file", ""), "max_encoder_len": ("file", ""), "max_batch_size": ("file", "")}
    features = features.to(served.engine.model.dtype)
    handle = served.submit(seed=None, hints=hints, input_features=features, **kwargs)
    if not await served.wait([handle], request):
        served.metrics.client_gone(ROUTE, generated_tokens=0)
        return JSONResponse({}, status_code=499)
    sequences = handle.result(timeout=0)
    text = served.tokenizer.batch_decode(sequences, skip_special_tokens=True)[0]
    served.metrics.answered(
        ROUTE,
        seconds=time.perf_counter() - started,
        prompt_tokens=0,
        generated_tokens=len(own_tokens(sequences[0].tolist(), eos_token_ids=served.eos_token_ids)[0]),
        handles=[handle],
    )
    if response_format == "text":
        return PlainTextResponse(text)
    return JSONResponse({"text": text})


def _features(processor, data: bytes):
    """The model's `input_features` `[1, num_mel_bins, frames]` of a WAV file, through the checkpoint's processor."""
    extractor = processor.feature_extractor
    try:
        samples, rate = read_wav(data)
    except ValueError as error:
        raise APIError(400, str(error), param="file") from error
    window_s = extractor.n_samples / extractor.sampling_rate
    seconds = samples.size / rate
    if seconds > window_s:
        raise APIError(
            400,
            f"the audio lasts {seconds:.1f} s, longer than the model's window of {window_s:.1f} s: send parts of "
            f"{window_s:.0f} s or less (long-form transcription is not served)",
            param="file",
        )
    samples = resample(samples, rate, extractor.sampling_rate)
    return processor(samples, sampling_rate=extractor.sampling_rate, return_tensors="pt")["input_features"]
