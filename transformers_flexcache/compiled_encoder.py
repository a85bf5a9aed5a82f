"""The encoder of a compiled fixed-shape call, compiled at the call's padded shapes too.

Design decisions:
- Upstream's `generate` compiles the decode step only: the encoder (and the first decoder step) run eagerly, at the
  call's own shapes. On CPU the eager encoder is a large part of an encoder-decoder call's first token (a
  t5-small-sized T5, one row of 40 tokens, AMD EPYC Zen 3: encoder 64 ms of a 124 ms first token, eager linears on
  MKL). Under a fixed-shape policy the encoder's shapes are bounded as the decode step's are: rows and encoder length
  take the call's buckets. So a `compile_config` that asks for it (`compile_config_for_cpu()`: `FlexCompileConfig`
  with `compile_encoder=True`) compiles the encoder with the same settings, one graph per (rows bucket, encoder
  length bucket), compiled by `warmup()` with the decode graphs. A plain `CompileConfig` keeps upstream's behaviour.
- The call's token ids are padded to those shapes (rows: copies of row 0, as the policy pads rows; positions: the
  pad token, masked), the compiled encoder runs, and its outputs are cut back to the call's rows and length: from
  there the call goes on as an eagerly encoded call does (outputs padded with zeros, mask with zeros). Masked
  positions carry no weight in attention, so the real positions' outputs are the eager encoder's up to the float
  summation order of the compiled kernels.
- Token inputs only (`input_ids`): Whisper's features, Pix2Struct's patches and given `inputs_embeds` stay eager, as
  do calls that ask for the encoder's attentions or hidden states (their shapes would be the padded ones), candidate
  decoding, continuations given `encoder_outputs`, models dispatched by accelerate (`device_map`) and tensor-parallel
  models: their encoders run eagerly, as upstream runs them.
- One compiled encoder per model and config, held beside the model (weakly keyed, as the cache pool is: not in the
  model's `__dict__`, so `copy.deepcopy`, pickling and `torch.save` of the model are unaffected).
"""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.nn.functional as F
from transformers import CompileConfig

# model -> (compile config, its compiled encoder)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Encoder arguments that upstream's `_prepare_text_encoder_decoder_kwargs_for_generation` leaves out.
_NOT_FOR_THE_ENCODER = ("decoder_", "cross_attn", "use_cache", "cache")


class FlexCompileConfig(CompileConfig):
    """Upstream's `CompileConfig`, whose `generate` compiles the decode step, plus `compile_encoder`: under a
    fixed-shape policy, compile the encoder of an encoder-decoder call at the call's padded shapes too.

    `compile_encoder` is not one of `torch.compile`'s arguments: it is kept out of `to_dict()` (which upstream passes
    to `torch.compile`) and out of equality (the decode graphs do not depend on it).
    """

    def __init__(self, *args, compile_encoder: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.compile_encoder = compile_encoder

    def to_dict(self) -> dict:
        arguments = super().to_dict()
        arguments.pop("compile_encoder", None)
        return arguments


def compiles_encoder(model, generation_config, input_name: str, model_inputs: dict, *, candidates: bool) -> bool:
    """Whether this call's encoder runs compiled (see the module docstring)."""
    return bool(
        getattr(generation_config.compile_config, "compile_encoder", False)
        and model.config.is_encoder_decoder
        and not candidates
        and input_name == "input_ids"
        and isinstance(model_inputs.get("input_ids"), torch.Tensor)
        and model_inputs.get("encoder_outputs") is None
        and not generation_config.output_attentions
        and not generation_config.output_hidden_states
        and not hasattr(model, "hf_device_map")  # accelerate's hooks move the encoder's inputs and outputs
        and (getattr(model, "_tp_size", None) or 1) == 1
    )


def encode_at_fixed_shapes(
    model, generation_config, input_ids: torch.Tensor, model_kwargs: dict, *, rows: int, length: int, pad_token_id: int
) -> dict:
    """Derived from `GenerationMixin._prepare_text_encoder_decoder_kwargs_for_generation` (transformers==5.24.0):
    `model_kwargs` with `encoder_outputs` added, the encoder run compiled at `rows` x `length`.

    Differences: the ids (and the attention mask, ones where the call has none) are padded to `rows` rows (copies of
    row 0) and `length` positions (`pad_token_id`, masked), the compiled encoder runs, and its last hidden state is
    cut back to the call's rows and positions. Arguments reach the encoder as upstream passes them.
    """
    # input_ids: [B, L] -> encoder_outputs.last_hidden_state: [B, L, D], run at [rows, length]
    batch_size, input_len = input_ids.shape
    if rows < batch_size or length < input_len:
        raise ValueError(
            f"the encoder's shapes ({rows} rows, {length} positions) are below the call's {input_ids.shape}"
        )
    accepted = set(inspect.signature(model.get_encoder().forward).parameters)
    wildcard = "kwargs" in accepted or "model_kwargs" in accepted
    arguments = {
        name: value
        for name, value in model_kwargs.items()
        if not name.startswith(_NOT_FOR_THE_ENCODER) and (wildcard or name in accepted)
    }
    mask = arguments.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    arguments["input_ids"] = _pad_rows(F.pad(input_ids, (0, length - input_len), value=pad_token_id), rows)
    arguments["attention_mask"] = _pad_rows(F.pad(mask, (0, length - input_len), value=0), rows)
    arguments.update(output_attentions=False, output_hidden_states=False, return_dict=True)
    output = compiled_encoder(model, generation_config.compile_config)(**arguments)
    hidden = output.last_hidden_state[:batch_size, :input_len]
    model_kwargs["encoder_outputs"] = type(output)(last_hidden_state=hidden)
    return model_kwargs


def compiled_encoder(model, compile_config: CompileConfig):
    """`torch.compile(model.get_encoder(), **compile_config.to_dict())`, made once per model and config."""
    held = _COMPILED.get(model)
    if held is None or held[0] != compile_config:
        held = (compile_config, torch.compile(model.get_encoder(), **compile_config.to_dict()))
        _COMPILED[model] = held
    return held[1]


def _pad_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    if value.shape[0] == rows:
        return value
    return torch.cat([value, value[:1].expand(rows - value.shape[0], *value.shape[1:])], dim=0)
