"""Export a model with the flexible cache as registered buffers: one program for every batch and length that fits.

Shape legend:
    B        batch of the call, at most `max_batch_size` (B_max)
    S        new decoder tokens of the call (a prefill of several tokens, or one step)
    P        positions of the call: `cache_position = arange(start, start + S)`, ending at most at `max_cache_len`
    L_enc    encoder length of the call, at most `max_encoder_len` (L_enc_max)
    L_max    `max_cache_len`: decoder positions held per row
    H, D     key/value heads and head dim of a decoder layer
    V        vocabulary

Programs, `prefill` and `decode` (two `torch.export.ExportedProgram`s, or two methods of one ExecuTorch `.pte`):
    encoder-decoder  `prefill(input_ids [B, L_enc], attention_mask [B, L_enc], decoder_input_ids [B, S],
                     cache_position [S]) -> logits [B, S, V]` runs the encoder, writes its output and the
                     cross-attention keys/values of rows [:B], then the first decoder tokens.
                     `decode(decoder_input_ids [B, S], cache_position [S], encoder_attention_mask [B, L_enc])
                     -> logits [B, S, V]` runs the next decoder tokens, reading the cross-attention keys/values that
                     `prefill` wrote (they are never recomputed).
    decoder-only     `prefill` and `decode`, both `(input_ids [B, S], attention_mask [B, L_max], position_ids [B, S],
                     cache_position [S]) -> logits [B, S, V]`; `attention_mask` covers every cache position.

Design decisions:
- The wrapper module owns the cache as registered buffers, allocated once at the maximum shape: per decoder layer,
  self-attention keys/values `[B_max, H, L_max, D]`, and for encoder-decoder models cross-attention keys/values
  `[B_max, H, L_enc_max + 1, D]` and the encoder output `[B_max, L_enc_max + 1, d_model]`. ExecuTorch plans them
  once and shares them between the two methods (`share_mutable_buffers=True`): what `prefill` writes, `decode`
  reads, and everything persists between calls.
- Each call builds a `FlexibleEncoderDecoderCache` (or `FlexibleStaticCache`) over views of those buffers and runs
  the model's own forward. So the model's own code (our override's `update` / `get_kv` path) writes and reads the
  cache, and logits come from the model's own head: T5's `d_model**-0.5` scaling of tied embeddings is kept.
- Batch, encoder length and new decoder tokens are dynamic dimensions (`torch.export.Dim` bounded by the
  capacities). Cross-attention views are exact, `[:B, :, :L_enc]`, `L_enc` being read from the shape of the encoder
  attention mask, so the cross-attention mask covers exactly the call's encoder positions. The one spare encoder
  position is never used: it makes such a view non-contiguous for every `L_enc`, which keeps `torch.export` from
  specializing the program on `L_enc == max_encoder_len` when it traces a matmul on it.
- Self-attention positions are an input tensor, `cache_position`, as in upstream's `StaticCache`: new keys/values
  are written with `index_copy_` at those positions, and attention reads the whole row `[:B, :, :L_max]` under the
  causal mask that the model builds from `cache_position[0]` (`get_seq_length()`). A sequence restarts by calling
  `prefill` again from position 0: there is no reset program. `prefill` zeroes the call's rows of the
  self-attention buffers first, because ExecuTorch does not initialize mutable buffers and a masked slot must still
  hold a finite value (a NaN there would survive the mask).
- Capacities and inputs are checked in Python by the runners (`ExportedPrograms`, `ExecuTorchPrograms`) before a
  program runs: a `ValueError` names the value, the limit and the fix, instead of a kernel error or an
  out-of-bounds write.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.export import Dim, ExportedProgram
from transformers.cache_utils import Cache, EncoderDecoderCache

from .cache import (
    FlexibleCrossAttentionCache,
    FlexibleEncoderDecoderCache,
    FlexibleStaticCache,
    FlexibleStaticLayer,
    _layer_shapes,
)

METHOD_NAMES = ("prefill", "decode")


# --- the cache of one call: views of the wrapper's buffers ---------------------------------------------------------
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


# --- the modules that torch.export traces -------------------------------------------------------------------------
def _check_model(model: nn.Module, *, encoder_decoder: bool) -> None:
    from .modeling import FlexModelMixin

    if not isinstance(model, FlexModelMixin):
        raise TypeError(
            f"{type(model).__name__} is not a transformers_flexcache override model; load it after "
            "transformers_flexcache.register(), or convert it in place with transformers_flexcache.convert(model)"
        )
    if model.training:
        raise ValueError(f"{type(model).__name__} is in training mode (dropout would be exported); call model.eval()")
    if bool(model.config.is_encoder_decoder) != encoder_decoder:
        kind = "an encoder-decoder" if model.config.is_encoder_decoder else "a decoder-only"
        fix = "ExportableEncoderDecoder" if model.config.is_encoder_decoder else "ExportableDecoderOnly"
        raise TypeError(f"{type(model).__name__} is {kind} model; wrap it in {fix}")


def _check_capacities(**capacities: int) -> None:
    for name, value in capacities.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")


class _ExportableBase(nn.Module):
    def _register_self_attention_buffers(self, model: nn.Module) -> None:
        self.num_layers = 0
        for i, (_, num_heads, head_dim) in enumerate(_layer_shapes(model.config)):
            shape = (self.max_batch_size, num_heads, self.max_cache_len, head_dim)
            self.register_buffer(f"self_keys_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
            self.register_buffer(f"self_values_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
            self.num_layers += 1

    def _self_attention_cache(self, batch_size, cache_position: torch.Tensor) -> PositionedCache:
        layers = [
            PositionedLayer(
                key_storage=self.get_buffer(f"self_keys_{i}"),
                value_storage=self.get_buffer(f"self_values_{i}"),
                batch_size=batch_size,
                cache_position=cache_position,
            )
            for i in range(self.num_layers)
        ]
        return PositionedCache(layers=layers)

    def _zero_self_attention_rows(self, batch_size) -> None:
        # Masked slots must hold finite values: ExecuTorch leaves mutable buffers uninitialized.
        for i in range(self.num_layers):
            self.get_buffer(f"self_keys_{i}")[:batch_size].zero_()
            self.get_buffer(f"self_values_{i}")[:batch_size].zero_()

    def capacities(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.capacity_names}


class ExportableEncoderDecoder(_ExportableBase):
    """An encoder-decoder override model plus its flexible cache as registered buffers: `prefill` and `decode`.

    Args:
        model: an override model (e.g. `FlexT5ForConditionalGeneration`), in eval mode.
        max_batch_size (`int`): rows of every buffer.
        max_cache_len (`int`): decoder positions per row; greedy decoding of N new tokens uses N positions.
        max_encoder_len (`int`): encoder positions per row.

    Raises:
        TypeError: `model` is not an encoder-decoder override model.
        ValueError: a capacity is not a positive int, or `model` is in training mode.
    """

    is_encoder_decoder = True
    capacity_names = ("max_batch_size", "max_cache_len", "max_encoder_len")

    def __init__(self, model: nn.Module, *, max_batch_size: int, max_cache_len: int, max_encoder_len: int):
        super().__init__()
        _check_model(model, encoder_decoder=True)
        _check_capacities(max_batch_size=max_batch_size, max_cache_len=max_cache_len, max_encoder_len=max_encoder_len)
        self.model = model
        self.max_batch_size, self.max_cache_len, self.max_encoder_len = max_batch_size, max_cache_len, max_encoder_len
        self._register_self_attention_buffers(model)
        for i, (_, num_heads, head_dim) in enumerate(_layer_shapes(model.config)):
            shape = (max_batch_size, num_heads, max_encoder_len + 1, head_dim)  # + 1: see the module docstring
            self.register_buffer(f"cross_keys_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
            self.register_buffer(f"cross_values_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
        hidden_size = model.config.get_text_config(decoder=True).hidden_size
        shape = (max_batch_size, max_encoder_len + 1, hidden_size)
        self.register_buffer("encoder_hidden_states", torch.zeros(shape, dtype=model.dtype), persistent=False)

    def _cache(self, batch_size, cache_position: torch.Tensor, encoder_len) -> BufferViewEncoderDecoderCache:
        # encoder_len: 0 while the cross-attention keys/values are still to be written (prefill)
        cross_layers = [
            BufferViewLayer(
                key_storage=self.get_buffer(f"cross_keys_{i}"),
                value_storage=self.get_buffer(f"cross_values_{i}"),
                batch_size=batch_size,
                seq_len=encoder_len,
            )
            for i in range(self.num_layers)
        ]
        return BufferViewEncoderDecoderCache(
            self._self_attention_cache(batch_size, cache_position),
            BufferViewCrossAttentionCache(layers=cross_layers),
        )

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        cache_position: torch.Tensor,
    ) -> torch.Tensor:
        # input_ids, attention_mask: [B, L_enc]; decoder_input_ids: [B, S]; cache_position: [S] -> [B, S, V]
        batch_size = input_ids.shape[0]
        self._zero_self_attention_rows(batch_size)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            cache=self._cache(batch_size, cache_position, encoder_len=0),
            use_cache=True,
        )
        encoder_hidden_states = outputs.encoder_last_hidden_state  # [B, L_enc, d_model]
        # Kept for decode, which passes it back to the model (T5 only reads its shape; other models may read more).
        positions = torch.arange(encoder_hidden_states.shape[1], device=encoder_hidden_states.device)
        self.encoder_hidden_states[:batch_size].index_copy_(1, positions, encoder_hidden_states)
        return outputs.logits

    def decode(
        self, decoder_input_ids: torch.Tensor, cache_position: torch.Tensor, encoder_attention_mask: torch.Tensor
    ) -> torch.Tensor:
        # decoder_input_ids: [B, S]; cache_position: [S]; encoder_attention_mask: [B, L_enc] -> [B, S, V]
        batch_size, encoder_len = encoder_attention_mask.shape
        outputs = self.model(
            attention_mask=encoder_attention_mask,
            decoder_input_ids=decoder_input_ids,
            encoder_outputs=(self.encoder_hidden_states[:batch_size, :encoder_len],),
            cache=self._cache(batch_size, cache_position, encoder_len=encoder_len),
            use_cache=True,
        )
        return outputs.logits


class ExportableDecoderOnly(_ExportableBase):
    """A decoder-only override model plus its flexible cache as registered buffers: `prefill` and `decode`.

    Both methods take `(input_ids [B, S], attention_mask [B, L_max], position_ids [B, S], cache_position [S])`;
    `prefill` starts a sequence (it zeroes the call's rows first), `decode` continues it.

    Args:
        model: an override model (e.g. `FlexLlamaForCausalLM`), in eval mode.
        max_batch_size (`int`): rows of every buffer.
        max_cache_len (`int`): positions per row (prompt plus generated tokens, minus one).

    Raises:
        TypeError: `model` is not a decoder-only override model.
        ValueError: a capacity is not a positive int, or `model` is in training mode.
    """

    is_encoder_decoder = False
    capacity_names = ("max_batch_size", "max_cache_len")

    def __init__(self, model: nn.Module, *, max_batch_size: int, max_cache_len: int):
        super().__init__()
        _check_model(model, encoder_decoder=False)
        _check_capacities(max_batch_size=max_batch_size, max_cache_len=max_cache_len)
        self.model = model
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len
        self._register_self_attention_buffers(model)

    def decode(self, input_ids, attention_mask, position_ids, cache_position) -> torch.Tensor:
        # input_ids, position_ids: [B, S]; attention_mask: [B, L_max]; cache_position: [S] -> [B, S, V]
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=self._self_attention_cache(input_ids.shape[0], cache_position),
            use_cache=True,
        )
        return outputs.logits

    def prefill(self, input_ids, attention_mask, position_ids, cache_position) -> torch.Tensor:
        # input_ids, position_ids: [B, S]; attention_mask: [B, L_max]; cache_position: [S] -> [B, S, V]
        self._zero_self_attention_rows(input_ids.shape[0])
        return self.decode(input_ids, attention_mask, position_ids, cache_position)


class _Method(nn.Module):
    """One method of an exportable wrapper as `forward`.

    Both methods are traced through such a module holding the wrapper as `owner`, so the two programs name the
    buffers alike (`owner.self_keys_0`, ...): that is how ExecuTorch matches them to share their memory.
    """

    def __init__(self, owner: _ExportableBase, method_name: str):
        super().__init__()
        self.owner = owner
        self.method_name = method_name

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return getattr(self.owner, self.method_name)(*inputs)


# --- export ----------------------------------------------------------------------------------------------------------
def _dim(name: str, max_size: int) -> tuple[Dim | None, int]:
    """A dynamic dimension up to `max_size` and an example size for tracing (not 1: export specializes on 1)."""
    if max_size == 1:
        return None, 1
    return Dim(name, min=1, max=max_size), 2


def _example_inputs(wrapper: _ExportableBase) -> dict[str, tuple[tuple[torch.Tensor, ...], tuple]]:
    """Inputs to trace each method with, and their dynamic shapes."""
    batch, b = _dim("batch", wrapper.max_batch_size)
    tokens, s = _dim("decoder_len", wrapper.max_cache_len)
    ids = torch.zeros(b, s, dtype=torch.long)
    positions = torch.arange(s)
    if wrapper.is_encoder_decoder:
        encoder_len, e = _dim("encoder_len", wrapper.max_encoder_len)
        encoder_ids, encoder_mask = torch.zeros(b, e, dtype=torch.long), torch.ones(b, e, dtype=torch.long)
        return {
            "prefill": (
                (encoder_ids, encoder_mask, ids, positions),
                ({0: batch, 1: encoder_len}, {0: batch, 1: encoder_len}, {0: batch, 1: tokens}, {0: tokens}),
            ),
            "decode": (
                (ids, positions, encoder_mask),
                ({0: batch, 1: tokens}, {0: tokens}, {0: batch, 1: encoder_len}),
            ),
        }
    mask = torch.ones(b, wrapper.max_cache_len, dtype=torch.long)
    # Distinct tensors for distinct inputs: export would trace one tensor passed twice as a single input.
    inputs = (
        (ids, mask, torch.zeros_like(ids), positions),
        ({0: batch, 1: tokens}, {0: batch}, {0: batch, 1: tokens}, {0: tokens}),
    )
    return {"prefill": inputs, "decode": inputs}


def export_programs(wrapper: _ExportableBase) -> dict[str, ExportedProgram]:
    """`torch.export` both methods of `wrapper`, with dynamic batch, encoder length and decoder tokens.

    Args:
        wrapper: an `ExportableEncoderDecoder` or `ExportableDecoderOnly`.

    Returns:
        `{"prefill": ExportedProgram, "decode": ExportedProgram}`; their buffers are `wrapper`'s.
    """
    programs = {}
    with torch.no_grad():
        for name, (inputs, dynamic_shapes) in _example_inputs(wrapper).items():
            programs[name] = torch.export.export(
                _Method(wrapper, name), inputs, dynamic_shapes=(dynamic_shapes,), strict=False
            )
    return programs


def export_encoder_decoder(
    model: nn.Module, *, max_batch_size: int, max_cache_len: int, max_encoder_len: int
) -> ExportedPrograms:
    """Export an encoder-decoder override model: one program pair for every batch and encoder length that fits.

    Args:
        model: an override model (e.g. `FlexT5ForConditionalGeneration`), in eval mode.
        max_batch_size (`int`), max_cache_len (`int`), max_encoder_len (`int`): the capacities.

    Returns:
        `ExportedPrograms`: runs the exported `prefill` and `decode`, and lowers them with `to_executorch`.

    Example:

    ```python
    >>> programs = export_encoder_decoder(model, max_batch_size=4, max_cache_len=32, max_encoder_len=64)
    >>> tokens = greedy_generate(programs, input_ids, attention_mask, max_new_tokens=16, decoder_start_token_id=0)
    >>> programs.to_executorch("t5.pte")
    ```
    """
    wrapper = ExportableEncoderDecoder(
        model, max_batch_size=max_batch_size, max_cache_len=max_cache_len, max_encoder_len=max_encoder_len
    )
    return ExportedPrograms(wrapper, export_programs(wrapper))


def export_decoder_only(model: nn.Module, *, max_batch_size: int, max_cache_len: int) -> ExportedPrograms:
    """Export a decoder-only override model: one program pair for every batch and prompt length that fits.

    Args:
        model: an override model (e.g. `FlexLlamaForCausalLM`), in eval mode.
        max_batch_size (`int`), max_cache_len (`int`): the capacities.

    Returns:
        `ExportedPrograms`: runs the exported `prefill` and `decode`, and lowers them with `to_executorch`.
    """
    wrapper = ExportableDecoderOnly(model, max_batch_size=max_batch_size, max_cache_len=max_cache_len)
    return ExportedPrograms(wrapper, export_programs(wrapper))


# --- runners: checks, then a program ---------------------------------------------------------------------------------
class ProgramRunner:
    """Checks each call against the capacities, then runs `prefill` or `decode`. Subclasses say how to run.

    Attributes:
        is_encoder_decoder (`bool`): which signature `prefill` and `decode` have (see the module docstring).
        capacities (`dict[str, int]`): `max_batch_size`, `max_cache_len` and, for encoder-decoder, `max_encoder_len`.
    """

    def __init__(self, *, is_encoder_decoder: bool, capacities: dict[str, int]):
        self.is_encoder_decoder = is_encoder_decoder
        self.capacities = dict(capacities)
        self._started = None  # (batch, encoder length, next position) of the sequence that prefill started

    def _run(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    def _fail(self, value_name: str, value: int, limit_name: str) -> None:
        limit = self.capacities[limit_name]
        if value > limit:
            raise ValueError(
                f"{value_name}={value} exceeds {limit_name}={limit} of this exported program; export it again with "
                f"{limit_name}={value} or more"
            )

    def _check(self, method_name: str, batch_size: int, num_new: int, cache_position, encoder_len) -> None:
        if batch_size < 1 or num_new < 1:
            raise ValueError(f"{method_name} needs at least one row and one token, got batch {batch_size}, {num_new}")
        self._fail("batch_size", batch_size, "max_batch_size")
        if encoder_len is not None:
            self._fail("encoder_len", encoder_len, "max_encoder_len")
        if not isinstance(cache_position, torch.Tensor) or cache_position.dtype != torch.long:
            raise TypeError("cache_position must be a torch.long tensor, arange(start, start + new tokens)")
        start = int(cache_position[0]) if cache_position.numel() else 0
        if not torch.equal(cache_position, torch.arange(start, start + num_new)):
            raise ValueError(
                f"cache_position={cache_position.tolist()} must be arange({start}, {start + num_new}): one position "
                "per new token, consecutive"
            )
        self._fail("decoder_len", start + num_new, "max_cache_len")
        if method_name == "prefill":
            return
        if self._started is None:
            raise ValueError("decode was called before prefill; call prefill to start a sequence")
        started_batch, started_encoder_len, next_position = self._started
        if (batch_size, encoder_len) != (started_batch, started_encoder_len):
            raise ValueError(
                f"decode got batch {batch_size} and encoder length {encoder_len}, but prefill started batch "
                f"{started_batch} with encoder length {started_encoder_len}; call prefill to start another sequence"
            )
        if start > next_position:
            raise ValueError(
                f"cache_position starts at {start}, but positions from {next_position} were never written; "
                f"continue from {next_position}"
            )

    def prefill(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Start a sequence (see the module docstring for the inputs of each kind); returns logits `[B, S, V]`.

        Raises:
            ValueError: a batch, encoder length or position beyond the capacities, or malformed `cache_position`.
        """
        inputs = tuple(torch.as_tensor(x).long().contiguous() for x in inputs)
        if self.is_encoder_decoder:
            input_ids, attention_mask, decoder_input_ids, cache_position = inputs
            if attention_mask.shape != input_ids.shape or decoder_input_ids.shape[0] != input_ids.shape[0]:
                raise ValueError(
                    f"attention_mask {tuple(attention_mask.shape)} and decoder_input_ids "
                    f"{tuple(decoder_input_ids.shape)} must match input_ids {tuple(input_ids.shape)} in batch"
                )
            batch_size, encoder_len = input_ids.shape
        else:
            decoder_input_ids, attention_mask, _, cache_position = inputs
            self._check_decoder_only_mask(decoder_input_ids, attention_mask)
            batch_size, encoder_len = decoder_input_ids.shape[0], None
        num_new = decoder_input_ids.shape[1]
        self._check("prefill", batch_size, num_new, cache_position, encoder_len)
        logits = self._run("prefill", inputs)
        self._started = (batch_size, encoder_len, int(cache_position[-1]) + 1)
        return logits

    def decode(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Continue the sequence that `prefill` started; returns logits `[B, S, V]`.

        Raises:
            ValueError: as `prefill`, or a batch or encoder length other than the prefill's, or a gap in positions.
        """
        inputs = tuple(torch.as_tensor(x).long().contiguous() for x in inputs)
        if self.is_encoder_decoder:
            decoder_input_ids, cache_position, encoder_attention_mask = inputs
            batch_size, encoder_len = encoder_attention_mask.shape
        else:
            decoder_input_ids, attention_mask, _, cache_position = inputs
            self._check_decoder_only_mask(decoder_input_ids, attention_mask)
            batch_size, encoder_len = decoder_input_ids.shape[0], None
        self._check("decode", batch_size, decoder_input_ids.shape[1], cache_position, encoder_len)
        logits = self._run("decode", inputs)
        self._started = (*self._started[:2], max(self._started[2], int(cache_position[-1]) + 1))
        return logits

    def _check_decoder_only_mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        want = (input_ids.shape[0], self.capacities["max_cache_len"])
        if tuple(attention_mask.shape) != want:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; it must cover every cache position: "
                f"{want} (batch, max_cache_len)"
            )


class ExportedPrograms(ProgramRunner):
    """The exported `prefill` and `decode` programs of one wrapper, run with `torch` (they share its buffers).

    Attributes:
        programs (`dict[str, ExportedProgram]`): `prefill` and `decode`.
        wrapper: the `ExportableEncoderDecoder` / `ExportableDecoderOnly` that owns the buffers.
    """

    def __init__(self, wrapper: _ExportableBase, programs: dict[str, ExportedProgram]):
        super().__init__(is_encoder_decoder=wrapper.is_encoder_decoder, capacities=wrapper.capacities())
        self.wrapper = wrapper
        self.programs = programs
        # `ExportedProgram.module()` keeps the state tensors it is given, so both modules mutate the wrapper's buffers.
        self._modules = {name: program.module() for name, program in programs.items()}

    def _run(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.no_grad():
            return self._modules[method_name](*inputs)

    def to_executorch(self, path: str | os.PathLike, *, backend: str | None = "xnnpack") -> str:
        """Lower both programs into one ExecuTorch `.pte` at `path`, their cache buffers shared; returns the path.

        Args:
            path: where to write the `.pte`.
            backend (`str` or `None`, *optional*, defaults to `"xnnpack"`): `"xnnpack"` delegates what XNNPACK can
                run (linear layers and more); `None` keeps ExecuTorch's portable kernels only (lowers faster).

        Raises:
            ImportError: executorch is not installed (`pip install "transformers-flexcache[executorch]"`).
            ValueError: an unknown `backend`.
        """
        try:
            from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
            from executorch.exir.passes import MemoryPlanningPass
        except ImportError as error:
            raise ImportError(
                'to_executorch needs executorch: pip install "transformers-flexcache[executorch]"'
            ) from error
        if backend == "xnnpack":
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

            partitioner = [XnnpackPartitioner()]
        elif backend is None:
            partitioner = []
        else:
            raise ValueError(f"backend={backend!r} is not one of ('xnnpack', None)")
        metadata = {**self.capacities, "is_encoder_decoder": int(self.is_encoder_decoder)}
        edge = to_edge_transform_and_lower(self.programs, partitioner=partitioner, constant_methods=metadata)
        program = edge.to_executorch(
            ExecutorchBackendConfig(
                # One allocation of every cache buffer, shared by prefill and decode (matched by buffer name).
                memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
                emit_mutable_buffer_names=True,
            )
        )
        with open(path, "wb") as file:
            program.write_to_file(file)
        return os.fspath(path)


class ExecuTorchPrograms(ProgramRunner):
    """`prefill` and `decode` of a `.pte` written by `ExportedPrograms.to_executorch`, run in ExecuTorch's runtime.

    The capacities are read from the `.pte` itself. Its cache buffers persist between calls and are shared by the
    two methods, as in the exported programs.

    Args:
        path: the `.pte` file.

    Raises:
        ImportError: executorch is not installed.
        ValueError: the file has no `prefill` / `decode` methods or capacities (not written by `to_executorch`).
    """

    def __init__(self, path: str | os.PathLike):
        try:
            from executorch.runtime import Runtime
        except ImportError as error:
            raise ImportError(
                'ExecuTorchPrograms needs executorch: pip install "transformers-flexcache[executorch]"'
            ) from error
        self.program = Runtime.get().load_program(os.fspath(path))
        names = self.program.method_names
        wanted = {"prefill", "decode", "is_encoder_decoder", "max_batch_size", "max_cache_len"}
        if not wanted <= names:
            raise ValueError(f"{path} has methods {sorted(names)}, not {sorted(wanted)}; write it with to_executorch")
        constant = {name: self.program.load_method(name).execute([])[0] for name in names - {"prefill", "decode"}}
        is_encoder_decoder = bool(constant.pop("is_encoder_decoder"))
        super().__init__(is_encoder_decoder=is_encoder_decoder, capacities={k: int(v) for k, v in constant.items()})
        self._methods = {name: self.program.load_method(name) for name in METHOD_NAMES}

    def _run(self, method_name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self._methods[method_name].execute(list(inputs))[0]


# --- greedy decoding -------------------------------------------------------------------------------------------------
def greedy_generate(
    runner: ProgramRunner,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    decoder_start_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    output_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Greedy decoding with exported programs, as `model.generate(do_sample=False, num_beams=1)` decodes.

    Args:
        runner: `ExportedPrograms` or `ExecuTorchPrograms`.
        input_ids (`torch.LongTensor`): `[B, L_enc]` encoder tokens, or `[B, P]` a left-padded prompt (decoder-only).
        attention_mask (`torch.LongTensor`, *optional*): same shape as `input_ids`; all ones if not given.
        max_new_tokens (`int`): tokens to generate at most.
        decoder_start_token_id (`int`): first decoder token (encoder-decoder only).
        eos_token_id (`int`, *optional*): a row that produced it is finished and gets `pad_token_id` afterwards;
            decoding stops when every row is finished.
        pad_token_id (`int`, *optional*): defaults to `eos_token_id`.
        output_logits (`bool`, *optional*, defaults to `False`): also return each step's logits, as `generate`'s
            `output_logits=True` does.

    Returns:
        `torch.LongTensor`: `[B, 1 + N]` decoder tokens (start token first), or `[B, P + N]` prompt and new tokens,
        `N <= max_new_tokens`: what `generate` returns. With `output_logits=True`, also a tuple of N `[B, V]` logits.

    Raises:
        ValueError: the generation would need more positions than `max_cache_len`, or inputs exceed a capacity.
    """
    # input_ids: [B, L] -> [B, 1 + N] (encoder-decoder) or [B, P + N] (decoder-only)
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    batch_size, input_len = input_ids.shape
    if runner.is_encoder_decoder:
        if decoder_start_token_id is None:
            raise ValueError("decoder_start_token_id is required for an encoder-decoder program")
        sequences = torch.full((batch_size, 1), decoder_start_token_id, dtype=torch.long)
    else:
        sequences = input_ids
    num_prefix = sequences.shape[1]
    # The last new token is returned, never fed back: positions used = prefix + new tokens - 1.
    needed = num_prefix + max_new_tokens - 1
    if needed > runner.capacities["max_cache_len"]:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} after {num_prefix} prefix tokens needs max_cache_len={needed}, but the "
            f"program has max_cache_len={runner.capacities['max_cache_len']}; export it again with "
            f"max_cache_len={needed} or more"
        )
    pad_token_id = eos_token_id if pad_token_id is None else pad_token_id

    if runner.is_encoder_decoder:
        logits = runner.prefill(input_ids, attention_mask, sequences, torch.arange(num_prefix))
    else:
        full_mask = torch.zeros(batch_size, runner.capacities["max_cache_len"], dtype=torch.long)
        full_mask[:, :input_len] = attention_mask
        # As generate: positions count the real tokens of each row; padding gets position 0.
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        logits = runner.prefill(input_ids, full_mask, position_ids, torch.arange(num_prefix))

    finished = torch.zeros(batch_size, dtype=torch.bool)
    step_logits = []
    for step in range(max_new_tokens):
        step_logits.append(logits[:, -1])  # [B, V]
        next_tokens = step_logits[-1].argmax(-1)  # [B]
        if eos_token_id is not None:
            next_tokens = next_tokens.masked_fill(finished, pad_token_id)
            finished |= next_tokens == eos_token_id
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)
        if step == max_new_tokens - 1 or bool(finished.all()):
            break
        position = sequences.shape[1] - 1
        cache_position = torch.tensor([position])
        if runner.is_encoder_decoder:
            logits = runner.decode(next_tokens[:, None], cache_position, attention_mask)
        else:
            full_mask[:, position] = 1
            position_ids = position_ids[:, -1:] + 1
            logits = runner.decode(next_tokens[:, None], full_mask, position_ids, cache_position)
    return (sequences, tuple(step_logits)) if output_logits else sequences
