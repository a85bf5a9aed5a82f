"""`POST /v1/completions`: OpenAI's legacy completions, each prompt one request to the engine.

How OpenAI's parameters become `generate` arguments:
- `prompt`: text, tokenized by the checkpoint's tokenizer as `tokenizer(prompt)` does (special tokens included), or
  token ids as given; a list of prompts is one engine request per prompt, and prompt `i`'s `j`-th sequence is
  choice `i * n + j`. For an encoder-decoder model the prompt is the encoder's input (the source text) and the
  completion is the decoder's text; for a decoder-only model the completion continues the prompt.
- `max_tokens` -> `max_new_tokens` (default 16, OpenAI's); `min_tokens` -> `min_new_tokens`.
- `temperature`: 0 -> `do_sample=False` (greedy); above 0 -> `do_sample=True` at that temperature; left out, the
  checkpoint's generation config decides, as in `generate`. `top_p`, `top_k`, `repetition_penalty` as given
  (`top_p` and `top_k` are left out when greedy).
- `n` -> `num_return_sequences` with `do_sample=True`: OpenAI's n samples (n > 1 with temperature 0 is refused).
- `stop` -> `stop_strings` (the engine passes the tokenizer); the text is cut before the stop sequence.
- `seed` -> the engine's seed of the request: it samples what `torch.manual_seed(seed)` then `generate` alone does.
- `return_token_ids` (vLLM's): each choice also holds its sequence's own `token_ids` and the `prompt_token_ids`.

A stream sends one chunk per choice and step that adds text, then each choice's last piece with its finish reason,
the usage if `stream_options.include_usage`, and `data: [DONE]`. A client that disconnects cancels its requests: their
seats are free within one decode step.
"""

from __future__ import annotations

import asyncio
import json
import time

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import bridge
from .schemas import DEFAULT_MAX_TOKENS, APIError, CompletionRequest, completion, completion_choice, new_id, usage
from .text import Sequence

ROUTE = "/v1/completions"
router = APIRouter()


@router.post(ROUTE)
async def create_completion(body: CompletionRequest, request: Request):
    started = time.perf_counter()
    served = request.app.state.served
    served.check_request(body.model, route=ROUTE, needs="text")
    refusal = body.unsupported()
    if refusal is not None:
        raise refusal
    prompts = prompt_token_ids(served, body.prompt)
    kwargs = generate_kwargs(body)
    job = CompletionJob(served, body, prompts, started=started)
    job.submit(kwargs)
    if body.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(job.stream(), media_type="text/event-stream", headers=headers)
    if not await served.wait(job.handles, request):
        served.metrics.client_gone(ROUTE, generated_tokens=0)
        return JSONResponse({}, status_code=499)
    return JSONResponse(job.answer())


def prompt_token_ids(served, prompt) -> list[list[int]]:
    """The token ids of each prompt of `prompt` (a text, token ids, or a list of either)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt=[] holds no prompt: pass a text, token ids, or a list of either", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    prompts = []
    for index, item in enumerate(prompt):
        ids = served.tokenizer(item)["input_ids"] if isinstance(item, str) else list(item)
        where = "prompt" if len(prompt) == 1 else f"prompt[{index}]"
        if not ids:
            raise APIError(400, f"{where} has no tokens: pass some text or token ids", param="prompt")
        outside = [token for token in ids if not 0 <= token < served.vocab_size]
        if outside:
            raise APIError(
                400,
                f"{where} holds token ids outside the model's vocabulary ({outside[:5]}; vocab_size="
                f"{served.vocab_size}): pass ids from 0 to {served.vocab_size - 1}",
                param="prompt",
            )
        prompts.append(ids)
    return prompts


def generate_kwargs(body: CompletionRequest) -> dict:
    """The `generate` arguments of a completion request (see the module docstring)."""
    max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
    if body.min_tokens > max_tokens:
        raise APIError(
            400,
            f"min_tokens={body.min_tokens} exceeds max_tokens={max_tokens}: pass min_tokens <= max_tokens",
            param="min_tokens",
        )
    kwargs: dict = {"max_new_tokens": max_tokens}
    if body.min_tokens:
        kwargs["min_new_tokens"] = body.min_tokens
    greedy = body.temperature == 0
    if greedy:
        if body.n > 1:
            raise APIError(
                400,
                f"n={body.n} with temperature=0 would be {body.n} copies of one greedy completion: pass temperature > 0 "
                "to sample n completions, or n=1",
                param="n",
            )
        kwargs["do_sample"] = False
    elif body.temperature is not None:
        kwargs.update(do_sample=True, temperature=body.temperature)
    if body.n > 1:
        kwargs.update(do_sample=True, num_return_sequences=body.n)
    if not greedy:
        for name in ("top_p", "top_k"):
            if getattr(body, name) is not None:
                kwargs[name] = getattr(body, name)
    if body.repetition_penalty is not None:
        kwargs["repetition_penalty"] = body.repetition_penalty
    if body.stop_sequences:
        kwargs["stop_strings"] = body.stop_sequences
    return kwargs


def capacity_hints(served) -> dict[str, tuple[str, str]]:
    """What a completion request can change instead of the server's capacity flag."""
    positions = "a smaller max_tokens" if served.is_encoder_decoder else "a shorter prompt or a smaller max_tokens"
    return {
        "max_batch_size": ("n", "ask for fewer completions (n)"),
        "max_cache_len": ("max_tokens", f"send {positions}"),
        "max_encoder_len": ("prompt", "send a shorter prompt"),
    }


