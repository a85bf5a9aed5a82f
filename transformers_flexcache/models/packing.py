"""A padded batch's real tokens, packed: what an encoder's per-token work (its linears, norms and activations) runs
on when only its self-attention needs the rows.

An encoder call pads every row to the call's longest, and upstream's encoder computes every position, padding
included (masked in attention, then in the decoder's cross-attention). CTranslate2's encoder follows a call's real
tokens. A packed encoder (an override's `_flex_encode_packed`, run by `compile/encoder.py`) gathers the real tokens
into one sequence `[1, N, d]` after the embeddings, runs each layer's per-token modules on it, and has its
self-attention scatter queries, keys and values back into `[B, L, ...]` rows (padding zero, masked as upstream masks
it) and gather its output again. Its output is `[B, L, d]` with zeros at the padding positions, which every consumer
masks (the decoder's cross-attention mask is built from the same attention mask); the real positions' states are
upstream's (within float rounding: a GEMM of other rows).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Where the real tokens of a `[batch, length]` call lie: `index` `[N]`, their flat positions in `batch * length`
    (ascending: row by row, each row's tokens in order); `is_real` `[batch * length]` whether a position is a real
    token, and `inverse` `[batch * length]` its place in `index` (any place for a padding position)."""

    index: torch.Tensor
    is_real: torch.Tensor
    inverse: torch.Tensor
    batch: int
    length: int

    @classmethod
    def of(cls, attention_mask: torch.Tensor, index: torch.Tensor) -> PackedRows:
        """The rows of a `[B, L]` attention mask whose real positions are `index` (`real_positions(attention_mask)`)."""
        is_real = attention_mask.reshape(-1) != 0
        inverse = (is_real.cumsum(0) - 1).clamp(min=0)  # index is ascending: the count of real positions before
        return cls(index, is_real, inverse, *attention_mask.shape)

    def pack(self, states: torch.Tensor) -> torch.Tensor:
        """`[B, L, F]` -> `[1, N, F]`: the real tokens' states, in `index` order."""
        flat = states.reshape(self.batch * self.length, states.shape[-1])
        return flat.index_select(0, self.index).unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`[1, N, F]` -> `[B, L, F]`: each token back at its position, zeros at the padding. A gather (each
        position reads its token), not a scatter into zeros: one pass, which a compiler fuses with what made
        `packed`."""
        flat = packed[0].index_select(0, self.inverse)
        flat = torch.where(self.is_real[:, None], flat, flat.new_zeros(()))
        return flat.view(self.batch, self.length, packed.shape[-1])


def real_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, L]` attention mask -> `[N]` flat positions of its real tokens (`PackedRows.index`); run eagerly, before
    a compiled encoder (its size is the call's number of real tokens)."""
    return attention_mask.reshape(-1).nonzero().squeeze(1)


def run_packed(layers, hidden_states: torch.Tensor, mask, attention_mask: torch.Tensor, index: torch.Tensor):
    """`[B, L, d]` states -> `[B, L, d]` (zeros at the padding): each of an encoder's `layers` run in turn on the
    real tokens (`PackedRows.pack`), as `layer(states, mask, packed_rows=rows)`, which the layer passes on to its
    self-attention (BART's encoder layers and their copies: `FlexBartAttentionMixin._flex_packed_self_attention`)."""
    rows = PackedRows.of(attention_mask, index)
    hidden_states = rows.pack(hidden_states)
    for layer in layers:
        hidden_states = layer(hidden_states, mask, packed_rows=rows)
    return rows.unpack(hidden_states)
