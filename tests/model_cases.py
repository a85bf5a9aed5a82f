"""Tiny seeded models for the tests, one `ModelCase` per supported model type.

A case builds two models with the same weights from an upstream config class: the upstream model (the oracle,
generating with its default DynamicCache) and our override. It also makes generate inputs of a given batch and
length (prompt tokens, or encoder tokens for encoder-decoder models), with padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from model_overrides.llama import FlexLlamaForCausalLM
from model_overrides.t5 import FlexT5ForConditionalGeneration

VOCAB = 99


@dataclass
class ModelCase:
    name: str
    build_config: Callable[[], object]
    upstream_class: type
    flex_class: type
    make_inputs: Callable[[int, int, torch.Generator], dict]
    # generate kwargs that every call of this case needs (e.g. special token ids)
    generate_kwargs: dict = field(default_factory=dict)
    attn_implementations: tuple[str, ...] = ("eager", "sdpa")
    # Why this model cannot compile a padded generate stream into one decode graph, with what was measured; the
    # compile tests then expect it to fail (strict xfail) instead of passing. Empty: it must reach one graph.
    compile_opt_out: str = ""

    def build(self, attn_implementation: str = "eager", seed: int = 0):
        """(upstream model, override model) with identical seeded weights, in eval mode."""
        config = self.build_config()
        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        upstream = self.upstream_class(config).eval()
        flex = self.flex_class(config).eval()
        flex.load_state_dict(upstream.state_dict())
        return upstream, flex


def _token_inputs(batch_size: int, length: int, generator: torch.Generator, *, padding_side: str) -> dict:
    """Random tokens (ids >= 3) with a mask; row 0 is padded to half its length on `padding_side`."""
    input_ids = torch.randint(3, VOCAB, (batch_size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if batch_size > 1 and length > 1:
        num_pad = length // 2
        if padding_side == "left":
            attention_mask[0, :num_pad] = 0
        else:
            attention_mask[0, length - num_pad :] = 0
        input_ids[0][attention_mask[0] == 0] = 0  # pad_token_id
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _llama_config():
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _t5_config():
    return T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=2,
    )


LLAMA = ModelCase(
    name="llama",
    build_config=_llama_config,
    upstream_class=LlamaForCausalLM,
    flex_class=FlexLlamaForCausalLM,
    make_inputs=lambda b, n, g: _token_inputs(b, n, g, padding_side="left"),
)

T5 = ModelCase(
    name="t5",
    build_config=_t5_config,
    upstream_class=T5ForConditionalGeneration,
    flex_class=FlexT5ForConditionalGeneration,
    make_inputs=lambda b, n, g: _token_inputs(b, n, g, padding_side="right"),
)

MODEL_CASES = [LLAMA, T5]
