"""The flexible caches: self-attention, cross-attention and encoder-decoder. They alone decide capacity and growth.

Shape legend: `B` live batch, `B_max` `max_batch_size`, `H` kv heads, `S` new tokens, `L` live length, `L_max`
`max_cache_len` (self-attention) or `max_encoder_len` (cross-attention), `D` head dim.

Design decisions:
- Storage is allocated once, when the cache is built, from one `LayerSpec` per layer (kv heads, head dims, device
  and dtype: read from the config, or from the loaded model by `placement.py`). Nothing is allocated again unless a
  call exceeds a capacity and the cache is allowed to grow.
- Capacity is decided here and nowhere else. `reserve(need, config=...)` is how a caller (generate) states what a
  call needs: it raises before anything changes (`on_overflow="error"`: a capacity given in the config is a limit
  even when the storage is larger), or grows once to what the call needs (`"grow"`, with a warning naming the
  capacity to preset). A continuation (`reserve(..., geometric=True)`: generate given a returned cache) and growth
  inside `update` (a cache used without `reserve`) are geometric: the length at least doubles, so a conversation
  continued turn by turn, or token by token, reallocates a logarithmic number of times. Storage never shrinks.
- A cache object can be superseded: `renewed()` returns a new cache object over the same storage (a pool hands one to
  each generate call) and the old object is marked stale with the reason. Any later use of a stale object raises a
  `ValueError` that says what overwrote its storage and how to keep a cache (`detach()`), instead of reading someone
  else's keys.
- Models reach the tensors only through `get_kv(layer_idx, batch_size, length)`, `update(...)`, the linear-attention
  state accessors and `cross_attention_kv`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.configuration_utils import PreTrainedConfig

from ..log import get_logger
from .config import (
    ON_OVERFLOW_CHOICES,
    SHAPE_POLICIES,
    CacheConfig,
    Overflow,
    check_choice,
    check_positive_int,
    overflow_message,
)
from .layers import ATTENTION_LAYER_CLASSES, FlexibleStaticLayer, LayerSpec
from .linear_attention import LINEAR_ATTENTION_LAYER_CLASSES, FlexibleLinearAttentionLayer
from .placement import layer_specs_for_model
from .sliding import SLIDING_LAYER_CLASSES
from .specs import layer_specs_from_config

logger = get_logger(__name__)


def plan_capacities(
    held: Mapping[str, int], need: Mapping[str, int], config: CacheConfig
) -> tuple[dict[str, int], list[Overflow]]:
    """The capacities to hold for a call that needs `need`, and the capacities that it exceeds.

    The target is grow-only: at least what is held (a capacity missing from `held`, or 0, is not set yet: the call
    sets it), what `config` sets and what the call needs. A call exceeds a
    capacity when it needs more than the configured value (`on_overflow="error"`: the configured value is a limit even
    when more is held), or more than is held when none is configured; with `on_overflow="grow"`, only needs beyond
    both what is held and what is configured count (those are what the warning names).
    """
    target, exceeded = {}, []
    for name, value in need.items():
        current, configured = held.get(name, 0), config.limit(name)
        if current == 0 and configured is None:
            limit = value  # nothing held or configured yet: the first call sets it
        elif config.on_overflow == "error":
            limit = configured if configured is not None else current
        else:
            limit = max(current, configured or 0)
        if value > limit:
            exceeded.append(Overflow(name, value, limit))
        target[name] = max(current, configured or 0, value)
    return target, exceeded


def with_headroom(target: Mapping[str, int], held: Mapping[str, int], name: str, config: CacheConfig) -> dict:
    """`target` with capacity `name` at least twice what is `held`, when it grows at all and `config` lets it grow
    (`on_overflow="grow"`): geometric growth, a logarithmic number of reallocations for a length that keeps growing."""
    target = dict(target)
    if config.on_overflow == "grow" and target.get(name, 0) > held.get(name, 0) > 0:
        target[name] = max(target[name], 2 * held[name])
    return target


class FlexibleStaticCache(Cache):
    """A static self-attention cache allocated once at `max_batch_size x max_cache_len`, serving any smaller shape.

    Hybrid models (Jamba) also get their linear-attention (Mamba) conv and recurrent states, allocated once at
    `max_batch_size` rows and read and written through `get_conv_state`, `update_conv_state`, `get_recurrent_state`
    and `update_recurrent_state`. Sliding-window layers (Mistral, Gemma2/3, Qwen2 with `use_sliding_window`) hold
    `min(sliding_window, max_cache_len)` positions per row (see `sliding.py`).

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
            rest to the attention mask, so that shapes stay fixed for `torch.compile` (see `FlexiblePaddedLayer`).
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

    length_name = "max_cache_len"
    # Defaults for objects built without __init__ (the export's views over buffers), overridden per object.
    _stale: str | None = None  # why this object may no longer be used (see `renewed`), or None
    _call_limits: dict[str, int] = {}  # the limits `reserve` set for the running call (on_overflow="error")
    _owner = None  # the pool that holds this cache (see `ownership.py`), or None
    # A shape, not storage: with the padded policy, decoder-only prompts are left-padded to it. 0: not set yet.
    max_prompt_len = 0
    # Padded policy: the masked columns before the real prompt of the call that filled this cache. A continuation
    # from it is left-padded by as many, so that its positions line up with what the cache holds.
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
        check_positive_int("max_batch_size", max_batch_size)
        check_positive_int(self.length_name, max_cache_len)
        self.on_overflow = check_choice("on_overflow", on_overflow, ON_OVERFLOW_CHOICES)
        self.shape_policy = check_choice("shape_policy", shape_policy, SHAPE_POLICIES)
        if layer_specs is None:
            if config is None:
                raise TypeError(f"{type(self).__name__} needs config= (or layer_specs=) to know its layers")
            layer_specs = layer_specs_from_config(config, dtype=dtype, device=device)
        self.layer_specs = list(layer_specs)
        layers = [
            self._layer_class(spec)(spec=spec, max_batch_size=max_batch_size, max_cache_len=max_cache_len)
            for spec in self.layer_specs
        ]
        super().__init__(layers=layers)
        self.num_allocations = 1

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

    def __repr__(self) -> str:
        if self._stale is not None:
            return f"{type(self).__name__}(stale)"
        return super().__repr__()

    def __getstate__(self) -> dict:
        # A copy (`copy.deepcopy`, pickling) is nobody's: it is not in the pool of the model that returned the
        # original, whose lock cannot be copied anyway.
        state = dict(self.__dict__)
        state.pop("_owner", None)
        return state

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
        per_device: dict[str, int] = {}
        for spec in specs:
            key = str(spec.device)
            per_device[key] = per_device.get(key, 0) + spec.nbytes(
                max_batch_size=max_batch_size, max_cache_len=max_cache_len
            )
        return per_device

    # --- capacities -------------------------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.layers[0].max_batch_size

    @property
    def max_cache_len(self) -> int:
        # The first attention layer: linear-attention layers have no length axis.
        return next(layer.max_cache_len for layer in self.layers if isinstance(layer, FlexibleStaticLayer))

    def capacities(self) -> dict[str, int]:
        """What the cache holds, by capacity name (`max_prompt_len` 0: not set)."""
        return {
            "max_batch_size": self.max_batch_size,
            self.length_name: self.max_cache_len,
            "max_prompt_len": self.max_prompt_len,
        }

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_per_device().values())

    def nbytes_per_device(self) -> dict[str, int]:
        """Bytes held on each device (`{}` for a stale object, which holds none)."""
        per_device: dict[str, int] = {}
        for layer in self._layers:  # a stale object holds no layers: 0 bytes, no error
            for tensor in layer.storages():
                key = str(tensor.device)
                per_device[key] = per_device.get(key, 0) + tensor.untyped_storage().nbytes()
        return per_device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        """The device of the first layer's storage (see `layer_specs` for each layer's)."""
        return self.layers[0].device

    def data_ptrs(self) -> list[int]:
        """Data pointers of every storage tensor: equal across calls exactly when no reallocation happened."""
        return [tensor.data_ptr() for layer in self.layers for tensor in layer.storages()]

    def reserve(self, need: Mapping[str, int], *, config: CacheConfig | None = None, geometric: bool = False) -> None:
        """Make room for a call that needs `need` (`max_batch_size`, `max_cache_len`: rows and positions it writes).

        With `config.on_overflow="error"` (or the cache's own `on_overflow` when no config is given), a need over a
        limit raises before anything changes; the limits also hold for the `update`s of the call. Otherwise the storage
        grows once to what the call needs (and to any larger capacity `config` sets), keeping its live content.

        Args:
            geometric (`bool`, *optional*, defaults to `False`): a length that must grow grows to at least twice what
                is held. For a continuation: each turn needs a little more than the last, and growing to exactly that
                would reallocate at every turn.

        Raises:
            ValueError: with `on_overflow="error"`, naming each value, its limit and the `cache_config` that fits.
        """
        self._check_live()
        config = config if config is not None else CacheConfig(on_overflow=self.on_overflow)
        held = self.capacities()
        target, exceeded = plan_capacities(held, need, config)
        if exceeded and config.on_overflow == "error":
            raise ValueError(overflow_message(exceeded))
        if geometric:
            target = with_headroom(target, held, self.length_name, config)
        if exceeded:
            logger.warning("%s grows (one reallocation): %s", type(self).__name__, overflow_message(exceeded))
        self._apply_reservation(target, config, need=need)

    def _apply_reservation(self, target: Mapping[str, int], config: CacheConfig, *, need: Mapping[str, int]) -> None:
        """Grow to `target` (the capacities of this cache named in it), and keep `config`'s limits for the call; tell
        each attention layer the positions the call needs (the bucketed layer sizes its attention span from them)."""
        names = [name for name in self.capacities() if name in target]
        self.on_overflow = config.on_overflow
        limits = {name: config.limit(name) or target[name] for name in names}
        self._call_limits = limits if config.on_overflow == "error" else {}
        self._grow_to(target)
        if self.length_name in need:
            for layer in self.layers:
                if isinstance(layer, FlexibleStaticLayer):
                    layer.plan_call(cache_len=need[self.length_name], config=config)

    def _grow_to(self, target: Mapping[str, int]) -> None:
        self.max_prompt_len = max(self.max_prompt_len, target.get("max_prompt_len", 0))
        batch = max(self.max_batch_size, target.get("max_batch_size", 0))
        length = max(self.max_cache_len, target.get(self.length_name, 0))
        if (batch, length) == (self.max_batch_size, self.max_cache_len):
            return
        before = self.data_ptrs()
        for layer in self.layers:
            layer.grow(max_batch_size=batch, max_cache_len=length)
        if self.data_ptrs() != before:  # sliding-window layers past their window grow without reallocating
            self.num_allocations += 1

    def grow(self, *, max_batch_size: int | None = None, max_cache_len: int | None = None) -> None:
        """Reallocate to at least these capacities, keeping live content. A no-op when the cache is big enough."""
        self._grow_to({"max_batch_size": max_batch_size or 0, self.length_name: max_cache_len or 0})

    def ensure_capacity(self, *, batch_size: int, length: int) -> None:
        """Make room for `batch_size` rows reaching `length` positions inside a forward, per `on_overflow`.

        Growth here is geometric (a row count or length at least doubles), so that a cache continued token by token
        without `reserve` reallocates a logarithmic number of times.

        Raises:
            ValueError: with `on_overflow="error"`, naming each value, its limit and the `cache_config` that fits.
                Nothing has been changed when it is raised.
        """
        limits = {**self.capacities(), **self._call_limits}
        need = {"max_batch_size": batch_size, self.length_name: length}
        exceeded = [Overflow(name, value, limits[name]) for name, value in need.items() if value > limits[name]]
        if not exceeded:
            return
        message = overflow_message(exceeded)
        if self.on_overflow == "error":
            raise ValueError(message)
        held = self.capacities()
        target = {
            name: max(value, 2 * held[name]) if value > held[name] else held[name] for name, value in need.items()
        }
        logger.warning(
            "%s grows (one reallocation, to %s): %s", type(self).__name__, _format_capacities(target), message
        )
        self._grow_to(target)

    # --- ownership ----------------------------------------------------------------------------------------------
    def renewed(self) -> FlexibleStaticCache:
        """A new, reset cache object over the same storage; this one is left for `mark_stale`.

        A pool gives each generate call a renewed object, so that a cache returned by an earlier call is a different
        object, which can be told that its storage was reused.
        """
        cache = copy.copy(self)
        cache.layers = [layer.renewed() for layer in self.layers]
        cache._owner = self._owner
        cache._stale = None
        cache._call_limits = {}
        cache.reset()
        return cache

    def mark_stale(self, reason: str) -> None:
        """From now on, any use of this object raises `ValueError(reason)`: every method, `layers` and `len(cache)`.
        What stays readable: `is_stale`, `repr()`, `nbytes`/`nbytes_per_device()` (0: it holds nothing), and the
        settings it was built with (`shape_policy`, `on_overflow`, `layer_specs`).

        The object also lets go of its layers: storage that a later growth or `release` drops is then freed even while
        a caller still holds this object.
        """
        self._stale = reason
        self._layers = []

    @property
    def is_stale(self) -> bool:
        return self._stale is not None

    def _check_live(self) -> None:
        # Not while dynamo traces: a compiled step would guard on it. Stale caches are refused before (generate).
        if self._stale is not None and not torch.compiler.is_compiling():
            raise ValueError(self._stale)

    def free(self, reason: str) -> int:
        """Give the storage back now (every object over it, this one included, becomes stale); returns the bytes."""
        freed = self.nbytes
        for layer in self.layers:
            for tensor in layer.storages():
                tensor.untyped_storage().resize_(0)
        self.mark_stale(reason)
        return freed

    def detach(self) -> FlexibleStaticCache:
        """Take this cache out of the pool of the model that returned it, so that no later `generate` call reuses its
        storage: it is yours to continue from, for as long as you hold it. Returns the cache."""
        self._check_live()
        if self._owner is not None:
            self._owner.detach(self)
        return self

    # --- the public accessor ------------------------------------------------------------------------------------
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
            raise ValueError(f"length={length} must be between 0 and {self.length_name}={layer.max_cache_len}")
        return layer.get_kv(batch_size, length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write `key_states`/`value_states` after the live length of layer `layer_idx`; return what to attend to.

        Args:
            key_states (`torch.Tensor`): `[B, H, S, D]` new keys.
            value_states (`torch.Tensor`): `[B, H, S, D]` new values.
            layer_idx (`int`): decoder layer.

        Returns:
            `tuple[torch.Tensor, torch.Tensor]`: views `[B, H, L + S, D]` of everything this call wrote; with
            `shape_policy="padded"`, `[B, H, L_max, D]` (all positions; the mask hides those not written).

        Raises:
            ValueError: the heads, head dim, device or dtype differ from the storage's; the batch differs from the one
                already written since the last `reset()`; the call exceeds a capacity with `on_overflow="error"`
                (with `shape_policy="padded"` only the batch is checked here, see `FlexiblePaddedLayer`); or this
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
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx={layer_idx} is out of range for a cache of {len(self.layers)} layers")
        layer = self.layers[layer_idx]
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

    # --- linear-attention (Mamba) states ------------------------------------------------------------------------
    def _linear_layer(self, layer_idx: int, state_idx: int) -> FlexibleLinearAttentionLayer:
        self._check_live()
        layer = self._checked_layer(layer_idx, FlexibleLinearAttentionLayer)
        if state_idx != 0:
            raise ValueError(f"state_idx={state_idx} is out of range: linear-attention layers hold one state (0)")
        return layer

    def _check_state_batch(self, layer: FlexibleLinearAttentionLayer, layer_idx: int, batch_size: int) -> None:
        if layer.batch_size > 0 and batch_size != layer.batch_size:
            raise ValueError(
                f"batch_size={batch_size} differs from batch_size={layer.batch_size} already cached in layer "
                f"{layer_idx}; call cache.reset() before a call with another batch"
            )

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Conv state of linear-attention layer `layer_idx` for the live batch.

        Args:
            layer_idx (`int`): a linear-attention decoder layer.
            state_idx (`int`, *optional*, defaults to 0): which state; these layers hold one.

        Returns:
            `torch.Tensor | None`: a view `[B, C, K]` into the storage (no copy), so that the model's in-place decode
            update (`conv_state.copy_(...)`) lands in the cache; None from `reset()` until this call's first
            `update_conv_state`, as upstream.

        Raises:
            ValueError: `layer_idx` is out of range or not a linear-attention layer, or `state_idx` is not 0.
        """
        return self._linear_layer(layer_idx, state_idx).get_conv_state()

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Write the conv state of linear-attention layer `layer_idx`: the last `K` positions of what is returned.

        Args:
            conv_states (`torch.Tensor`): `[B, C, S]` new conv inputs.
            layer_idx (`int`): a linear-attention decoder layer.
            state_idx (`int`, *optional*, defaults to 0): which state; these layers hold one.
            conv_kernel_size (`int`, *optional*): the model's kernel size, checked against the storage's `K`.

        Returns:
            `torch.Tensor`: as upstream's `LinearAttentionLayer.update_conv_state`: on the first update since
            `reset()` (the prefill) `conv_states` left-padded to at least `K` positions, `[B, C, max(S, K)]`;
            afterwards the cached state followed by `conv_states`, `[B, C, K + S]`.

        Raises:
            ValueError: as for `get_conv_state`; `C` or `K` differs from the storage; the batch differs from the one
                written since the last `reset()`; or `B` exceeds `max_batch_size` with `on_overflow="error"`.
                Nothing is written in any of these cases.
        """
        layer = self._linear_layer(layer_idx, state_idx)
        kernel_size = layer.conv_kernel_size[0]
        if conv_kernel_size is not None and conv_kernel_size != kernel_size:
            raise ValueError(
                f"conv_kernel_size={conv_kernel_size} differs from the kernel size {kernel_size} that layer "
                f"{layer_idx} was allocated with (the config's `mamba_d_conv`)"
            )
        if tuple(conv_states.shape[1:-1]) != layer.conv_shape[:-1]:
            raise ValueError(
                f"conv_states of shape {tuple(conv_states.shape)} do not fit layer {layer_idx}, allocated for "
                f"[batch, {layer.conv_shape[0]}, length] from the config"
            )
        self._check_state_batch(layer, layer_idx, conv_states.shape[0])
        self.ensure_capacity(batch_size=conv_states.shape[0], length=0)
        return layer.update_conv_state(conv_states)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Recurrent (SSM) state of linear-attention layer `layer_idx` for the live batch.

        Args:
            layer_idx (`int`): a linear-attention decoder layer.
            state_idx (`int`, *optional*, defaults to 0): which state; these layers hold one.

        Returns:
            `torch.Tensor | None`: a view `[B, C, N]` into the storage (no copy), so that the model's in-place decode
            update (`state.copy_(...)`) lands in the cache; None from `reset()` until this call's first
            `update_conv_state`, as upstream.

        Raises:
            ValueError: `layer_idx` is out of range or not a linear-attention layer, or `state_idx` is not 0.
        """
        return self._linear_layer(layer_idx, state_idx).get_recurrent_state()

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        """Write the recurrent (SSM) state of linear-attention layer `layer_idx`.

        Args:
            recurrent_states (`torch.Tensor`): `[B, C, N]` the state after this call's tokens.
            layer_idx (`int`): a linear-attention decoder layer.
            state_idx (`int`, *optional*, defaults to 0): which state; these layers hold one.

        Returns:
            `torch.Tensor`: a view `[B, C, N]` into the storage, holding `recurrent_states`.

        Raises:
            ValueError: as for `get_recurrent_state`; `(C, N)` differs from the storage; the batch differs from the
                one written since the last `reset()`; or `B` exceeds `max_batch_size` with `on_overflow="error"`.
                Nothing is written in any of these cases.
        """
        layer = self._linear_layer(layer_idx, state_idx)
        if tuple(recurrent_states.shape[1:]) != layer.recurrent_shape:
            raise ValueError(
                f"recurrent_states of shape {tuple(recurrent_states.shape)} do not fit layer {layer_idx}, allocated "
                f"for [batch, {', '.join(map(str, layer.recurrent_shape))}] from the config"
            )
        self._check_state_batch(layer, layer_idx, recurrent_states.shape[0])
        self.ensure_capacity(batch_size=recurrent_states.shape[0], length=0)
        return layer.update_recurrent_state(recurrent_states)


def _format_capacities(capacities: Mapping[str, int]) -> str:
    return ", ".join(f"{name}={value}" for name, value in capacities.items())


class FlexibleCrossAttentionCache(FlexibleStaticCache):
    """The cross-attention half of `FlexibleEncoderDecoderCache`: its capacity is `max_encoder_len`.

    Its live length is the encoder length that the current call wrote. Its layers keep exact Python-int lengths in
    every shape policy: the cache is written once per call (a model can ask `get_seq_length` whether it was, without a
    host sync), and the padded policy pads the encoder output to `max_encoder_len`, so its shapes are already fixed.
    With a fixed-shape policy (`"padded"`, `"bucketed"`) its storage is only marked as a static address, for CUDA
    graphs.
    """

    length_name = "max_encoder_len"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if ATTENTION_LAYER_CLASSES[self.shape_policy].is_compileable:  # the fixed-shape policies
            for layer in self.layers:
                layer.mark_static_address()

    def _layer_class(self, spec: LayerSpec) -> type:
        return FlexibleStaticLayer

    def capacities(self) -> dict[str, int]:
        return {"max_batch_size": self.max_batch_size, self.length_name: self.max_cache_len}


class FlexibleEncoderDecoderCache(EncoderDecoderCache):
    """Self-attention plus cross-attention flexible caches, allocated once for encoder-decoder models.

    Args:
        config (`PreTrainedConfig`, *optional*): the model's config (not needed with both `*layer_specs`).
        max_batch_size (`int`): rows to allocate in both caches.
        max_cache_len (`int`): decoder positions to allocate (self-attention).
        max_encoder_len (`int`): encoder positions to allocate (cross-attention).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the storage.
        device (`torch.device` or `str`, *optional*, defaults to `"cpu"`): device of the storage.
        on_overflow (`str`, *optional*, defaults to `"grow"`): `"grow"` or `"error"`, as for `FlexibleStaticCache`.
        shape_policy (`str`, *optional*, defaults to `"exact"`): `"exact"` or `"padded"`, as for
            `FlexibleStaticCache` (it applies to self-attention; see `FlexibleCrossAttentionCache` for cross-attention).
        layer_specs, cross_layer_specs (`list[LayerSpec]`, *optional*): per-layer specs of the self-attention and
            cross-attention storage (see `FlexibleStaticCache`).

    Models read the cross-attention keys and values of the current call through `cross_attention_kv`, which writes
    them on the call's first decoder step (`cross_attention_cache.update`) and reads them back afterwards
    (`cross_attention_cache.get_kv`).
    """

    _stale: str | None = None
    _owner = None

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
            FlexibleCrossAttentionCache(max_cache_len=max_encoder_len, layer_specs=cross_layer_specs, **common),
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
        common = {"config": config, "max_batch_size": max_batch_size, "dtype": dtype}
        per_device = FlexibleStaticCache.nbytes_per_device_for(
            max_cache_len=max_cache_len, layer_specs=layer_specs, **common
        )
        cross = FlexibleStaticCache.nbytes_per_device_for(
            max_cache_len=max_encoder_len, layer_specs=cross_layer_specs, **common
        )
        return {key: per_device.get(key, 0) + cross.get(key, 0) for key in {**per_device, **cross}}

    @property
    def max_batch_size(self) -> int:
        return self.self_attention_cache.max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self.self_attention_cache.max_cache_len

    @property
    def max_encoder_len(self) -> int:
        return self.cross_attention_cache.max_cache_len

    def capacities(self) -> dict[str, int]:
        return {**self.self_attention_cache.capacities(), **self.cross_attention_cache.capacities()}

    @property
    def on_overflow(self) -> str:
        return self.self_attention_cache.on_overflow

    @on_overflow.setter
    def on_overflow(self, value: str) -> None:
        check_choice("on_overflow", value, ON_OVERFLOW_CHOICES)
        self.self_attention_cache.on_overflow = self.cross_attention_cache.on_overflow = value

    @property
    def shape_policy(self) -> str:
        return self.self_attention_cache.shape_policy

    @property
    def nbytes(self) -> int:
        return self.self_attention_cache.nbytes + self.cross_attention_cache.nbytes

    def nbytes_per_device(self) -> dict[str, int]:
        own, cross = self.self_attention_cache.nbytes_per_device(), self.cross_attention_cache.nbytes_per_device()
        return {key: own.get(key, 0) + cross.get(key, 0) for key in {**own, **cross}}

    @property
    def num_allocations(self) -> int:
        return self.self_attention_cache.num_allocations + self.cross_attention_cache.num_allocations

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

    def data_ptrs(self) -> list[int]:
        return self.self_attention_cache.data_ptrs() + self.cross_attention_cache.data_ptrs()

    def reserve(self, need: Mapping[str, int], *, config: CacheConfig | None = None, geometric: bool = False) -> None:
        """Make room for a call in both caches (`max_batch_size`, `max_cache_len`, `max_encoder_len`): both are
        checked before either changes. See `FlexibleStaticCache.reserve` (`geometric` applies to the decoder length).

        Raises:
            ValueError: with `on_overflow="error"`, naming each value, its limit and the `cache_config` that fits.
        """
        self._check_live()
        config = config if config is not None else CacheConfig(on_overflow=self.on_overflow)
        held = self.capacities()
        target, exceeded = plan_capacities(held, need, config)
        if exceeded and config.on_overflow == "error":
            raise ValueError(overflow_message(exceeded))
        if geometric:
            target = with_headroom(target, held, self.self_attention_cache.length_name, config)
        if exceeded:
            logger.warning("%s grows (one reallocation): %s", type(self).__name__, overflow_message(exceeded))
        self.self_attention_cache._apply_reservation(target, config, need=need)
        self.cross_attention_cache._apply_reservation(target, config, need=need)

    # --- ownership ----------------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        if self._stale is not None:
            return f"{type(self).__name__}(stale)"
        return super().__repr__()

    def __getstate__(self) -> dict:
        # As `FlexibleStaticCache.__getstate__`: a copy is nobody's.
        state = dict(self.__dict__)
        state.pop("_owner", None)
        return state

    def renewed(self) -> FlexibleEncoderDecoderCache:
        """A new, reset cache object over the same storage (see `FlexibleStaticCache.renewed`)."""
        cache = copy.copy(self)
        cache._owner = self._owner
        cache.self_attention_cache = self.self_attention_cache.renewed()
        cache.cross_attention_cache = self.cross_attention_cache.renewed()
        cache.is_updated = dict.fromkeys(self.is_updated, False)
        cache._stale = None
        return cache

    def mark_stale(self, reason: str) -> None:
        self._stale = reason
        self.self_attention_cache.mark_stale(reason)
        self.cross_attention_cache.mark_stale(reason)

    @property
    def is_stale(self) -> bool:
        return self._stale is not None

    def _check_live(self) -> None:
        if self._stale is not None and not torch.compiler.is_compiling():
            raise ValueError(self._stale)

    def free(self, reason: str) -> int:
        """Give both caches' storage back now; returns the bytes (see `FlexibleStaticCache.free`)."""
        freed = self.self_attention_cache.free(reason) + self.cross_attention_cache.free(reason)
        self.mark_stale(reason)
        return freed

    def detach(self) -> FlexibleEncoderDecoderCache:
        """See `FlexibleStaticCache.detach`."""
        self._check_live()
        if self._owner is not None:
            self._owner.detach(self)
        return self

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
        self.self_attention_cache.early_initialization(batch_size, num_heads, head_dim, dtype, device)
        self.cross_attention_cache.early_initialization(batch_size, num_heads, head_dim, dtype, device)


def is_flexible_cache(cache) -> bool:
    """Whether `cache` is one of this package's caches."""
    return isinstance(cache, (FlexibleStaticCache, FlexibleEncoderDecoderCache))
