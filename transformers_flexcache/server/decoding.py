"""How a completion's tokens are chosen: OpenAI's, vLLM's and `generate`'s fields as `generate`'s decoding arguments.

Design decisions:
- `temperature`: 0 -> greedy (`do_sample=False`); above 0 -> sampling at that temperature; left out, the checkpoint's
  generation config decides, as in `generate`. `top_p` and `top_k` go with it (left out when greedy).
- Beam search is `generate`'s: the beam width is `num_beams` (`generate`'s name) or, with vLLM's `use_beam_search`,
  `best_of` (vLLM's older API) or else `n` (vLLM's current one). `n` hypotheses come back, best first
  (`num_return_sequences`), so `n` may not exceed the width. `length_penalty` and `early_stopping` are
  `generate`'s. With a temperature above 0 it is `generate`'s beam sampling (`do_sample=True` with beams), not vLLM's
  temperature-scaled deterministic beam search.
- Without beams, `n > 1` is OpenAI's `n` samples (`do_sample=True, num_return_sequences=n`); with `temperature=0` it
  would be `n` copies of one greedy completion, so it is refused. OpenAI's `best_of` (sample `best_of`, return the `n`
  of highest mean log probability) is not served: without beam search, `best_of` other than `n` is refused.
- A field that would change nothing is refused, not dropped: `length_penalty` or `early_stopping` without beams,
  `n` above the beam width, `best_of` and `num_beams` that disagree.
"""

from __future__ import annotations

from .schemas import APIError

MAX_LOGPROBS = 20  # top log probabilities per token at most (vLLM's default `max_logprobs`)


def beam_width(body) -> int:
    """The request's number of beams (1: no beam search), its fields checked against each other."""
    if body.num_beams is not None:
        if body.use_beam_search and body.best_of not in (None, body.num_beams):
            raise APIError(
                400,
                f"best_of={body.best_of} and num_beams={body.num_beams} both set the beam width: pass one of them",
                param="best_of",
            )
        return body.num_beams
    if body.use_beam_search:
        return body.best_of if body.best_of is not None else body.n
    return 1


def decoding_kwargs(body) -> dict:
    """`generate`'s decoding arguments for a completion request (see the module docstring).

    Raises:
        APIError: 400 for fields that contradict each other or would change nothing.
    """
    width = beam_width(body)
    beams = width > 1
    if not beams:
        for name in ("length_penalty", "early_stopping"):
            if getattr(body, name) is not None:
                raise APIError(
                    400,
                    f"{name}={getattr(body, name)!r} applies to beam search only: pass num_beams > 1 (or "
                    "use_beam_search with n or best_of > 1), or leave it out",
                    param=name,
                )
        if not body.use_beam_search and body.best_of not in (None, body.n):
            raise APIError(
                400,
                f"best_of={body.best_of} is not served without beam search (OpenAI's best_of samples best_of "
                "completions and keeps the n most likely): ask for n completions with logprobs and choose yourself, "
                "or pass use_beam_search=true to make best_of the beam width",
                param="best_of",
            )
    elif body.n > width:
        raise APIError(
            400,
            f"n={body.n} exceeds the beam width {width}: beam search returns at most num_beams hypotheses; pass "
            f"num_beams >= {body.n}",
            param="n",
        )
    greedy = body.temperature == 0
    kwargs: dict = {}
    if greedy:
        if body.n > 1 and not beams:
            raise APIError(
                400,
                f"n={body.n} with temperature=0 would be {body.n} copies of one greedy completion: pass temperature > 0 "
                f"to sample n completions, num_beams >= {body.n} for the n best hypotheses of beam search, or n=1",
                param="n",
            )
        kwargs["do_sample"] = False
    elif body.temperature is not None:
        kwargs.update(do_sample=True, temperature=body.temperature)
    if beams:
        kwargs["num_beams"] = width
        if body.n > 1:
            kwargs["num_return_sequences"] = body.n
        if body.length_penalty is not None:
            kwargs["length_penalty"] = body.length_penalty
        if body.early_stopping is not None:
            kwargs["early_stopping"] = body.early_stopping
    elif body.n > 1:
        kwargs.update(do_sample=True, num_return_sequences=body.n)
    if not greedy:
        for name in ("top_p", "top_k"):
            if getattr(body, name) is not None:
                kwargs[name] = getattr(body, name)
    if body.repetition_penalty is not None:
        kwargs["repetition_penalty"] = body.repetition_penalty
    return kwargs


# Fields that only change generated tokens: refused with max_tokens=0, which generates none (a score of the echoed
# tokens). temperature, top_p, top_k, seed and repetition_penalty are accepted there, as OpenAI accepts them: nothing
# is sampled, and log probabilities are the model's own (before any processor).
GENERATION_ONLY = ("num_beams", "use_beam_search", "best_of", "length_penalty", "early_stopping", "stop")


def check_scoring_only(body) -> None:
    """Refuse the fields that a request generating nothing (`max_tokens=0`) would ignore."""
    if body.n > 1:
        raise APIError(400, f"n={body.n} with max_tokens=0: a score is one choice per prompt; pass n=1", param="n")
    if body.min_tokens:
        raise APIError(400, f"min_tokens={body.min_tokens} exceeds max_tokens=0: leave it out", param="min_tokens")
    for name in GENERATION_ONLY:
        if getattr(body, name) not in (None, False):
            raise APIError(
                400,
                f"{name}={getattr(body, name)!r} applies to generated tokens, and max_tokens=0 generates none: leave "
                "it out, or pass max_tokens >= 1",
                param=name,
            )
