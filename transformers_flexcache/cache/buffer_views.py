"""The cache of one call of an exported program: flexible-cache objects over the export wrapper's packed buffers.

Shapes as in `transformers_flexcache.export`, which alone uses this module; it lives in the cache package because
its classes subclass the cache's layers and set their storage. These classes allocate nothing: the wrapper module owns the storage
(registered buffers) and builds these objects in each call, so that the model's own code reads and writes the
buffers through the flexible cache's public methods (`update`, `get_kv`, `get_seq_length`, `get_mask_sizes`).

Design decisions:
- A layer's keys (and values) are one 2-d buffer `[N_max, D]`, rows of head-dim vectors, read as a prefix
  `[:B * H * L]` viewed as `[B, H, L, D]`. Writes are `index_put_` with one 1-d index along dim 0, which ExecuTorch
  runs in place (its portable `index_put_` supports exactly that case) once `run_reinplace_pass` is on; slicing a
  4-d buffer `[:B, :, start:end]` and writing into it would instead cost a copy of the whole buffer per layer and step
  (functionalization turns it into `slice_scatter` plus a write-back).
- Self-attention rows are laid out `[B_max, H, L_max]` (row `(b * H + h) * L_max + position`), so a call's batch is
  a prefix. Cross-attention keys/values are packed for the call's encoder length: `[B, H, L_enc]` from row 0, so
  that a call's view is a prefix too, whatever `L_enc`.
- ExecuTorch copies a prefix (`slice_copy`: its views must keep the element count), so every read of a call's rows
  `[:B]` is a copy of them per layer and step. A cross-attention layer whose length is fixed (Whisper's 1500
  encoder positions: 18 MB of keys and values per row of whisper-tiny) may instead be read whole
  (`read_all_rows`): `get_kv` returns all `B_max` rows as a view of the whole buffer, which ExecuTorch makes
  without a copy, and the export attention runs the rows past the call's batch on zero queries
  (`rewrites.export_attention_forward`). Reading `B_max` rows costs less than copying `B` rows and reading them
  again whenever `B > B_max / 3`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, EncoderDecoderCache

from .containers import FlexibleCrossAttentionCache, FlexibleEncoderDecoderCache, FlexibleStaticCache
from .layers import FlexibleStaticLayer
from .specs import layer_specs_from_config


def layer_shapes(config) -> list[tuple[str, int, int]]:
    """`(layer_type, num_kv_heads, head_dim)` per decoder layer of `config`, from the cache's layer specs."""
    return [(spec.layer_type, spec.num_heads, spec.k_head_dim) for spec in layer_specs_from_config(config)]


def packed_view(storage: torch.Tensor, batch_size, num_heads: int, length) -> torch.Tensor:
    """The prefix of `storage` `[N_max, D]` that holds `[batch_size, num_heads, length, D]`, as that view."""
    # storage: [N_max, D] -> [B, H, L, D]
    return storage[: batch_size * num_heads * length].view(batch_size, num_heads, length, storage.shape[-1])


def self_attention_rows(batch_size, num_heads: int, max_cache_len: int, cache_position: torch.Tensor) -> torch.Tensor:
    """Rows of a self-attention storage that hold positions `cache_position` of rows `[:B]`: `[B * H * S]`."""
    # cache_position: [S] -> [B * H * S], ordered as key_states [B, H, S, D] flattened
    rows = torch.arange(batch_size * num_heads, device=cache_position.device) * max_cache_len  # [B * H]
    return (rows[:, None] + cache_position[None, :]).reshape(-1)


