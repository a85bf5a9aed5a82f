"""Whisper: cross-attention reads its keys and values through `get_kv`; the decoder accepts an encoder mask.

Upstream (transformers==5.24.0) needs two changes to run on a flexible cache:

- `WhisperAttention.forward` reuses cross-attention keys and values by reading the cache's per-layer `is_updated`
  flag and the `keys`/`values` attributes of the cross-attention cache's layer objects. With a cache larger than the
  call, those would be the whole storage. `FlexWhisperAttention` writes them once per call with
  `cross_attention_cache.update` and reads exactly the live rows and encoder positions with
  `cross_attention_cache.get_kv`.
- `WhisperDecoder.forward` builds no cross-attention mask (it passes `encoder_attention_mask=None` to its layers).
  With exact-shape views no mask is needed: the cross keys end at the encoder length of the call, as with
  DynamicCache. But encoder outputs padded to a fixed length (a fixed-shape mode) need one, so
  `FlexWhisperDecoder.forward` accepts `encoder_attention_mask` (`[B, L_enc]`, 1 for live encoder positions) and
  builds the cross mask with `create_bidirectional_mask`, as BART's decoder does. Without it, outputs are
  upstream's.

`WhisperGenerationMixin` splits every output per row after each call it makes to upstream's generate, and stacks
the rows back at the end; for the cache that is a copy to the CPU of every row (a per-call allocation).
`_postprocess_outputs` and `_stack_split_outputs` keep the flexible cache instead: `generate` returns it (no copy)
when its rows are the call's rows, and copies rows only when a temperature fallback is about to reuse the storage
(rows then come from several calls, as upstream's copy does): the call's lease of that storage copies them first
(`Lease.before_reuse`).

With `cache_config={"shape_policy": "padded"}` (fixed shapes for `torch.compile`), two things are Whisper's own:
- Whisper's generate calls upstream's once per 30-second segment and per temperature fallback, on the rows still
  running, so the padding happens around each of those calls, not around Whisper's generate
  (`FlexCacheInnerGenerateMixin`, right before `GenerationMixin` among the bases).
- Encoder outputs are padded with the mask this decoder reads, `encoder_attention_mask`
  (`_flex_encoder_mask_key`); Whisper's `attention_mask` masks log-mel frames, not encoder positions.

For serving long audio (`serving/`, `server/transcriptions.py`), two more:
- `_flex_encoder_len` counts one window's encoder positions for long-form features (upstream's generate encodes them
  a window at a time), so that a long recording fits a cache sized for one window.
- `generate(..., segment_listener=fn)` calls `fn(row, segments, window_start_s)` as each window's segments are made
  (`_retrieve_segment`), so that a server can stream them; upstream only returns them at the end.

Shapes: B batch, S new decoder tokens, L_enc encoder length (live), d d_model.
"""

from __future__ import annotations

import copy
from contextvars import ContextVar

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.whisper.modeling_whisper import (
    ALL_ATTENTION_FUNCTIONS,
    WhisperAttention,
    WhisperDecoder,
    WhisperForConditionalGeneration,
    eager_attention_forward,
)
from transformers.utils import ModelOutput
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from transformers_flexcache.cache import FlexibleEncoderDecoderCache, has_cross_attention_kv
from transformers_flexcache.generate.hooks import ForwardingCache
from transformers_flexcache.generate.mixin import FlexCacheInnerGenerateMixin
from transformers_flexcache.generate.plan import current_plan
from transformers_flexcache.models.modeling import FlexModelMixin