class CompletionJob:
    """One completion request: its engine requests (one per prompt), and its answer or stream."""

    def __init__(self, served, body: CompletionRequest, prompts: list[list[int]], *, started: float):
        self.served = served
        self.body = body
        self.prompts = prompts
        self.started = started
        self.request_id = new_id("cmpl")
        self.max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
        self.handles: list = []
        self.sequences = {
            (prompt, row): Sequence(
                served.tokenizer,
                stop=body.stop_sequences,
                eos_token_ids=served.eos_token_ids,
                pad_token_id=served.pad_token_id,
            )
            for prompt in range(len(prompts))
            for row in range(body.n)
        }

    def submit(self, kwargs: dict) -> None:
        hints = capacity_hints(self.served)
        try:
            for ids in self.prompts:
                input_ids = torch.tensor([ids], dtype=torch.long)
                handle = self.served.submit(
                    seed=self.body.seed,
                    hints=hints,
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    **kwargs,
                )
                self.handles.append(handle)
        except BaseException:
            for handle in self.handles:
                handle.cancel()
            raise

    def new_tokens(self, prompt: int) -> list[list[int]]:
        """Each sequence's new tokens: `generate` returns decoder-only prompts with them, and encoder-decoder
        sequences after the decoder start token."""
        sequences = self.handles[prompt].result(timeout=0)
        skip = 1 if self.served.is_encoder_decoder else len(self.prompts[prompt])
        return sequences[:, skip:].tolist()

    def _index(self, prompt: int, row: int) -> int:
        return prompt * self.body.n + row

    def answer(self) -> dict:
        choices, num_tokens = [], 0
        for prompt in range(len(self.prompts)):
            for row, tokens in enumerate(self.new_tokens(prompt)):
                text, reason, own = self.sequences[prompt, row].final(tokens, max_tokens=self.max_tokens)
                extra = (
                    {"token_ids": own, "prompt_token_ids": self.prompts[prompt]} if self.body.return_token_ids else {}
                )
                choices.append(completion_choice(self._index(prompt, row), text, reason, **extra))
                num_tokens += len(own)
        prompt_tokens = self._answered(num_tokens)
        return completion(
            request_id=self.request_id,
            model=self.served.model_name,
            choices=choices,
            usage=usage(prompt_tokens, num_tokens),
        )

    def _answered(self, generated_tokens: int) -> int:
        """Record the answered request in the metrics; returns its prompt tokens."""
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        self.served.metrics.answered(
            ROUTE,
            seconds=time.perf_counter() - self.started,
            prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens,
            handles=self.handles,
        )
        return prompt_tokens

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = completion(request_id=self.request_id, model=self.served.model_name, choices=choices, usage=usage)
        return f"data: {json.dumps(body)}\n\n"

    async def stream(self):
        """The server-sent events of the answer; cancels the requests if the client goes (or anything fails)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for key, handle in enumerate(self.handles):
            bridge.follow(handle, key, queue, loop)
        remaining, num_tokens, streamed, answered = set(range(len(self.handles))), 0, 0, False
        try:
            while remaining:
                prompt, tokens = await queue.get()
                if tokens is not bridge.END:
                    streamed += len(tokens)
                    for row, token in enumerate(tokens):
                        piece = self.sequences[prompt, row].push(token)
                        if piece:
                            yield self._chunk([completion_choice(self._index(prompt, row), piece, None)])
                    continue
                remaining.discard(prompt)
                error = self.handles[prompt].exception(timeout=0)
                if error is not None:
                    failure = self.served.failure(error)
                    self.served.metrics.refused(ROUTE, failure.status_code)
                    answered = True
                    yield f"data: {json.dumps(failure.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                for row, tokens in enumerate(self.new_tokens(prompt)):
                    piece, reason, own = self.sequences[prompt, row].close(tokens, max_tokens=self.max_tokens)
                    num_tokens += len(own)
                    yield self._chunk([completion_choice(self._index(prompt, row), piece, reason)])
            prompt_tokens = sum(len(ids) for ids in self.prompts)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield self._chunk([], usage(prompt_tokens, num_tokens))
            yield "data: [DONE]\n\n"
            answered = True
            self._answered(num_tokens)
        finally:
            for handle in self.handles:
                handle.cancel()  # a no-op for a finished one; frees the seats of the others within a step
            if not answered:
                self.served.metrics.client_gone(ROUTE, generated_tokens=streamed)
