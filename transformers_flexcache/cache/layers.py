"""Attention storage of one layer: keys and values in `[B_max, H, L_max, D]`, allocated once, with the live shape.

Shape legend: `B` live batch, `B_max` rows of storage, `H` kv heads of this layer (on this rank), `S` new tokens,
`L` live length, `L_max` capacity along the length axis, `D` head dim.

Three layer classes, one per way of running a call (the `shape_policy` of `CacheConfig`):
- `FlexibleStaticLayer` ("exact"): `update` writes rows `[:B]` at `[L : L + S]` and returns views `[:B, :, : L + S]`,
  so attention never reads a row or a position that the current call did not write, and `reset` only sets counters
  back to zero. Lengths are Python ints: no host sync in eager, but a new shape to `torch.compile` at every step.
- `FlexiblePaddedLayer` ("padded"): `update` writes with `index_copy_` at positions counted by a 0-d tensor with a
  static address and returns all `L_max` positions of the call's rows, leaving the unwritten ones to the attention
  mask (as upstream's `StaticLayer`), so that a compiled decode step sees one set of shapes.
- `FlexibleBucketedLayer` ("bucketed"): as padded, but attention spans `W` positions, the call's decoder length
  bucket (`plan_call`), not `L_max`: `update` returns `[:B, :, :W]`, so that a compiled decode step sees one set of
  shapes per (rows bucket, length bucket) and a short call does not attend over the whole capacity.

Layers never check capacities: the caches in `containers.py` do, before anything is written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin


@dataclass(frozen=True)
class LayerSpec:
    """What one cache layer holds, and where: everything needed to allocate it, and to tell its size before.

    Attention layers (`layer_type` "full_attention", or "sliding_attention" with its `sliding_window`) use
    `num_heads`, `k_head_dim`, `v_head_dim`; linear-attention (Mamba) layers use `conv_shape` `(C, K)` and
    `recurrent_shape` `(C, N)` per row, and hold the recurrent state in `recurrent_dtype`. `device` is where the
    layer's attention runs; `dtype` that of its key/value projections.
    """

    layer_type: str
    device: torch.device
    dtype: torch.dtype
    num_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    conv_shape: tuple[int, ...] = ()
    recurrent_shape: tuple[int, ...] = ()
    recurrent_dtype: torch.dtype | None = None
    sliding_window: int | None = None  # "sliding_attention": a row holds min(sliding_window, max_cache_len) positions

    def nbytes(self, *, max_batch_size: int, max_cache_len: int) -> int:
        """Bytes that a layer of this spec allocates at these capacities."""
        item = torch.empty((), dtype=self.dtype).element_size()
        if self.layer_type == "linear_attention":
            recurrent_item = torch.empty((), dtype=self.recurrent_dtype or self.dtype).element_size()
            conv = max_batch_size * _numel(self.conv_shape) * item
            return conv + max_batch_size * _numel(self.recurrent_shape) * recurrent_item
        if self.sliding_window is not None:
            max_cache_len = min(self.sliding_window, max_cache_len)
        return max_batch_size * self.num_heads * max_cache_len * (self.k_head_dim + self.v_head_dim) * item


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _check_tokens_to_remove(tokens_to_remove: int) -> None:
    if tokens_to_remove > 0:
        raise ValueError(
            f"crop({tokens_to_remove}) is not supported; pass a negative number of tokens to remove, as for upstream's "
            "StaticLayer"
        )


class FlexibleStaticLayer(CacheLayerMixin):
    """Keys and values of one attention layer in `[B_max, H, L_max, D]` storage, with the live batch and length.

    Built by `FlexibleStaticCache`; models use the cache's `get_kv` and `update`, not this class.
    """

    is_compileable = False  # live lengths are Python ints: each decode step is a new shape to the compiler
    is_croppable = True
    is_sliding = False
    supports_early_init = True

    def __init__(self, *, spec: LayerSpec, max_batch_size: int, max_cache_len: int):
        # CacheLayerMixin.__init__ would set `keys`/`values` attributes; here they are read-only live views.
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.num_heads = spec.num_heads
        self.device = torch.device(spec.device)
        storage = {"dtype": spec.dtype, "device": spec.device}
        self._key_storage = torch.zeros(max_batch_size, spec.num_heads, max_cache_len, spec.k_head_dim, **storage)
        self._value_storage = torch.zeros(max_batch_size, spec.num_heads, max_cache_len, spec.v_head_dim, **storage)
        self.batch_size = 0  # live batch: rows written by the current call
        self.seq_len = 0  # live length: positions written by the current call
        self.is_initialized = True

    def renewed(self) -> FlexibleStaticLayer:
        """A new layer object over the same storage, with counters of its own (set back by `reset`)."""
        return copy.copy(self)

    def static_tensors(self) -> list[torch.Tensor]:
        """The tensors a compiled step mutates in place, whose address must stay fixed for CUDA graphs
        (`compile.hooks.mark_static_addresses` marks them when a fixed-shape cache is leased on an accelerator)."""
        return [self._key_storage, self._value_storage]

    def storages(self) -> list[torch.Tensor]:
        """The tensors this layer allocated (for sizes, data pointers and `release`)."""
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

    def plan_call(self, *, cache_len: int, config) -> None:
        """Told by the cache, before a call, the decoder positions it needs (`cache_len`) and its `CacheConfig`.
        Only the bucketed layer uses it."""
        return None

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
        # Upstream's semantics (`CacheLayerMixin.crop`, transformers==5.24.0): a negative count of tokens to remove.
        _check_tokens_to_remove(tokens_to_remove)
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


class FlexiblePaddedLayer(FlexibleStaticLayer):
    """The fixed-shape ("padded") mode of `FlexibleStaticLayer`, for `torch.compile` and CUDA graphs.

    `update` writes with `index_copy_` at positions counted by `cumulative_length`, a 0-d tensor with a static
    address (as upstream's `StaticLayer`), and returns all `L_max` positions of the call's rows; the attention mask
    hides those not written yet (`get_mask_sizes` returns the capacity). So a decode step has the same shapes and reads
    no changing Python value at any step of any call, and compiles once. The exact mode's Python-int `seq_len` is not
    used: the live length is `cumulative_length`. The length is not checked against the capacity here (that would
    need a host sync): `generate` reserves room before the call, and `index_copy_` raises past the capacity on CPU.
    """

    is_compileable = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # A tensor, not an int: positions then derive from it inside the graph instead of being baked into it.
        self.cumulative_length = torch.zeros((), dtype=torch.long, device=self.device)
        # Positions a `crop` rolled back since the last `reset`: they may hold values past the live length.
        self._cropped_from = 0

    def static_tensors(self) -> list[torch.Tensor]:
        return [self._key_storage, self._value_storage, self.cumulative_length]

    @property
    def keys(self) -> torch.Tensor:  # [B, H, L_max, D]
        return self._key_storage[: self.batch_size]

    @property
    def values(self) -> torch.Tensor:  # [B, H, L_max, D]
        return self._value_storage[: self.batch_size]

    def _attended(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> 2 x [B, H, L_max, D]: the positions attention spans
        return self._key_storage[:batch_size], self._value_storage[:batch_size]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, L_max, D]
        batch_size, num_new = key_states.shape[0], key_states.shape[-2]
        positions = torch.arange(num_new, device=self.device) + self.cumulative_length  # [S]
        self.cumulative_length.add_(num_new)  # in place: the address stays static
        keys, values = self._attended(batch_size)
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
        # Unlike the exact mode, attention reads every position (with weight 0 where masked): zero what was written so
        # that nothing non-finite left by an earlier call can turn a masked product into NaN (upstream zeroes too).
        written = self._written_positions()
        for storage in (self._key_storage, self._value_storage):
            storage[:, :, :written].zero_()
        self.cumulative_length.zero_()
        self._cropped_from = 0
        self.batch_size = 0

    def _written_positions(self) -> int:
        """How many leading positions of the storage (of every row) can hold a value written since the last `reset`.

        Every write (`update`, in every subclass) lands below the live length `cumulative_length` as it stands after
        it; only `crop` lowers that length, and it keeps what it rolled back from. Read on the host on CPU, where it
        costs ~1 us and a cache of capacity (16 rows, 1024 positions) is otherwise zeroed whole at every call (27 ms
        for a t5-small-sized T5, AMD EPYC Zen 3); elsewhere the storage is zeroed whole, without a host sync.
        """
        capacity = self._key_storage.shape[2]
        if self.device.type != "cpu":
            return capacity
        return min(capacity, max(int(self.cumulative_length), self._cropped_from))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.batch_size == 0:
            return
        beam_idx = beam_idx.to(self.device)
        # Copied back in place (upstream's StaticLayer rebinds `keys`), so the static address is kept.
        for storage in (self._key_storage[: self.batch_size], self._value_storage[: self.batch_size]):
            storage.copy_(storage.index_select(0, beam_idx))

    def crop(self, tokens_to_remove: int) -> None:
        # The removed positions stay in the storage, masked: the next update overwrites them (as upstream's StaticLayer).
        _check_tokens_to_remove(tokens_to_remove)
        if self.device.type == "cpu":  # what `reset` zeroes (`_written_positions`); a host read only on CPU
            self._cropped_from = max(self._cropped_from, int(self.cumulative_length))
        self.cumulative_length.add_(tokens_to_remove).clamp_(min=0)

    def grow(self, *, max_batch_size: int, max_cache_len: int) -> None:
        """Reallocate to the given capacities (each at least the current one), keeping all written content."""
        old_keys, old_values = self._key_storage, self._value_storage
        self._key_storage = old_keys.new_zeros(max_batch_size, self.num_heads, max_cache_len, old_keys.shape[-1])
        self._value_storage = old_values.new_zeros(max_batch_size, self.num_heads, max_cache_len, old_values.shape[-1])
        self._key_storage[: old_keys.shape[0], :, : old_keys.shape[2]].copy_(old_keys)
        self._value_storage[: old_values.shape[0], :, : old_values.shape[2]].copy_(old_values)
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len


class FlexibleBucketedLayer(FlexiblePaddedLayer):
    """The "bucketed" mode: as `FlexiblePaddedLayer`, with attention over the call's decoder length bucket.

    Before each call the cache tells the layer the decoder positions the call needs (`plan_call`); attention then
    spans `window_len` positions, the smallest bucket of `max_cache_len` that holds them (`CacheConfig.bucket_for`),
    instead of the whole capacity: `update` returns views `[:B, :, :W]` and `get_mask_sizes` returns `W`. Within a
    call `W` is fixed, so a compiled decode step guards on one value of it per bucket: one graph per (rows, encoder
    length, decoder length) bucket, a number known in advance. The rows `B` are the call's, padded to a bucket by
    `BucketedPolicy`.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.window_len = self.max_cache_len  # until a call is planned: the whole capacity, as padded

    def plan_call(self, *, cache_len: int, config) -> None:
        self.window_len = min(
            config.bucket_for("max_cache_len", cache_len, capacity=self.max_cache_len), self.max_cache_len
        )

    def _attended(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> 2 x [B, H, W, D]
        window = self.window_len
        return self._key_storage[:batch_size, :, :window], self._value_storage[:batch_size, :, :window]

    @property
    def keys(self) -> torch.Tensor:  # [B, H, W, D]
        return self._attended(self.batch_size)[0]

    @property
    def values(self) -> torch.Tensor:  # [B, H, W, D]
        return self._attended(self.batch_size)[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Attention spans the call's length bucket; the mask hides the positions not written yet.
        return self.window_len, 0


# The attention layer class of each `shape_policy`.
ATTENTION_LAYER_CLASSES = {
    "exact": FlexibleStaticLayer,
    "padded": FlexiblePaddedLayer,
    "bucketed": FlexibleBucketedLayer,
}
