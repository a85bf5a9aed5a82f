"""Pegasus: BART's change, through `FlexBartAttentionMixin`.

Upstream's `PegasusAttention` (transformers==5.24.0) is a copy of `BartAttention` ("Copied from
transformers.models.bart.modeling_bart.BartAttention with Bart->Pegasus"): it reads the cache's `is_updated` flag and
the cross-attention layers' `keys`/`values`. `FlexPegasusAttention` takes BART's override of that forward
(`model_overrides/bart.py`) instead of a copy of its own.

What needs no change: sinusoidal positions are `arange(S) + cache.get_seq_length()` (`PegasusDecoder.forward`), the
live decoder length; the causal mask is sized by `get_mask_sizes`; the cross-attention mask is built from this call's
encoder mask and output, so it spans the live encoder length that `get_kv` returns.
"""

from __future__ import annotations

from transformers import GenerationMixin
from transformers.models.pegasus import modeling_pegasus
from transformers.models.pegasus.modeling_pegasus import PegasusAttention, PegasusForConditionalGeneration

from model_overrides.bart import FlexBartAttentionMixin
from transformers_flexcache.models.modeling import FlexModelMixin


class FlexPegasusAttention(FlexBartAttentionMixin, PegasusAttention):
    """Derived from `transformers.models.pegasus.modeling_pegasus.PegasusAttention.forward` (transformers==5.24.0), a
    copy of `BartAttention.forward`.

    Differences: those of `FlexBartAttentionMixin.forward` (cross-attention keys and values through
    `cross_attention_kv`); upstream's forward otherwise.
    """

    _flex_eager_attention_forward = staticmethod(modeling_pegasus.eager_attention_forward)


class FlexPegasusForConditionalGeneration(FlexModelMixin, PegasusForConditionalGeneration, GenerationMixin):
    """`PegasusForConditionalGeneration` with cross-attention through `get_kv`, and `flexible_static` in generate."""

    _flex_module_classes = {PegasusAttention: FlexPegasusAttention}


FLEX_MODEL_CLASSES = [FlexPegasusForConditionalGeneration]
