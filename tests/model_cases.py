"""Tiny seeded models for the tests, one `ModelCase` per supported model type.

A case builds two models with the same weights from a tiny config of `transformers_flexcache.zoo`: the upstream model (the oracle,
generating with its default DynamicCache) and our override. It also makes generate inputs of a given batch and
length (prompt tokens, or encoder tokens for encoder-decoder models, with padding; for Whisper, log-mel features or
encoder outputs, see `_whisper_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers
from transformers import (
    BartForConditionalGeneration,
    JambaForCausalLM,
    LlamaForCausalLM,
    M2M100ForConditionalGeneration,
    MarianMTModel,
    MBartForConditionalGeneration,
    PegasusForConditionalGeneration,
    Pix2StructForConditionalGeneration,
    T5ForConditionalGeneration,
    WhisperForConditionalGeneration,
)
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from model_overrides.bart import FlexBartForConditionalGeneration
from model_overrides.jamba import FlexJambaForCausalLM
from model_overrides.llama import FlexLlamaForCausalLM
from model_overrides.m2m_100 import FlexM2M100ForConditionalGeneration
from model_overrides.marian import FlexMarianMTModel
from model_overrides.mbart import FlexMBartForConditionalGeneration
from model_overrides.pegasus import FlexPegasusForConditionalGeneration
from model_overrides.pix2struct import FlexPix2StructForConditionalGeneration
from model_overrides.t5 import FlexT5ForConditionalGeneration
from model_overrides.whisper import FlexWhisperForConditionalGeneration
from transformers_flexcache import zoo
from transformers_flexcache.models.generic import flex_class_for

VOCAB = zoo.TINY_VOCAB
WHISPER_MAX_SOURCE_POSITIONS = zoo.WHISPER_TINY_MAX_SOURCE_POSITIONS
WHISPER_NUM_MEL_BINS = zoo.WHISPER_TINY_NUM_MEL_BINS
WHISPER_D_MODEL = zoo.WHISPER_TINY_D_MODEL
PATCH_DIM = zoo.PIX2STRUCT_PATCH_DIM
PATCH_COLUMNS = 4  # patches per image row, for the row/column ids


def _llama_config():
    return zoo.tiny_config("llama")


def _t5_config():
    return zoo.tiny_config("t5")


def _jamba_config():
    return zoo.tiny_config("jamba")


def _whisper_config():
    return zoo.tiny_config("whisper")


def _bart_config():
    return zoo.tiny_config("bart")


def _pix2struct_config():
    return zoo.tiny_config("pix2struct")


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
    # Padding sides that tests/generate/test_decoding.py checks; None: left for decoder-only models, and both sides of the
    # encoder input for encoder-decoder models, when `make_inputs` gives an attention_mask (none: no padding test).
    padding_sides: tuple[str, ...] | None = None
    # Input length for tests/generate/test_decoding.py, when the default does not suit the model's own generate.
    decoding_input_len: int | None = None
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


def _whisper_inputs(batch_size: int, length: int, generator: torch.Generator) -> dict:
    """Log-mel features when `length` is the encoder's fixed length, else encoder outputs of `length` positions.

    Whisper's encoder takes exactly `2 * max_source_positions` frames, so features always give the same encoder
    length. Shorter encoder lengths reach generate as `encoder_outputs`, as precomputed or trimmed encoder states do.
    """
    if length == WHISPER_MAX_SOURCE_POSITIONS:
        features = torch.randn(batch_size, WHISPER_NUM_MEL_BINS, 2 * length, generator=generator)
        return {"input_features": features}
    if length > WHISPER_MAX_SOURCE_POSITIONS:
        raise ValueError(
            f"length={length} exceeds max_source_positions={WHISPER_MAX_SOURCE_POSITIONS} of the test Whisper config; "
            "longer encoder outputs would switch Whisper's generate to long-form"
        )
    hidden_states = torch.randn(batch_size, length, WHISPER_D_MODEL, generator=generator)
    return {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden_states)}


def _patch_inputs(batch_size: int, length: int, generator: torch.Generator) -> dict:
    """`length` image patches per row laid out as the image processor does (1-based row/column ids, then pixels);
    row 0 has only the first half of its patches, the rest zeros with mask 0 (the processor's padding)."""
    # -> flattened_patches: [B, length, 2 + PATCH_DIM], attention_mask: [B, length]
    index = torch.arange(length)
    ids = torch.stack([index // PATCH_COLUMNS + 1, index % PATCH_COLUMNS + 1], dim=-1).float()
    pixels = torch.randn(batch_size, length, PATCH_DIM, generator=generator)
    flattened_patches = torch.cat([ids.expand(batch_size, -1, -1), pixels], dim=-1)
    attention_mask = torch.ones(batch_size, length, dtype=torch.long)
    if batch_size > 1 and length > 1:
        attention_mask[0, length - length // 2 :] = 0
        flattened_patches[0, length - length // 2 :] = 0
    return {"flattened_patches": flattened_patches, "attention_mask": attention_mask}


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

JAMBA = ModelCase(
    name="jamba",
    build_config=_jamba_config,
    upstream_class=JambaForCausalLM,
    flex_class=FlexJambaForCausalLM,
    make_inputs=lambda b, n, g: _token_inputs(b, n, g, padding_side="left"),
)

WHISPER = ModelCase(
    name="whisper",
    build_config=_whisper_config,
    upstream_class=WhisperForConditionalGeneration,
    flex_class=FlexWhisperForConditionalGeneration,
    make_inputs=_whisper_inputs,
    # Log-mel features, not encoder outputs: upstream's Whisper generate cannot expand `encoder_outputs` for
    # num_return_sequences (it repeats `input_features`, which is then None).
    decoding_input_len=WHISPER_MAX_SOURCE_POSITIONS,
)

BART = ModelCase(
    name="bart",
    build_config=_bart_config,
    upstream_class=BartForConditionalGeneration,
    flex_class=FlexBartForConditionalGeneration,
    make_inputs=lambda b, n, g: _token_inputs(b, n, g, padding_side="right"),
)

PIX2STRUCT = ModelCase(
    name="pix2struct",
    build_config=_pix2struct_config,
    upstream_class=Pix2StructForConditionalGeneration,
    flex_class=FlexPix2StructForConditionalGeneration,
    make_inputs=_patch_inputs,
    # The text config defaults use_cache=False; the reference must run with its DynamicCache. Generating with
    # flexible_static without use_cache is tested in tests/model_overrides/test_pix2struct.py.
    generate_kwargs={"use_cache": True},
)


def _bart_family_case(model_type: str, upstream_class: type, flex_class: type, **kwargs) -> ModelCase:
    """A case for a model whose attention upstream copies from BART's: right-padded token inputs, as BART's."""
    return ModelCase(
        name=model_type,
        build_config=lambda: zoo.tiny_config(model_type),
        upstream_class=upstream_class,
        flex_class=flex_class,
        make_inputs=lambda b, n, g: _token_inputs(b, n, g, padding_side="right"),
        **kwargs,
    )


MARIAN = _bart_family_case("marian", MarianMTModel, FlexMarianMTModel)
M2M_100 = _bart_family_case("m2m_100", M2M100ForConditionalGeneration, FlexM2M100ForConditionalGeneration)
MBART = _bart_family_case("mbart", MBartForConditionalGeneration, FlexMBartForConditionalGeneration)
PEGASUS = _bart_family_case("pegasus", PegasusForConditionalGeneration, FlexPegasusForConditionalGeneration)


def _generic_case(model_type: str) -> ModelCase:
    """A case for a decoder-only model with no module change: its `AutoModelForCausalLM` class, and the override the
    generic route builds for it; left-padded prompts, as Llama's."""
    upstream_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return ModelCase(
        name=model_type,
        build_config=lambda: zoo.tiny_config(model_type),
        upstream_class=upstream_class,
        flex_class=flex_class_for(upstream_class),
        make_inputs=lambda b, n, g: _token_inputs(b, n, g, padding_side="left"),
    )


# Sliding windows of 4 positions (zoo.TINY_SLIDING_WINDOW): Qwen2 and Gemma3 mix full and sliding-window layers,
# Mistral has only sliding-window ones.
QWEN2 = _generic_case("qwen2")
QWEN3 = _generic_case("qwen3")
MISTRAL = _generic_case("mistral")
PHI3 = _generic_case("phi3")
GPT2 = _generic_case("gpt2")
GEMMA3_TEXT = _generic_case("gemma3_text")

MODEL_CASES = [
    LLAMA,
    T5,
    BART,
    WHISPER,
    JAMBA,
    PIX2STRUCT,
    MARIAN,
    M2M_100,
    MBART,
    PEGASUS,
    QWEN2,
    QWEN3,
    MISTRAL,
    PHI3,
    GPT2,
    GEMMA3_TEXT,
]