class BufferViewLayer(FlexibleStaticLayer):
    """A `FlexibleStaticLayer` over packed storage owned by an export wrapper (its registered buffers).

    Used for cross-attention: `update` packs the call's keys/values from row 0 and `get_kv` reads them back, as
    `[B, H, L_enc, D]`. `batch_size` and `seq_len` may be symbolic sizes read from the call's input shapes.
    """

    def __init__(
        self,
        *,
        key_storage: torch.Tensor,
        value_storage: torch.Tensor,
        num_heads: int,
        max_batch_size: int,
        max_cache_len: int,
        batch_size,
        seq_len,
        read_all_rows: bool = False,
    ):
        # key_storage, value_storage: [N_max, D] with N_max = max_batch_size * num_heads * max_cache_len, used in place
        self.num_heads, self.max_batch_size, self.max_cache_len = num_heads, max_batch_size, max_cache_len
        self.read_all_rows = read_all_rows
        self.device = key_storage.device
        self._key_storage, self._value_storage = key_storage, value_storage
        self.batch_size, self.seq_len = batch_size, seq_len
        self.is_initialized = True

    def get_kv(self, batch_size, length) -> tuple[torch.Tensor, torch.Tensor]:  # -> 2 x [B, H, length, D]
        if self.read_all_rows and isinstance(length, int) and length == self.max_cache_len:
            # every row: a view of the whole buffer, no slice -> 2 x [B_max, H, L_max, D]
            shape = (self.max_batch_size, self.num_heads, length)
            return self._key_storage.view(*shape, -1), self._value_storage.view(*shape, -1)
        return (
            packed_view(self._key_storage, batch_size, self.num_heads, length),
            packed_view(self._value_storage, batch_size, self.num_heads, length),
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, L_enc, D] -> 2 x [B, H, L_enc, D]; written once per sequence, packed from row 0
        batch_size, _, num_new, head_dim = key_states.shape
        rows = torch.arange(batch_size * self.num_heads * num_new, device=key_states.device)
        self._key_storage.index_put_((rows,), key_states.reshape(-1, head_dim))
        self._value_storage.index_put_((rows,), value_states.reshape(-1, value_states.shape[-1]))
        self.batch_size, self.seq_len = batch_size, num_new
        return self.get_kv(batch_size, num_new)


class PositionedLayer(BufferViewLayer):
    """Self-attention over whole rows `[B, H, L_max, D]`, written at the tensor positions `cache_position`.

    Positions are data, not shapes, so one program serves every step. As for upstream's `StaticLayer`, keys span
    `L_max` and the model masks the slots past the positions: its causal mask starts at `get_seq_length()`.
    """

    is_compileable = True  # keys span L_max: the mask must be built, never skipped as a plain causal one

    def __init__(
        self,
        *,
        key_storage: torch.Tensor,
        value_storage: torch.Tensor,
        num_heads: int,
        max_batch_size: int,
        max_cache_len: int,
        batch_size,
        cache_position: torch.Tensor,
        rows: torch.Tensor | None = None,
    ):
        super().__init__(
            key_storage=key_storage,
            value_storage=value_storage,
            num_heads=num_heads,
            max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
            batch_size=batch_size,
            seq_len=0,
        )
        self.cache_position = cache_position  # [S]
        # [B * H * S]: where this call writes; shared by the layers of one call (one computation in the graph)
        self.rows = self_attention_rows(batch_size, num_heads, max_cache_len, cache_position) if rows is None else rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, L_max, D]
        self._key_storage.index_put_((self.rows,), key_states.reshape(-1, key_states.shape[-1]))
        self._value_storage.index_put_((self.rows,), value_states.reshape(-1, value_states.shape[-1]))
        return self.get_kv(self.batch_size, self.max_cache_len)

    def get_seq_length(self) -> torch.Tensor:
        return self.cache_position[0]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0


class _OverBuffers:
    """What a cache over buffers sets instead of allocating: its layers, and that nothing grows."""

    def __init__(self, *, layers: list[BufferViewLayer]):
        Cache.__init__(self, layers=layers)
        self.on_overflow = "error"  # the runners check capacities before a program runs; nothing can grow inside
        self.num_allocations = 0


class BufferViewCache(_OverBuffers, FlexibleStaticCache):
    """A `FlexibleStaticCache` of `BufferViewLayer`s: nothing is allocated, nothing grows."""


class PositionedCache(BufferViewCache):
    """The self-attention cache of a call: writes at `cache_position`, which the runner has checked."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, H, S, D] -> 2 x [B, H, L_max, D]
        return self.layers[layer_idx].update(key_states, value_states)


class BufferViewCrossAttentionCache(_OverBuffers, FlexibleCrossAttentionCache):
    """The cross-attention cache of a call: the packed `[B, H, L_enc, D]` keys/values of the sequence."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, H, L_enc, D] -> 2 x [B, H, L_enc, D]; capacities are checked by the runners
        return self.layers[layer_idx].update(key_states, value_states)

    def get_kv(self, layer_idx: int, batch_size, length) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer_idx].get_kv(batch_size, length)


class BufferViewEncoderDecoderCache(FlexibleEncoderDecoderCache):
    """A `FlexibleEncoderDecoderCache` over an export wrapper's buffers, built for one call of a program."""

    def __init__(self, self_attention_cache: PositionedCache, cross_attention_cache: BufferViewCrossAttentionCache):
        EncoderDecoderCache.__init__(self, self_attention_cache, cross_attention_cache)
