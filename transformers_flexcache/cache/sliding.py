"""Sliding-window attention storage of one layer: the last positions of each row, allocated once.

Shape legend: `B` live batch, `B_max` rows of storage, `H` kv heads, `S` new tokens, `W` the layer's
`sliding_window` (a query attends to itself and the `W - 1` positions before it), `C` = `min(W, max_cache_len)` slots
per row, `L` positions written since `reset` (the live length: `get_seq_length`), `D` head dim.

Design decisions:
- Storage is `[B_max, H, C, D]`, allocated when the cache is built, whatever the call's batch (any `B <= B_max`) and
  whatever its length: a row never holds more than the window. `max_cache_len` still counts every position a row
  may reach (as for full-attention layers, it is the cache's limit), and growing it past `W` reallocates nothing.
- The slots of a row hold its last positions in order, oldest first, so that upstream's masks apply unchanged: they
  are built from `get_mask_sizes` as `kv_offset + arange(kv_length)` absolute positions, the 2D padding mask
  indexed by those positions. A ring buffer would need masks of its own.
- Both layer classes return what upstream's layers return, so that the mask upstream builds covers exactly the
  returned keys: `FlexibleSlidingWindowLayer` ("exact") the keys of `DynamicSlidingWindowLayer` (the `W - 1` kept
  positions plus the new ones), `FlexiblePaddedSlidingWindowLayer` ("padded") those of `StaticSlidingWindowLayer`
  (all `C` slots while the new tokens fit, with the mask hiding the unwritten ones).
- A prefill longer than the window is attended in full (the returned keys are the kept positions and all the new
  ones, a new tensor), and only its last positions are stored, as upstream does.
- The exact layer drops positions that left the window at the start of the next `update`, not at the end of the
  current one: the views it returned are still being attended to when `update` returns.
- The padded layer's decode step (one new token) reads no Python value that changes: when the row is full, the
  slots shift left by one with a gather at a tensor offset, so a compiled step sees the same graph before and after
  the window fills. Its `get_mask_sizes` runs outside compiled code (`generate` builds masks before the forward) and
  reads the live length from the device; a multi-token update after the prefill (a continuation) does too.
- The bucketed layer is the padded one, except while its slots are fewer than the window (`max_cache_len <
  sliding_window`: no position ever leaves, the layer is a full-attention one of `C` slots): attention then spans the
  call's decoder length bucket, as `FlexibleBucketedLayer`. Once positions can leave, it spans the `C` slots, which
  the window bounds.
- `crop` (assisted generation) works as long as no position has left the storage; after that a rollback cannot be
  undone (upstream's layers refuse too, unless they record the past).
"""

from __future__ import annotations

import torch

from .layers import FlexiblePaddedLayer, FlexibleStaticLayer, LayerSpec, _check_tokens_to_remove


def window_len(sliding_window: int, max_cache_len: int) -> int:
    """Slots per row of a sliding-window layer: `min(sliding_window, max_cache_len)`."""
    return min(sliding_window, max_cache_len)


def _check_sliding_window(spec: LayerSpec) -> int:
    window = spec.sliding_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"a sliding-window layer needs a positive int sliding_window, got {window!r}")
    return window


