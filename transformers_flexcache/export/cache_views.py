"""The cache of one call of an exported program: flexible-cache objects over views of the wrapper's buffers.

Shapes as in `transformers_flexcache.export`. These classes allocate nothing: the wrapper module owns the storage
(registered buffers) and builds these objects in each call, so that the model's own code reads and writes the
buffers through the flexible cache's public methods (`update`, `get_kv`, `get_seq_length`, `get_mask_sizes`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, EncoderDecoderCache

from ..cache import FlexibleCrossAttentionCache, FlexibleEncoderDecoderCache, FlexibleStaticCache, FlexibleStaticLayer


class BufferViewLayer(FlexibleStaticLayer):
    """A `FlexibleStaticLayer` over storage owned by an export wrapper (its registered buffers), not allocated here.

    `batch_size` and `seq_len` may be symbolic sizes read from the call's input shapes, so `update` and `get_kv`
    return exact views `[:B, :, :L]` whose sizes are dynamic dimensions of the exported program.
    """

    def __init__(self, *, key_storage: torch.Tensor, value_storage: torch.Tensor, batch_size, seq_len):
        # key_storage, value_storage: [B_max, H, L_max, D], used in place
        self.max_batch_size, self.num_heads, self.max_cache_len, _ = key_storage.shape
        self.device = key_storage.device
        self._key_storage, self._value_storage = key_storage, value_storage
        self.batch_size, self.seq_len = batch_size, seq_len
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, L + S, D]
        # index_copy_ into rows [:B] (contiguous for any B) rather than copy_ into [:B, :, L : L + S]: tracing a copy
        # into a view that is contiguous only at L + S == L_max would specialize the program on that length.
        batch_size, num_new = key_states.shape[0], key_states.shape[-2]
        positions = torch.arange(num_new, device=key_states.device) + self.seq_len
        self._key_storage[:batch_size].index_copy_(2, positions, key_states)
        self._value_storage[:batch_size].index_copy_(2, positions, value_states)
        self.batch_size, self.seq_len = batch_size, self.seq_len + num_new
        return self.get_kv(batch_size, self.seq_len)


class PositionedLayer(BufferViewLayer):
    """Self-attention over whole buffer rows, written at the tensor positions `cache_position`.

    Positions are data, not shapes, so one program serves every step. As for upstream's `StaticLayer`, keys span
    `L_max` and the model masks the slots past the positions: its causal mask starts at `get_seq_length()`.
    """

    is_compileable = True  # keys span L_max: the mask must be built, never skipped as a plain causal one

    def __init__(self, *, key_storage: torch.Tensor, value_storage: torch.Tensor, batch_size, cache_position):
        super().__init__(key_storage=key_storage, value_storage=value_storage, batch_size=batch_size, seq_len=0)
        self.cache_position = cache_position  # [S]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, L_max, D]
        keys, values = self._key_storage[: self.batch_size], self._value_storage[: self.batch_size]
        keys.index_copy_(2, self.cache_position, key_states)
        values.index_copy_(2, self.cache_position, value_states)
        return keys, values

    def get_seq_length(self) -> torch.Tensor:
        return self.cache_position[0]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0


class BufferViewCache(FlexibleStaticCache):
    """A `FlexibleStaticCache` of `BufferViewLayer`s: capacities are the buffers' shapes, nothing is allocated."""

    def __init__(self, *, layers: list[BufferViewLayer]):
        Cache.__init__(self, layers=layers)
        self.on_overflow = "error"  # the runners check capacities before a program runs; nothing can grow inside
        self.num_allocations = 0


class PositionedCache(BufferViewCache):
    """The self-attention cache of a call: writes at `cache_position`, which the runner has checked."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, L_max, D]
        return self.layers[layer_idx].update(key_states, value_states)


class BufferViewCrossAttentionCache(BufferViewCache, FlexibleCrossAttentionCache):
    """The cross-attention cache of a call: exact views `[:B, :, :L_enc]` of the cross-attention buffers."""


class BufferViewEncoderDecoderCache(FlexibleEncoderDecoderCache):
    """A `FlexibleEncoderDecoderCache` over an export wrapper's buffers, built for one call of a program."""

    def __init__(self, self_attention_cache: PositionedCache, cross_attention_cache: BufferViewCrossAttentionCache):
        EncoderDecoderCache.__init__(self, self_attention_cache, cross_attention_cache)