class FlexWhisperAttention(WhisperAttention):
    def _flex_project_kv(self, key_value_states):
        # key_value_states: [B, L_enc, d_model] -> 2 x [B, H, L_enc, D], as upstream projects them
        kv_shape = (key_value_states.shape[0], -1, self.num_heads, self.head_dim)
        key_states = self.k_proj(key_value_states).view(kv_shape).transpose(1, 2).contiguous()
        return key_states, self.v_proj(key_value_states).view(kv_shape).transpose(1, 2).contiguous()

    def forward(
        self, hidden_states, key_value_states=None, cache=None, attention_mask=None, output_attentions=False, **kwargs
    ):
        """Derived from `transformers.models.whisper.modeling_whisper.WhisperAttention.forward` (transformers==5.24.0).

        Differences: with a `FlexibleEncoderDecoderCache` (or the serving engine's seat cache), cross-attention keys and values are written with
        `cross_attention_cache.update` on the first decoder step and read with `cross_attention_cache.get_kv`
        afterwards. Self-attention, encoder attention and any other cache go to upstream's forward unchanged.
        """
        # hidden_states: [B, S, d], key_value_states: [B, L_enc, d] -> ([B, S, d], attention weights or None)
        if key_value_states is None or not has_cross_attention_kv(cache):
            return super().forward(
                hidden_states,
                key_value_states=key_value_states,
                cache=cache,
                attention_mask=attention_mask,
                output_attentions=output_attentions,
                **kwargs,
            )

        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        # Upstream scales the query before the product (and passes scaling=1.0 below) to match the original model.
        query_states = (self.q_proj(hidden_states) * self.scaling).view(hidden_shape).transpose(1, 2).contiguous()

        # flexcache: projected once per call through the cache's accessors, instead of the `is_updated` flag and layer attributes
        key_states, value_states = cache.cross_attention_kv(self.layer_idx, key_value_states, self._flex_project_kv)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout,
            scaling=1.0,
            output_attentions=output_attentions,
            **kwargs,
        )
        attn_output = self.out_proj(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, attn_weights


class FlexWhisperDecoder(WhisperDecoder):
    @merge_with_config_defaults
    @capture_outputs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        encoder_hidden_states=None,
        cache=None,
        inputs_embeds=None,
        position_ids=None,
        use_cache=None,
        encoder_attention_mask=None,  # flexcache: [B, L_enc], 1 for live encoder positions
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """Derived from `transformers.models.whisper.modeling_whisper.WhisperDecoder.forward` (transformers==5.24.0).

        Differences: takes `encoder_attention_mask` (`[B, L_enc]`) and passes the cross-attention mask built from it
        to every layer, where upstream passes `encoder_attention_mask=None`. Without it, the behaviour is upstream's.

        Raises:
            ValueError: `encoder_attention_mask` does not cover exactly the encoder positions of
                `encoder_hidden_states`.
        """
        # input_ids: [B, S], encoder_hidden_states: [B, L_enc, d] -> last_hidden_state [B, S, d]
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You cannot specify both decoder_input_ids and decoder_inputs_embeds at the same time")
        if (
            encoder_attention_mask is not None
            and encoder_hidden_states is not None
            and encoder_attention_mask.shape[-1] != encoder_hidden_states.shape[1]
        ):  # flexcache: a mask that is not the live encoder length would attend to stale or missing positions
            raise ValueError(
                f"encoder_attention_mask covers {encoder_attention_mask.shape[-1]} encoder positions but the encoder "
                f"outputs have {encoder_hidden_states.shape[1]}; pass a mask of shape [batch, "
                f"{encoder_hidden_states.shape[1]}] (1 for live positions, 0 for padding)"
            )

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        # Upstream's cache defaults, unchanged: the decoder's layer count, and an EncoderDecoderCache for cross-attention.
        if use_cache and cache is None:
            decoder_cache_config = copy.deepcopy(self.config)
            decoder_cache_config.num_hidden_layers = self.config.decoder_layers
            cache = (
                EncoderDecoderCache(
                    DynamicCache(config=decoder_cache_config), DynamicCache(config=decoder_cache_config)
                )
                if encoder_hidden_states is not None or self.config.is_encoder_decoder
                else DynamicCache(config=decoder_cache_config)
            )
        elif (
            use_cache
            and encoder_hidden_states is not None
            and isinstance(cache, DynamicCache)
            and not isinstance(cache, EncoderDecoderCache)
            and cache.get_seq_length() == 0
        ):
            decoder_cache_config = copy.deepcopy(self.config)
            decoder_cache_config.num_hidden_layers = self.config.decoder_layers
            cache = EncoderDecoderCache(
                DynamicCache(config=decoder_cache_config), DynamicCache(config=decoder_cache_config)
            )

        cache_length = cache.get_seq_length() if cache is not None else 0

        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + cache_length
            position_ids = position_ids.unsqueeze(0).repeat(inputs_embeds.shape[0], 1)

        positions = self.embed_positions(
            input_ids if input_ids is not None else inputs_embeds, cache_length=cache_length, position_ids=position_ids
        )
        hidden_states = inputs_embeds + positions.to(inputs_embeds.device)
        hidden_states = torch.nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        # flexcache: the cross-attention mask, [B, 1, S, L_enc] (None when there is no mask or nothing is masked)
        cross_attention_mask = None
        if encoder_attention_mask is not None and encoder_hidden_states is not None:
            cross_attention_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
            )

        for decoder_layer in self.layers:
            # add LayerDrop (see https://huggingface.co/papers/1909.11556 for description)
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue

            hidden_states = decoder_layer(
                hidden_states,
                causal_mask,
                encoder_hidden_states,
                encoder_attention_mask=cross_attention_mask,  # flexcache: upstream passes None
                cache=cache if use_cache else None,
                use_cache=use_cache,
                **kwargs,
            )

        hidden_states = self.layer_norm(hidden_states)

        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden_states, cache=cache)


