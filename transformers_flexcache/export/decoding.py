"""Decoding with exported programs: greedy or sampled, as upstream's `generate` decodes.

Shapes as in `transformers_flexcache.export`.

Design decisions:
- Sampling uses upstream's own logits warpers (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, in
  upstream's order) and draws with `torch.multinomial` on the softmax, one draw per step for the whole batch, as
  `GenerationMixin._sample` does. Upstream draws from torch's global generator and nothing else in `generate` draws
  (eval mode: no dropout), so `torch.manual_seed(s)` before each call gives the same tokens as
  `model.generate(do_sample=True, ...)` after `torch.manual_seed(s)`, whenever the logits agree closely enough that
  no draw falls on a different side of a cumulative-probability boundary. `generator=` draws from another generator.
- The defaults of `temperature`, `top_k`, `top_p` are `GenerationConfig`'s (1.0, 50, 1.0).
- Finished rows (after `eos_token_id`) get `pad_token_id` and keep running until every row is finished, as upstream.
- `logits_processor=` takes upstream's own processors (`LogitsProcessor`s called as `processor(sequences, scores)`,
  with the sequences so far: prompt or start token, then the new tokens), applied after the forced EOS and before
  the sampling warpers, where `generate(logits_processor=...)` applies a caller's.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .runners import ProgramRunner, counted_position_ids


def _warpers(do_sample: bool, temperature: float, top_k: int | None, top_p: float) -> LogitsProcessorList:
    warpers = LogitsProcessorList()
    if not do_sample:
        return warpers
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 when sampling; pass do_sample=False for greedy")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    return warpers


def generate(
    runner: ProgramRunner,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    input_features: torch.Tensor | None = None,
    flattened_patches: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = 50,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    decoder_start_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    forced_eos_token_id: int | None = None,
    logits_processor: LogitsProcessorList | None = None,
    output_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Decode with exported programs, as `model.generate(num_beams=1, ...)` decodes (greedy or sampling).

    Args:
        runner: `ExportedPrograms` or `ExecuTorchPrograms`.
        input_ids (`torch.LongTensor`, *optional*): `[B, L_enc]` encoder tokens, or `[B, P]` a left-padded prompt
            (decoder-only).
        attention_mask (`torch.LongTensor`, *optional*): `[B, L_enc]` (encoder-decoder) or `[B, P]`; all ones if not
            given.
        input_features, flattened_patches, encoder_hidden_states (`torch.FloatTensor`, *optional*): the encoder
            input of a program exported with that `encoder_input`, instead of `input_ids`.
        max_new_tokens (`int`): tokens to generate at most.
        do_sample (`bool`, *optional*, defaults to `False`): sample instead of taking the argmax.
        temperature (`float`), top_k (`int`), top_p (`float`): upstream's sampling warpers (defaults as
            `GenerationConfig`); ignored without `do_sample`.
        generator (`torch.Generator`, *optional*): what sampling draws from; torch's global generator if not given,
            as upstream's `generate`.
        decoder_start_token_id (`int`): first decoder token (encoder-decoder only).
        eos_token_id (`int`, *optional*): a row that produced it is finished and gets `pad_token_id` afterwards;
            decoding stops when every row is finished.
        pad_token_id (`int`, *optional*): defaults to `eos_token_id`.
        forced_eos_token_id (`int`, *optional*): the last token allowed by `max_new_tokens` is this one for every
            unfinished row, as generate's `ForcedEOSTokenLogitsProcessor` does (BART checkpoints set it). No other
            logits processor is applied but those of `logits_processor`.
        logits_processor (`LogitsProcessorList`, *optional*): upstream logits processors (e.g.
            `MinNewTokensLengthLogitsProcessor`, `SuppressTokensAtBeginLogitsProcessor`) applied to each step's
            scores `[B, V]` with the sequences so far, after the forced EOS and before the sampling warpers.
        output_logits (`bool`, *optional*, defaults to `False`): also return each step's raw logits, as `generate`'s
            `output_logits=True` does.

    Returns:
        `torch.LongTensor`: `[B, 1 + N]` decoder tokens (start token first), or `[B, P + N]` prompt and new tokens,
        `N <= max_new_tokens`: what `generate` returns. With `output_logits=True`, also a tuple of N `[B, V]` logits.

    Raises:
        ValueError: the generation would need more positions than `max_cache_len`, inputs exceed a capacity, not
            exactly the encoder input that the program takes, or invalid sampling parameters.
    """
    # input_ids: [B, L] -> [B, 1 + N] (encoder-decoder) or [B, P + N] (decoder-only)
    warpers = _warpers(do_sample, temperature, top_k, top_p)
    given = {
        "input_ids": input_ids,
        "input_features": input_features,
        "flattened_patches": flattened_patches,
        "encoder_hidden_states": encoder_hidden_states,
    }
    given = {name: value for name, value in given.items() if value is not None}
    wanted = runner.encoder_input if runner.is_encoder_decoder else "input_ids"
    if list(given) != [wanted]:
        raise ValueError(f"this program takes {wanted}, got {sorted(given) or 'no input'}; pass {wanted}")
    if runner.is_encoder_decoder and decoder_start_token_id is None:
        raise ValueError("decoder_start_token_id is required for an encoder-decoder program")
    first = given[wanted]
    num_prefix = 1 if runner.is_encoder_decoder else first.shape[1]
    # The last new token is returned, never fed back: positions used = prefix + new tokens - 1.
    needed = num_prefix + max_new_tokens - 1
    if needed > runner.capacities["max_cache_len"]:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} after {num_prefix} prefix tokens needs max_cache_len={needed}, but the "
            f"program has max_cache_len={runner.capacities['max_cache_len']}; export it again with "
            f"max_cache_len={needed} or more"
        )
    step = _encoder_decoder_steps if runner.is_encoder_decoder else _decoder_only_steps
    steps = step(runner, first, attention_mask, decoder_start_token_id)
    sequences, logits = next(steps)
    pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
    finished = torch.zeros(sequences.shape[0], dtype=torch.bool)
    step_logits = []
    for index in range(max_new_tokens):
        step_logits.append(logits)  # [B, V]
        scores = logits.float()
        if forced_eos_token_id is not None and index == max_new_tokens - 1:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, forced_eos_token_id] = 0
        if logits_processor is not None:
            scores = logits_processor(sequences, scores)
        scores = warpers(sequences, scores)
        if do_sample:
            next_tokens = torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=generator).squeeze(1)
        else:
            next_tokens = scores.argmax(-1)  # [B]
        if eos_token_id is not None:
            next_tokens = next_tokens.masked_fill(finished, pad_token_id)
            finished |= next_tokens == eos_token_id
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)
        if index == max_new_tokens - 1 or bool(finished.all()):
            break
        logits = steps.send(next_tokens)
    steps.close()
    return (sequences, tuple(step_logits)) if output_logits else sequences


