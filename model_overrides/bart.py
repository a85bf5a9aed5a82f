"""BART: cross-attention reads its keys and values through the flexible cache's `get_kv`.

Upstream's `BartAttention.forward` (transformers==5.24.0) reuses cross-attention keys and values by reading the
cache's per-layer `is_updated` flag and the `keys`/`values` attributes of the cross-attention cache's layer objects.
With a cache that is larger than the call, those tensors would be the whole storage. Here the cross-attention path
asks the cache for exactly the rows and encoder positions that the current call wrote.

The change lives in `FlexBartAttentionMixin`, so that the attention classes that upstream copies from `BartAttention`
("Copied from transformers.models.bart.modeling_bart.BartAttention": Marian, M2M100, mBART, Pegasus, ...) take it
without a copy of their own: `class FlexMarianAttention(FlexBartAttentionMixin, MarianAttention)`.

What needs no change:
- Self-attention only calls `update`, which returns views of the live batch and length.
- Learned positions: `BartDecoder.forward` takes them from `cache.get_seq_length()`, which for our cache is the
  live decoder length (a Python int), so positions are `arange(S) + L` exactly as with a DynamicCache. For the
  serving engine, whose rows each have their own length, the seat cache answers `[B, 1]`, so the decoder's position
  ids are `[B, S]`; `FlexBartLearnedPositionalEmbedding` then looks them up as they are (upstream's takes `[S]`).
- Masks: the causal mask is sized by `get_mask_sizes` (live length), and the cross-attention mask is built by
  `create_bidirectional_mask` from the encoder mask and `encoder_hidden_states` of this call, so it covers exactly
  the live encoder length, padded rows included, which is the length `get_kv` returns.

Shapes: `B` live batch, `S` new decoder tokens, `L_enc` live encoder length, `H` heads, `D` head dim.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.bart.modeling_bart import (
    ALL_ATTENTION_FUNCTIONS,
    BartAttention,
    BartForConditionalGeneration,
    BartLearnedPositionalEmbedding,
    eager_attention_forward,
)

from transformers_flexcache.cache import has_cross_attention_kv
from transformers_flexcache.models.modeling import FlexModelMixin
from transformers_flexcache.models.packing import PackedRows, run_packed


class FlexBartAttentionMixin:
    """The change of `FlexBartAttention`, for `BartAttention` and every attention class copied from it.

    Put it before the upstream attention class. `_flex_eager_attention_forward` is the module-level
    `eager_attention_forward` of the upstream class's file (each copies BERT's), which upstream falls back to.
    """

    _flex_eager_attention_forward = staticmethod(eager_attention_forward)

    def _flex_project_kv(self, key_value_states):
        # key_value_states: [B, L_enc, d_model] -> 2 x [B, H, L_enc, D], as upstream projects them
        kv_shape = (*key_value_states.shape[:-1], -1, self.head_dim)
        key_states = self.k_proj(key_value_states).view(kv_shape).transpose(1, 2)
        return key_states, self.v_proj(key_value_states).view(kv_shape).transpose(1, 2)

    def forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
        """Derived from `transformers.models.bart.modeling_bart.BartAttention.forward` (transformers==5.24.0).

        Differences: with a `FlexibleEncoderDecoderCache` (or the serving engine's seat cache), cross-attention keys and values are written with
        `cross_attention_cache.update` on the first decoder step and read with `cross_attention_cache.get_kv`
        afterwards. Self-attention, encoder attention and any other cache go to upstream's forward unchanged.
        """
        # hidden_states: [B, S, d_model], key_value_states: [B, L_enc, d_model] -> [B, S, d_model], weights
        packed_rows = kwargs.pop("packed_rows", None)
        if packed_rows is not None:
            return self._flex_packed_self_attention(hidden_states, attention_mask, packed_rows, **kwargs)
        if key_value_states is None or not has_cross_attention_kv(cache):
            return super().forward(hidden_states, key_value_states, cache, attention_mask, **kwargs)

        input_shape = hidden_states.shape[:-1]
        query_states = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)

        # flexcache: projected once per call through the cache's accessors, instead of the `is_updated` flag and layer attributes
        key_states, value_states = cache.cross_attention_kv(self.layer_idx, key_value_states, self._flex_project_kv)

        attn_output, attn_weights = self._flex_attend(query_states, key_states, value_states, attention_mask, **kwargs)
        attn_output = self.out_proj(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, attn_weights

    def _flex_attend(self, query_states, key_states, value_states, attention_mask, **kwargs):
        """Upstream's attention call of `BartAttention.forward` (transformers==5.24.0): the configured attention
        interface (its file's `eager_attention_forward` by default) on `[B, H, S, D]` queries, keys and values."""
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self._flex_eager_attention_forward
        )
        return attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout,
            scaling=self.scaling,
            **kwargs,
        )

    def _flex_packed_self_attention(self, hidden_states, attention_mask, rows: PackedRows, **kwargs):
        """Derived from `BartAttention.forward` (transformers==5.24.0) for an encoder's self-attention on packed
        tokens (`transformers_flexcache.models.packing`; the packed encoders of BART and Marian, `_flex_encode_packed`).

        Differences: the projections run on the call's real tokens `[1, N, d]`; queries, keys and values are
        put back into their rows (`rows.unpack`, zeros at the padding, which `attention_mask` masks) for upstream's
        attention, whose output is gathered back before the output projection. No cache: an encoder has none.
        """
        # hidden_states: [1, N, d_model] -> [1, N, d_model]; queries, keys, values [B, H, L, D]
        row_shape = (rows.batch, rows.length, -1, self.head_dim)
        query_states, key_states, value_states = (
            rows.unpack(projection(hidden_states)).view(row_shape).transpose(1, 2)
            for projection in (self.q_proj, self.k_proj, self.v_proj)
        )
        attn_output, attn_weights = self._flex_attend(query_states, key_states, value_states, attention_mask, **kwargs)
        attn_output = rows.pack(attn_output.reshape(rows.batch, rows.length, -1))
        return self.out_proj(attn_output), attn_weights


