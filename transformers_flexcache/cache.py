"""A static KV cache that is allocated once at a maximum shape and serves any smaller batch and length.

Shape legend used in this module:
    B      batch of the current call (live batch)
    B_max  `max_batch_size`, rows in the storage
    H      key/value heads
    S      new tokens in one `update`
    L      live length: tokens written for the current call
    L_max  capacity along the length axis (`max_cache_len`, or `max_encoder_len` for cross-attention)
    D      head dim
    C, K   linear-attention (Mamba) conv channels and conv kernel size
    N      linear-attention recurrent (SSM) state size

Design decisions:
- Storage is `[B_max, H, L_max, D]` per layer for keys and for values, allocated once when the cache is built.
  Nothing is allocated again unless a call exceeds a capacity and the cache is allowed to grow.
- `update` writes the call's rows `[:B]` at positions `[L : L + S]` and returns views `[:B, :, : L + S]` into the
  storage ("exact" shapes). Attention therefore never reads a row or a position that the current call did not
  write, which is why `reset` only has to set counters back to zero: stale data left by an earlier, larger call is
  unreachable. It also means the outputs match `DynamicCache`, which holds exactly those tensors.
- Live lengths are Python ints. That keeps eager decoding free of host syncs, but every step is a new shape to
  `torch.compile`, so this ("exact") mode reports `is_compileable = False`.
- `shape_policy="padded"` is the fixed-shape mode for `torch.compile` and CUDA graphs (`FlexiblePaddedLayer`): the
  self-attention layers return all `L_max` positions, leave the unwritten ones to the attention mask
  (`get_mask_sizes` returns the capacity) and count positions in a 0-d tensor with a static address, as upstream's
  `StaticLayer` does. The cross-attention cache keeps exact Python-int lengths: it is written once per call, and
  `generate` pads the encoder output to `max_encoder_len`, so its live length is always the capacity. Generate pads
  the batch to `max_batch_size` (see `padding.py`), so a compiled decode step sees one set of shapes for every call.
- Capacity is checked before anything is written: a refused call (`on_overflow="error"`) leaves the cache exactly
  as it was; with the default `on_overflow="grow"` the storage is reallocated once, live content copied, and a
  warning says which capacity to preset.
- Models reach the tensors only through `get_kv(layer_idx, batch_size, length)` and `update(...)`.
- Linear-attention (Mamba) layers hold their conv state `[B_max, C, K]` and recurrent state `[B_max, C, N]`, also
  allocated once at construction, with shapes read from the config as the model reads them (see
  `_linear_attention_shapes`). `get_conv_state`/`get_recurrent_state` hand out views `[:B]`: the model updates them
  in place while decoding, so its writes land in the storage. `reset` only clears `has_previous_state`: the next
  prefill overwrites rows `[:B]` whole before anything reads them. In padded mode they are compileable
  (`FlexiblePaddedLinearAttentionLayer`): every call has the same batch, and the states no length axis.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    EncoderDecoderCache,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)
from transformers.configuration_utils import PreTrainedConfig, get_head_shapes

logger = logging.getLogger(__name__)

ON_OVERFLOW_CHOICES = ("grow", "error")
SHAPE_POLICIES = ("exact", "padded")


@dataclass(frozen=True)
class Overflow:
    """One capacity that a call exceeds: `value` is what the call needs, `limit` what the cache holds."""

    name: str
    value: int
    limit: int

    def describe(self) -> str:
        return f"{self.name.removeprefix('max_')}={self.value} exceeds {self.name}={self.limit}"


def overflow_message(overflows: list[Overflow]) -> str:
    """The error text for `overflows`: each value and limit, then the `cache_config` that would fit."""
    fix = ", ".join(f'"{o.name}": {o.value}' for o in overflows)
    return "; ".join(o.describe() for o in overflows) + f"; pass cache_config={{{fix}}} or more"


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def _check_on_overflow(on_overflow: str) -> str:
    if on_overflow not in ON_OVERFLOW_CHOICES:
        raise ValueError(f"on_overflow={on_overflow!r} is not one of {ON_OVERFLOW_CHOICES}")
    return on_overflow


def _check_shape_policy(shape_policy: str) -> str:
    if shape_policy not in SHAPE_POLICIES:
        raise ValueError(f"shape_policy={shape_policy!r} is not one of {SHAPE_POLICIES}")
    return shape_policy


class FlexibleStaticLayer(CacheLayerMixin):
    """Keys and values of one attention layer in `[B_max, H, L_max, D]` storage, with the live batch and length.

    Built by `FlexibleStaticCache`; models use the cache's `get_kv` and `update`, not this class.
    """

    is_compileable = False  # live lengths are Python ints: each decode step is a new shape to the compiler
    is_croppable = True
    is_sliding = False
    supports_early_init = True

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_cache_len: int,
        num_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        # CacheLayerMixin.__init__ would set `keys`/`values` attributes; here they are read-only live views.
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.num_heads = num_heads
        self.device = torch.device(device)
        self._key_storage = torch.zeros(
            max_batch_size, num_heads, max_cache_len, k_head_dim, dtype=dtype, device=device
        )
        self._value_storage = torch.zeros(
            max_batch_size, num_heads, max_cache_len, v_head_dim, dtype=dtype, device=device
        )
        self.batch_size = 0  # live batch: rows written by the current call
        self.seq_len = 0  # live length: positions written by the current call
        self.is_initialized = True
        self.static_address = False  # set by `mark_static_address`; kept through `grow`

    def mark_static_address(self) -> None:
        """Tell `torch.compile` (and CUDA graphs) that the storage keeps its address across calls.

        Without it, a compiled step with `mode="reduce-overhead"` copies mutated inputs into its own buffers or skips
        CUDA graphs. Not allowed while dynamo traces, as for upstream's `StaticLayer`; a no-op then.
        """
        self.static_address = True
        if not torch.compiler.is_compiling():
            for tensor in self._static_tensors():
                torch._dynamo.mark_static_address(tensor)

    def _static_tensors(self) -> list[torch.Tensor]:
        return [self._key_storage, self._value_storage]

    # Read-only live views, for upstream code that reads `layer.keys` (e.g. Whisper's generate rebuilding caches).
    @property
    def keys(self) -> torch.Tensor:  # [B, H, L, D]
        return self._key_storage[: self.batch_size, :, : self.seq_len]

    @property
    def values(self) -> torch.Tensor:  # [B, H, L, D]
        return self._value_storage[: self.batch_size, :, : self.seq_len]

    @property
    def dtype(self) -> torch.dtype:
        return self._key_storage.dtype

    @property
    def nbytes(self) -> int:
        return self._key_storage.nbytes + self._value_storage.nbytes

    def data_ptrs(self) -> tuple[int, int]:
        return self._key_storage.data_ptr(), self._value_storage.data_ptr()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Storage is allocated in __init__; nothing is left to initialize lazily.
        return None

    def get_kv(self, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # -> 2 x [B, H, length, D]
        return self._key_storage[:batch_size, :, :length], self._value_storage[:batch_size, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, L + S, D]
        batch_size, num_new = key_states.shape[0], key_states.shape[-2]
        start = self.seq_len
        self._key_storage[:batch_size, :, start : start + num_new].copy_(key_states)
        self._value_storage[:batch_size, :, start : start + num_new].copy_(value_states)
        self.batch_size, self.seq_len = batch_size, start + num_new
        return self.get_kv(batch_size, self.seq_len)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Same as DynamicLayer: the mask spans exactly the live length plus the new tokens.
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        # No zeroing: views end at the live batch and length, so stale slots are never read.
        self.batch_size = 0
        self.seq_len = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.seq_len == 0:
            return
        live_keys, live_values = self.get_kv(self.batch_size, self.seq_len)
        beam_idx = beam_idx.to(self.device)
        # index_select makes a new tensor first, so copying it back over its own source is safe.
        live_keys.copy_(live_keys.index_select(0, beam_idx))
        live_values.copy_(live_values.index_select(0, beam_idx))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}) is not supported; pass a negative number of tokens to remove, as for "
                "upstream StaticLayer"
            )
        self.seq_len = max(0, self.seq_len + tokens_to_remove)

    def offload(self):
        raise NotImplementedError("offloading is not supported by FlexibleStaticCache")

    def prefetch(self):
        raise NotImplementedError("offloading is not supported by FlexibleStaticCache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("batch_repeat_interleave is only defined for DynamicCache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("batch_select_indices is only defined for DynamicCache")

    def grow(self, *, max_batch_size: int, max_cache_len: int) -> None:
        """Reallocate to the given capacities (each at least the current one), keeping the live content."""
        new_keys = self._key_storage.new_zeros(
            max_batch_size, self.num_heads, max_cache_len, self._key_storage.shape[-1]
        )
        new_values = self._value_storage.new_zeros(
            max_batch_size, self.num_heads, max_cache_len, self._value_storage.shape[-1]
        )
        live_keys, live_values = self.get_kv(self.batch_size, self.seq_len)
        new_keys[: self.batch_size, :, : self.seq_len].copy_(live_keys)
        new_values[: self.batch_size, :, : self.seq_len].copy_(live_values)
        self._key_storage, self._value_storage = new_keys, new_values
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len
        if self.static_address:
            self.mark_static_address()


class FlexiblePaddedLayer(FlexibleStaticLayer):
    """The fixed-shape ("padded") mode of `FlexibleStaticLayer`, for `torch.compile` and CUDA graphs.

    `update` writes with `index_copy_` at positions counted by `cumulative_length`, a 0-d tensor with a static
    address (as upstream's `StaticLayer`), and returns all `L_max` positions of the call's rows; the attention mask
    hides those not written yet (`get_mask_sizes` returns the capacity). So a decode step has the same shapes and reads
    no changing Python value at any step of any call, and compiles once. The exact mode's Python-int `seq_len` is not
    used: the live length is `cumulative_length`. `update` does not check the length against the capacity (that
    would need a host sync): `generate` checks before the call, and `index_copy_` raises past the capacity on CPU.
    """

    is_compileable = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # A tensor, not an int: positions then derive from it inside the graph instead of being baked into it.
        self.cumulative_length = torch.zeros((), dtype=torch.long, device=self.device)
        self.mark_static_address()

    def _static_tensors(self) -> list[torch.Tensor]:
        return [self._key_storage, self._value_storage, self.cumulative_length]

    @property
    def keys(self) -> torch.Tensor:  # [B, H, L_max, D]
        return self._key_storage[: self.batch_size]

    @property
    def values(self) -> torch.Tensor:  # [B, H, L_max, D]
        return self._value_storage[: self.batch_size]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, L_max, D]
        batch_size, num_new = key_states.shape[0], key_states.shape[-2]
        positions = torch.arange(num_new, device=self.device) + self.cumulative_length  # [S]
        self.cumulative_length.add_(num_new)  # in place: the address stays static
        keys, values = self._key_storage[:batch_size], self._value_storage[:batch_size]
        keys.index_copy_(2, positions, key_states)
        values.index_copy_(2, positions, value_states)
        self.batch_size = batch_size
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Attention always spans the whole capacity; the mask hides the positions not written yet.
        return self.max_cache_len, 0

    def get_seq_length(self) -> torch.Tensor:  # 0-d, as upstream's StaticLayer: an int would be baked into graphs
        return self.cumulative_length

    def reset(self) -> None:
        # Unlike the exact mode, attention reads every position (with weight 0 where masked): zero the storage so that
        # nothing non-finite left by an earlier call can turn a masked product into NaN (upstream zeroes too).
        self._key_storage.zero_()
        self._value_storage.zero_()
        self.cumulative_length.zero_()
        self.batch_size = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.batch_size == 0:
            return
        beam_idx = beam_idx.to(self.device)
        # Copied back in place (upstream's StaticLayer rebinds `keys`), so the static address is kept.
        for storage in (self._key_storage[: self.batch_size], self._value_storage[: self.batch_size]):
            storage.copy_(storage.index_select(0, beam_idx))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}) is not supported; pass a negative number of tokens to remove, as for "
                "upstream StaticLayer"
            )
        self.cumulative_length.sub_(-tokens_to_remove)

    def grow(self, *, max_batch_size: int, max_cache_len: int) -> None:
        """Reallocate to the given capacities (each at least the current one), keeping all written content."""
        old_keys, old_values = self._key_storage, self._value_storage
        self._key_storage = old_keys.new_zeros(max_batch_size, self.num_heads, max_cache_len, old_keys.shape[-1])
        self._value_storage = old_values.new_zeros(max_batch_size, self.num_heads, max_cache_len, old_values.shape[-1])
        self._key_storage[: old_keys.shape[0], :, : old_keys.shape[2]].copy_(old_keys)
        self._value_storage[: old_values.shape[0], :, : old_values.shape[2]].copy_(old_values)
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len
        self.mark_static_address()


class FlexibleLinearAttentionLayer(LinearAttentionCacheLayerMixin):
    """Conv and recurrent (SSM) states of one linear-attention (Mamba) layer in `[B_max, ...]` storage.

    Built by `FlexibleStaticCache`; models use the cache's `get_conv_state`, `update_conv_state`,
    `get_recurrent_state` and `update_recurrent_state`, not this class. Those return views `[:B]` of the storage,
    because models write into them in place while decoding (Jamba's `causal_conv1d_update` and
    `selective_state_update` call `copy_` on the tensors they are given).
    """

    is_compileable = False  # the live batch is a Python int, as for the attention layers
    is_croppable = False  # a recurrent state cannot be rolled back
    is_sliding = False

    def __init__(
        self,
        *,
        max_batch_size: int,
        conv_shape: tuple[int, int],
        recurrent_shape: tuple[int, ...],
        dtype: torch.dtype,
        recurrent_dtype: torch.dtype,
        device: torch.device,
    ):
        # LinearAttentionCacheLayerMixin.__init__ would set `conv_states`/`recurrent_states` dicts filled lazily at
        # the call's batch; here they are read-only live views of storage allocated now.
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        self._conv_storage = torch.zeros(max_batch_size, *conv_shape, dtype=dtype, device=device)  # [B_max, C, K]
        self._recurrent_storage = torch.zeros(  # [B_max, C, N]
            max_batch_size, *recurrent_shape, dtype=recurrent_dtype, device=device
        )
        self.number_of_states = 1
        self.conv_kernel_size = {0: conv_shape[-1]}
        self.has_previous_state = {0: False}  # read by upstream's `Cache.has_previous_state`
        self.record_past = False  # read by upstream's `Cache.is_recording_past`
        self.batch_size = 0  # live batch: rows written by the current call

    # Read-only live views, for upstream code that reads `layer.conv_states[0]` / `layer.recurrent_states[0]`.
    @property
    def conv_states(self) -> dict[int, torch.Tensor]:  # {0: [B, C, K]}
        return {0: self._conv_storage[: self.batch_size]}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor]:  # {0: [B, C, N]}
        return {0: self._recurrent_storage[: self.batch_size]}

    @property
    def dtype(self) -> torch.dtype:
        return self._conv_storage.dtype

    @property
    def conv_shape(self) -> tuple[int, ...]:
        return tuple(self._conv_storage.shape[1:])

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return tuple(self._recurrent_storage.shape[1:])

    @property
    def nbytes(self) -> int:
        return self._conv_storage.nbytes + self._recurrent_storage.nbytes

    def data_ptrs(self) -> tuple[int, int]:
        return self._conv_storage.data_ptr(), self._recurrent_storage.data_ptr()

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        # Storage is allocated in __init__; nothing is left to initialize lazily.
        return None

    def get_conv_state(self) -> torch.Tensor | None:  # -> [B, C, K], or None before this call's prefill
        return self._conv_storage[: self.batch_size] if self.has_previous_state[0] else None

    def get_recurrent_state(self) -> torch.Tensor | None:  # -> [B, C, N], or None before this call's prefill
        return self._recurrent_storage[: self.batch_size] if self.has_previous_state[0] else None

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        # conv_states: [B, C, S] -> [B, C, max(S, K)] on the prefill, [B, C, K + S] after it
        batch_size, kernel_size = conv_states.shape[0], self.conv_kernel_size[0]
        if not self.has_previous_state[0]:
            # Prefill, as upstream's LinearAttentionLayer: left-pad to the kernel. The K-window written below covers
            # rows [:B] whole, and the recurrent rows are cleared, so nothing of an earlier call stays reachable.
            full_conv_states = conv_states
            if conv_states.shape[-1] < kernel_size:
                full_conv_states = torch.nn.functional.pad(conv_states, (kernel_size - conv_states.shape[-1], 0))
            self._recurrent_storage[:batch_size].zero_()
            self.batch_size = batch_size
            self.has_previous_state[0] = True
        else:
            full_conv_states = torch.cat([self._conv_storage[:batch_size], conv_states], dim=-1)
        self._conv_storage[:batch_size].copy_(full_conv_states[..., -kernel_size:])
        return full_conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        # recurrent_states: [B, C, N] -> [B, C, N] view of the storage
        batch_size = recurrent_states.shape[0]
        live = self._recurrent_storage[:batch_size]
        live.copy_(recurrent_states)
        self.batch_size = batch_size
        return live

    def reset(self) -> None:
        # No zeroing: the next prefill overwrites rows [:B] whole before get_*_state can return them.
        self.batch_size = 0
        self.has_previous_state[0] = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.batch_size == 0:
            return
        beam_idx = beam_idx.to(self.device)
        for storage in (self._conv_storage, self._recurrent_storage):
            live = storage[: self.batch_size]
            # index_select makes a new tensor first, so copying it back over its own source is safe.
            live.copy_(live.index_select(0, beam_idx))

    def activate_past_recording(self):
        raise NotImplementedError(
            "past recording (assisted generation, rollback) is not supported by FlexibleStaticCache's linear-attention "
            "layers: their states have a fixed size"
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("linear-attention states cannot be cropped: a recurrent state cannot be rolled back")

    def offload(self):
        raise NotImplementedError("offloading is not supported by FlexibleStaticCache")

    def prefetch(self):
        raise NotImplementedError("offloading is not supported by FlexibleStaticCache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("batch_repeat_interleave is only defined for DynamicCache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("batch_select_indices is only defined for DynamicCache")

    def grow(self, *, max_batch_size: int, max_cache_len: int | None = None) -> None:
        """Reallocate to `max_batch_size` rows (at least the current), keeping the live rows.

        `max_cache_len` is accepted so that the cache can grow every layer alike; these states have no length axis.
        """
        new_conv = self._conv_storage.new_zeros(max_batch_size, *self.conv_shape)
        new_recurrent = self._recurrent_storage.new_zeros(max_batch_size, *self.recurrent_shape)
        new_conv[: self.batch_size].copy_(self._conv_storage[: self.batch_size])
        new_recurrent[: self.batch_size].copy_(self._recurrent_storage[: self.batch_size])
        self._conv_storage, self._recurrent_storage = new_conv, new_recurrent
        self.max_batch_size = max_batch_size


class FlexiblePaddedLinearAttentionLayer(FlexibleLinearAttentionLayer):
    """The fixed-shape ("padded") mode of `FlexibleLinearAttentionLayer`, for `torch.compile` and CUDA graphs.

    Its states have no length axis, and in padded mode `generate` runs every call at the same batch, so the live
    batch (a Python int) is the same at every step of every call and a compiled decode step guards on a constant, as
    upstream's `LinearAttentionLayer` (compileable, static addresses) does. Being compileable also matters in eager:
    upstream drops a decode step's causal mask under SDPA unless the cache is compileable (`create_causal_mask`,
    transformers==5.24.0), and the padded attention layers of a hybrid model need that mask to hide the positions not
    written yet.
    """

    is_compileable = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mark_static_address()

    def mark_static_address(self) -> None:
        """Mark the conv and recurrent storage as static addresses (a no-op while dynamo traces)."""
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self._conv_storage)
            torch._dynamo.mark_static_address(self._recurrent_storage)

    def grow(self, *, max_batch_size: int, max_cache_len: int | None = None) -> None:
        super().grow(max_batch_size=max_batch_size, max_cache_len=max_cache_len)
        self.mark_static_address()


# Layer types that FlexibleStaticCache holds: attention keys/values, or linear-attention (Mamba) conv/recurrent states.
SUPPORTED_LAYER_TYPES = ("full_attention", "linear_attention")


def _layer_shapes(config: PreTrainedConfig) -> list[tuple[str, int, int]]:
    """`(layer_type, num_kv_heads, head_dim)` for each decoder layer of `config`, as upstream's StaticCache sees it.

    Heads and head dim only matter for attention layers; linear-attention shapes come from `_linear_attention_shapes`.
    """
    text_config = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    num_heads, head_dim = get_head_shapes(text_config)
    num_layers = len(layer_types)
    num_heads = num_heads if isinstance(num_heads, list) else [num_heads] * num_layers
    head_dim = head_dim if isinstance(head_dim, list) else [head_dim] * num_layers
    shapes = list(zip(layer_types, num_heads, head_dim, strict=True))
    unsupported = sorted({layer_type for layer_type, _, _ in shapes if layer_type not in SUPPORTED_LAYER_TYPES})
    if unsupported:
        raise ValueError(
            f"layer types {unsupported} of {type(config).__name__} are not supported by FlexibleStaticCache, which "
            f"holds {list(SUPPORTED_LAYER_TYPES)} layers only"
        )
    if "full_attention" not in layer_types:
        # Upstream takes positions and masks from an attention layer (`Cache.get_seq_length` raises without one).
        raise ValueError(
            f"{type(config).__name__} has no full-attention layer (layer types {sorted(set(layer_types))}); "
            "FlexibleStaticCache needs at least one"
        )
    return shapes


# Config attributes that size a linear-attention layer's states, named as Jamba names them.
LINEAR_ATTENTION_CONFIG_NAMES = ("hidden_size", "mamba_expand", "mamba_d_conv", "mamba_d_state")


def _linear_attention_shapes(config: PreTrainedConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """Per-row shapes `((C, K), (C, N))` of a linear-attention layer's conv state and recurrent state.

    Read as `JambaMambaMixer.__init__` reads them (transformers==5.24.0): `C = mamba_expand * hidden_size`,
    `K = mamba_d_conv`, `N = mamba_d_state`. Upstream has no model-agnostic source for these shapes (its
    `LinearAttentionLayer` takes them from the first update, at the call's batch), and allocating at construction is
    what lets a cache be planned up front (`nbytes_for`, export). So a config that names them otherwise is refused
    here rather than guessed; every update also checks the shapes it receives against the storage.

    Raises:
        ValueError: the config lacks one of `LINEAR_ATTENTION_CONFIG_NAMES`.
    """
    text_config = config.get_text_config(decoder=True)
    missing = [name for name in LINEAR_ATTENTION_CONFIG_NAMES if getattr(text_config, name, None) is None]
    if missing:
        raise ValueError(
            f"FlexibleStaticCache cannot size the linear-attention states of {type(config).__name__}: it reads "
            f"{list(LINEAR_ATTENTION_CONFIG_NAMES)} (as Jamba's Mamba mixer does), and {missing} are missing"
        )
    num_channels = text_config.mamba_expand * text_config.hidden_size
    return (num_channels, text_config.mamba_d_conv), (num_channels, text_config.mamba_d_state)


def _recurrent_dtype(dtype: torch.dtype) -> torch.dtype:
    # Upstream's Mamba scan multiplies by float32 `A`, so the recurrent state it caches has the promoted dtype
    # (float32 for a bfloat16 model). Storing it in the model's dtype would round it and change the outputs.
    return torch.promote_types(dtype, torch.float32)


def _build_layer(
    layer_type: str,
    num_heads: int,
    head_dim: int,
    *,
    config: PreTrainedConfig,
    max_batch_size: int,
    max_cache_len: int,
    dtype: torch.dtype,
    device: torch.device | str,
    shape_policy: str = "exact",
) -> FlexibleStaticLayer | FlexibleLinearAttentionLayer:
    if layer_type == "linear_attention":
        conv_shape, recurrent_shape = _linear_attention_shapes(config)
        linear_layer_class = (
            FlexiblePaddedLinearAttentionLayer if shape_policy == "padded" else FlexibleLinearAttentionLayer
        )
        return linear_layer_class(
            max_batch_size=max_batch_size,
            conv_shape=conv_shape,
            recurrent_shape=recurrent_shape,
            dtype=dtype,
            recurrent_dtype=_recurrent_dtype(dtype),
            device=device,
        )
    attention_layer_class = FlexiblePaddedLayer if shape_policy == "padded" else FlexibleStaticLayer
    return attention_layer_class(
        max_batch_size=max_batch_size,
        max_cache_len=max_cache_len,
        num_heads=num_heads,
        k_head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=device,
    )


class FlexibleStaticCache(Cache):
    """A static self-attention cache allocated once at `max_batch_size x max_cache_len`, serving any smaller shape.

    Hybrid models (Jamba) also get their linear-attention (Mamba) conv and recurrent states, allocated once at
    `max_batch_size` rows and read and written through `get_conv_state`, `update_conv_state`, `get_recurrent_state`
    and `update_recurrent_state`.

    Args:
        config (`PreTrainedConfig`): the model's config; the decoder's layer types, kv heads and head dim (and, for
            linear-attention layers, the Mamba sizes, see `_linear_attention_shapes`) are read from it.
        max_batch_size (`int`): rows to allocate (count `batch x num_beams` for beam search).
        max_cache_len (`int`): positions to allocate per row (prompt plus generated tokens).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the storage (the model's dtype).
        device (`torch.device` or `str`, *optional*, defaults to `"cpu"`): device of the storage.
        on_overflow (`str`, *optional*, defaults to `"grow"`): what a call over capacity does: `"grow"` reallocates
            once (with a warning naming the capacity to preset), `"error"` raises `ValueError` before writing.
        shape_policy (`str`, *optional*, defaults to `"exact"`): `"exact"` returns views of the live batch and length
            (eager, `torch.export` with dynamic shapes); `"padded"` returns all `max_cache_len` positions and leaves the
            rest to the attention mask, so that shapes stay fixed for `torch.compile` (see `FlexiblePaddedLayer`).

    Raises:
        ValueError: a capacity is not a positive int, `on_overflow` or `shape_policy` is unknown, the model has layer
            types other than full attention and linear attention, or no full-attention layer.

    Example:

    ```python
    >>> cache = FlexibleStaticCache(config=model.config, max_batch_size=8, max_cache_len=256)
    >>> out = model(input_ids[:2], cache=cache, use_cache=True)  # batch 2 of 8, no reallocation
    >>> keys, values = cache.get_kv(0, batch_size=2, length=cache.get_seq_length())
    >>> cache.reset()  # cheap: counters only; the next call may use any batch <= 8
    ```
    """

    length_name = "max_cache_len"

    def __init__(
        self,
        *,
        config: PreTrainedConfig,
        max_batch_size: int,
        max_cache_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        on_overflow: str = "grow",
        shape_policy: str = "exact",
    ):
        _check_positive_int("max_batch_size", max_batch_size)
        _check_positive_int(self.length_name, max_cache_len)
        self.on_overflow = _check_on_overflow(on_overflow)
        self.shape_policy = _check_shape_policy(shape_policy)
        sizes = {"max_batch_size": max_batch_size, "max_cache_len": max_cache_len, "dtype": dtype, "device": device}
        layers = [
            _build_layer(layer_type, num_heads, head_dim, config=config, shape_policy=shape_policy, **sizes)
            for layer_type, num_heads, head_dim in _layer_shapes(config)
        ]
        super().__init__(layers=layers)
        self.num_allocations = 1

    @classmethod
    def nbytes_for(
        cls, *, config: PreTrainedConfig, max_batch_size: int, max_cache_len: int, dtype: torch.dtype = torch.float32
    ) -> int:
        """Bytes that a cache of these capacities allocates, computed without allocating anything."""
        # The meta device allocates nothing, and building the cache there counts exactly what a real one holds.
        meta_cache = cls(
            config=config, max_batch_size=max_batch_size, max_cache_len=max_cache_len, dtype=dtype, device="meta"
        )
        return meta_cache.nbytes

    # --- capacities -------------------------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.layers[0].max_batch_size

    @property
    def max_cache_len(self) -> int:
        # The first attention layer: linear-attention layers have no length axis.
        return next(layer.max_cache_len for layer in self.layers if isinstance(layer, FlexibleStaticLayer))

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def data_ptrs(self) -> list[int]:
        """Data pointers of every storage tensor: equal across calls exactly when no reallocation happened."""
        return [ptr for layer in self.layers for ptr in layer.data_ptrs()]

    def overflows(self, *, batch_size: int, length: int) -> list[Overflow]:
        """The capacities that a call of `batch_size` rows reaching `length` positions would exceed."""
        found = []
        if batch_size > self.max_batch_size:
            found.append(Overflow("max_batch_size", batch_size, self.max_batch_size))
        if length > self.max_cache_len:
            found.append(Overflow(self.length_name, length, self.max_cache_len))
        return found

    def grow(self, *, max_batch_size: int | None = None, max_cache_len: int | None = None) -> None:
        """Reallocate to at least these capacities, keeping live content. A no-op when the cache is big enough."""
        new_batch = max(self.max_batch_size, max_batch_size or 0)
        new_len = max(self.max_cache_len, max_cache_len or 0)
        if (new_batch, new_len) == (self.max_batch_size, self.max_cache_len):
            return
        for layer in self.layers:
            layer.grow(max_batch_size=new_batch, max_cache_len=new_len)
        self.num_allocations += 1

    def ensure_capacity(self, *, batch_size: int, length: int) -> None:
        """Make room for a call of `batch_size` rows reaching `length` positions, per `on_overflow`.

        Raises:
            ValueError: with `on_overflow="error"`, naming each value, its limit and the `cache_config` that fits.
                Nothing has been changed when it is raised.
        """
        found = self.overflows(batch_size=batch_size, length=length)
        if not found:
            return
        message = overflow_message(found)
        if self.on_overflow == "error":
            raise ValueError(message)
        logger.warning("FlexibleStaticCache grows (one reallocation): %s", message)
        self.grow(max_batch_size=batch_size, max_cache_len=length)

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
            ValueError: `layer_idx`, `batch_size` or `length` is out of range, or `layer_idx` is a linear-attention
                layer.
        """
        self._checked_layer(layer_idx, FlexibleStaticLayer)
        if not 0 <= batch_size <= self.max_batch_size:
            raise ValueError(f"batch_size={batch_size} must be between 0 and max_batch_size={self.max_batch_size}")
        if not 0 <= length <= self.max_cache_len:
            raise ValueError(f"length={length} must be between 0 and {self.length_name}={self.max_cache_len}")
        return self.layers[layer_idx].get_kv(batch_size, length)

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
            ValueError: the batch differs from the one already written since the last `reset()`, or the call exceeds
                a capacity with `on_overflow="error"`; with `shape_policy="padded"`, the batch exceeds
                `max_batch_size` (the length is not checked here, see `FlexiblePaddedLayer`). Nothing is written.
        """
        layer = self._checked_layer(layer_idx, FlexibleStaticLayer)
        batch_size, num_new = key_states.shape[0], key_states.shape[-2]
        if isinstance(layer, FlexiblePaddedLayer):
            # Only static shapes are read here: a compiled decode step must not guard on a changing Python value.
            if batch_size > self.max_batch_size:
                raise ValueError(
                    f"batch_size={batch_size} exceeds max_batch_size={self.max_batch_size}; a padded cache does not "
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

    def early_initialization(self, batch_size: int, num_heads, head_dim, dtype: torch.dtype, device) -> None:
        """Storage is allocated at construction; this only makes room for `batch_size` rows (upstream API)."""
        self.ensure_capacity(batch_size=batch_size, length=0)

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
            raise ValueError(
                f"layer {layer_idx} is {kinds[type(layer)]} layer, not {kinds[layer_class]} one; use "
                f"{accessors[type(layer)]} for it"
            )
        return layer

    # --- linear-attention (Mamba) states ------------------------------------------------------------------------
    def _linear_layer(self, layer_idx: int, state_idx: int) -> FlexibleLinearAttentionLayer:
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


class FlexibleCrossAttentionCache(FlexibleStaticCache):
    """The cross-attention half of `FlexibleEncoderDecoderCache`: its capacity is `max_encoder_len`.

    Its live length is the encoder length that the current call wrote. Its lengths stay Python ints with
    `shape_policy="padded"` too: it is written once per call (a model can ask `get_seq_length` whether it was, without
    a host sync), and `generate` pads the encoder output to `max_encoder_len`, so its shapes are already fixed. Padded
    mode only marks its storage as a static address for CUDA graphs.
    """

    length_name = "max_encoder_len"

    def __init__(self, *, shape_policy: str = "exact", **kwargs):
        super().__init__(shape_policy="exact", **kwargs)
        self.shape_policy = _check_shape_policy(shape_policy)
        if shape_policy == "padded":
            for layer in self.layers:
                layer.mark_static_address()


class FlexibleEncoderDecoderCache(EncoderDecoderCache):
    """Self-attention plus cross-attention flexible caches, allocated once for encoder-decoder models.

    Args:
        config (`PreTrainedConfig`): the model's config.
        max_batch_size (`int`): rows to allocate in both caches.
        max_cache_len (`int`): decoder positions to allocate (self-attention).
        max_encoder_len (`int`): encoder positions to allocate (cross-attention).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the storage.
        device (`torch.device` or `str`, *optional*, defaults to `"cpu"`): device of the storage.
        on_overflow (`str`, *optional*, defaults to `"grow"`): `"grow"` or `"error"`, as for `FlexibleStaticCache`.
        shape_policy (`str`, *optional*, defaults to `"exact"`): `"exact"` or `"padded"`, as for
            `FlexibleStaticCache` (it applies to self-attention; see `FlexibleCrossAttentionCache` for cross-attention).

    Models read the cross-attention keys and values of the current call through
    `cache.cross_attention_cache.get_kv(layer_idx, batch_size, cache.get_encoder_length(layer_idx))`, after the first
    decoder step has written them with `cache.cross_attention_cache.update(...)`.
    """

    def __init__(
        self,
        *,
        config: PreTrainedConfig,
        max_batch_size: int,
        max_cache_len: int,
        max_encoder_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        on_overflow: str = "grow",
        shape_policy: str = "exact",
    ):
        common = {
            "config": config,
            "max_batch_size": max_batch_size,
            "dtype": dtype,
            "device": device,
            "shape_policy": shape_policy,
        }
        _check_positive_int("max_encoder_len", max_encoder_len)
        super().__init__(
            FlexibleStaticCache(max_cache_len=max_cache_len, on_overflow=on_overflow, **common),
            FlexibleCrossAttentionCache(max_cache_len=max_encoder_len, on_overflow=on_overflow, **common),
        )

    @classmethod
    def nbytes_for(
        cls,
        *,
        config: PreTrainedConfig,
        max_batch_size: int,
        max_cache_len: int,
        max_encoder_len: int,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """Bytes that a cache of these capacities allocates, computed without allocating anything."""
        common = {"config": config, "max_batch_size": max_batch_size, "dtype": dtype}
        return FlexibleStaticCache.nbytes_for(max_cache_len=max_cache_len, **common) + FlexibleStaticCache.nbytes_for(
            max_cache_len=max_encoder_len, **common
        )

    @property
    def max_batch_size(self) -> int:
        return self.self_attention_cache.max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self.self_attention_cache.max_cache_len

    @property
    def max_encoder_len(self) -> int:
        return self.cross_attention_cache.max_cache_len

    @property
    def on_overflow(self) -> str:
        return self.self_attention_cache.on_overflow

    @property
    def shape_policy(self) -> str:
        return self.self_attention_cache.shape_policy

    @on_overflow.setter
    def on_overflow(self, value: str) -> None:
        _check_on_overflow(value)
        self.self_attention_cache.on_overflow = self.cross_attention_cache.on_overflow = value

    @property
    def nbytes(self) -> int:
        return self.self_attention_cache.nbytes + self.cross_attention_cache.nbytes

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
    def batch_size(self) -> int:
        return self.self_attention_cache.batch_size

    def data_ptrs(self) -> list[int]:
        return self.self_attention_cache.data_ptrs() + self.cross_attention_cache.data_ptrs()

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

    def overflows(self, *, batch_size: int, length: int, encoder_length: int) -> list[Overflow]:
        found = self.self_attention_cache.overflows(batch_size=batch_size, length=length)
        found += [
            o
            for o in self.cross_attention_cache.overflows(batch_size=batch_size, length=encoder_length)
            if o.name != "max_batch_size"
        ]
        return found

    def ensure_capacity(self, *, batch_size: int, length: int, encoder_length: int) -> None:
        """Make room for a call in both caches, per `on_overflow`; checks both before changing either."""
        found = self.overflows(batch_size=batch_size, length=length, encoder_length=encoder_length)
        if not found:
            return
        message = overflow_message(found)
        if self.on_overflow == "error":
            raise ValueError(message)
        logger.warning("FlexibleEncoderDecoderCache grows (one reallocation): %s", message)
        self.self_attention_cache.grow(max_batch_size=batch_size, max_cache_len=length)
        self.cross_attention_cache.grow(max_batch_size=batch_size, max_cache_len=encoder_length)

    def get_kv(self, layer_idx: int, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-attention keys and values (see `FlexibleStaticCache.get_kv`); cross-attention ones are read from
        `cross_attention_cache.get_kv`."""
        return self.self_attention_cache.get_kv(layer_idx, batch_size, length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Self-attention update, for models that call `update` on the combined cache."""
        return self.self_attention_cache.update(key_states, value_states, layer_idx, *args, **kwargs)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # Beams of one input share its encoder output, and beam_idx only moves rows within an input's beams, so
        # the cross-attention rows are already equal where they would be copied: reordering them would copy for
        # nothing.
        self.self_attention_cache.reorder_cache(beam_idx)

    def early_initialization(self, batch_size: int, num_heads, head_dim, dtype: torch.dtype, device) -> None:
        """Storage is allocated at construction; this only makes room for `batch_size` rows (upstream API)."""
        self.self_attention_cache.early_initialization(batch_size, num_heads, head_dim, dtype, device)
        self.cross_attention_cache.early_initialization(batch_size, num_heads, head_dim, dtype, device)
