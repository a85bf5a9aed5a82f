"""`POST /v1/completions`: OpenAI's legacy completions, each prompt one request to the engine.

How OpenAI's parameters become `generate` arguments:
- `prompt`: text, tokenized by the checkpoint's tokenizer as `tokenizer(prompt)` does (special tokens included), or
  token ids as given; a list of prompts is one engine request per prompt, and prompt `i`'s `j`-th sequence is
  choice `i * n + j`. For an encoder-decoder model the prompt is the encoder's input (the source text) and the
  completion is the decoder's text; for a decoder-only model the completion continues the prompt.
- `target_prefix` (CTranslate2's name; encoder-decoder models): the decoder starts from its start token, then these
  tokens (`decoder_input_ids`), and the completion continues them. A text is tokenized without special tokens; a
  list of texts or of token-id lists gives one prefix per prompt.
- `max_tokens` -> `max_new_tokens` (default 16, OpenAI's); `min_tokens` -> `min_new_tokens`. `max_tokens=0` with
  `echo` generates nothing: the answer is the echoed tokens and, with `logprobs`, their score (`scoring.py`).
- `temperature`, `top_p`, `top_k`, `n`, beam search (`num_beams`, vLLM's `use_beam_search` and `best_of`,
  `length_penalty`, `early_stopping`) and `repetition_penalty`: `decoding.py`. With beams, a choice also holds
  `sequence_score`, `generate`'s `sequences_scores` of its hypothesis.
- `logprobs`: `generate`'s `output_logits`, as OpenAI's `logprobs` object (`logprobs.py`).
- `echo`: the choice's text starts with the prompt (decoder-only) or the target prefix (encoder-decoder: what the
  decoder was given; the source is another text, often another language); with `logprobs`, their tokens' log
  probabilities come first (`scoring.py`: one more engine request per prompt).
- `stop` -> `stop_strings` (the engine passes the tokenizer); the text is cut before the stop sequence.
- `seed` -> the engine's seed of the request: it samples what `torch.manual_seed(seed)` then `generate` alone does.
- `return_token_ids` (vLLM's): each choice also holds its sequence's own `token_ids` and the `prompt_token_ids`.

A stream sends one chunk per choice and step that adds text, then each choice's last piece with its finish reason,
the usage if `stream_options.include_usage`, and `data: [DONE]` (beam search: each hypothesis's text comes whole, in
its last chunk, once the search ends). A client that disconnects cancels its requests: their seats are free within
one decode step.
"""

from __future__ import annotations

import asyncio
import json
import time

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import bridge
from .decoding import MAX_LOGPROBS, check_scoring_only, decoding_kwargs
from .logprobs import TokenLogprob, choice_logprobs, generated_logprobs
from .schemas import DEFAULT_MAX_TOKENS, APIError, CompletionRequest, completion, completion_choice, new_id, usage
from .scoring import check_scored_tokens, scoring_kwargs
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
    prefixes = target_prefixes(served, body.target_prefix, len(prompts), generates=kwargs is not None)
    job = CompletionJob(served, body, prompts, prefixes, started=started)
    job.submit(kwargs)
    if body.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(job.stream(), media_type="text/event-stream", headers=headers)
    if not await served.wait(job.handles, request):
        served.metrics.client_gone(ROUTE, generated_tokens=0)
        return JSONResponse({}, status_code=499)
    return JSONResponse(job.answer())


def _checked_ids(served, ids: list[int], *, where: str, param: str) -> list[int]:
    if not ids:
        raise APIError(400, f"{where} has no tokens: pass some text or token ids", param=param)
    outside = [token for token in ids if not 0 <= token < served.vocab_size]
    if outside:
        raise APIError(
            400,
            f"{where} holds token ids outside the model's vocabulary ({outside[:5]}; vocab_size="
            f"{served.vocab_size}): pass ids from 0 to {served.vocab_size - 1}",
            param=param,
        )
    return ids


