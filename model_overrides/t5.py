"""T5: cross-attention reads its keys and values through the flexible cache's `get_kv`.

Upstream's `T5Attention.forward` (transformers==5.24.0) reuses cross-attention keys and values by reading the
cache's per-layer `is_updated` flag and the `keys`/`values` attributes of the cross-attention cache's layer objects.
With a cache that is larger than the call, those tensors would be the whole storage. Here the cross-attention path
asks the cache for exactly the rows and encoder positions that the current call wrote. Self-attention, the relative
position bias (from `get_seq_length()`) and the masks need no change: the cache answers them for the live batch and
length, so the cross-attention mask built from the encoder mask covers exactly the live encoder length.

For the serving engine, whose rows each have a length of their own, `compute_bias` also takes those lengths as a
`[B, 1]` tensor (what its seat cache's `get_seq_length()` answers in a decode step) and returns one bias per row."""

from __future__ import annotations

import torch
from transformers import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.t5.modeling_t5 import (
    ALL_ATTENTION_FUNCTIONS,
    T5Attention,
    T5ForConditionalGeneration,
    eager_attention_forward,
)

from transformers_flexcache.cache import has_cross_attention_kv
from transformers_flexcache.models.modeling import FlexModelMixin
from transformers_flexcache.models.packing import PackedRows


def per_row_relative_bias(attention, query_length: int, key_length: int, device, past_seen_tokens: torch.Tensor):
    """T5's relative position bias for rows that each start at their own position, `[B, H, S, L]`.

    Derived from `transformers.models.t5.modeling_t5.T5Attention.compute_bias` (transformers==5.24.0), which takes one
    past length for the whole batch. Differences: `past_seen_tokens` is `[B, 1]`, so that query position `i` of row
    `b` is `past_seen_tokens[b] + i`; the buckets and the embedding are upstream's. Pix2Struct's text attention
    (a copy of T5's) uses it too.
    """
    # past_seen_tokens: [B, 1] -> [B, H, S, L]
    if device is None:
        device = attention.relative_attention_bias.weight.device
    context_position = torch.arange(query_length, dtype=torch.long, device=device)[None, :, None]
    context_position = context_position + past_seen_tokens.to(device)[:, :, None]  # [B, S, 1]
    memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, None, :]  # [1, 1, L]
    relative_position_bucket = attention._relative_position_bucket(
        memory_position - context_position,  # [B, S, L]
        bidirectional=not getattr(attention, "is_decoder", True),
        num_buckets=attention.relative_attention_num_buckets,
        max_distance=attention.relative_attention_max_distance,
    )
    return attention.relative_attention_bias(relative_position_bucket).permute(0, 3, 1, 2)  # [B, H, S, L]


