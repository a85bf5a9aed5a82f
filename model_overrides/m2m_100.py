"""M2M100 (and NLLB checkpoints, which load into it): BART's change, through `FlexBartAttentionMixin`.

Upstream's `M2M100Attention` (transformers==5.24.0) is a copy of `BartAttention` ("Copied from
transformers.models.bart.modeling_bart.BartAttention with Bart->M2M100"): it reads the cache's `is_updated` flag and
the cross-attention layers' `keys`/`values`. `FlexM2M100Attention` takes BART's override of that forward
(`model_overrides/bart.py`) instead of a copy of its own. Dense NLLB checkpoints (`facebook/nllb-200-*`) have
`model_type="m2m_100"` and load into `M2M100ForConditionalGeneration`, so into this override; NLLB-MoE is another
model type (`nllb_moe`), not covered here.

`M2M100SinusoidalPositionalEmbedding` numbers decoder positions from the token ids (padding tokens keep
`padding_idx`) plus `cache.get_seq_length()`, the live decoder length, and grows its table only when not compiling.
For the serving engine that length is `[B, 1]` (each row its own), on which upstream's growth check cannot branch:
`FlexM2M100SinusoidalPositionalEmbedding` checks the longest row instead.

What needs no change: the causal mask is sized by `get_mask_sizes`; the cross-attention mask is built from this call's encoder
mask and output, so it spans the live encoder length that `get_kv` returns.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin
from transformers.models.m2m_100 import modeling_m2m_100
from transformers.models.m2m_100.modeling_m2m_100 import (
    M2M100Attention,
    M2M100ForConditionalGeneration,
    M2M100SinusoidalPositionalEmbedding,
)
from transformers.utils import is_torchdynamo_compiling

from model_overrides.bart import FlexBartAttentionMixin
from transformers_flexcache.models.modeling import FlexModelMixin


class FlexM2M100Attention(FlexBartAttentionMixin, M2M100Attention):
    """Derived from `transformers.models.m2m_100.modeling_m2m_100.M2M100Attention.forward` (transformers==5.24.0), a
    copy of `BartAttention.forward`.

    Differences: those of `FlexBartAttentionMixin.forward` (cross-attention keys and values through
    `cross_attention_kv`); upstream's forward otherwise.
    """

    _flex_eager_attention_forward = staticmethod(modeling_m2m_100.eager_attention_forward)


class FlexM2M100SinusoidalPositionalEmbedding(M2M100SinusoidalPositionalEmbedding):
    @torch.no_grad()
    def forward(self, input_ids=None, inputs_embeds=None, cache_length=0):
        """Derived from `transformers.models.m2m_100.modeling_m2m_100.M2M100SinusoidalPositionalEmbedding.forward`
        (transformers==5.24.0).

        Differences: `cache_length` may be `[B, 1]` (each row its own length: the serving engine's decode step); the
        table then grows to the longest row (not while compiling, as upstream), and the positions are upstream's
        (`create_position_ids_from_input_ids` broadcasts over rows). Any other call is upstream's.
        """
        # input_ids: [B, S], cache_length: [B, 1] -> [B, S, d]
        if not (isinstance(cache_length, torch.Tensor) and cache_length.dim() == 2 and input_ids is not None):
            return super().forward(input_ids, inputs_embeds, cache_length)
        batch_size, seq_len = input_ids.size()
        position_ids = self.create_position_ids_from_input_ids(input_ids, self.padding_idx, cache_length)
        if not is_torchdynamo_compiling():
            max_pos = self.padding_idx + 1 + seq_len + int(cache_length.max())  # flexcache: the longest row
            if max_pos > self.weights.size(0):
                self.make_weights(max_pos + self.offset, self.embedding_dim, self.padding_idx)
        flat = self.weights.index_select(0, position_ids.to(input_ids.device).view(-1))
        return flat.view(batch_size, seq_len, self.weights.shape[-1]).detach()


class FlexM2M100ForConditionalGeneration(FlexModelMixin, M2M100ForConditionalGeneration, GenerationMixin):
    """`M2M100ForConditionalGeneration` with cross-attention through `get_kv`, and `flexible_static` in generate."""

    _flex_module_classes = {
        M2M100Attention: FlexM2M100Attention,
        M2M100SinusoidalPositionalEmbedding: FlexM2M100SinusoidalPositionalEmbedding,
    }


FLEX_MODEL_CLASSES = [FlexM2M100ForConditionalGeneration]
