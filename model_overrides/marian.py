"""Marian (opus-mt): BART's change, through `FlexBartAttentionMixin`.

Upstream's `MarianAttention` (transformers==5.24.0) is a copy of `BartAttention` ("Copied from
transformers.models.bart.modeling_bart.BartAttention with Bart->Marian"): it reads the cache's `is_updated` flag and
the cross-attention layers' `keys`/`values`. `FlexMarianAttention` takes BART's override of that forward
(`model_overrides/bart.py`) instead of a copy of its own.

What needs no change: sinusoidal positions are `arange(S) + cache.get_seq_length()` (`MarianDecoder.forward`), the
live decoder length; the causal mask is sized by `get_mask_sizes`; the cross-attention mask is built from this
call's encoder mask and output, so it spans the live encoder length that `get_kv` returns. `final_logits_bias` is
added after the decoder and does not touch the cache.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.marian import modeling_marian
from transformers.models.marian.modeling_marian import MarianAttention, MarianMTModel

from model_overrides.bart import FlexBartAttentionMixin
from transformers_flexcache.models.modeling import FlexModelMixin
from transformers_flexcache.models.packing import run_packed


class FlexMarianAttention(FlexBartAttentionMixin, MarianAttention):
    """Derived from `transformers.models.marian.modeling_marian.MarianAttention.forward` (transformers==5.24.0), a
    copy of `BartAttention.forward`.

    Differences: those of `FlexBartAttentionMixin.forward` (cross-attention keys and values through
    `cross_attention_kv`); upstream's forward otherwise.
    """

    _flex_eager_attention_forward = staticmethod(modeling_marian.eager_attention_forward)


class FlexMarianMTModel(FlexModelMixin, MarianMTModel, GenerationMixin):
    """`MarianMTModel` with cross-attention through `get_kv`, and `flexible_static` in generate."""

    _flex_module_classes = {MarianAttention: FlexMarianAttention}

    @staticmethod
    def _flex_encode_packed(encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor):
        """Derived from `MarianEncoder.forward` (transformers==5.24.0) for an inference call: its output, whose last
        hidden state `[B, L, d]` is computed on the real tokens only (`transformers_flexcache.models.packing`; zeros at the
        padding positions). Differences: the layers run on the packed tokens `[1, N, d]` after the embeddings and
        positions, their self-attention on the rows (`FlexBartAttentionMixin._flex_packed_self_attention`); dropout,
        layer drop and recorded outputs, which an inference call of the encoder has none of, are left out
        (`compile/encoder.py` packs only such calls)."""
        # input_ids, attention_mask: [B, L]; index: [N] -> [B, L, d_model]
        inputs_embeds = encoder.embed_tokens(input_ids) * encoder.embed_scale
        hidden_states = inputs_embeds + encoder.embed_positions(inputs_embeds.shape[:-1])
        mask = create_bidirectional_mask(
            config=encoder.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )
        return BaseModelOutput(
            last_hidden_state=run_packed(encoder.layers, hidden_states, mask, attention_mask, index)
        )


FLEX_MODEL_CLASSES = [FlexMarianMTModel]