class FlexT5Attention(T5Attention):
    def compute_bias(self, query_length, key_length, device=None, past_seen_tokens=0):
        """Wraps `T5Attention.compute_bias` (transformers==5.24.0).

        Differences: `past_seen_tokens` may be a `[B, 1]` tensor of per-row lengths (the serving engine's seat cache
        in a decode step); the bias is then `[B, H, S, L]` (`per_row_relative_bias`). Otherwise it is upstream's.
        """
        if isinstance(past_seen_tokens, torch.Tensor) and past_seen_tokens.dim() == 2:
            return per_row_relative_bias(self, query_length, key_length, device, past_seen_tokens)
        return super().compute_bias(query_length, key_length, device, past_seen_tokens)

    def _flex_project_kv(self, key_value_states):
        # key_value_states: [B, L_enc, d_model] -> 2 x [B, H, L_enc, D], as upstream projects them
        kv_shape = (*key_value_states.shape[:-1], -1, self.key_value_proj_dim)
        key_states = self.k(key_value_states).view(kv_shape).transpose(1, 2)
        return key_states, self.v(key_value_states).view(kv_shape).transpose(1, 2)

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None, **kwargs):
        """Derived from `transformers.models.t5.modeling_t5.T5Attention.forward` (transformers==5.24.0).

        Differences: with a `FlexibleEncoderDecoderCache` (or the serving engine's seat cache), cross-attention keys and values are written with
        `cross_attention_cache.update` on the first decoder step and read with `cross_attention_cache.get_kv`
        afterwards. Self-attention, and any other cache, go to upstream's forward unchanged. Cross-attention has no
        relative attention bias in T5, so the upstream lines for it are left out.
        """
        # hidden_states: [B, S, d_model], key_value_states: [B, L_enc, d_model] -> [B, S, d_model]
        packed_rows = kwargs.pop("packed_rows", None)
        if packed_rows is not None:
            return self._flex_packed_self_attention(hidden_states, mask, position_bias, packed_rows, **kwargs)
        if key_value_states is None or not has_cross_attention_kv(cache):
            return super().forward(hidden_states, mask, key_value_states, position_bias, cache, **kwargs)

        input_shape = hidden_states.shape[:-1]
        query_states = self.q(hidden_states).view(*input_shape, -1, self.key_value_proj_dim).transpose(1, 2)

        # flexcache: projected once per call through the cache's accessors, instead of the `is_updated` flag and layer attributes
        key_states, value_states = cache.cross_attention_kv(self.layer_idx, key_value_states, self._flex_project_kv)

        if position_bias is None:
            # Cross-attention layers have no relative attention bias: upstream adds zeros of this shape.
            position_bias = query_states.new_zeros((1, self.n_heads, input_shape[1], key_states.shape[-2]))

        attn_output, attn_weights = self._flex_attend(
            query_states, key_states, value_states, mask, position_bias, **kwargs
        )
        attn_output = self.o(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, position_bias, attn_weights

    def _flex_attend(self, query_states, key_states, value_states, mask, position_bias, **kwargs):
        """Upstream's attention call of `T5Attention.forward` (transformers==5.24.0): the configured attention
        interface (T5's `eager_attention_forward` by default) on `[B, H, S, D]` queries, keys and values."""
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        return attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            mask,
            dropout=0.0 if not self.training else self.dropout,
            scaling=self.scaling,
            position_bias=position_bias,
            **kwargs,
        )

    def _flex_packed_self_attention(self, hidden_states, mask, position_bias, rows: PackedRows, **kwargs):
        """Derived from `T5Attention.forward` (transformers==5.24.0) for the encoder's self-attention on packed
        tokens (`transformers_flexcache.models.packing`, `FlexT5ForConditionalGeneration._flex_encode_packed`).

        Differences: the projections run on the call's real tokens `[1, N, d]`; queries, keys and values are
        put back into their rows (`rows.unpack`, zeros at the padding, which `mask` masks) for upstream's attention,
        whose output is gathered back before the output projection. The relative position bias is that of the rows'
        length (upstream takes the length from the states, here `N`). No cache: an encoder has none.
        """
        # hidden_states: [1, N, d_model] -> [1, N, d_model]; queries, keys, values [B, H, L, D]
        row_shape = (rows.batch, rows.length, -1, self.key_value_proj_dim)
        query_states, key_states, value_states = (
            rows.unpack(projection(hidden_states)).view(row_shape).transpose(1, 2)
            for projection in (self.q, self.k, self.v)
        )
        if position_bias is None:  # the first layer's, shared by the others
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(rows.length, rows.length, device=query_states.device)
            else:
                position_bias = query_states.new_zeros((1, self.n_heads, rows.length, rows.length))
        attn_output, attn_weights = self._flex_attend(
            query_states, key_states, value_states, mask, position_bias, **kwargs
        )
        attn_output = rows.pack(attn_output.reshape(rows.batch, rows.length, -1))
        return self.o(attn_output), position_bias, attn_weights


class FlexT5ForConditionalGeneration(FlexModelMixin, T5ForConditionalGeneration, GenerationMixin):
    """`T5ForConditionalGeneration` with cross-attention through `get_kv`, and `flexible_static` in generate."""

    _flex_module_classes = {T5Attention: FlexT5Attention}

    @staticmethod
    def _flex_encode_packed(encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor):
        """Derived from `T5Stack.forward` (transformers==5.24.0) for the encoder of an inference call: its output,
        whose last hidden state `[B, L, d]` is computed on the real tokens only (`transformers_flexcache.models.packing`;
        zeros at the padding positions). Differences: the blocks run on the packed tokens `[1, N, d]`, their
        self-attention on the rows (`FlexT5Attention._flex_packed_self_attention`); dropout, a cache and recorded
        outputs, which an inference call of the encoder has none of, are left out (`compile/encoder.py` packs only
        such calls)."""
        # input_ids, attention_mask: [B, L]; index: [N] -> [B, L, d_model]
        inputs_embeds = encoder.embed_tokens(input_ids)
        mask = create_bidirectional_mask(
            config=encoder.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )
        rows = PackedRows.of(attention_mask, index)
        hidden_states, position_bias = rows.pack(inputs_embeds), None
        for block in encoder.block:
            hidden_states, position_bias, _ = block(hidden_states, mask, position_bias, packed_rows=rows)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=rows.unpack(encoder.final_layer_norm(hidden_states))
        )


FLEX_MODEL_CLASSES = [FlexT5ForConditionalGeneration]
