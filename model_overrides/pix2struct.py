"""Pix2Struct: cross-attention through the flexible cache's `get_kv`, and `flexible_static` turns the cache on.

Two changes to upstream (transformers==5.24.0):

- `Pix2StructTextAttention.forward` reuses cross-attention keys and values by reading the cache's per-layer
  `is_updated` flag and the `keys`/`values` attributes of the cross-attention cache's layer objects, as T5 does.
  With a cache larger than the call, those would be the whole storage. Here the cross-attention path asks the cache
  for exactly the rows and encoder positions (image patches) that the current call wrote.
- `Pix2StructTextConfig.use_cache` defaults to `False`, and the model's generation config inherits it, so upstream's
  `generate(cache_implementation="static")` silently runs without any cache (its only sign is a warning that
  `cache_implementation` "may be ignored"). Asking for `cache_implementation="flexible_static"` is asking for a
  cache, so the override turns `use_cache` on for that call, unless `generate` is passed `use_cache=False`.

What needs no change:
- Self-attention only calls `update`; its relative position bias uses `cache.get_seq_length(layer_idx)`, the live
  decoder length.
- The cross-attention mask is built by `create_bidirectional_mask` from the patch mask and `encoder_hidden_states`
  of this call, so it covers exactly the live number of patches, padded patches included.
- `Pix2StructTextBlock` does not forward `**kwargs` to its attention modules. That does not matter here: the
  flexible path needs only `cache` and `layer_idx`, which reach attention as before.

Shapes: `B` live batch, `S` new decoder tokens, `L_enc` live encoder length (patches), `H` heads, `D` head dim.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationMixin
from transformers.models.pix2struct.modeling_pix2struct import (
    ALL_ATTENTION_FUNCTIONS,
    Pix2StructForConditionalGeneration,
    Pix2StructTextAttention,
    eager_attention_forward,
)

from model_overrides.t5 import per_row_relative_bias
from transformers_flexcache.cache import has_cross_attention_kv
from transformers_flexcache.models.modeling import FlexModelMixin


class FlexPix2StructTextAttention(Pix2StructTextAttention):
    def compute_bias(self, query_length, key_length, device=None, past_seen_tokens=0):
        """Wraps `Pix2StructTextAttention.compute_bias` (transformers==5.24.0).

        Differences: `past_seen_tokens` may be a `[B, 1]` tensor of per-row lengths (the serving engine's seat cache
        in a decode step); the bias is then `[B, H, S, L]`, as for T5 (`per_row_relative_bias`). The text decoder's
        buckets are unidirectional, as upstream's. Otherwise it is upstream's.
        """
        if isinstance(past_seen_tokens, torch.Tensor) and past_seen_tokens.dim() == 2:
            return per_row_relative_bias(self, query_length, key_length, device, past_seen_tokens)
        return super().compute_bias(query_length, key_length, device, past_seen_tokens)

    def _flex_project_kv(self, key_value_states):
        # key_value_states: [B, L_enc, hidden] -> 2 x [B, H, L_enc, D], as upstream projects them
        kv_shape = (*key_value_states.shape[:-1], -1, self.key_value_proj_dim)
        key_states = self.key(key_value_states).view(kv_shape).transpose(1, 2)
        return key_states, self.value(key_value_states).view(kv_shape).transpose(1, 2)

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None, **kwargs):
        """Derived from `transformers.models.pix2struct.modeling_pix2struct.Pix2StructTextAttention.forward`
        (transformers==5.24.0).

        Differences: with a `FlexibleEncoderDecoderCache` (or the serving engine's seat cache), cross-attention keys and values are written with
        `cross_attention_cache.update` on the first decoder step and read with `cross_attention_cache.get_kv`
        afterwards. Self-attention, and any other cache, go to upstream's forward unchanged. Cross-attention layers
        have no relative attention bias, so the upstream lines for it are left out.
        """
        # hidden_states: [B, S, hidden], key_value_states: [B, L_enc, hidden] -> [B, S, hidden], bias, weights
        if key_value_states is None or not has_cross_attention_kv(cache):
            return super().forward(hidden_states, mask, key_value_states, position_bias, cache, **kwargs)

        input_shape = hidden_states.shape[:-1]
        query_states = self.query(hidden_states).view(*input_shape, -1, self.key_value_proj_dim).transpose(1, 2)

        # flexcache: projected once per call through the cache's accessors, instead of the `is_updated` flag and layer attributes
        key_states, value_states = cache.cross_attention_kv(self.layer_idx, key_value_states, self._flex_project_kv)

        if position_bias is None:
            # Cross-attention layers have no relative attention bias: upstream adds zeros of this shape.
            position_bias = query_states.new_zeros((1, self.n_heads, input_shape[1], key_states.shape[-2]))
            if self.gradient_checkpointing and self.training:
                position_bias.requires_grad = True

        if mask is not None and isinstance(mask, torch.Tensor):
            mask = mask[:, :, :, : key_states.shape[-2]]

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
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
        attn_output = self.output(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, position_bias, attn_weights


class FlexPix2StructForConditionalGeneration(FlexModelMixin, Pix2StructForConditionalGeneration, GenerationMixin):
    """`Pix2StructForConditionalGeneration` with cross-attention through `get_kv`, and `flexible_static` in generate
    (which turns `use_cache` on unless `generate` is passed `use_cache=False`)."""

    _flex_module_classes = {Pix2StructTextAttention: FlexPix2StructTextAttention}

    def _prepare_generation_config(self, generation_config, **kwargs):
        """Wraps `GenerationMixin._prepare_generation_config` (transformers==5.24.0).

        Differences: when the call asks for `cache_implementation="flexible_static"` (in its kwargs, its
        `generation_config`, or the model's: the request of the call's plan) and does not pass `use_cache` to
        `generate`, it runs with
        `use_cache=True` instead of the `False` that the generation config inherits from `Pix2StructTextConfig`. A
        `generation_config` cannot tell an inherited `False` from a chosen one, so only `generate(use_cache=False)`
        keeps the cache off. It is set before upstream merges the call's settings, so upstream's "cache_implementation
        may be ignored" warning is not raised for them; a name found only in the model's own `generation_config` still
        gets that warning (once, while upstream merges it), although the cache is used.
        """
        if self._flex_request(generation_config, kwargs).flexible and kwargs.get("use_cache") is None:
            if generation_config is None:
                kwargs["use_cache"] = True
            else:
                # A copy: the caller's config stays as it was (upstream copies it too, just after this).
                generation_config = copy.copy(generation_config)
                generation_config.use_cache = True
        return super()._prepare_generation_config(generation_config, **kwargs)


FLEX_MODEL_CLASSES = [FlexPix2StructForConditionalGeneration]