class _CacheRows:
    """The rows of one flexible cache that Whisper's post-processing kept, copied only if its storage is reused (the
    running call's lease of the cache calls `_copy_all` before a later lease reuses it)."""

    def __init__(self, cache: FlexibleEncoderDecoderCache, lease):
        self.cache = cache
        self.copies: list | None = None
        if lease is not None:
            lease.before_reuse(self._copy_all)

    def _copy_all(self) -> None:
        if self.copies is not None:
            return
        cache, batch_size = self.cache, self.cache.batch_size
        length, encoder_len = int(cache.get_seq_length()), cache.get_encoder_length()
        self.copies = []
        for row in range(batch_size):
            layers = []
            for layer_idx in range(len(cache.self_attention_cache)):
                keys, values = cache.self_attention_cache.get_kv(layer_idx, batch_size, length)
                cross_keys, cross_values = cache.cross_attention_cache.get_kv(layer_idx, batch_size, encoder_len)
                layers.append(tuple(t[row][None].cpu() for t in (keys, values, cross_keys, cross_values)))
            self.copies.append(EncoderDecoderCache(layers))

    def copy_of(self, row: int) -> EncoderDecoderCache:
        self._copy_all()
        return self.copies[row]


class _RowOf:
    """Row `index` of a `_CacheRows`."""

    def __init__(self, rows: _CacheRows, index: int):
        self.rows, self.index = rows, index


_SEGMENT_LISTENER: ContextVar = ContextVar("flexcache_whisper_segment_listener", default=None)