class _SlidingWindowStorage:
    """What both sliding-window layers add to their attention layer class (put it first among the bases)."""

    is_sliding = True

    def __init__(self, *, spec: LayerSpec, max_batch_size: int, max_cache_len: int):
        self.sliding_window = _check_sliding_window(spec)
        super().__init__(
            spec=spec, max_batch_size=max_batch_size, max_cache_len=window_len(self.sliding_window, max_cache_len)
        )
        self.max_cache_len = max_cache_len  # positions a row may reach; the storage holds `window_len` of them

    @property
    def window_len(self) -> int:
        return self._key_storage.shape[2]

    @property
    def is_croppable(self) -> bool:
        # Whether `crop` can always put the layer back: only when no position can ever leave the storage.
        return self.max_cache_len <= self.sliding_window

    def get_kv(self, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # -> 2 x [B, H, length, D]
        """The first `length` slots of the first `batch_size` rows: the oldest kept positions first.

        Raises:
            ValueError: `length` exceeds the slots of the layer.
        """
        if length > self.window_len:
            raise ValueError(
                f"length={length} exceeds the {self.window_len} positions that a sliding-window layer holds per row "
                f"(sliding_window={self.sliding_window}, max_cache_len={self.max_cache_len})"
            )
        return self._key_storage[:batch_size, :, :length], self._value_storage[:batch_size, :, :length]

    def _reallocate(self, max_batch_size: int, num_slots: int, keep_rows: int, keep_slots: int) -> None:
        # Copies slots [:keep_slots] of rows [:keep_rows] into new storage [max_batch_size, H, num_slots, D].
        old_keys, old_values = self._key_storage, self._value_storage
        self._key_storage = old_keys.new_zeros(max_batch_size, self.num_heads, num_slots, old_keys.shape[-1])
        self._value_storage = old_values.new_zeros(max_batch_size, self.num_heads, num_slots, old_values.shape[-1])
        self._key_storage[:keep_rows, :, :keep_slots].copy_(old_keys[:keep_rows, :, :keep_slots])
        self._value_storage[:keep_rows, :, :keep_slots].copy_(old_values[:keep_rows, :, :keep_slots])


class FlexibleSlidingWindowLayer(_SlidingWindowStorage, FlexibleStaticLayer):
    """The exact mode of a sliding-window layer: DynamicSlidingWindowLayer's keys and mask sizes, in `[B_max, H, C,
    D]` storage (module docstring). Built by `FlexibleStaticCache` for `"sliding_attention"` layers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.num_stored = 0  # slots [:num_stored] hold the last positions written

    @property
    def keys(self) -> torch.Tensor:  # [B, H, num_stored, D]
        return self._key_storage[: self.batch_size, :, : self.num_stored]

    @property
    def values(self) -> torch.Tensor:  # [B, H, num_stored, D]
        return self._value_storage[: self.batch_size, :, : self.num_stored]

    def _drop_oldest(self, batch_size: int, num_drop: int) -> None:
        # Slots [num_drop:num_stored] move to [:num_stored - num_drop]; clone first, the ranges overlap.
        for storage in (self._key_storage, self._value_storage):
            rows = storage[:batch_size]
            rows[:, :, : self.num_stored - num_drop].copy_(rows[:, :, num_drop : self.num_stored].clone())
        self.num_stored -= num_drop

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, min(L, W - 1) + S, D], the keys DynamicSlidingWindowLayer returns
        batch_size, num_new = key_states.shape[0], key_states.shape[-2]
        keep = min(self.num_stored, self.sliding_window - 1)  # what the new tokens may still attend to
        if keep < self.num_stored:
            self._drop_oldest(batch_size, self.num_stored - keep)
        self.batch_size, self.seq_len = batch_size, self.seq_len + num_new
        if keep + num_new <= self.window_len:
            self._key_storage[:batch_size, :, keep : keep + num_new].copy_(key_states)
            self._value_storage[:batch_size, :, keep : keep + num_new].copy_(value_states)
            self.num_stored = keep + num_new
            return self.keys, self.values
        # More new tokens than the storage holds: attend to all of them, keep the last `window_len`.
        full_keys = torch.cat([self._key_storage[:batch_size, :, :keep], key_states], dim=-2)
        full_values = torch.cat([self._value_storage[:batch_size, :, :keep], value_states], dim=-2)
        self._key_storage[:batch_size].copy_(full_keys[:, :, -self.window_len :])
        self._value_storage[:batch_size].copy_(full_values[:, :, -self.window_len :])
        self.num_stored = self.window_len
        return full_keys, full_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # As DynamicSlidingWindowLayer (transformers==5.24.0): the kept `W - 1` positions, then the new ones.
        if self.seq_len >= self.sliding_window:
            return self.sliding_window - 1 + query_length, self.seq_len - self.sliding_window + 1
        return self.seq_len + query_length, 0

    def reset(self) -> None:
        super().reset()
        self.num_stored = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.num_stored == 0:
            return
        beam_idx = beam_idx.to(self.device)
        for live in (self.keys, self.values):
            live.copy_(live.index_select(0, beam_idx))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` positions (upstream's semantics: a negative count).

        Raises:
            ValueError: a positive count, or a position has already left the storage (it cannot be restored).
        """
        _check_tokens_to_remove(tokens_to_remove)
        if self.seq_len > self.num_stored:
            raise ValueError(
                f"crop({tokens_to_remove}) cannot roll back a sliding-window layer whose row already dropped positions "
                f"({self.seq_len} written, {self.num_stored} kept, sliding_window={self.sliding_window})"
            )
        self.num_stored = max(0, self.num_stored + tokens_to_remove)
        self.seq_len = self.num_stored

    def grow(self, *, max_batch_size: int, max_cache_len: int) -> None:
        """Make room for the given capacities (each at least the current one), keeping the live content. The slots
        are reallocated only when the batch or `min(sliding_window, max_cache_len)` grows."""
        num_slots = window_len(self.sliding_window, max_cache_len)
        if (max_batch_size, num_slots) != (self.max_batch_size, self.window_len):
            self._reallocate(max_batch_size, num_slots, self.batch_size, self.num_stored)
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len


class FlexiblePaddedSlidingWindowLayer(_SlidingWindowStorage, FlexiblePaddedLayer):
    """The fixed-shape mode of a sliding-window layer: StaticSlidingWindowLayer's keys and mask sizes, in `[B_max,
    H, C, D]` storage at static addresses (module docstring), compileable."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.is_empty = True  # nothing written since `reset`: a multi-token update is a prefill

    def _seen(self) -> int:
        # The live length as a Python int: a host read, only outside compiled steps (masks, continuations, crop).
        return int(self.cumulative_length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, C, D]; a prefill longer than C: 2 x [B, H, L + S, D]
        batch_size, num_new = key_states.shape[0], key_states.shape[-2]
        self.batch_size = batch_size
        keys, values = self._key_storage[:batch_size], self._value_storage[:batch_size]
        if num_new == 1:
            return self._decode(keys, values, key_states, value_states)
        if self.is_empty:
            self.is_empty = False
            if num_new <= self.window_len:
                positions = torch.arange(num_new, device=self.device)
                keys.index_copy_(2, positions, key_states)
                values.index_copy_(2, positions, value_states)
                self.cumulative_length.add_(num_new)
                return keys, values
            keys.copy_(key_states[:, :, -self.window_len :])
            values.copy_(value_states[:, :, -self.window_len :])
            self.cumulative_length.add_(num_new)
            return key_states, value_states
        return self._continue(keys, values, key_states, value_states)

    def _decode(self, keys, values, key_states, value_states):
        # keys: [B, H, C, D], key_states: [B, H, 1, D] -> 2 x [B, H, C, D], with no changing Python value read
        self.is_empty = False
        position = self.cumulative_length.view(1)
        if self.window_len == self.sliding_window:
            # A full row shifts left by one (slot i takes slot i + 1) and writes the new token in the last slot.
            is_full = (self.cumulative_length >= self.window_len).long()
            shift = (torch.arange(self.window_len, device=self.device) + is_full).clamp_(max=self.window_len - 1)
            keys.copy_(keys.index_select(2, shift))
            values.copy_(values.index_select(2, shift))
            position = position.clamp(max=self.window_len - 1)
        keys.index_copy_(2, position, key_states)
        values.index_copy_(2, position, value_states)
        self.cumulative_length.add_(1)
        return keys, values

    def _continue(self, keys, values, key_states, value_states):
        # Several tokens after the prefill (a continuation): StaticSlidingWindowLayer's branches on the live length.
        num_new, seen = key_states.shape[-2], self._seen()
        self.cumulative_length.add_(num_new)
        if seen + num_new <= self.window_len:
            positions = torch.arange(num_new, device=self.device) + seen
            keys.index_copy_(2, positions, key_states)
            values.index_copy_(2, positions, value_states)
            return keys, values
        kept = self.window_len - 1 if seen >= self.window_len else seen
        start = 1 if seen >= self.window_len else 0
        full_keys = torch.cat([keys[:, :, start : start + kept], key_states], dim=-2)
        full_values = torch.cat([values[:, :, start : start + kept], value_states], dim=-2)
        keys.copy_(full_keys[:, :, -self.window_len :])
        values.copy_(full_values[:, :, -self.window_len :])
        return full_keys, full_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # As StaticSlidingWindowLayer (transformers==5.24.0), with `C` slots.
        if self.window_len < self.sliding_window:
            return self.window_len, 0  # no position ever leaves: a full-attention layer of C slots
        seen = self._seen()
        if seen >= self.window_len:
            return self.window_len - 1 + query_length, seen - self.window_len + 1
        if seen + query_length > self.window_len:
            return seen + query_length, 0
        return self.window_len, 0

    def reset(self) -> None:
        super().reset()
        self.is_empty = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` positions (upstream's semantics: a negative count).

        Raises:
            ValueError: a positive count, or a position has already left the storage (it cannot be restored).
        """
        _check_tokens_to_remove(tokens_to_remove)
        if self._seen() > self.window_len:
            raise ValueError(
                f"crop({tokens_to_remove}) cannot roll back a sliding-window layer whose rows already dropped "
                f"positions ({self._seen()} written, sliding_window={self.sliding_window})"
            )
        super().crop(tokens_to_remove)

    def grow(self, *, max_batch_size: int, max_cache_len: int) -> None:
        """Make room for the given capacities, keeping all written slots; the slots are reallocated only when the
        batch or `min(sliding_window, max_cache_len)` grows."""
        num_slots = window_len(self.sliding_window, max_cache_len)
        if (max_batch_size, num_slots) != (self.max_batch_size, self.window_len):
            old_batch, old_slots = self.max_batch_size, self.window_len
            self._reallocate(max_batch_size, num_slots, old_batch, old_slots)
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len


class FlexibleBucketedSlidingWindowLayer(FlexiblePaddedSlidingWindowLayer):
    """The "bucketed" mode of a sliding-window layer: padded, with attention over the call's decoder length bucket
    while no position can leave the slots (module docstring)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attended_len = self.window_len  # until a call is planned: every slot, as padded

    def plan_call(self, *, cache_len: int, config) -> None:
        if self.window_len < self.sliding_window:
            self.attended_len = min(
                config.bucket_for("max_cache_len", cache_len, capacity=self.window_len), self.window_len
            )
        else:
            self.attended_len = self.window_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # -> 2 x [B, H, A, D] with A the attended bucket while it is below the slots; else as the padded layer
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.attended_len < self.window_len and keys.shape[2] == self.window_len:
            return keys[:, :, : self.attended_len], values[:, :, : self.attended_len]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.window_len < self.sliding_window:
            return self.attended_len, 0
        return super().get_mask_sizes(query_length)

    def grow(self, *, max_batch_size: int, max_cache_len: int) -> None:
        super().grow(max_batch_size=max_batch_size, max_cache_len=max_cache_len)
        self.attended_len = self.window_len


# The sliding-window layer class of each `shape_policy`.
SLIDING_LAYER_CLASSES = {
    "exact": FlexibleSlidingWindowLayer,
    "padded": FlexiblePaddedSlidingWindowLayer,
    "bucketed": FlexibleBucketedSlidingWindowLayer,
}
