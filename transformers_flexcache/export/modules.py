"""The modules that `torch.export` traces, and the functions that export them.

Shapes and design as in `transformers_flexcache.export`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from ..cache import layer_specs_from_config
from ..modeling import FlexModelMixin
from .cache_views import (
    BufferViewCrossAttentionCache,
    BufferViewEncoderDecoderCache,
    BufferViewLayer,
    PositionedCache,
    PositionedLayer,
)
from .runners import ENCODER_INPUTS, ExportedPrograms


def _check_model(model: nn.Module, *, encoder_decoder: bool) -> None:
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


# Keyword of the model's forward that masks cross-attention, where it is not `attention_mask`.
_ENCODER_MASK_KEYWORDS = {"whisper": "encoder_attention_mask"}


def _check_encoder_input(model: nn.Module, encoder_input: str, max_encoder_len: int) -> None:
    if encoder_input not in ENCODER_INPUTS:
        raise ValueError(f"encoder_input={encoder_input!r} is not one of {ENCODER_INPUTS}")
    if encoder_input == "input_ids" and model.main_input_name != "input_ids":
        raise ValueError(
            f"{type(model).__name__}'s encoder takes {model.main_input_name}, not input_ids; pass "
            f"encoder_input={model.main_input_name!r} or 'encoder_hidden_states'"
        )
    if encoder_input == "input_features":
        fixed_len = getattr(model.config, "max_source_positions", None)
        if fixed_len is None or model.main_input_name != "input_features":
            raise ValueError(f"{type(model).__name__}'s encoder does not take input_features; pass encoder_input=None")
        if max_encoder_len != fixed_len:
            raise ValueError(
                f"max_encoder_len={max_encoder_len}, but input_features always give max_source_positions={fixed_len} "
                f"encoder positions; pass max_encoder_len={fixed_len}, or encoder_input='encoder_hidden_states' for "
                "encoder outputs of any length up to max_encoder_len"
            )


def _check_capacities(**capacities: int) -> None:
    for name, value in capacities.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")


class _ExportableBase(nn.Module):
    def _register_self_attention_buffers(self, model: nn.Module) -> None:
        self.num_layers = 0
        for i, spec in enumerate(layer_specs_from_config(model.config)):
            shape = (self.max_batch_size, spec.num_heads, self.max_cache_len, spec.k_head_dim)
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
        max_encoder_len (`int`): encoder positions per row. With `encoder_input="input_features"` it must be the
            encoder's fixed output length, `config.max_source_positions`.
        encoder_input (`str`, *optional*): what `prefill` feeds the encoder, one of `ENCODER_INPUTS`; defaults to
            `model.main_input_name` (`"input_ids"` for T5 and BART, `"input_features"` for Whisper).
            `"encoder_hidden_states"` skips the encoder: `prefill` takes its output, of any length up to
            `max_encoder_len`, for any encoder-decoder model.

    Raises:
        TypeError: `model` is not an encoder-decoder override model.
        ValueError: a capacity is not a positive int, `model` is in training mode, an unknown `encoder_input`, or
            `max_encoder_len` is not the fixed encoder length of `"input_features"`.
    """

    is_encoder_decoder = True
    capacity_names = ("max_batch_size", "max_cache_len", "max_encoder_len")

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch_size: int,
        max_cache_len: int,
        max_encoder_len: int,
        encoder_input: str | None = None,
    ):
        super().__init__()
        _check_model(model, encoder_decoder=True)
        _check_capacities(max_batch_size=max_batch_size, max_cache_len=max_cache_len, max_encoder_len=max_encoder_len)
        self.encoder_input = model.main_input_name if encoder_input is None else encoder_input
        _check_encoder_input(model, self.encoder_input, max_encoder_len)
        self.model = model
        self.max_batch_size, self.max_cache_len, self.max_encoder_len = max_batch_size, max_cache_len, max_encoder_len
        self._register_self_attention_buffers(model)
        for i, spec in enumerate(layer_specs_from_config(model.config)):
            shape = (
                max_batch_size,
                spec.num_heads,
                max_encoder_len + 1,
                spec.k_head_dim,
            )  # + 1: see the module docstring
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

    def _encoder_kwargs(self, encoder_input: torch.Tensor, encoder_attention_mask: torch.Tensor) -> dict:
        # encoder_input: [B, L_enc] ids, [B, L_enc, d_model] states or [B, num_mel_bins, 2 * L_enc] frames
        kwargs = {self._encoder_mask_keyword: encoder_attention_mask}
        if self.encoder_input == "encoder_hidden_states":
            kwargs["encoder_outputs"] = (encoder_input,)
        else:
            kwargs[self.encoder_input] = encoder_input
        return kwargs

    @property
    def _encoder_mask_keyword(self) -> str:
        # Whisper's encoder takes no mask; its decoder's cross-attention mask comes from `encoder_attention_mask`,
        # which model_overrides/whisper.py adds. T5 and BART mask both encoder and cross-attention with
        # `attention_mask`.
        return _ENCODER_MASK_KEYWORDS.get(self.model.config.model_type, "attention_mask")

    def prefill(
        self,
        encoder_input: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        cache_position: torch.Tensor,
    ) -> torch.Tensor:
        # encoder_input: see _encoder_kwargs; encoder_attention_mask: [B, L_enc]; decoder_input_ids: [B, S];
        # cache_position: [S] -> [B, S, V]
        batch_size = decoder_input_ids.shape[0]
        self._zero_self_attention_rows(batch_size)
        outputs = self.model(
            **self._encoder_kwargs(encoder_input, encoder_attention_mask),
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
            **{self._encoder_mask_keyword: encoder_attention_mask},
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


def _dim(name: str, max_size: int) -> tuple[Dim, int]:
    """A dynamic dimension up to `max_size` and an example size for tracing (not 1: export specializes on 1)."""
    if max_size == 1:
        return Dim.STATIC, 1
    return Dim(name, min=1, max=max_size), 2


def _example_inputs(wrapper: _ExportableBase) -> dict[str, tuple[tuple[torch.Tensor, ...], tuple]]:
    """Inputs to trace each method with, and their dynamic shapes."""
    batch, b = _dim("batch", wrapper.max_batch_size)
    tokens, s = _dim("decoder_len", wrapper.max_cache_len)
    ids = torch.zeros(b, s, dtype=torch.long)
    positions = torch.arange(s)
    if wrapper.is_encoder_decoder:
        config = wrapper.model.config
        if wrapper.encoder_input == "input_features":
            # The encoder's output length is fixed by the frames (2 per position): a static dimension.
            encoder_len, e = Dim.STATIC, wrapper.max_encoder_len
            encoder_input = torch.zeros(b, config.num_mel_bins, 2 * e, dtype=wrapper.model.dtype)
            encoder_input_dims = {0: batch}
        else:
            encoder_len, e = _dim("encoder_len", wrapper.max_encoder_len)
            if wrapper.encoder_input == "input_ids":
                encoder_input = torch.zeros(b, e, dtype=torch.long)
            else:  # encoder_hidden_states
                encoder_input = torch.zeros(b, e, wrapper.encoder_hidden_states.shape[-1], dtype=wrapper.model.dtype)
            encoder_input_dims = {0: batch, 1: encoder_len}
        encoder_mask = torch.ones(b, e, dtype=torch.long)
        return {
            "prefill": (
                (encoder_input, encoder_mask, ids, positions),
                (encoder_input_dims, {0: batch, 1: encoder_len}, {0: batch, 1: tokens}, {0: tokens}),
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
    model: nn.Module,
    *,
    max_batch_size: int,
    max_cache_len: int,
    max_encoder_len: int,
    encoder_input: str | None = None,
) -> ExportedPrograms:
    """Export an encoder-decoder override model: one program pair for every batch and encoder length that fits.

    Args:
        model: an override model (e.g. `FlexT5ForConditionalGeneration`), in eval mode.
        max_batch_size (`int`), max_cache_len (`int`), max_encoder_len (`int`): the capacities.
        encoder_input (`str`, *optional*): what `prefill` takes, as in `ExportableEncoderDecoder`: `"input_ids"`,
            `"input_features"` (Whisper; fixed encoder length) or `"encoder_hidden_states"` (any model; encoder
            length up to `max_encoder_len`). Defaults to `model.main_input_name`.

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
        model,
        max_batch_size=max_batch_size,
        max_cache_len=max_cache_len,
        max_encoder_len=max_encoder_len,
        encoder_input=encoder_input,
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