def _items(value, *, name: str) -> list:
    """A text, token ids, or a list of either, as a list of texts or token-id lists."""
    if isinstance(value, str):
        return [value]
    if not value:
        what = name.replace("_", " ")
        raise APIError(400, f"{name}=[] holds no {what}: pass a text, token ids, or a list of either", param=name)
    return [value] if isinstance(value[0], int) else list(value)


def prompt_token_ids(served, prompt) -> list[list[int]]:
    """The token ids of each prompt of `prompt` (a text, token ids, or a list of either)."""
    items = _items(prompt, name="prompt")
    return [
        _checked_ids(
            served,
            served.tokenizer(item)["input_ids"] if isinstance(item, str) else list(item),
            where="prompt" if len(items) == 1 else f"prompt[{index}]",
            param="prompt",
        )
        for index, item in enumerate(items)
    ]


def target_prefixes(served, target_prefix, num_prompts: int, *, generates: bool) -> list[list[int]]:
    """Each prompt's target prefix as token ids (empty lists without one). A prefix that the decoder continues holds
    no end token; one that is only scored (`max_tokens=0`) may end with it."""
    if target_prefix is None:
        return [[] for _ in range(num_prompts)]
    if not served.is_encoder_decoder:
        raise APIError(
            400,
            f"target_prefix starts the decoder of an encoder-decoder model; {served.model_name} "
            f"({served.model_class}) is decoder-only and continues its prompt: append the prefix to the prompt",
            param="target_prefix",
        )
    items = _items(target_prefix, name="target_prefix")
    shared = isinstance(target_prefix, str) or isinstance(target_prefix[0], int)
    if not shared and len(items) != num_prompts:
        raise APIError(
            400,
            f"target_prefix has {len(items)} entries for {num_prompts} prompts: pass one per prompt, or one text "
            "(or token-id list) for all",
            param="target_prefix",
        )
    prefixes = []
    for index, item in enumerate(items if not shared else items * num_prompts):
        where = "target_prefix" if shared else f"target_prefix[{index}]"
        text_ids = served.tokenizer(item, add_special_tokens=False)["input_ids"] if isinstance(item, str) else None
        ids = _checked_ids(
            served, text_ids if text_ids is not None else list(item), where=where, param="target_prefix"
        )
        if generates and served.eos_token_ids & set(ids):
            raise APIError(
                400,
                f"{where} holds the end token {sorted(served.eos_token_ids & set(ids))[0]}: the decoder would continue "
                "past its end; leave it out (an end token may end a prefix that is only scored, with max_tokens=0)",
                param="target_prefix",
            )
        check_scored_tokens(ids, eos_token_ids=served.eos_token_ids, where=where)
        prefixes.append(ids)
    return prefixes


def given_texts(value, count: int) -> list[str | None]:
    """Each prompt's text of `value` (a prompt or a target prefix) as given: None for token ids or no value."""
    if value is None or not isinstance(value, str) and isinstance(value[0], int):
        return [None] * count
    return [value] * count if isinstance(value, str) else [item if isinstance(item, str) else None for item in value]


def generate_kwargs(body: CompletionRequest) -> dict | None:
    """The `generate` arguments of a completion request (see the module docstring); None for `max_tokens=0`, which
    generates nothing."""
    if body.logprobs is not None and body.logprobs > MAX_LOGPROBS:
        raise APIError(
            400,
            f"logprobs={body.logprobs} exceeds {MAX_LOGPROBS} top log probabilities per token: pass at most "
            f"{MAX_LOGPROBS}",
            param="logprobs",
        )
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens == 0:
        if not body.echo:
            raise APIError(
                400,
                "max_tokens=0 generates nothing: pass echo=true (with logprobs) for the score of the echoed tokens, "
                "or max_tokens >= 1",
                param="max_tokens",
            )
        check_scoring_only(body)
        return None
    if body.min_tokens > max_tokens:
        raise APIError(
            400,
            f"min_tokens={body.min_tokens} exceeds max_tokens={max_tokens}: pass min_tokens <= max_tokens",
            param="min_tokens",
        )
    kwargs: dict = {"max_new_tokens": max_tokens, **decoding_kwargs(body)}
    if body.min_tokens:
        kwargs["min_new_tokens"] = body.min_tokens
    if body.stop_sequences:
        kwargs["stop_strings"] = body.stop_sequences
    if kwargs.get("num_beams", 1) > 1:
        kwargs.update(return_dict_in_generate=True, output_scores=True)  # sequences_scores
    if body.logprobs is not None:
        kwargs.update(return_dict_in_generate=True, output_logits=True)
    return kwargs


