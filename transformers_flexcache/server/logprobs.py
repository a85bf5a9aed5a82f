"""Log probabilities of a completion's tokens, and OpenAI's `logprobs` object of a choice.

Design decisions:
- A token's log probability is the model's own: `log_softmax` of the logits `generate` returns with
  `output_logits=True`, before any logits processor, temperature or penalty (vLLM's default, `raw_logprobs`;
  CTranslate2's `score_batch` scores the same way). So the figures of a sampled token do not depend on the temperature
  it was sampled at, and a score of given tokens (`scoring.py`) is comparable with those of generated ones.
- Beam search: the logits of a hypothesis's `t`-th token are those of the beam it came from at step `t`
  (`generate`'s `beam_indices`), as `compute_transition_scores` picks them.
- `top_logprobs` holds the `logprobs` most likely tokens of each position and the chosen token (so up to
  `logprobs + 1` entries, as OpenAI and vLLM return them); `logprobs=0` gives the chosen token alone.
- `tokens` are each token decoded on its own, special tokens included (an EOS shows as the tokenizer's EOS text), or
  `"token_id:{id}"` with vLLM's `return_tokens_as_token_ids` (two ids that decode alike then stay apart). `text_offset`
  is where each token's text starts in the choice's text: the length of the decoded text of the tokens before it.

Shape legend: `V` the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position of a choice: its token, the token's log probability and the most likely tokens there (None for
    a decoder-only prompt's first token, which nothing precedes)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None


def logprobs_at(logits: torch.Tensor, token: int, *, top: int) -> TokenLogprob:
    """The log probability of `token` under `logits`, and the `top` most likely tokens."""
    # logits: [V]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(top) if top else (logprobs[:0], torch.empty(0, dtype=torch.long))
    return TokenLogprob(token, float(logprobs[token]), tuple(zip(ids.tolist(), values.tolist(), strict=True)))


def generated_logprobs(output, row: int, tokens: list[int], *, top: int) -> list[TokenLogprob]:
    """The log probabilities of `tokens`, sequence `row`'s own new tokens in `generate`'s `output` (returned with
    `return_dict_in_generate=True, output_logits=True`)."""
    beam_indices = output.get("beam_indices")
    entries = []
    for step, token in enumerate(tokens):
        source = row if beam_indices is None else int(beam_indices[row, step])
        entries.append(logprobs_at(output.logits[step][source], token, top=top))
    return entries


def token_text(tokenizer, token: int, *, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else tokenizer.decode([token], skip_special_tokens=False)


def choice_logprobs(tokenizer, parts: list[tuple[int, list[TokenLogprob]]], *, as_ids: bool) -> dict:
    """OpenAI's `logprobs` of a choice whose text is made of `parts`: `(where the part's text starts in the choice's
    text, its tokens)`, such as the echoed prompt then the completion."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for start, entries in parts:
        ids = [entry.token for entry in entries]
        for index, entry in enumerate(entries):
            name = token_text(tokenizer, entry.token, as_ids=as_ids)
            tokens.append(name)
            token_logprobs.append(entry.logprob)
            if entry.top is None:
                top_logprobs.append(None)
            else:
                top = {token_text(tokenizer, token, as_ids=as_ids): value for token, value in entry.top}
                top.setdefault(name, entry.logprob)
                top_logprobs.append(top)
            text_offset.append(start + len(tokenizer.decode(ids[:index], skip_special_tokens=True)))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
