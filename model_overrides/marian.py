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

from transformers import GenerationMixin
from transformers.models.marian import modeling_marian
from transformers.models.marian.modeling_marian import MarianAttention, MarianMTModel

from model_overrides.bart import FlexBartAttentionMixin
from transformers_flexcache.modeling import FlexModelMixin


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


FLEX_MODEL_CLASSES = [FlexMarianMTModel]
