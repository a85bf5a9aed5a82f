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
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.configuration_utils import PreTrainedConfig

from ..log import get_logger
from .capacity import Reservation
from .config import (
    ON_OVERFLOW_CHOICES,
    SHAPE_POLICIES,
    Overflow,
    check_choice,
    check_positive_int,
    overflow_message,
)
from .layers import ATTENTION_LAYER_CLASSES, FlexibleStaticLayer, LayerSpec
from .lifecycle import FlexibleStorage
from .linear_attention import LINEAR_ATTENTION_LAYER_CLASSES, FlexibleLinearAttentionLayer, LinearAttentionStates
from .placement import layer_specs_for_model
from .sliding import SLIDING_LAYER_CLASSES
from .specs import layer_specs_from_config

logger = get_logger(__name__)


def _nbytes_per_device(specs: list[LayerSpec], *, max_batch_size: int, length: int) -> dict[str, int]:
    per_device: dict[str, int] = {}
    for spec in specs:
        key = str(spec.device)
        per_device[key] = per_device.get(key, 0) + spec.nbytes(max_batch_size=max_batch_size, max_cache_len=length)
    return per_device


def _sum_per_device(*parts: Mapping[str, int]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for device, nbytes in part.items():
            total[device] = total.get(device, 0) + nbytes
    return total


class FlexibleLayerCache(FlexibleStorage, Cache):
    """A list of layers in `[B_max, ..., L_max, ...]` storage, with the live batch and length: what the self- and
    cross-attention caches share. Subclasses name the storage length (`LENGTH_CAPACITY`) and choose the layer class
    of each spec (`_layer_class`)."""

    LENGTH_CAPACITY: str = ""  # the capacity that the layers' storage length stands for
    # Defaults for objects built without __init__ (the export's views over buffers), overridden per object.
    _call_limits: dict[str, int] = {}  # the limits `reserve` set for the running call (on_overflow="error")

    def _build(
        self,
        *,
        layer_specs: list[LayerSpec],
        max_batch_size: int,
        length: int,
        on_overflow: str,
        shape_policy: str,
    ) -> None:
        check_positive_int("max_batch_size", max_batch_size)
        check_positive_int(self.LENGTH_CAPACITY, length)
        self.on_overflow = check_choice("on_overflow", on_overflow, ON_OVERFLOW_CHOICES)
        self.shape_policy = check_choice("shape_policy", shape_policy, SHAPE_POLICIES)
        self.layer_specs = list(layer_specs)
        layers = [
            self._layer_class(spec)(spec=spec, max_batch_size=max_batch_size, max_cache_len=length)
            for spec in self.layer_specs
        ]
        Cache.__init__(self, layers=layers)
        self.num_allocations = 1

    def _layer_class(self, spec: LayerSpec) -> type:
        raise NotImplementedError

    @property
    def layers(self) -> list:
        """The layers (upstream's `Cache.layers`).

        Raises:
            ValueError: this cache object is stale (see `mark_stale`).
        """
        self._check_live()
        return self._layers

    @layers.setter
    def layers(self, layers: list) -> None:
        self._layers = layers

    # --- FlexibleStorage ------------------------------------------------------------------------------------------
    def _parts(self) -> tuple[FlexibleLayerCache, ...]:
        return (self,)

    def _storages(self) -> list[torch.Tensor]:
        return [tensor for layer in self._layers for tensor in layer.storages()]  # none once stale: no error

    def _let_go(self, reason: str) -> None:
        self._layers = []

    def _renew_from(self, old: FlexibleLayerCache) -> None:
        self.layers = [layer.renewed() for layer in old.layers]
        self._call_limits = {}
        self.reset()

    def _own_capacities(self) -> dict[str, int]:
        return {"max_batch_size": self.max_batch_size, self.LENGTH_CAPACITY: self._length()}

    def _apply(self, reservation: Reservation) -> None:
        """Grow to the capacities of `reservation.required` that this cache holds, and keep the call's limits: those
        configured, else what the storage holds (`on_overflow="error"`)."""
        names = [name for name in self._own_capacities() if name in reservation.need]
        self.on_overflow = reservation.config.on_overflow
        self._grow_to({name: reservation.required[name] for name in names})
        held = self._own_capacities()
        limits = {name: reservation.limits.get(name, held[name]) for name in names}
        self._call_limits = limits if reservation.config.on_overflow == "error" else {}

    # --- capacities -----------------------------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.layers[0].max_batch_size

    def _length(self) -> int:
        # The first attention layer: linear-attention layers have no length axis.
        return next(layer.max_cache_len for layer in self.layers if isinstance(layer, FlexibleStaticLayer))

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        """The device of the first layer's storage (see `layer_specs` for each layer's)."""
        return self.layers[0].device

    def _grow_to(self, target: Mapping[str, int]) -> None:
        batch = max(self.max_batch_size, target.get("max_batch_size", 0))
        length = max(self._length(), target.get(self.LENGTH_CAPACITY, 0))
        if (batch, length) == (self.max_batch_size, self._length()):
            return
        before = self.data_ptrs()
        for layer in self.layers:
            layer.grow(max_batch_size=batch, max_cache_len=length)
        if self.data_ptrs() != before:  # sliding-window layers past their window grow without reallocating
            self.num_allocations += 1

    def ensure_capacity(self, *, batch_size: int, length: int) -> None:
        """Make room for `batch_size` rows reaching `length` positions inside a forward, per `on_overflow`.

        Growth here is geometric (a row count or length at least doubles), so that a cache continued token by token
        without a reservation reallocates a logarithmic number of times.

        Raises:
            ValueError: with `on_overflow="error"`, naming each value, its limit and the `cache_config` that fits.
                Nothing has been changed when it is raised.
        """
        held = self._own_capacities()
        limits = {**held, **self._call_limits}
        need = {"max_batch_size": batch_size, self.LENGTH_CAPACITY: length}
        exceeded = [Overflow(name, value, limits[name]) for name, value in need.items() if value > limits[name]]
        if not exceeded:
            return
        message = overflow_message(exceeded)
        if self.on_overflow == "error":
            raise ValueError(message)
        target = {
            name: max(value, 2 * held[name]) if value > held[name] else held[name] for name, value in need.items()
        }
        capacities = ", ".join(f"{name}={value}" for name, value in target.items())
        logger.warning("%s grows (one reallocation, to %s): %s", type(self).__name__, capacities, message)
        self._grow_to(target)

    # --- the public accessor --------------------------------------------------------------------------------------
    def get_kv(self, layer_idx: int, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer `layer_idx` for the first `batch_size` rows and `length` positions.

        Args:
            layer_idx (`int`): decoder layer.
            batch_size (`int`): rows to return, at most `max_batch_size`.
            length (`int`): positions to return, at most the capacity.

        Returns:
            `tuple[torch.Tensor, torch.Tensor]`: views `[batch_size, kv_heads, length, head_dim]` into the storage
            (no copy): writes through them land in the cache.

        Raises:
            ValueError: `layer_idx`, `batch_size` or `length` is out of range, `layer_idx` is a linear-attention
                layer, or this cache object is stale.
        """
        self._check_live()
        layer = self._checked_layer(layer_idx, FlexibleStaticLayer)
        if not 0 <= batch_size <= layer.max_batch_size:
            raise ValueError(f"batch_size={batch_size} must be between 0 and max_batch_size={layer.max_batch_size}")
        if not 0 <= length <= layer.max_cache_len:
            raise ValueError(f"length={length} must be between 0 and {self.LENGTH_CAPACITY}={layer.max_cache_len}")
        return layer.get_kv(batch_size, length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write `key_states`/`value_states` after the live length of layer `layer_idx`; return what to attend to.

        Args:
            key_states (`torch.Tensor`): `[B, H, S, D]` new keys.
            value_states (`torch.Tensor`): `[B, H, S, D]` new values.
            layer_idx (`int`): decoder layer.

        Returns:
            `tuple[torch.Tensor, torch.Tensor]`: views `[B, H, L + S, D]` of everything this call wrote; with
            `shape_policy="padded"`, `[B, H, L_max, D]` (all positions; the mask hides those not written), and with
            `"bucketed"` `[B, H, W, D]`, the call's length bucket.

        Raises:
            ValueError: the heads, head dim, device or dtype differ from the storage's; the batch differs from the one
                already written since the last `reset()`; the call exceeds a capacity with `on_overflow="error"`
                (with a fixed-shape policy only the batch is checked here, see `FlexiblePaddedLayer`); or this
                cache object is stale. Nothing is written.
        """
        self._check_live()
        layer = self._checked_layer(layer_idx, FlexibleStaticLayer)
        self._check_states(layer, layer_idx, key_states, value_states)
        batch_size, num_new = key_states.shape[0], key_states.shape[-2]
        if layer.is_compileable:
            # Only static shapes are read here: a compiled decode step must not guard on a changing Python value.
            if batch_size > layer.max_batch_size:
                raise ValueError(
                    f"batch_size={batch_size} exceeds max_batch_size={layer.max_batch_size}; a padded cache does not "
                    f'grow inside a forward: pass cache_config={{"max_batch_size": {batch_size}}} or more'
                )
            return layer.update(key_states, value_states)
        if layer.seq_len > 0 and batch_size != layer.batch_size:
            raise ValueError(
                f"batch_size={batch_size} differs from batch_size={layer.batch_size} already cached in layer "
                f"{layer_idx}; call cache.reset() before a call with another batch"
            )
        self.ensure_capacity(batch_size=batch_size, length=layer.seq_len + num_new)
        return layer.update(key_states, value_states)

    def _check_states(self, layer: FlexibleStaticLayer, layer_idx: int, key_states, value_states) -> None:
        # Shapes, devices and dtypes are static: these checks cost a compiled step nothing.
        storage_keys, storage_values = layer._key_storage, layer._value_storage
        expected = (layer.num_heads, storage_keys.shape[-1]), (layer.num_heads, storage_values.shape[-1])
        got = (key_states.shape[1], key_states.shape[-1]), (value_states.shape[1], value_states.shape[-1])
        if got != expected:
            raise ValueError(
                f"layer {layer_idx} got keys/values of (heads, head_dim) {got[0]}/{got[1]}, but its storage holds "
                f"{expected[0]}/{expected[1]}; the cache was sized for other projections (a tensor-parallel shard, "
                "or another model): build it with FlexibleStaticCache.for_model(model, ...) or through generate"
            )
        if key_states.device != storage_keys.device or key_states.dtype != storage_keys.dtype:
            raise ValueError(
                f"layer {layer_idx} got keys on {key_states.device} in {key_states.dtype}, but its storage is on "
                f"{storage_keys.device} in {storage_keys.dtype}; build the cache with FlexibleStaticCache.for_model"
                "(model, ...) (or through generate), which places each layer where the model runs it"
            )

    def early_initialization(self, batch_size: int, num_heads, head_dim, dtype: torch.dtype, device) -> None:
        """Storage is allocated at construction; this only makes room for `batch_size` rows (upstream API)."""
        self.ensure_capacity(batch_size=batch_size, length=0)

    def get_seq_length(self, layer_idx: int = 0):
        self._check_live()
        return super().get_seq_length(layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._check_live()
        super().reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self._check_live()
        super().crop(tokens_to_remove)

    @property
    def batch_size(self) -> int:
        """The live batch: rows written by the current call (0 before the first update after a reset)."""
        return self.layers[0].batch_size

    def _checked_layer(self, layer_idx: int, layer_class: type) -> FlexibleStaticLayer | FlexibleLinearAttentionLayer:
        """Layer `layer_idx`, checked to exist and to be of `layer_class`."""
        layers = self.layers
        if not 0 <= layer_idx < len(layers):
            raise ValueError(f"layer_idx={layer_idx} is out of range for a cache of {len(layers)} layers")
        layer = layers[layer_idx]
        if not isinstance(layer, layer_class):
            kinds = {FlexibleStaticLayer: "an attention", FlexibleLinearAttentionLayer: "a linear-attention"}
            accessors = {
                FlexibleStaticLayer: "get_kv/update",
                FlexibleLinearAttentionLayer: "get_conv_state/get_recurrent_state and their update_ methods",
            }
            kind = next(k for k in kinds if isinstance(layer, k))
            raise ValueError(
                f"layer {layer_idx} is {kinds[kind]} layer, not {kinds[layer_class]} one; use {accessors[kind]} for it"
            )
        return layer


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
        return _nbytes_per_device(specs, max_batch_size=max_batch_size, length=max_cache_len)

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
        if ATTENTION_LAYER_CLASSES[self.shape_policy].is_compileable:  # the fixed-shape policies
            for layer in self.layers:
                layer.mark_static_address()

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
            _nbytes_per_device(layer_specs, max_batch_size=max_batch_size, length=max_cache_len),
            _nbytes_per_device(cross_layer_specs, max_batch_size=max_batch_size, length=max_encoder_len),
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