def _encoder_decoder_steps(runner, encoder_input, attention_mask, decoder_start_token_id):
    """Yields (start tokens, logits of the first step), then the logits after each token sent."""
    batch_size = encoder_input.shape[0]
    masked = runner.encoder_input != "input_features"
    if masked and attention_mask is None:
        encoder_len = encoder_input.shape[1]
        attention_mask = torch.ones(batch_size, encoder_len, dtype=torch.long)
    mask = (attention_mask,) if masked else ()
    encoder_hidden_states = runner.encoder(encoder_input, *mask)
    tokens = torch.full((batch_size, 1), decoder_start_token_id, dtype=torch.long)
    position = 0
    next_tokens = yield (
        tokens,
        runner.text_decoder(tokens, encoder_hidden_states, torch.tensor([position]), *mask)[:, -1],
    )
    while True:
        position += 1
        logits = runner.text_decoder(next_tokens[:, None], encoder_hidden_states, torch.tensor([position]), *mask)
        next_tokens = yield logits[:, -1]


def _decoder_only_steps(runner, input_ids, attention_mask, _):
    """Yields (prompt, logits of its last position), then the logits after each token sent."""
    batch_size, prompt_len = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    full_mask = torch.zeros(batch_size, runner.capacities["max_cache_len"], dtype=torch.long)
    full_mask[:, :prompt_len] = attention_mask
    # Every position's id at once (the positions after the prompt will hold tokens): what the runners check.
    sequence_mask = full_mask.clone()
    sequence_mask[:, prompt_len:] = 1
    position_ids = counted_position_ids(sequence_mask)
    cache_position = torch.arange(prompt_len)
    logits = runner.prefill(input_ids, full_mask, position_ids[:, :prompt_len], cache_position)
    next_tokens = yield input_ids, logits[:, -1]
    position = prompt_len
    while True:
        full_mask[:, position] = 1
        logits = runner.decode(
            next_tokens[:, None], full_mask, position_ids[:, position : position + 1], torch.tensor([position])
        )
        position += 1
        next_tokens = yield logits[:, -1]


def greedy_generate(runner: ProgramRunner, *args, **kwargs):
    """`generate(runner, ..., do_sample=False)`: greedy decoding, as `model.generate(do_sample=False)`."""
    return generate(runner, *args, **kwargs, do_sample=False)
