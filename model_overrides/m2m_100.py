"""M2M100 (and NLLB checkpoints, which load into it): BART's change, through `FlexBartAttentionMixin`.

Upstream's `M2M100Attention` (transformers==5.24.0) is a copy of `BartAttention` ("Copied from
transformers.models.bart.modeling_bart.BartAttention with Bart->M2M100"): it reads the cache's `is_updated` flag and
the cross-attention layers' `keys`/`values`. `FlexM2M100Attention` takes BART's override of that forward
(`model_overrides/bart.py`) instead of a copy of its own. Dense NLLB checkpoints (`facebook/nllb-200-*`) have
`model_type="m2m_100"` and load into `M2M100ForConditionalGeneration`, so into this override; NLLB-MoE is another
model type (`nllb_moe`), not covered here.

What needs no change: `M2M100SinusoidalPositionalEmbedding` numbers decoder positions from the token ids (padding
tokens keep `padding_idx`) plus `cache.get_seq_length()`, the live decoder length, and grows its table only when not
compiling; the causal mask is sized by `get_mask_sizes`; the cross-attention mask is built from this call's encoder
mask and output, so it spans the live encoder length that `get_kv` returns.
"""

from __future__ import annotations

from transformers import GenerationMixin
from transformers.models.m2m_100 import modeling_m2m_100
from transformers.models.m2m_100.modeling_m2m_100 import M2M100Attention, M2M100ForConditionalGeneration

from model_overrides.bart import FlexBartAttentionMixin
from transformers_flexcache.modeling import FlexModelMixin


class FlexM2M100Attention(FlexBartAttentionMixin, M2M100Attention):
    """Derived from `transformers.models.m2m_100.modeling_m2m_100.M2M100Attention.forward` (transformers==5.24.0), a
    copy of `BartAttention.forward`.

    Differences: those of `FlexBartAttentionMixin.forward` (cross-attention keys and values through
    `cross_attention_kv`); upstream's forward otherwise.
    """

    _flex_eager_attention_forward = staticmethod(modeling_m2m_100.eager_attention_forward)


class FlexM2M100ForConditionalGeneration(FlexModelMixin, M2M100ForConditionalGeneration, GenerationMixin):
    """`M2M100ForConditionalGeneration` with cross-attention through `get_kv`, and `flexible_static` in generate."""

    _flex_module_classes = {M2M100Attention: FlexM2M100Attention}


FLEX_MODEL_CLASSES = [FlexM2M100ForConditionalGeneration]