class FlexBartAttention(FlexBartAttentionMixin, BartAttention):
    """`BartAttention` with cross-attention keys and values through the cache's accessors (`FlexBartAttentionMixin`)."""


class FlexLearnedPositionsMixin:
    """Per-row positions for BART's learned positional embedding and its copies (mBART)."""

    def forward(self, input_ids, cache_length=0, position_ids=None):
        """Wraps `transformers.models.bart.modeling_bart.BartLearnedPositionalEmbedding.forward` (transformers==5.24.0).

        Differences: `position_ids` of shape `[B, S]` (each row its own positions: the serving engine's decode step)
        are looked up as they are; upstream's takes `[S]` and adds a batch axis. Otherwise upstream's.
        """
        # position_ids: [B, S] -> [B, S, d]
        if position_ids is not None and position_ids.dim() == 2:
            return nn.Embedding.forward(self, position_ids + self.offset)
        return super().forward(input_ids, cache_length, position_ids)


class FlexBartLearnedPositionalEmbedding(FlexLearnedPositionsMixin, BartLearnedPositionalEmbedding):
    """`BartLearnedPositionalEmbedding` that also takes per-row positions (`FlexLearnedPositionsMixin`)."""


class FlexBartForConditionalGeneration(FlexModelMixin, BartForConditionalGeneration, GenerationMixin):
    """`BartForConditionalGeneration` with cross-attention through `get_kv`, and `flexible_static` in generate."""

    _flex_module_classes = {
        BartAttention: FlexBartAttention,
        BartLearnedPositionalEmbedding: FlexBartLearnedPositionalEmbedding,
    }

    @staticmethod
    def _flex_encode_packed(encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor):
        """Derived from `BartEncoder.forward` (transformers==5.24.0) for an inference call: its output, whose last
        hidden state `[B, L, d]` is computed on the real tokens only (`transformers_flexcache.models.packing`; zeros at the
        padding positions). Differences: the layers run on the packed tokens `[1, N, d]` after the embeddings,
        positions and embedding norm, their self-attention on the rows (`FlexBartAttentionMixin.
        _flex_packed_self_attention`); dropout, layer drop and recorded outputs, which an inference call of the
        encoder has none of, are left out (`compile/encoder.py` packs only such calls)."""
        # input_ids, attention_mask: [B, L]; index: [N] -> [B, L, d_model]
        inputs_embeds = encoder.embed_tokens(input_ids)
        hidden_states = inputs_embeds + encoder.embed_positions(inputs_embeds[:, :, -1]).to(inputs_embeds.device)
        hidden_states = encoder.layernorm_embedding(hidden_states)
        mask = create_bidirectional_mask(
            config=encoder.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )
        return BaseModelOutput(
            last_hidden_state=run_packed(encoder.layers, hidden_states, mask, attention_mask, index)
        )


FLEX_MODEL_CLASSES = [FlexBartForConditionalGeneration]
