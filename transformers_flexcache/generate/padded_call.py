"""What a fixed-shape policy does to one generate call's inputs and outputs: rows padded by repeating the first input,
decoder-only prompts left-padded, lengths counted from the real prompt, encoder outputs right-padded with a masked
tail, padding rows finished from the first step, and outputs cut back to the real rows and prompt (`PaddedCall`).
The policies that decide the sizes, and the order of these steps around upstream's `generate`, are in `generate/policies.py`
(whose docstring gives the design decisions).

Shape legend: `B` the call's batch, `B_pad` the padded batch, `P` prompt length, `P_pad` = `max_prompt_len`, `L_enc`
encoder length, `L_enc_max` = `max_encoder_len`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.utils import ModelOutput

from .padded_sampling import RealRowsSampling

# Decoder-only inputs that have one entry per prompt token, and the value that pads them on the left.
PER_TOKEN_INPUTS = {
    "input_ids": None,
    "attention_mask": 0,
    "inputs_embeds": 0.0,
    "position_ids": 0,
    "token_type_ids": 0,
}


class PaddingRowsStoppingCriteria(StoppingCriteria):
    """Marks the rows of padding inputs as finished at every step, so they never prolong a generate call.

    Args:
        batch_size (`int`): inputs of the call (real rows come first).
        padded_batch_size (`int`): inputs after padding.
    """

    def __init__(self, *, batch_size: int, padded_batch_size: int):
        self.batch_size = batch_size
        self.padded_batch_size = padded_batch_size

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        # input_ids: [B_pad * rows_per_input, T] -> [B_pad * rows_per_input]; beam search passes more rows per input
        rows_per_input = input_ids.shape[0] // self.padded_batch_size
        is_done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        is_done[self.batch_size * rows_per_input :] = True
        return is_done


def pad_rows(value, batch_size: int, padded_batch_size: int):
    """`value` with its batch axis grown from `batch_size` to `padded_batch_size` by repeating row 0.

    Tensors whose first axis is not `batch_size` are returned unchanged (as for upstream's beam expansion, every model
    input is taken to be batch-major); `ModelOutput`s, dicts, tuples and lists are padded item by item.
    """
    # value: [B, ...] -> [B_pad, ...]
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != batch_size or padded_batch_size == batch_size:
            return value
        filler = value[:1].expand(padded_batch_size - batch_size, *value.shape[1:])
        return torch.cat([value, filler], dim=0)
    if isinstance(value, ModelOutput):
        return type(value)(**{key: pad_rows(item, batch_size, padded_batch_size) for key, item in value.items()})
    if isinstance(value, dict):
        return {key: pad_rows(item, batch_size, padded_batch_size) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(pad_rows(item, batch_size, padded_batch_size) for item in value)
    return value


def left_pad_prompt(model_inputs: dict, *, prompt_len: int, num_pad: int, pad_token_id: int) -> dict:
    """Left-pad the per-token decoder-only inputs of `model_inputs` by `num_pad` positions.

    `input_ids` are padded with `pad_token_id`, `attention_mask` with zeros, the others with zeros. The caller gives
    the mask upstream would infer when the call has none (`infer_attention_mask`); a mask of ones is made only when
    there is still none. Inputs whose second axis is not `prompt_len` are left as they are.
    """
    # input_ids: [B, P] -> [B, P_pad]; inputs_embeds: [B, P, d] -> [B, P_pad, d]
    padded = dict(model_inputs)
    prompt = next(padded[name] for name in ("input_ids", "inputs_embeds") if padded.get(name) is not None)
    if padded.get("attention_mask") is None:
        padded["attention_mask"] = torch.ones(prompt.shape[:2], dtype=torch.long, device=prompt.device)
    for name, fill in PER_TOKEN_INPUTS.items():
        value = padded.get(name)
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != prompt_len:
            continue
        fill = pad_token_id if fill is None else fill
        pad_shape = (value.shape[0], num_pad, *value.shape[2:])
        padded[name] = torch.cat([value.new_full(pad_shape, fill), value], dim=1)
    return padded


def pad_token_id(generation_config) -> int:
    """The token that pads prompts: `pad_token_id`, else the first `eos_token_id`, else 0 (it is masked anyway)."""
    for token_id in (generation_config.pad_token_id, generation_config.eos_token_id):
        if isinstance(token_id, (list, tuple)):
            token_id = token_id[0] if token_id else None
        if token_id is not None:
            return int(token_id)
    return 0


def lengths_as_new_tokens(resolved, sources: tuple, *, prompt_len: int) -> dict:
    """`max_length`/`min_length` that the caller set, as new-token counts after the real prompt of `prompt_len`.

    Upstream counts total lengths from the start of the (here left-padded) prompt, new-token counts after it. A total
    length counts as set when the call's kwargs, its `generation_config` or the model's (the items of `sources`) set
    it; it is removed from the kwargs (`sources[0]`) so that only the new-token count reaches upstream.
    """
    kwargs = sources[0]
    lengths = {}
    for total, new in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
        set_by_caller = any(
            (source.get(total) if isinstance(source, dict) else getattr(source, total, None)) is not None
            for source in sources
        )
        if getattr(resolved, new) is None and set_by_caller:
            kwargs.pop(total, None)
            lengths[new] = max(getattr(resolved, total) - prompt_len, 0)
    return lengths


def pad_encoder_outputs(model_kwargs: dict, max_encoder_len: int, *, mask_key: str = "attention_mask") -> None:
    """Right-pad `encoder_outputs` and the encoder mask in `model_kwargs` to `max_encoder_len`, in place.

    The mask (`model_kwargs[mask_key]`: `attention_mask` for most models; Whisper's decoder reads
    `encoder_attention_mask`, its `attention_mask` being the log-mel frames') is always set, ones where the call has
    none, so that the padding is never attended to and every call passes the same inputs to a compiled decoder.
    `encoder_outputs` is replaced by a copy: the caller's is untouched.
    """
    # encoder_outputs[0]: [N, L_enc, d] -> [N, L_enc_max, d]; model_kwargs[mask_key]: [N, L_enc] -> [N, L_enc_max]
    encoder_outputs = model_kwargs["encoder_outputs"]
    hidden = encoder_outputs[0]
    num_pad = max_encoder_len - hidden.shape[1]
    mask = model_kwargs.get(mask_key)
    if mask is None:
        mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    if num_pad > 0:
        hidden = F.pad(hidden, (0, 0, 0, num_pad))
        mask = F.pad(mask, (0, num_pad))
    if isinstance(encoder_outputs, ModelOutput):
        first_key = next(iter(encoder_outputs.keys()))
        encoder_outputs = type(encoder_outputs)(**{**encoder_outputs, first_key: hidden})
    else:
        encoder_outputs = (hidden, *encoder_outputs[1:])
    model_kwargs["encoder_outputs"] = encoder_outputs
    model_kwargs[mask_key] = mask


@dataclass(frozen=True)
class CallShape:
    """One shape a fixed-shape policy runs calls at (what `warmup` compiles, one call each).

    `batch_size` inputs (`rows // max(num_beams, num_return_sequences)`), a prompt (decoder-only) or encoder
    (encoder-decoder) length of `length`, and `max_new_tokens` new tokens, which make attention span `cache_len`
    decoder positions (the capacity, or a bucket of it).
    """

    batch_size: int
    length: int
    max_new_tokens: int
    cache_len: int


@dataclass
class PaddedCall:
    """What padding did to one generate call, to undo it on the outputs."""

    batch_size: int
    padded_batch_size: int
    num_prompt_pad: int  # columns added on the left of decoder-only `input_ids` (cut from `sequences`)
    padded_prompt_len: int
    continuation: bool = False  # the call continues a cache given to it, at that cache's shapes
    candidates: bool = False  # candidate decoding (assistant, prompt lookup): batch and encoder are not padded
    encoder_len: int | None = None  # the call's own encoder positions, before they were padded (encoder-decoder)

    sampling: RealRowsSampling | None = None  # a sampled call with padding rows: draws as the unpadded call

    def stopping_criteria(self, given: StoppingCriteriaList | None) -> StoppingCriteriaList | None:
        """The caller's stopping criteria, plus one that finishes the padding rows (when there are any), and for a
        sampled call the replay of the real rows' random draws (`generate/padded_sampling.py`)."""
        if self.padded_batch_size == self.batch_size:
            return given
        criteria = StoppingCriteriaList(list(given or []))
        criteria.append(
            PaddingRowsStoppingCriteria(batch_size=self.batch_size, padded_batch_size=self.padded_batch_size)
        )
        if self.sampling is not None:
            criteria.append(self.sampling.criterion)
        return criteria

    def cut_rows(self, value):
        # value: [B_pad * m, ...] -> [B * m, ...], recursively through tuples
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] % self.padded_batch_size:
                return value
            return value[: value.shape[0] // self.padded_batch_size * self.batch_size]
        if isinstance(value, (tuple, list)):
            return type(value)(self.cut_rows(item) for item in value)
        return value

    def cut_sequences(self, sequences: torch.Tensor) -> torch.Tensor:
        # sequences: [B_pad * m, P_pad + new] -> [B * m, P + new]
        return self.cut_rows(sequences)[:, self.num_prompt_pad :]

    def cut(self, output):
        """`generate`'s output for the real rows and the real prompt."""
        if isinstance(output, torch.Tensor):
            return self.cut_sequences(output)
        for key, value in list(output.items()):
            output[key] = self.cut_sequences(value) if key == "sequences" else self.cut_rows(value)
        return output


def infer_attention_mask(model, resolved, inputs_tensor: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
    """The attention mask upstream's `generate` would build for a call that has none (transformers==5.24.0:
    `_prepare_special_tokens` then `_prepare_attention_mask_for_generation`): `input_ids != pad_token_id` where a pad
    token occurs and differs from EOS, else ones. Computed on a copy of `resolved`."""
    # inputs_tensor: [B, P] -> [B, P]
    resolved = copy.deepcopy(resolved)
    model._prepare_special_tokens(resolved, False, device=inputs_tensor.device, batch_size=inputs_tensor.shape[0])
    return model._prepare_attention_mask_for_generation(inputs_tensor, resolved, dict(model_kwargs))
