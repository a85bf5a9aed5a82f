"""mBART: BART's change, through `FlexBartAttentionMixin`.

Upstream's `MBartAttention` (transformers==5.24.0) is a copy of `BartAttention` ("Copied from
transformers.models.bart.modeling_bart.BartAttention with Bart->MBart"): it reads the cache's `is_updated` flag and
the cross-attention layers' `keys`/`values`. `FlexMBartAttention` takes BART's override of that forward
(`model_overrides/bart.py`) instead of a copy of its own.

Learned positions are `arange(S) + cache.get_seq_length()` (`MBartDecoder.forward`), the live decoder length; for the
serving engine's per-row lengths they are `[B, S]`, which `FlexMBartLearnedPositionalEmbedding` takes (BART's
`FlexLearnedPositionsMixin`; upstream's embedding is a copy of BART's).

What needs no change: the causal mask is sized by `get_mask_sizes`; the cross-attention mask is built from this call's
encoder mask and output, so it spans the live encoder length that `get_kv` returns. mBART's pre-layer norms and its
extra final layer norms do not touch the cache.
"""

from __future__ import annotations

from transformers import GenerationMixin
from transformers.models.mbart import modeling_mbart
from transformers.models.mbart.modeling_mbart import (
    MBartAttention,
    MBartForConditionalGeneration,
    MBartLearnedPositionalEmbedding,
)

from model_overrides.bart import FlexBartAttentionMixin, FlexLearnedPositionsMixin
from transformers_flexcache.models.modeling import FlexModelMixin


class FlexMBartAttention(FlexBartAttentionMixin, MBartAttention):
    """Derived from `transformers.models.mbart.modeling_mbart.MBartAttention.forward` (transformers==5.24.0), a copy
    of `BartAttention.forward`.

    Differences: those of `FlexBartAttentionMixin.forward` (cross-attention keys and values through
    `cross_attention_kv`); upstream's forward otherwise.
    """

    _flex_eager_attention_forward = staticmethod(modeling_mbart.eager_attention_forward)


class FlexMBartLearnedPositionalEmbedding(FlexLearnedPositionsMixin, MBartLearnedPositionalEmbedding):
    """Derived from `transformers.models.mbart.modeling_mbart.MBartLearnedPositionalEmbedding.forward`
    (transformers==5.24.0), a copy of BART's: per-row positions `[B, S]`, as `FlexLearnedPositionsMixin.forward`."""


class FlexMBartForConditionalGeneration(FlexModelMixin, MBartForConditionalGeneration, GenerationMixin):
    """`MBartForConditionalGeneration` with cross-attention through `get_kv`, and `flexible_static` in generate."""

    _flex_module_classes = {
        MBartAttention: FlexMBartAttention,
        MBartLearnedPositionalEmbedding: FlexMBartLearnedPositionalEmbedding,
    }


FLEX_MODEL_CLASSES = [FlexMBartForConditionalGeneration]
