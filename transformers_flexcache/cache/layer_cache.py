"""A cache of layers: `[B_max, ..., L_max, ...]` storage per layer, the live batch and length, and the accessors.

What the self-attention and cross-attention caches (`containers.py`) share: building the layers of their specs,
growing them, the limits of a call, and the public accessors models use (`get_kv`, `update`). The storage length of
a layer is neutral; each container names it (`LENGTH_CAPACITY`: `max_cache_len` or `max_encoder_len`), in its
capacities and in the errors raised here.

Shape legend: `B` live batch, `B_max` `max_batch_size`, `H` kv heads, `S` new tokens, `L` live length, `L_max` the
length of a layer's storage, `D` head dim.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers.cache_utils import Cache

from ..log import get_logger
from .capacity import Reservation, exceeding
from .config import ON_OVERFLOW_CHOICES, SHAPE_POLICIES, check_choice, check_positive_int, overflow_message
from .layers import FlexibleStaticLayer, LayerSpec
from .lifecycle import FlexibleStorage
from .linear_attention import FlexibleLinearAttentionLayer, length_layer_idx

logger = get_logger(__name__)


def nbytes_per_device_of(specs: list[LayerSpec], *, max_batch_size: int, length: int) -> dict[str, int]:
    """Bytes that layers of `specs` allocate on each device at `max_batch_size` rows of `length` positions."""
    per_device: dict[str, int] = {}
    for spec in specs:
        key = str(spec.device)
        per_device[key] = per_device.get(key, 0) + spec.nbytes(max_batch_size=max_batch_size, max_cache_len=length)
    return per_device


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
        exceeded = exceeding(need, limits)
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
        """Overrides `transformers.cache_utils.Cache.get_seq_length` (transformers==5.25.0).

        Differences: a linear-attention `layer_idx` is answered by the first attention layer (`length_layer_idx`), as
        transformers 5.24 answered it, where 5.25 reads the linear-attention layer's own token count (see
        `linear_attention.py` for why ours keeps none); and a stale cache raises.
        """
        self._check_live()
        return super().get_seq_length(length_layer_idx(self.layers, layer_idx))

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
