"""The stream of `transformers-flexcache bench`: the calls each strategy runs, and the capacities and buckets they need.

Design decisions:
- One seeded stream of calls per model, with varying batch sizes and prompt (or encoder) lengths, and a fixed
  number of new tokens, greedy, with EOS suppressed at every step (`NoEndOfSequence`), so every call of every
  strategy decodes exactly the same number of steps and the outputs can be compared token for token.
- `NoEndOfSequence` does what `min_new_tokens = max_new_tokens` did, at a fraction of its cost: upstream's two
  processors for it (`MinLengthLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`) each build a vocabulary-sized
  mask with `torch.isin` at every step, about 1 ms each per step at t5-small's 32128 tokens on one core, a fifth of
  a compiled decode step at batch 1, which CTranslate2's own minimum length does not pay. A service does not force a
  minimum length; the benchmark does so that every strategy decodes the same steps, and should not charge it.
- The flexible strategies' capacities fit every call of the stream (`capacities_for`): allocated once, never grown.
- The bucketed strategy's buckets (`bench_buckets`). Encoder-decoder models: rows at one row, a quarter, a half and
  three quarters of the capacity (`serving.buckets.row_buckets` in quarters: 1, 2, 4, 6 and 8 at the default 8), and the encoder length at its capacity only
  where that is at most `ONE_ENCODER_BUCKET_MAX` positions (the default stream's 48): 5 decode graphs. Measured side by
  side on an AMD EPYC Zen 3 (t5-small-sized T5, bucketed compiled, one thread, the 8 calls of the default stream 6
  times, interleaved; a script outside the repo): with rows 1, 4, 8 the encoder's half bucket (24) besides the
  capacity made no difference (the stream summed 1788 against 1729 ms in int8, 3363 against 3334 in fp32, tokens
  equal): at 48 positions a decode step's cross-attention costs nothing measurable beside its linears (the keys and
  values are projected at the call's own length either way), and it doubled the decode graphs (6 against 3, about
  25 s of compiling each). Rows at quarters cut the padding rows of batches 2, 5 and 6: the stream 1711 ms (int8)
  and 3195 (fp32), 4-5% under the 6 graphs of one row, half the rows and half the encoder length, with one graph
  fewer. Over `ONE_ENCODER_BUCKET_MAX` positions (`--max-length`) the half encoder bucket comes back: a step reads
  the whole span's cross-attention keys and values. Decoder-only models: one row and half the rows, and the decoder
  length that a prompt of half the capacity reaches: 6 graphs (finer rows would pass dynamo's 8 per function);
  prompts also at a quarter, a half and three quarters of their capacity, which costs no graph (the prefill runs
  eagerly) and shortens the prefill of short prompts. The one-row bucket is there for the light load of a service:
  on an Intel Xeon (MKL's linears, one thread) opus-mt-sized Marian's compiled step at batch 1 took 15.0 ms in a
  bucket of one row against 21.1 ms in a bucket of 4 (on an AMD EPYC with oneDNN's linears, 18.1 against 18.4 ms:
  no cost there).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

from ..serving.buckets import row_buckets

# An encoder-decoder stream's encoder lengths get one decode bucket, the capacity, up to this many positions (see
# the module docstring: measured at 48).
ONE_ENCODER_BUCKET_MAX = 64

# The stream's shape when the command line does not set it: `--quick`, and the default run.
QUICK_DEFAULTS = {"calls": 6, "max_batch_size": 4, "min_length": 4, "max_length": 16, "new_tokens": 8}
FULL_DEFAULTS = {"calls": 12, "max_batch_size": 8, "min_length": 8, "max_length": 48, "new_tokens": 12}


class NoEndOfSequence(LogitsProcessor):
    """EOS suppressed at every step, so that no row finishes before `max_new_tokens`: the scores and tokens of
    `min_new_tokens = max_new_tokens`, without a vocabulary-sized `torch.isin` per step.

    It runs after upstream's processors (generate appends custom ones): a row where an earlier processor left every
    other score at -inf (BART's forced EOS at the last position, which under `min_new_tokens` overrides the
    suppression too) keeps it.

    Args:
        eos_token_id (`int | list[int] | None`): the model's EOS id(s); None suppresses nothing.
    """

    def __init__(self, eos_token_id):
        ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos_token_id = torch.tensor(sorted(set(ids)), dtype=torch.long)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # scores: [B, V] -> [B, V]
        if not len(self.eos_token_id):
            return scores
        eos = self.eos_token_id.to(scores.device)
        suppressed = scores.index_fill(1, eos, float("-inf"))
        # [B]: only EOS can be chosen (every other score -inf, as a forced EOS leaves them). `amax` rather than
        # `isfinite`: 0.02 against 0.7 ms at 8 x 32128 scores on one thread (AMD EPYC Zen 3), at every step.
        forced = suppressed.amax(dim=-1) == float("-inf")
        if bool(forced.any()):  # rare (a forced EOS): those rows keep their scores
            suppressed = torch.where(forced[:, None], scores, suppressed)
        return suppressed


@dataclass(frozen=True)
class Call:
    batch_size: int
    length: int  # prompt length (decoder-only) or input length (encoder-decoder)
    encoder_len: int | None = None  # encoder positions (encoder-decoder), set once the model is known


def make_stream(*, num_calls: int, max_batch_size: int, min_len: int, max_len: int, seed: int) -> list[Call]:
    """A seeded stream of calls whose batch sizes cycle through 1..max and whose lengths spread evenly over
    min..max, each shuffled: large and small shapes alternate, and both maxima appear when there are enough calls.
    """
    rng = random.Random(seed)
    batches = [1 + i % max_batch_size for i in range(num_calls)]
    steps = max(num_calls - 1, 1)
    lengths = [min_len + round(i * (max_len - min_len) / steps) for i in range(num_calls)]
    rng.shuffle(batches)
    rng.shuffle(lengths)
    return [Call(batch, length) for batch, length in zip(batches, lengths, strict=True)]


def bench_buckets(
    capacities: dict[str, int], *, encoder_decoder: bool, new_tokens: int, min_encoder_len: int | None = None
) -> dict[str, list[int]]:
    """The bucketed strategy's buckets, then each capacity (see the module docstring). Encoder-decoder models: rows at
    one row and quarters of the capacity (`row_buckets(..., parts=4)`); the encoder length at its capacity, and at half of
    it too where the capacity is over `ONE_ENCODER_BUCKET_MAX` and the stream has encoder lengths that short (not
    Whisper's, always 1500). Decoder-only models: one row and half the rows (`row_buckets`), prompts at a quarter, a
    half and three quarters of the capacity, and the decoder length that a prompt of half the capacity reaches
    (prompt + new tokens - 1).

    Generate compiles one decode graph per rows and decoder (or encoder) length bucket: 5 graphs for T5, BART and
    Marian at the default stream, 6 for a decoder-only model, 2 for Whisper (2 rows of capacity, one encoder length).
    Prompt buckets add none (the prefill runs eagerly), they only shorten the prefill of short prompts: on the ~100M
    Llama at 2 threads the stream took 0.97x DynamicCache's time with these three, 1.04x with the half alone (first
    token 183 ms against 236 ms)."""
    if encoder_decoder:
        capacity = capacities["max_encoder_len"]
        half = (capacity + 1) // 2
        used = min_encoder_len is None or min_encoder_len <= half
        encoder = [half] if used and capacity > ONE_ENCODER_BUCKET_MAX else [capacity]
        return {"max_batch_size": row_buckets(capacities["max_batch_size"], parts=4), "max_encoder_len": encoder}
    prompt = capacities["max_prompt_len"]
    half = (prompt + 1) // 2
    return {
        "max_batch_size": row_buckets(capacities["max_batch_size"]),
        "max_prompt_len": sorted({max(1, prompt // 4), half, max(1, 3 * prompt // 4)} - {prompt}),
        "max_cache_len": [half + new_tokens - 1],
    }


def capacities_for(config, stream: list[Call], new_tokens: int) -> dict[str, int]:
    """The `cache_config` capacities that fit every call of `stream`: allocated once, never grown."""
    max_batch = max(call.batch_size for call in stream)
    if config.is_encoder_decoder:
        # The decoder holds its start token and the new tokens; the cross-attention cache the encoder output.
        return {
            "max_batch_size": max_batch,
            "max_cache_len": new_tokens + 1,
            "max_encoder_len": max(call.encoder_len for call in stream),
        }
    max_prompt = max(call.length for call in stream)
    # max_prompt_len only shapes the padded policy's prefill (decoder-only prompts are left-padded to it).
    return {"max_batch_size": max_batch, "max_cache_len": max_prompt + new_tokens, "max_prompt_len": max_prompt}