def capacity_hints(served) -> dict[str, tuple[str, str]]:
    """What a completion request can change instead of the server's capacity flag."""
    positions = (
        "a smaller max_tokens or a shorter target_prefix"
        if served.is_encoder_decoder
        else "a shorter prompt or a smaller max_tokens"
    )
    return {
        "max_batch_size": ("n", "ask for fewer completions (n) or beams (num_beams)"),
        "max_cache_len": ("max_tokens", f"send {positions}"),
        "max_encoder_len": ("prompt", "send a shorter prompt"),
    }


def _sequences(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.sequences


class CompletionJob:
    """One completion request: its engine requests (per prompt, one that generates and, for `echo` with `logprobs`,
    one that scores the echoed tokens), and its answer or stream."""

    def __init__(
        self, served, body: CompletionRequest, prompts: list[list[int]], prefixes: list[list[int]], *, started: float
    ):
        self.served = served
        self.body = body
        self.prompts = prompts
        self.prefixes = prefixes
        echoed = body.target_prefix if served.is_encoder_decoder else body.prompt
        self.given_texts = given_texts(echoed, len(prompts))
        self.started = started
        self.request_id = new_id("cmpl")
        self.max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        self.generation: list = []  # one handle per prompt, when the request generates
        self.scoring: dict[int, object] = {}  # prompt -> the handle scoring its echoed tokens
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

    @property
    def handles(self) -> list:
        return [*self.generation, *self.scoring.values()]

    def echoed(self, prompt: int) -> list[int]:
        """The tokens `echo` returns: the decoder's given tokens (the target prefix, or the prompt)."""
        return self.prefixes[prompt] if self.served.is_encoder_decoder else self.prompts[prompt]

    def scored(self, prompt: int) -> list[int]:
        """The echoed tokens that have a log probability (a decoder-only prompt's first has none)."""
        return self.echoed(prompt) if self.served.is_encoder_decoder else self.prompts[prompt][1:]

    def submit(self, kwargs: dict | None) -> None:
        hints = capacity_hints(self.served)
        submit = self.served.submit
        scores = self.body.echo and self.body.logprobs is not None
        if scores and not self.served.is_encoder_decoder:
            for index in range(len(self.prompts)):
                where = "prompt" if len(self.prompts) == 1 else f"prompt[{index}]"
                check_scored_tokens(self.prompts[index], eos_token_ids=self.served.eos_token_ids, where=where)
        try:
            for index, ids in enumerate(self.prompts):
                if kwargs is not None:
                    input_ids = torch.tensor([ids], dtype=torch.long)
                    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
                    if self.prefixes[index]:
                        start = [self.served.decoder_start_token_id]
                        inputs["decoder_input_ids"] = torch.tensor([start + self.prefixes[index]], dtype=torch.long)
                    self.generation.append(submit(seed=self.body.seed, hints=hints, **inputs, **kwargs))
                if scores and self.scored(index):
                    scoring = scoring_kwargs(self.served, ids, self.scored(index))
                    self.scoring[index] = submit(seed=None, hints=hints, **scoring)
        except BaseException:
            for handle in self.handles:
                handle.cancel()
            raise

    def _skip(self, prompt: int) -> int:
        """Columns of `generate`'s sequences before the new tokens: the decoder's start token and target prefix, or
        the decoder-only prompt."""
        if self.served.is_encoder_decoder:
            return 1 + len(self.prefixes[prompt])
        return len(self.prompts[prompt])

    def new_tokens(self, prompt: int) -> list[list[int]]:
        """Each sequence's new tokens, after the decoder's given tokens."""
        sequences = _sequences(self.generation[prompt].result(timeout=0))
        return sequences[:, self._skip(prompt) :].tolist()

    def _index(self, prompt: int, row: int) -> int:
        return prompt * self.body.n + row

    def _echo_text(self, prompt: int) -> str:
        """The echoed text: as the request gave it, or the echoed token ids decoded."""
        if not self.body.echo:
            return ""
        given = self.given_texts[prompt]
        return (
            given if given is not None else self.served.tokenizer.decode(self.echoed(prompt), skip_special_tokens=True)
        )

    def _echo_logprobs(self, prompt: int) -> list[TokenLogprob]:
        entries = []
        if not self.served.is_encoder_decoder:
            entries.append(TokenLogprob(self.prompts[prompt][0], None, None))
        if prompt in self.scoring:
            output = self.scoring[prompt].result(timeout=0)
            entries += generated_logprobs(output, 0, self.scored(prompt), top=self.body.logprobs)
        return entries

    def _choices(self, prompt: int) -> tuple[list[dict], int]:
        """The choices of one prompt, and their generated tokens."""
        body, echo_text = self.body, self._echo_text(prompt)
        output = self.generation[prompt].result(timeout=0) if self.generation else None
        rows = self.new_tokens(prompt) if output is not None else [[]]
        choices, num_tokens = [], 0
        for row, tokens in enumerate(rows):
            if output is None:
                text, reason, own = "", "length", []
            else:
                text, reason, own = self.sequences[prompt, row].final(tokens, max_tokens=self.max_tokens)
            extra = {}
            if body.logprobs is not None:
                parts = [(0, self._echo_logprobs(prompt))] if body.echo else []
                if output is not None:
                    parts.append((len(echo_text), generated_logprobs(output, row, own, top=body.logprobs)))
                extra["logprobs"] = choice_logprobs(
                    self.served.tokenizer, parts, as_ids=body.return_tokens_as_token_ids
                )
            if output is not None and output_scores(output) is not None:
                extra["sequence_score"] = float(output_scores(output)[row])
            if body.return_token_ids:
                extra.update(token_ids=own, prompt_token_ids=self.prompts[prompt])
            choices.append(completion_choice(self._index(prompt, row), echo_text + text, reason, **extra))
            num_tokens += len(own)
        return choices, num_tokens

    def answer(self) -> dict:
        choices, num_tokens = [], 0
        for prompt in range(len(self.prompts)):
            some, tokens = self._choices(prompt)
            choices += some
            num_tokens += tokens
        prompt_tokens = self._answered(num_tokens)
        return completion(
            request_id=self.request_id,
            model=self.served.model_name,
            choices=choices,
            usage=usage(prompt_tokens, num_tokens),
        )

    def _prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts) + sum(len(ids) for ids in self.prefixes)

    def _answered(self, generated_tokens: int) -> int:
        """Record the answered request in the metrics; returns its prompt tokens."""
        prompt_tokens = self._prompt_tokens()
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
        for key, handle in enumerate(self.generation):
            bridge.follow(handle, key, queue, loop)
        remaining, num_tokens, streamed, answered = set(range(len(self.generation))), 0, 0, False
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
                error = self.generation[prompt].exception(timeout=0)
                if error is not None:
                    failure = self.served.failure(error)
                    self.served.metrics.refused(ROUTE, failure.status_code)
                    answered = True
                    yield f"data: {json.dumps(failure.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                scores = output_scores(self.generation[prompt].result(timeout=0))
                for row, tokens in enumerate(self.new_tokens(prompt)):
                    piece, reason, own = self.sequences[prompt, row].close(tokens, max_tokens=self.max_tokens)
                    num_tokens += len(own)
                    extra = {} if scores is None else {"sequence_score": float(scores[row])}
                    yield self._chunk([completion_choice(self._index(prompt, row), piece, reason, **extra)])
            prompt_tokens = self._prompt_tokens()
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


def output_scores(output) -> torch.Tensor | None:
    """`generate`'s `sequences_scores` (beam search), or None."""
    return None if isinstance(output, torch.Tensor) else output.get("sequences_scores")
