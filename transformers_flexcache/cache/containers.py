"""The flexible caches: self-attention, cross-attention, and the encoder-decoder cache made of the two.

Shape legend: `B` live batch, `B_max` `max_batch_size`, `H` kv heads, `S` new tokens, `L` live length, `L_max` the
length of a layer's storage (`max_cache_len` for self-attention, `max_encoder_len` for cross-attention), `D` head dim.

Design decisions:
- Storage is allocated once, when the cache is built, from one `LayerSpec` per layer (kv heads, head dims, device
  and dtype: read from the config, or from the loaded model by `placement.py`). Nothing is allocated again unless a
  call exceeds a capacity and the cache is allowed to grow.
- A layer's storage has rows and a length, whatever it holds; the container names them: `FlexibleStaticCache` holds
  `max_batch_size` rows of `max_cache_len` decoder positions, `FlexibleCrossAttentionCache` rows of `max_encoder_len`
  encoder positions (`LENGTH_CAPACITY`), in its constructor, its capacities and its errors. (The layers keep
  upstream's name for their storage length, `max_cache_len`, which upstream's cross-attention `StaticLayer`s use for
  encoder positions too.)
- What a call may hold is decided once, by `capacity.decide` (asked by the model's pool), and applied by
  `reserve(reservation)`; storage never shrinks. Growth inside `update` (a cache used by hand, or a call that writes
  past its reservation with `on_overflow="grow"`) is geometric: a row count or a length at least doubles, so that a
  cache continued token by token reallocates a logarithmic number of times.
- The storage lifecycle (bytes, reservation, renewal, staleness, release) is `FlexibleStorage`'s, defined once over
  the parts of a cache: `FlexibleEncoderDecoderCache` loops over its two halves (`lifecycle.py`).
- Models reach the tensors only through `get_kv(layer_idx, batch_size, length)`, `update(...)`, the linear-attention
  state accessors (`LinearAttentionStates`) and `cross_attention_kv`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers.cache_utils import EncoderDecoderCache
from transformers.configuration_utils import PreTrainedConfig

from .capacity import Reservation
from .config import ON_OVERFLOW_CHOICES, check_choice, check_positive_int
from .layer_cache import FlexibleLayerCache, nbytes_per_device_of
from .layers import ATTENTION_LAYER_CLASSES, FlexibleStaticLayer, LayerSpec
from .lifecycle import FlexibleStorage
from .linear_attention import LINEAR_ATTENTION_LAYER_CLASSES, LinearAttentionStates
from .placement import layer_specs_for_model
from .sliding import SLIDING_LAYER_CLASSES
from .specs import layer_specs_from_config


def _sum_per_device(*parts: Mapping[str, int]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for device, nbytes in part.items():
            total[device] = total.get(device, 0) + nbytes
    return total


class FlexibleStaticCache(LinearAttentionStates, FlexibleLayerCache):
    """A static self-attention cache allocated once at `max_batch_size x max_cache_len`, serving any smaller shape.

    Hybrid models (Jamba) also get their linear-attention (Mamba) conv and recurrent states, allocated once at
    `max_batch_size` rows and read and written through `get_conv_state`, `update_conv_state`, `get_recurrent_state`
    and `update_recurrent_state` (`LinearAttentionStates`). Sliding-window layers (Mistral, Gemma2/3, Qwen2 with
    `use_sliding_window`) hold `min(sliding_window, max_cache_len)` positions per row (see `sliding.py`).

    Args:
        config (`PreTrainedConfig`, *optional*): the model's config; the decoder's layer types, kv heads and head dim
            (and, for linear-attention layers, the Mamba sizes) are read from it. Not needed with `layer_specs`.
        max_batch_size (`int`): rows to allocate (count `batch x num_beams` for beam search).
        max_cache_len (`int`): positions to allocate per row (prompt plus generated tokens).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the storage (the model's dtype).
        device (`torch.device` or `str`, *optional*, defaults to `"cpu"`): device of the storage.
        on_overflow (`str`, *optional*, defaults to `"grow"`): what a call over capacity does: `"grow"` reallocates
            (with a warning naming the capacity to preset), `"error"` raises `ValueError` before writing.
        shape_policy (`str`, *optional*, defaults to `"exact"`): `"exact"` returns views of the live batch and length
            (eager, `torch.export` with dynamic shapes); `"padded"` returns all `max_cache_len` positions and leaves the
            rest to the attention mask, so that shapes stay fixed for `torch.compile` (see `FlexiblePaddedLayer`);
            `"bucketed"` returns the positions of the call's length bucket (see `FlexibleBucketedLayer`).
        layer_specs (`list[LayerSpec]`, *optional*): one spec per decoder layer, overriding what `config`, `dtype`
            and `device` say: `FlexibleStaticCache.for_model` places each layer where the model runs it.

    Raises:
        ValueError: a capacity is not a positive int, `on_overflow` or `shape_policy` is unknown, the model has layer
            types other than full attention, sliding-window attention and linear attention, or no attention layer.

    Example:

    ```python
    >>> cache = FlexibleStaticCache(config=model.config, max_batch_size=8, max_cache_len=256)
    >>> out = model(input_ids[:2], cache=cache, use_cache=True)  # batch 2 of 8, no reallocation
    >>> keys, values = cache.get_kv(0, batch_size=2, length=cache.get_seq_length())
    >>> cache.reset()  # cheap: counters only; the next call may use any batch <= 8
    ```
    """

    LENGTH_CAPACITY = "max_cache_len"
    # A shape, not storage: with a fixed-shape policy, decoder-only prompts are left-padded to it. 0: not set yet.
    max_prompt_len = 0
    # Fixed-shape policies: the masked columns before the real prompt of the call that filled this cache (what its
    # rows hold). A continuation from it is left-padded by as many, so that its positions line up with them.
    num_prompt_pad = 0

    def __init__(
        self,
        *,
        config: PreTrainedConfig | None = None,
        max_batch_size: int,
        max_cache_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        on_overflow: str = "grow",
        shape_policy: str = "exact",
        layer_specs: list[LayerSpec] | None = None,
    ):
        if layer_specs is None:
            if config is None:
                raise TypeError(f"{type(self).__name__} needs config= (or layer_specs=) to know its layers")
            layer_specs = layer_specs_from_config(config, dtype=dtype, device=device)
        self._build(
            layer_specs=layer_specs,
            max_batch_size=max_batch_size,
            length=max_cache_len,
            on_overflow=on_overflow,
            shape_policy=shape_policy,
        )

    @classmethod
    def for_model(cls, model, *, max_batch_size: int, max_cache_len: int, **kwargs) -> FlexibleStaticCache:
        """A cache for `model`'s decoder with each layer's storage where the model runs that layer, with the heads its
        projections produce (tensor-parallel shards) and in their dtype (see `placement.py`). Other keyword arguments
        are those of the constructor."""
        layer_specs, _ = layer_specs_for_model(model)
        return cls(
            config=model.config,
            max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
            layer_specs=layer_specs,
            **kwargs,
        )

    def _layer_class(self, spec: LayerSpec) -> type:
        if spec.layer_type == "linear_attention":
            return LINEAR_ATTENTION_LAYER_CLASSES[self.shape_policy]
        if spec.layer_type == "sliding_attention":
            return SLIDING_LAYER_CLASSES[self.shape_policy]
        return ATTENTION_LAYER_CLASSES[self.shape_policy]

    @classmethod
    def nbytes_for(
        cls,
        *,
        config: PreTrainedConfig | None = None,
        max_batch_size: int,
        max_cache_len: int,
        dtype: torch.dtype = torch.float32,
        layer_specs: list[LayerSpec] | None = None,
    ) -> int:
        """Bytes that a cache of these capacities allocates, computed without allocating anything."""
        return sum(
            cls.nbytes_per_device_for(
                config=config,
                max_batch_size=max_batch_size,
                max_cache_len=max_cache_len,
                dtype=dtype,
                layer_specs=layer_specs,
            ).values()
        )

    @classmethod
    def nbytes_per_device_for(
        cls,
        *,
        config: PreTrainedConfig | None = None,
        max_batch_size: int,
        max_cache_len: int,
        dtype: torch.dtype = torch.float32,
        layer_specs: list[LayerSpec] | None = None,
    ) -> dict[str, int]:
        """Bytes that a cache of these capacities allocates on each device (`"cpu"`, `"cuda:0"`, ...)."""
        specs = layer_specs if layer_specs is not None else layer_specs_from_config(config, dtype=dtype)
        return nbytes_per_device_of(specs, max_batch_size=max_batch_size, length=max_cache_len)

    @property
    def max_cache_len(self) -> int:
        return self._length()

    def _own_capacities(self) -> dict[str, int]:
        return {**super()._own_capacities(), "max_prompt_len": self.max_prompt_len}

    def _apply(self, reservation: Reservation) -> None:
        """As `FlexibleLayerCache._apply`, and tell each attention layer the decoder positions the call needs (the
        bucketed layer sizes its attention span from them)."""
        self.max_prompt_len = max(self.max_prompt_len, reservation.required.get("max_prompt_len", 0))
        super()._apply(reservation)
        if "max_cache_len" in reservation.need:
            for layer in self.layers:
                if isinstance(layer, FlexibleStaticLayer):
                    layer.plan_call(cache_len=reservation.need["max_cache_len"], config=reservation.config)

    def grow(self, *, max_batch_size: int | None = None, max_cache_len: int | None = None) -> None:
        """Reallocate to at least these capacities, keeping live content. A no-op when the cache is big enough."""
        self._grow_to({"max_batch_size": max_batch_size or 0, "max_cache_len": max_cache_len or 0})


class FlexibleCrossAttentionCache(FlexibleLayerCache):
    """The cross-attention half of `FlexibleEncoderDecoderCache`: `max_batch_size` rows of `max_encoder_len` encoder
    positions.

    Its live length is the encoder length that the current call wrote. Its layers keep exact Python-int lengths in
    every shape policy: the cache is written once per call (a model can ask `get_seq_length` whether it was, without a
    host sync), and the fixed-shape policies pad the encoder output to their encoder length, so its shapes are already
    fixed. With a fixed-shape policy (`"padded"`, `"bucketed"`) its storage is only marked as a static address, for
    CUDA graphs.

    Args:
        config (`PreTrainedConfig`, *optional*): the model's config (the decoder's kv heads and head dim are read from
            it). Not needed with `layer_specs`.
        max_batch_size (`int`): rows to allocate.
        max_encoder_len (`int`): encoder positions to allocate per row.
        dtype, device, on_overflow, shape_policy, layer_specs: as for `FlexibleStaticCache`.
    """

    LENGTH_CAPACITY = "max_encoder_len"

    def __init__(
        self,
        *,
        config: PreTrainedConfig | None = None,
        max_batch_size: int,
        max_encoder_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        on_overflow: str = "grow",
        shape_policy: str = "exact",
        layer_specs: list[LayerSpec] | None = None,
    ):
        if layer_specs is None:
            if config is None:
                raise TypeError(f"{type(self).__name__} needs config= (or layer_specs=) to know its layers")
            layer_specs = layer_specs_from_config(config, dtype=dtype, device=device)
        self._build(
            layer_specs=layer_specs,
            max_batch_size=max_batch_size,
            length=max_encoder_len,
            on_overflow=on_overflow,
            shape_policy=shape_policy,
        )

    def _layer_class(self, spec: LayerSpec) -> type:
        return FlexibleStaticLayer

    @property
    def max_encoder_len(self) -> int:
        return self._length()

    def grow(self, *, max_batch_size: int | None = None, max_encoder_len: int | None = None) -> None:
        """Reallocate to at least these capacities, keeping live content. A no-op when the cache is big enough."""
        self._grow_to({"max_batch_size": max_batch_size or 0, "max_encoder_len": max_encoder_len or 0})


class FlexibleEncoderDecoderCache(FlexibleStorage, EncoderDecoderCache):
    """Self-attention plus cross-attention flexible caches, allocated once for encoder-decoder models.

    Args:
        config (`PreTrainedConfig`, *optional*): the model's config (not needed with both `*layer_specs`).
        max_batch_size (`int`): rows to allocate in both caches.
        max_cache_len (`int`): decoder positions to allocate (self-attention).
        max_encoder_len (`int`): encoder positions to allocate (cross-attention).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the storage.
        device (`torch.device` or `str`, *optional*, defaults to `"cpu"`): device of the storage.
        on_overflow (`str`, *optional*, defaults to `"grow"`): `"grow"` or `"error"`, as for `FlexibleStaticCache`.
        shape_policy (`str`, *optional*, defaults to `"exact"`): `"exact"`, `"padded"` or `"bucketed"`, as for
            `FlexibleStaticCache` (it applies to self-attention; see `FlexibleCrossAttentionCache` for
            cross-attention).
        layer_specs, cross_layer_specs (`list[LayerSpec]`, *optional*): per-layer specs of the self-attention and
            cross-attention storage (see `FlexibleStaticCache`).

    Models read the cross-attention keys and values of the current call through `cross_attention_kv`, which writes
    them on the call's first decoder step (`cross_attention_cache.update`) and reads them back afterwards
    (`cross_attention_cache.get_kv`). The lifecycle of the storage (bytes, reservation, renewal, staleness, release)
    loops over the two halves (`FlexibleStorage`).
    """

    def __init__(
        self,
        *,
        config: PreTrainedConfig | None = None,
        max_batch_size: int,
        max_cache_len: int,
        max_encoder_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        on_overflow: str = "grow",
        shape_policy: str = "exact",
        layer_specs: list[LayerSpec] | None = None,
        cross_layer_specs: list[LayerSpec] | None = None,
    ):
        common = {
            "config": config,
            "max_batch_size": max_batch_size,
            "dtype": dtype,
            "device": device,
            "shape_policy": shape_policy,
            "on_overflow": on_overflow,
        }
        check_positive_int("max_encoder_len", max_encoder_len)
        super().__init__(
            FlexibleStaticCache(max_cache_len=max_cache_len, layer_specs=layer_specs, **common),
            FlexibleCrossAttentionCache(max_encoder_len=max_encoder_len, layer_specs=cross_layer_specs, **common),
        )

    @classmethod
    def for_model(
        cls, model, *, max_batch_size: int, max_cache_len: int, max_encoder_len: int, **kwargs
    ) -> FlexibleEncoderDecoderCache:
        """A cache for `model`'s decoder, each layer placed where the model runs it (see
        `FlexibleStaticCache.for_model`). Other keyword arguments are those of the constructor."""
        layer_specs, cross_layer_specs = layer_specs_for_model(model)
        return cls(
            config=model.config,
            max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
            max_encoder_len=max_encoder_len,
            layer_specs=layer_specs,
            cross_layer_specs=cross_layer_specs,
            **kwargs,
        )

    @classmethod
    def nbytes_for(
        cls,
        *,
        config: PreTrainedConfig | None = None,
        max_batch_size: int,
        max_cache_len: int,
        max_encoder_len: int,
        dtype: torch.dtype = torch.float32,
        layer_specs: list[LayerSpec] | None = None,
        cross_layer_specs: list[LayerSpec] | None = None,
    ) -> int:
        """Bytes that a cache of these capacities allocates, computed without allocating anything."""
        return sum(
            cls.nbytes_per_device_for(
                config=config,
                max_batch_size=max_batch_size,
                max_cache_len=max_cache_len,
                max_encoder_len=max_encoder_len,
                dtype=dtype,
                layer_specs=layer_specs,
                cross_layer_specs=cross_layer_specs,
            ).values()
        )

    @classmethod
    def nbytes_per_device_for(
        cls,
        *,
        config: PreTrainedConfig | None = None,
        max_batch_size: int,
        max_cache_len: int,
        max_encoder_len: int,
        dtype: torch.dtype = torch.float32,
        layer_specs: list[LayerSpec] | None = None,
        cross_layer_specs: list[LayerSpec] | None = None,
    ) -> dict[str, int]:
        """Bytes that a cache of these capacities allocates on each device."""
        if layer_specs is None or cross_layer_specs is None:
            from_config = layer_specs_from_config(config, dtype=dtype)
            layer_specs, cross_layer_specs = layer_specs or from_config, cross_layer_specs or from_config
        return _sum_per_device(
            nbytes_per_device_of(layer_specs, max_batch_size=max_batch_size, length=max_cache_len),
            nbytes_per_device_of(cross_layer_specs, max_batch_size=max_batch_size, length=max_encoder_len),
        )

    # --- FlexibleStorage: the two halves ------------------------------------------------------------------------
    def _parts(self) -> tuple[FlexibleLayerCache, ...]:
        return (self.self_attention_cache, self.cross_attention_cache)

    def _let_go(self, reason: str) -> None:
        for part in self._parts():
            part.mark_stale(reason)

    def _renew_from(self, old: FlexibleEncoderDecoderCache) -> None:
        self.self_attention_cache = old.self_attention_cache.renewed()
        self.cross_attention_cache = old.cross_attention_cache.renewed()
        self.is_updated = dict.fromkeys(old.is_updated, False)

    # --- what the halves hold -------------------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.self_attention_cache.max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self.self_attention_cache.max_cache_len

    @property
    def max_encoder_len(self) -> int:
        return self.cross_attention_cache.max_encoder_len

    @property
    def on_overflow(self) -> str:
        return self.self_attention_cache.on_overflow

    @on_overflow.setter
    def on_overflow(self, value: str) -> None:
        check_choice("on_overflow", value, ON_OVERFLOW_CHOICES)
        for part in self._parts():
            part.on_overflow = value

    @property
    def shape_policy(self) -> str:
        return self.self_attention_cache.shape_policy

    @property
    def num_allocations(self) -> int:
        return sum(part.num_allocations for part in self._parts())

    @property
    def dtype(self) -> torch.dtype:
        return self.self_attention_cache.dtype

    @property
    def device(self) -> torch.device:
        return self.self_attention_cache.device

    @property
    def layer_specs(self) -> list[LayerSpec]:
        return self.self_attention_cache.layer_specs

    @property
    def cross_layer_specs(self) -> list[LayerSpec]:
        return self.cross_attention_cache.layer_specs

    @property
    def batch_size(self) -> int:
        return self.self_attention_cache.batch_size

    @property
    def num_prompt_pad(self) -> int:
        return self.self_attention_cache.num_prompt_pad

    @num_prompt_pad.setter
    def num_prompt_pad(self, value: int) -> None:
        self.self_attention_cache.num_prompt_pad = value

    # --- access -------------------------------------------------------------------------------------------------
    def get_encoder_length(self, layer_idx: int = 0) -> int:
        """Encoder positions that the current call wrote into cross-attention layer `layer_idx` (0 before)."""
        return self.cross_attention_cache.get_seq_length(layer_idx)

    def cross_attention_kv(self, layer_idx: int, key_value_states: torch.Tensor, project) -> tuple[torch.Tensor, ...]:
        """Cross-attention keys and values of layer `layer_idx` for the current call, projected once per call.

        The call's first decoder step projects `key_value_states` with `project` and writes the result with
        `cross_attention_cache.update`; later steps read it back with `cross_attention_cache.get_kv` for the live
        batch and the encoder length written, without projecting again. This is what upstream does with `is_updated`
        and `.layers[i].keys`, through the public accessors.

        Args:
            layer_idx (`int`): decoder layer.
            key_value_states (`torch.Tensor`): `[B, L_enc, d_model]` encoder output of the call.
            project (`Callable`): maps `key_value_states` to `(key_states, value_states)`, each `[B, H, L_enc, D]`.

        Returns:
            `tuple[torch.Tensor, torch.Tensor]`: views `[B, H, L_enc, D]` into the cross-attention storage.
        """
        # key_value_states: [B, L_enc, d_model] -> 2 x [B, H, L_enc, D]
        encoder_len = self.get_encoder_length(layer_idx)
        if encoder_len > 0:
            return self.cross_attention_cache.get_kv(layer_idx, key_value_states.shape[0], encoder_len)
        key_states, value_states = project(key_value_states)
        return self.cross_attention_cache.update(key_states, value_states, layer_idx)

    def get_kv(self, layer_idx: int, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-attention keys and values (see `FlexibleStaticCache.get_kv`); cross-attention ones are read from
        `cross_attention_cache.get_kv`."""
        return self.self_attention_cache.get_kv(layer_idx, batch_size, length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Self-attention update, for models that call `update` on the combined cache."""
        return self.self_attention_cache.update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0):
        self._check_live()
        return self.self_attention_cache.get_seq_length(layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # Beams of one input share its encoder output, and beam_idx only moves rows within an input's beams, so
        # the cross-attention rows are already equal where they would be copied: reordering them would copy for
        # nothing.
        self.self_attention_cache.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the self-attention cache (assisted and prompt-lookup decoding roll candidates back).

        Overrides `EncoderDecoderCache.crop` (transformers==5.24.0), which refuses anything but a DynamicCache: the
        cross-attention half holds the encoder positions, which a rollback never touches.
        """
        self.self_attention_cache.crop(tokens_to_remove)

    def early_initialization(self, batch_size: int, num_heads, head_dim, dtype: torch.dtype, device) -> None:
        """Storage is allocated at construction; this only makes room for `batch_size` rows (upstream API)."""
        for part in self._parts():
            part.early_initialization(batch_size, num_heads, head_dim, dtype, device)


def is_flexible_cache(cache) -> bool:
    """Whether `cache` is one of this package's caches."""
    return isinstance(cache, (FlexibleStaticCache, FlexibleEncoderDecoderCache))