class FlexWhisperForConditionalGeneration(
    FlexModelMixin, WhisperForConditionalGeneration, FlexCacheInnerGenerateMixin, GenerationMixin
):
    """`WhisperForConditionalGeneration` with cross-attention through `get_kv`, an optional cross-attention mask, and
    `flexible_static` in generate.

    `encoder_attention_mask` (`[B, L_enc]`) given to `forward` or `generate` reaches the decoder through upstream's
    `**kwargs`. `FlexCacheInnerGenerateMixin` pads each call that Whisper's generate makes to upstream's generate in
    `shape_policy="padded"`.
    """

    _flex_module_classes = {WhisperAttention: FlexWhisperAttention, WhisperDecoder: FlexWhisperDecoder}
    # Padded mode pads the mask that `FlexWhisperDecoder` reads; `attention_mask` masks log-mel frames.
    _flex_encoder_mask_key = "encoder_attention_mask"
    # Whisper's generate repeats each input per returned sequence before upstream's generate expands beams.
    _flex_repeats_inputs_per_sequence = True

    def generate(self, *args, segment_listener=None, **kwargs):
        """Wraps `WhisperGenerationMixin.generate` (transformers==5.24.0).

        Differences: `segment_listener` (optional), a callable, is called as `segment_listener(row, segments,
        window_start_s)` each time a window of a row is transcribed, with the segments that upstream's generate adds
        for it (its own dicts, as `return_segments=True` returns them) and the start of the window in seconds: a
        server streams segments as they complete. It sees only this call (a context variable, not the model's state:
        several generate calls on one model may run in threads at once).
        """
        token = _SEGMENT_LISTENER.set(segment_listener)
        try:
            return super().generate(*args, **kwargs)
        finally:
            _SEGMENT_LISTENER.reset(token)

    def _retrieve_segment(self, **kwargs):
        """Wraps `WhisperGenerationMixin._retrieve_segment` (transformers==5.24.0), called by its generate with
        keywords only. Differences: the call's `segment_listener` (see `generate`) hears of the segments."""
        segments, segment_offset = super()._retrieve_segment(**kwargs)
        listener = _SEGMENT_LISTENER.get()
        if listener is not None:
            row = kwargs["prev_idx"]
            listener(row, segments, float(kwargs["time_offset"][row]))
        return segments, segment_offset

    def _flex_encoder_len(self, inputs_tensor, model_input_name: str, model_kwargs: dict) -> int:
        """Encoder positions of a call: its encoder's convolutions halve the log-mel frames (`input_features`:
        `[B, mel, frames]`), unless `encoder_outputs` are given. Features longer than the encoder's window are
        long-form: Whisper's generate encodes them one window (`max_source_positions` positions) at a time."""
        if model_kwargs.get("encoder_outputs") is not None or model_input_name != "input_features":
            return super()._flex_encoder_len(inputs_tensor, model_input_name, model_kwargs)
        positions = int(self._get_feat_extract_output_lengths(torch.tensor(inputs_tensor.shape[-1])))
        return min(positions, self.config.max_source_positions)

    def _postprocess_outputs(
        self, seek_outputs, decoder_input_ids, return_token_timestamps, generation_config, **kwargs
    ):
        """Wraps `WhisperGenerationMixin._postprocess_outputs` (transformers==5.24.0).

        Differences: a flexible cache in the outputs is not copied row by row to the CPU (upstream splits every output
        per row, the cache included, to stack them back later), and a cache whose model calls run elsewhere is dropped
        (`ForwardingCache`: a serving engine request's seats, which serve other requests once it ends). Each row keeps a reference to the cache instead, and
        `_stack_split_outputs` returns the cache itself when its rows are the call's rows in order. If a later call of
        the same generate (a temperature fallback) is about to reuse that storage, the rows are copied first, as
        upstream copies them.
        """
        cache = seek_outputs.get("cache") if isinstance(seek_outputs, ModelOutput) else None
        if not isinstance(cache, (FlexibleEncoderDecoderCache, ForwardingCache)):
            return super()._postprocess_outputs(
                seek_outputs, decoder_input_ids, return_token_timestamps, generation_config, **kwargs
            )
        without_cache = type(seek_outputs)(**{key: value for key, value in seek_outputs.items() if key != "cache"})
        if isinstance(cache, ForwardingCache):
            # flexcache: a serving engine's request holds no rows of its own to keep (its seats serve others next)
            return super()._postprocess_outputs(
                without_cache, decoder_input_ids, return_token_timestamps, generation_config, **kwargs
            )
        sequences, rows = super()._postprocess_outputs(
            without_cache, decoder_input_ids, return_token_timestamps, generation_config, **kwargs
        )
        if isinstance(rows, list):
            plan = current_plan(self)
            shared = _CacheRows(cache, plan and plan.lease_of(cache)) if kwargs.get("is_shortform") else None
            for index, row in enumerate(rows):
                # Upstream keeps no cache for long-form calls ("too costly"): neither does this.
                row["cache"] = _RowOf(shared, index) if shared is not None else None
        return sequences, rows

    def _stack_split_outputs(self, seek_outputs, model_output_type, device, kwargs):
        """Wraps `WhisperGenerationMixin._stack_split_outputs` (transformers==5.24.0).

        Differences: rows that refer to one flexible cache, in order, give back that cache (no copy); otherwise (rows
        from several calls after a temperature fallback) each row's copy is stacked as upstream stacks them.
        """
        refs = [row.get("cache") for row in seek_outputs]
        if not refs or not all(isinstance(ref, _RowOf) for ref in refs):
            return super()._stack_split_outputs(seek_outputs, model_output_type, device, kwargs)
        shared = refs[0].rows
        # The cache itself when the returned rows are its first rows, in order. As for every other model, it then
        # holds every row the call ran: each beam (upstream's copy keeps rows 0..B-1, which are these first rows),
        # and the padding rows of the padded policy.
        whole = all(ref.rows is shared for ref in refs) and [ref.index for ref in refs] == list(range(len(refs)))
        if whole and shared.copies is None and not shared.cache.is_stale:
            rows = [{key: value for key, value in row.items() if key != "cache"} for row in seek_outputs]
            outputs = super()._stack_split_outputs(rows, model_output_type, device, kwargs)
            outputs["cache"] = shared.cache
            return outputs
        rows = [{**row, "cache": ref.rows.copy_of(ref.index)} for row, ref in zip(seek_outputs, refs, strict=True)]
        return super()._stack_split_outputs(rows, model_output_type, device, kwargs)

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """Wraps `GenerationMixin._validate_model_kwargs` (transformers==5.24.0).

        Differences: `encoder_attention_mask` is accepted: it reaches `FlexWhisperDecoder` through `forward`'s
        `**kwargs`, which upstream's signature-based check cannot see. Every other key is checked by upstream.
        """
        super()._validate_model_kwargs({k: v for k, v in model_kwargs.items() if k != "encoder_attention_mask"})


FLEX_MODEL_CLASSES = [FlexWhisperForConditionalGeneration]
