"""The score of given tokens: log probabilities of an echoed target prefix (or prompt), by forced decoding on the engine.

OpenAI's way to score a text is `echo=true, max_tokens=0, logprobs=k` (the log probabilities of the prompt); for a
translation model the echoed text is the target (`target_prefix`), scored given the source, as CTranslate2's
`score_batch` does.

Design decisions:
- The engine runs `generate`, which computes no log probabilities for the tokens it is given. So the tokens to score
  are decoded one step each, forced (`ForcedTokens`: each step's scores are replaced by one that allows the given
  token only), with `output_logits=True`: the logits of step `t` are the model's for the `t`-th given token after
  those before it, what one teacher-forced forward computes, within float tolerance. The request is an engine request
  like any other: its steps are batched with the others'.
- The forced request is greedy and one row, whatever the completion asks; its scores replace the processed ones, so
  no processor of the checkpoint's generation config (a forced EOS, a minimum length) can change its path.
- Encoder-decoder: the decoder starts from its start token, then the tokens are forced. Decoder-only: the prompt's
  first token is the input, the others are forced; the first has no log probability (OpenAI's `None`).
- An end token (EOS) is allowed as the last token only: `generate` stops there, so a given EOS before the end would
  leave the tokens after it unscored (an EOS at the end scores the translation's end, as `score_batch` does).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from .schemas import APIError


class ForcedTokens(LogitsProcessor):
    """Scores that allow exactly the given token at each step (0 for it, -inf elsewhere).

    Args:
        tokens (`list[int]`): the tokens to force, one per step.
        start (`int`): the length of the decoder's input before the first forced step.
    """

    def __init__(self, tokens: list[int], *, start: int):
        self.tokens = tokens
        self.start = start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # input_ids: [1, start + t], scores: [1, V] -> [1, V]
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.start]] = 0.0
        return forced


def check_scored_tokens(tokens: list[int], *, eos_token_ids: set[int], where: str) -> None:
    """Refuse tokens holding an end token before their last one (see the module docstring)."""
    early = [index for index, token in enumerate(tokens[:-1]) if token in eos_token_ids]
    if early:
        raise APIError(
            400,
            f"{where} holds the end token {tokens[early[0]]} at position {early[0]}, before its last token: the "
            "decoder would end there; pass the tokens up to it (an end token may come last)",
            param="target_prefix" if where.startswith("target_prefix") else "prompt",
        )


def scoring_kwargs(served, prompt: list[int], tokens: list[int]) -> dict:
    """`Engine.submit`'s arguments for the log probabilities of `tokens`: the target after `prompt`'s source
    (encoder-decoder), or the prompt's tokens after its first (decoder-only, `tokens` being `prompt[1:]`)."""
    start = served.decoder_start_token_id if served.is_encoder_decoder else None
    input_ids = torch.tensor([prompt if served.is_encoder_decoder else prompt[:1]], dtype=torch.long)
    kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if served.is_encoder_decoder:
        kwargs["decoder_input_ids"] = torch.tensor([[start]], dtype=torch.long)
    return {
        **kwargs,
        "max_new_tokens": len(tokens),
        "do_sample": False,
        "num_beams": 1,
        "logits_processor": LogitsProcessorList([ForcedTokens(tokens, start=1)]),
        "output_logits": True,
        "return_dict_in_generate": True,
    }
