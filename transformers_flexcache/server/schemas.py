"""OpenAI's request bodies, answers and error body, as the server speaks them.

Fields follow OpenAI's API reference (legacy completions, audio transcriptions). `top_k`, `min_tokens`,
`repetition_penalty`, `return_token_ids`, `return_tokens_as_token_ids`, `use_beam_search` and `length_penalty` are
vLLM's extra parameters, under vLLM's names; `num_beams` and `early_stopping` are `generate`'s, and `target_prefix`
CTranslate2's (see `completions.py` and `beams.py`). Unknown fields are refused, as OpenAI's API does ("Unrecognized
request argument"), so that a misspelt parameter is never silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for legacy completions


class APIError(Exception):
    """A request answered with OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.

    Args:
        status_code (`int`): the HTTP status.
        message (`str`): what is wrong, the limit, and the fix.
        type (`str`, *optional*): OpenAI's error type (`"invalid_request_error"`, `"rate_limit_error"`,
            `"server_error"`, ...).
        param (`str`, *optional*): the request field at fault.
        code (`str`, *optional*): a machine-readable code (`"context_length_exceeded"`, `"model_not_found"`, ...).
        headers (`dict`, *optional*): extra response headers (`Retry-After`).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """`POST /v1/completions`. For an encoder-decoder model the prompt is the source text (or its token ids) and the
    completion is the decoder's text; for a decoder-only model the completion continues the prompt."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the score of the echoed tokens
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch.manual_seed takes
    # vLLM's extra sampling parameters
    top_k: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
    return_token_ids: bool = False  # choices then hold `token_ids` (each sequence's own) and `prompt_token_ids`
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:{id}"
    # OpenAI's echo and logprobs (`completions.py`), and beam search (`beams.py`)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = Field(default=None, ge=1)
    use_beam_search: bool = False
    num_beams: int | None = Field(default=None, ge=1)
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    # the decoder's first tokens (encoder-decoder models): a text, token ids, or one of either per prompt
    target_prefix: str | list[int] | list[str] | list[list[int]] | None = None
    # OpenAI's fields that this server refuses unless left at their defaults (see `unsupported`)
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, unused

    def unsupported(self) -> APIError | None:
        """The first field set to something this server does not do, as a 400, or None."""
        why = {
            "suffix": (self.suffix is not None, "there is no fill-in-the-middle"),
            "presence_penalty": (bool(self.presence_penalty), "pass repetition_penalty (generate's) instead"),
            "frequency_penalty": (bool(self.frequency_penalty), "pass repetition_penalty (generate's) instead"),
            "logit_bias": (bool(self.logit_bias), "generate's sequence_bias is not exposed"),
        }
        for name, (is_set, fix) in why.items():
            if is_set:
                value = getattr(self, name)
                return APIError(400, f"{name}={value!r} is not supported by this server: {fix}", param=name)
        for name in ("return_token_ids", "echo", "logprobs"):
            if getattr(self, name) not in (False, None) and self.stream:
                return APIError(400, f"{name} is served without stream only: leave one out", param="stream")
        if isinstance(self.stop, list) and not all(self.stop):
            return APIError(
                400, f"stop={self.stop!r} holds an empty sequence: every stop sequence needs text", param="stop"
            )
        if self.stop == "":
            return APIError(400, "stop='' is empty: pass a sequence of one or more characters", param="stop")
        return None

    @property
    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_choice(
    index: int, text: str, finish_reason: str | None, *, logprobs: dict | None = None, **extra
) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, **extra}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(*, request_id: str, model: str, choices: list[dict], usage: dict | None) -> dict:
    """A completion, or one chunk of a streamed one (the same object, as in OpenAI's API)."""
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "transformers-flexcache"}
