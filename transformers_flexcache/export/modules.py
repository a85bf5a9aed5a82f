"""The modules that `torch.export` traces, and the function that exports them.

Shapes, methods and design as in `transformers_flexcache.export`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from ..cache.buffer_views import (
    BufferViewCrossAttentionCache,
    BufferViewEncoderDecoderCache,
    BufferViewLayer,
    PositionedCache,
    PositionedLayer,
    layer_shapes,
    packed_view,
    self_attention_rows,
)
from ..cache.placement import cross_attention_projections
from ..models.modeling import FlexModelMixin
from .rewrites import export_friendly, infer_symbolic_view_dims

# What an encoder-decoder `encoder` method takes: token ids, Whisper's log-mel frames, Pix2Struct's patches, or the
# encoder's output itself.
ENCODER_INPUTS = ("input_ids", "input_features", "flattened_patches", "encoder_hidden_states")
FLOAT_INPUTS = ("input_features", "flattened_patches", "encoder_hidden_states")


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


def _check_encoder_input(model: nn.Module, encoder_input: str, max_encoder_len: int) -> None:
    if encoder_input not in ENCODER_INPUTS:
        raise ValueError(f"encoder_input={encoder_input!r} is not one of {ENCODER_INPUTS}")
    if encoder_input != "encoder_hidden_states" and model.main_input_name != encoder_input:
        raise ValueError(
            f"{type(model).__name__}'s encoder takes {model.main_input_name}, not {encoder_input}; pass "
            f"encoder_input={model.main_input_name!r} or 'encoder_hidden_states'"
        )
    if encoder_input == "input_features":
        fixed_len = model.config.max_source_positions
        if max_encoder_len != fixed_len:
            raise ValueError(
                f"max_encoder_len={max_encoder_len}, but input_features always give max_source_positions={fixed_len} "
                f"encoder positions; pass max_encoder_len={fixed_len}, or encoder_input='encoder_hidden_states' for "
                "encoder outputs of any length up to max_encoder_len"
            )


def check_capacities(**capacities: int) -> None:
    """Raise `ValueError` unless every capacity is a positive int."""
    for name, value in capacities.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")


class _ExportableBase(nn.Module):
    method_names: tuple[str, ...] = ()
    capacity_names: tuple[str, ...] = ()

    def _register_self_attention_buffers(self, model: nn.Module) -> None:
        # Per decoder layer: keys and values `[B_max * H * L_max, D]`, rows laid out [B_max, H, L_max]. A
        # sliding-window layer is stored as a full one: every position of a row stays, and the sliding-window mask
        # that the model builds over absolute positions (kv_offset 0) hides those outside the window, so a program
        # attends to exactly what DynamicSlidingWindowLayer keeps, at the memory of a full-attention layer.
        shapes = layer_shapes(model.config)
        attention = ("full_attention", "sliding_attention")
        other = sorted({layer_type for layer_type, _, _ in shapes if layer_type not in attention})
        if other:
            raise ValueError(
                f"{type(model).__name__} has {other} layers, which export does not cover: the buffers hold attention "
                "keys/values only (Jamba's Mamba states: see docs/export.md, 'Jamba')"
            )
        self.num_heads = []
        for i, (_, num_heads, head_dim) in enumerate(shapes):
            shape = (self.max_batch_size * num_heads * self.max_cache_len, head_dim)
            self.register_buffer(f"self_keys_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
            self.register_buffer(f"self_values_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
            self.num_heads.append(num_heads)

    @property
    def num_layers(self) -> int:
        return len(self.num_heads)

    def _self_attention_cache(self, batch_size, cache_position: torch.Tensor) -> PositionedCache:
        rows = {
            num_heads: self_attention_rows(batch_size, num_heads, self.max_cache_len, cache_position)
            for num_heads in set(self.num_heads)
        }
        layers = [
            PositionedLayer(
                key_storage=self.get_buffer(f"self_keys_{i}"),
                value_storage=self.get_buffer(f"self_values_{i}"),
                num_heads=num_heads,
                max_batch_size=self.max_batch_size,
                max_cache_len=self.max_cache_len,
                batch_size=batch_size,
                cache_position=cache_position,
                rows=rows[num_heads],
            )
            for i, num_heads in enumerate(self.num_heads)
        ]
        return PositionedCache(layers=layers)

    def _zero_self_attention_rows(self, batch_size, where: torch.Tensor | None = None) -> None:
        """Zero rows `[:batch_size]` of every self-attention buffer (only where the 0-d `where` is true, if given).

        ExecuTorch does not initialize mutable buffers, and a slot that the mask hides must still hold a finite value:
        a NaN there would survive the mask. Written in place with `index_put_`, as the cache writes.
        """
        shared = {}  # (rows, zeros) per buffer shape: one computation in the graph for all layers
        for i, num_heads in enumerate(self.num_heads):
            for name in (f"self_keys_{i}", f"self_values_{i}"):
                storage = self.get_buffer(name)
                num_rows = batch_size * num_heads * self.max_cache_len
                key = (num_heads, storage.shape[-1])
                if key not in shared:
                    rows = torch.arange(num_rows, device=storage.device)
                    shared[key] = rows, storage.new_zeros(num_rows, storage.shape[-1])
                rows, zeros = shared[key]
                storage.index_put_((rows,), zeros if where is None else torch.where(where, zeros, storage[:num_rows]))

    def capacities(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.capacity_names}


class ExportableEncoderDecoder(_ExportableBase):
    """An encoder-decoder override model plus its flexible cache as registered buffers: `encoder` and `text_decoder`.

    The method names are ExecuTorch's (its Whisper export and ASR runner use `encoder` and `text_decoder`); see the
    package docstring for their inputs.

    Args:
        model: an override model (e.g. `FlexT5ForConditionalGeneration`), in eval mode.
        max_batch_size (`int`): rows of every buffer.
        max_cache_len (`int`): decoder positions per row; decoding N new tokens after the start token uses N of them.
        max_encoder_len (`int`): encoder positions per row. With `encoder_input="input_features"` it must be the
            encoder's fixed output length, `config.max_source_positions`.
        encoder_input (`str`, *optional*): what `encoder` takes, one of `ENCODER_INPUTS`; defaults to
            `model.main_input_name`. `"encoder_hidden_states"` skips the encoder: `encoder` takes its output, of any
            length up to `max_encoder_len`, and only writes the cross-attention keys/values.

    Raises:
        TypeError: `model` is not an encoder-decoder override model.
        ValueError: a capacity is not a positive int, `model` is in training mode, an unknown `encoder_input`, or
            `max_encoder_len` is not the fixed encoder length of `"input_features"`.
    """

    is_encoder_decoder = True
    method_names = ("encoder", "text_decoder")
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
        check_capacities(max_batch_size=max_batch_size, max_cache_len=max_cache_len, max_encoder_len=max_encoder_len)
        self.encoder_input = model.main_input_name if encoder_input is None else encoder_input
        _check_encoder_input(model, self.encoder_input, max_encoder_len)
        self.model = model
        self.max_batch_size, self.max_cache_len, self.max_encoder_len = max_batch_size, max_cache_len, max_encoder_len
        self._register_self_attention_buffers(model)
        for i, (_, num_heads, head_dim) in enumerate(layer_shapes(model.config)):
            shape = (max_batch_size * num_heads * max_encoder_len, head_dim)
            self.register_buffer(f"cross_keys_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
            self.register_buffer(f"cross_values_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
        self.hidden_size = model.config.get_text_config(decoder=True).hidden_size

    @property
    def masked(self) -> bool:
        """Whether the methods take encoder masks: not for log-mel features, whose encoder length is fixed and full
        (so that `encoder` and `text_decoder` have the inputs of ExecuTorch's ASR runner)."""
        return self.encoder_input != "input_features"

    @property
    def _encoder_mask_keyword(self) -> str:
        # The override says which keyword of its forward masks cross-attention (`_flex_encoder_mask_key`): Whisper's
        # encoder takes no mask, and model_overrides/whisper.py adds `encoder_attention_mask` for its decoder; the
        # others mask both encoder and cross-attention with `attention_mask`.
        return self.model._flex_encoder_mask_key

    def _cache(self, batch_size, cache_position: torch.Tensor, encoder_len) -> BufferViewEncoderDecoderCache:
        # encoder_len: 0 while the cross-attention keys/values are still to be written (in `encoder`)
        cross_layers = [
            BufferViewLayer(
                key_storage=self.get_buffer(f"cross_keys_{i}"),
                value_storage=self.get_buffer(f"cross_values_{i}"),
                num_heads=num_heads,
                max_batch_size=self.max_batch_size,
                max_cache_len=self.max_encoder_len,
                batch_size=batch_size,
                seq_len=encoder_len,
                # Log-mel features fill every encoder position: read whole rows (see cache/buffer_views.py).
                read_all_rows=self.encoder_input == "input_features" and self.max_batch_size > 1,
            )
            for i, num_heads in enumerate(self.num_heads)
        ]
        return BufferViewEncoderDecoderCache(
            self._self_attention_cache(batch_size, cache_position),
            BufferViewCrossAttentionCache(layers=cross_layers),
        )

    def _decoder_mask(self, batch_size, device) -> torch.Tensor:
        # [B, L_max] ones: the causal mask spans every cache position. Without it, some decoders (Pix2Struct) size
        # their default mask by `get_seq_length()`, which is data here (`cache_position[0]`), not a shape.
        return torch.ones(batch_size, self.max_cache_len, dtype=torch.long, device=device)

    def encoder(self, encoder_input: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Start a sequence for rows `[:B]`: run the encoder, write every layer's cross-attention keys/values.

        The keys/values are projected by each decoder layer's own cross-attention module (the overrides'
        `_flex_project_kv`, as their forward does on a first decoder step); the rows' self-attention buffers are
        zeroed. A model without those projections runs its decoder on one throw-away token instead, which writes
        them through the cache (its self-attention slot, position 0, is overwritten by the first `text_decoder`).
        """
        # encoder_input: [B, L_enc] ids, [B, num_mel_bins, 2 * L_enc] frames, [B, L_enc, 2 + patch] patches or
        # [B, L_enc, d_model] states; attention_mask: [B, L_enc] -> encoder_hidden_states [B, L_enc, d_model]
        batch_size = encoder_input.shape[0]
        self._zero_self_attention_rows(batch_size)
        projections = cross_attention_projections(self.model, len(layer_shapes(self.model.config)))
        if projections is None:
            return self._encoder_through_decoder(encoder_input, attention_mask)
        if self.encoder_input == "encoder_hidden_states":
            encoder_hidden_states = encoder_input.clone()  # a program output may not alias its input
        else:
            kwargs = {self.encoder_input: encoder_input}
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask
            encoder_hidden_states = self.model.get_encoder()(**kwargs)[0]
        cache = self._cache(batch_size, torch.zeros(1, dtype=torch.long, device=encoder_input.device), encoder_len=0)
        for layer_idx, project in enumerate(projections):
            key_states, value_states = project(encoder_hidden_states)
            cache.cross_attention_cache.update(key_states, value_states, layer_idx)
        return encoder_hidden_states

    def _encoder_through_decoder(
        self, encoder_input: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        # encoder_input, attention_mask: as `encoder` -> [B, L_enc, d_model]
        batch_size = encoder_input.shape[0]
        kwargs = {} if attention_mask is None else {self._encoder_mask_keyword: attention_mask}
        if self.encoder_input == "encoder_hidden_states":
            kwargs["encoder_outputs"] = (encoder_input,)
        else:
            kwargs[self.encoder_input] = encoder_input
        start = torch.zeros(batch_size, 1, dtype=torch.long, device=encoder_input.device)
        outputs = self.model(
            **kwargs,
            decoder_input_ids=start,
            decoder_attention_mask=self._decoder_mask(batch_size, start.device),
            cache=self._cache(batch_size, torch.zeros(1, dtype=torch.long, device=start.device), encoder_len=0),
            use_cache=True,
        )
        encoder_hidden_states = outputs.encoder_last_hidden_state
        if encoder_hidden_states is encoder_input:
            encoder_hidden_states = encoder_hidden_states.clone()  # a program output may not alias its input
        return encoder_hidden_states

    def text_decoder(
        self,
        decoder_input_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        cache_position: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder step of rows `[:B]`, attending to the cross-attention keys/values that `encoder` wrote.

        Only the shape of `encoder_hidden_states` is read (its length is the encoder length `L_enc`): the keys and
        values come from the buffers, they are never projected again.
        """
        # decoder_input_ids: [B, 1]; encoder_hidden_states: [B, L_enc, d_model]; cache_position: [1];
        # encoder_attention_mask: [B, L_enc] -> logits [B, 1, V]
        batch_size, encoder_len = encoder_hidden_states.shape[:2]
        kwargs = {} if encoder_attention_mask is None else {self._encoder_mask_keyword: encoder_attention_mask}
        outputs = self.model(
            **kwargs,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=self._decoder_mask(batch_size, decoder_input_ids.device),
            encoder_outputs=(encoder_hidden_states,),
            cache=self._cache(batch_size, cache_position, encoder_len=encoder_len),
            use_cache=True,
        )
        return outputs.logits


class ExportableDecoderOnly(_ExportableBase):
    """A decoder-only override model plus its flexible cache as registered buffers: `start` and `forward`.

    `forward(tokens [B, S], cache_position [S])` is ExecuTorch's LLM-runner method, on rows `[:B]`: it runs `S`
    tokens per row at positions `cache_position`, under each row's attention mask over the cache positions (the
    buffer `sequence_mask [B_max, L_max]`, all ones until `start` sets it), with position ids counted from that
    mask as `generate` counts them. `start(attention_mask [B, L_max])` starts sequences on rows `[:B]`: it zeroes
    their cache rows and sets their masks (a left-padded prompt's zeros). A `forward` at position 0 zeroes row 0:
    ExecuTorch's LLM runner never calls `start`, and gets row 0 unpadded. One method of the model serves every batch
    and step: lowering time goes per method.

    Args:
        model: an override model (e.g. `FlexLlamaForCausalLM`), in eval mode.
        max_batch_size (`int`): rows of every buffer.
        max_cache_len (`int`): positions per row (prompt plus generated tokens, minus one).

    Raises:
        TypeError: `model` is not a decoder-only override model.
        ValueError: a capacity is not a positive int, or `model` is in training mode.
    """

    is_encoder_decoder = False
    encoder_input = None
    method_names = ("start", "forward")
    capacity_names = ("max_batch_size", "max_cache_len")
    # Buffers that a `.pte` holds with their initial values (ExecuTorch leaves other mutable buffers uninitialized).
    initialized_buffers = ("sequence_mask",)

    def __init__(self, model: nn.Module, *, max_batch_size: int, max_cache_len: int):
        super().__init__()
        _check_model(model, encoder_decoder=False)
        check_capacities(max_batch_size=max_batch_size, max_cache_len=max_cache_len)
        self.model = model
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len
        self._register_self_attention_buffers(model)
        ones = torch.ones(max_batch_size, max_cache_len, dtype=torch.long)
        self.register_buffer("sequence_mask", ones, persistent=False)

    def start(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """Start sequences on rows `[:B]`: zero their cache rows, set their masks. Returns each row's count of ones."""
        # attention_mask: [B, L_max] -> [B]
        batch_size = attention_mask.shape[0]
        self._zero_self_attention_rows(batch_size)
        rows = torch.arange(batch_size, device=attention_mask.device)
        self.sequence_mask.index_put_((rows,), attention_mask)
        return attention_mask.sum(-1)

    def forward(self, tokens: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """`S` tokens per row of rows `[:B]` at positions `cache_position` (see the class docstring)."""
        # tokens: [B, S]; cache_position: [S] -> logits [B, S, V]
        batch_size = tokens.shape[0]
        self._zero_self_attention_rows(1, where=cache_position[0] == 0)
        attention_mask = self.sequence_mask[:batch_size]  # [B, L_max]
        # As generate: positions count each row's tokens; padding gets position 0.
        position_ids = attention_mask.cumsum(-1)[:, cache_position] - 1  # [B, S]
        position_ids = position_ids.masked_fill(attention_mask[:, cache_position] == 0, 0)
        outputs = self.model(
            input_ids=tokens,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=self._self_attention_cache(batch_size, cache_position),
            use_cache=True,
        )
        return outputs.logits


class _Method(nn.Module):
    """One method of an exportable wrapper as `forward`.

    Every method is traced through such a module holding the wrapper as `owner`, so the programs name the buffers
    alike (`owner.self_keys_0`, ...): that is how ExecuTorch matches them to share their memory.
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


def example_inputs(wrapper: _ExportableBase) -> dict[str, tuple[tuple[torch.Tensor, ...], tuple]]:
    """Inputs to trace each method with, and their dynamic shapes (see the package docstring)."""
    batch, b = _dim("batch", wrapper.max_batch_size)
    device = next(wrapper.model.parameters()).device
    if wrapper.is_encoder_decoder:
        return _encoder_decoder_inputs(wrapper, batch, b, device)
    tokens, s = _dim("tokens", wrapper.max_cache_len)
    ids, positions = torch.zeros(b, s, dtype=torch.long, device=device), torch.arange(s, device=device)
    mask = torch.ones(b, wrapper.max_cache_len, dtype=torch.long, device=device)
    return {"start": ((mask,), ({0: batch},)), "forward": ((ids, positions), ({0: batch, 1: tokens}, {0: tokens}))}


def _encoder_decoder_inputs(wrapper: ExportableEncoderDecoder, batch, b: int, device) -> dict:
    config, dtype = wrapper.model.config, wrapper.model.dtype
    if wrapper.encoder_input == "input_features":
        # The encoder's output length is fixed by the frames (2 per position): a static dimension.
        encoder_len, e = Dim.STATIC, wrapper.max_encoder_len
        encoder_input = torch.zeros(b, config.num_mel_bins, 2 * e, dtype=dtype, device=device)
    else:
        encoder_len, e = _dim("encoder_len", wrapper.max_encoder_len)
        if wrapper.encoder_input == "input_ids":
            encoder_input = torch.zeros(b, e, dtype=torch.long, device=device)
        elif wrapper.encoder_input == "flattened_patches":
            width = config.vision_config.patch_embed_hidden_size + 2  # row and column ids, then the pixels
            encoder_input = torch.zeros(b, e, width, dtype=dtype, device=device)
            encoder_input[..., :2] = 1  # 1-based row/column ids
        else:  # encoder_hidden_states
            encoder_input = torch.zeros(b, e, wrapper.hidden_size, dtype=dtype, device=device)
    encoder_input_dims = {0: batch} if encoder_len is Dim.STATIC else {0: batch, 1: encoder_len}
    states = torch.zeros(b, e, wrapper.hidden_size, dtype=dtype, device=device)
    step = (torch.zeros(b, 1, dtype=torch.long, device=device), states, torch.tensor([1], device=device))
    step_dims = ({0: batch}, {0: batch, 1: encoder_len}, None)
    if not wrapper.masked:
        return {"encoder": ((encoder_input,), (encoder_input_dims,)), "text_decoder": (step, step_dims)}
    mask_dims = {0: batch, 1: encoder_len}
    return {
        "encoder": (
            (encoder_input, torch.ones(b, e, dtype=torch.long, device=device)),
            (encoder_input_dims, mask_dims),
        ),
        "text_decoder": (
            (*step, torch.ones(b, e, dtype=torch.long, device=device)),
            (*step_dims, mask_dims),
        ),
    }


def export_programs(wrapper: _ExportableBase) -> dict[str, ExportedProgram]:
    """`torch.export` every method of `wrapper`, with dynamic batch, encoder length and prompt tokens.

    The model runs the rewrites of `rewrites.export_friendly` while it is traced (restored afterwards), and each
    program gets `rewrites.infer_symbolic_view_dims`.

    Args:
        wrapper: an `ExportableEncoderDecoder` or `ExportableDecoderOnly`.

    Returns:
        `{method name: ExportedProgram}`; their buffers are `wrapper`'s.
    """
    programs = {}
    # `preserve_node_meta`: the meta that the rewrites set (`rewrites.KERNEL_BMM`) reaches the programs' nodes.
    with torch.no_grad(), export_friendly(wrapper.model), torch.fx.traceback.preserve_node_meta():
        for name, (inputs, dynamic_shapes) in example_inputs(wrapper).items():
            programs[name] = torch.export.export(
                _Method(wrapper, name), inputs, dynamic_shapes=(dynamic_shapes,), strict=False
            )
            infer_symbolic_view_dims(programs[name])
    return programs


__all__ = [
    "ENCODER_INPUTS",
    "ExportableDecoderOnly",
    "ExportableEncoderDecoder",
    "example_inputs",
    "export_programs",
    "packed_view",
]
