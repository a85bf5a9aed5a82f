"""Comparison helpers: our generate against upstream's with DynamicCache, on the same inputs.

Tolerances. Tokens must be equal, always. Scores:
- A call run at its own shapes (the exact policy, or a fixed-shape call that needed no padding) computes what
  DynamicCache computes, on the same shapes: its scores are within `SCORE_ATOL`.
- A padded call (`shape_policy="padded"` or `"bucketed"`) runs at more rows and over longer, masked lengths than the
  DynamicCache run it is compared with. Float sums change with those shapes (matmul kernels block by rows, reductions
  by length), by amounts that depend on the CPU: Marian's tolerance of 2e-5, measured on an Intel machine, failed at
  6e-5 to 7.3e-5 on an AMD EPYC (AVX-512) with equal tokens (issue 21). So its tolerance is derived on the running
  machine: `upstream_movement` runs upstream's own model, with its own StaticCache spanning what the call's cache
  spans, on the call padded as the policy pads it (the batch extended by copies of its first input, encoder outputs
  right-padded and masked, decoder-only prompts left-padded with masked pad tokens), and measures how far upstream's
  scores move from its DynamicCache run; the call may differ by `SCORE_ATOL` plus `MOVEMENT_MARGIN` times that
  (`padded_call_atol`). The margin covers what that upstream run cannot pad as the flexible cache does: Whisper's
  encoder outputs (upstream's Whisper reads no cross-attention mask, so only its batch is extended).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading

import torch
import torch.nn.functional as F
from transformers import CompileConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import ModelOutput

from transformers_flexcache.padded_sampling import RealRowsSampling

SCORE_ATOL = 1e-5
MOVEMENT_MARGIN = 2.0


def own_copy(inputs: dict) -> dict:
    # Beam search and num_return_sequences expand `encoder_outputs` in place (GenerationMixin.
    # _expand_inputs_for_generation), so each generate gets its own shallow copy of model outputs it is given.
    return {key: copy.copy(value) if isinstance(value, ModelOutput) else value for key, value in inputs.items()}


@contextlib.contextmanager
def python_calls(function):
    """Yields a list whose length is the number of calls of `function` run as Python code within the context, in
    this thread and in threads started in it: a call that a compiled graph runs (or that dynamo traces) is not one."""
    code, calls = function.__code__, []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def counting_compile_config(counter, config_class=CompileConfig) -> CompileConfig:
    """A `config_class` (upstream's `CompileConfig`, or `FlexCompileConfig` to compile the encoder too) whose backend
    counts the graphs (`torch._dynamo.testing.CompileCounter`) and runs them as traced; compiling on CPU enabled."""

    def backend(graph_module, example_inputs, **kwargs):
        return counter(graph_module, example_inputs)

    config = config_class(backend=backend, fullgraph=True)
    config._compile_all_devices = True
    return config


def generate_both(upstream, flex, inputs: dict, *, cache_config: dict | None = None, seed: int = 0, **kwargs):
    """Run upstream (DynamicCache) and flex (`flexible_static`) generate with the same inputs and seed."""
    common = {"return_dict_in_generate": True, "output_scores": True, **kwargs}
    torch.manual_seed(seed)
    expected = upstream.generate(**own_copy(inputs), **common)
    torch.manual_seed(seed)
    actual = flex.generate(
        **own_copy(inputs), cache_implementation="flexible_static", cache_config=cache_config or {}, **common
    )
    return expected, actual


def score_difference(expected, actual) -> float:
    """The largest difference between the scores of `expected` and the first rows of `actual`'s, over the steps up to
    the first one at which their tokens differ (later steps continue other sequences), where both are finite."""
    rows = expected.sequences.shape[0]
    largest = 0.0
    for step, (want, got) in enumerate(zip(expected.scores, actual.scores, strict=False)):
        got = got[: want.shape[0]]
        finite = torch.isfinite(want) & torch.isfinite(got)
        if finite.any():
            largest = max(largest, (want[finite] - got[finite]).abs().max().item())
        want_tokens = expected.sequences[:, step - len(expected.scores)]
        if not torch.equal(want_tokens, actual.sequences[:rows, step - len(actual.scores)]):
            break
    return largest


def assert_same_generation(expected, actual, *, atol: float = SCORE_ATOL) -> None:
    """Same tokens, and every step's scores (and beam scores, if any) within `atol`."""
    assert torch.equal(expected.sequences, actual.sequences), (expected.sequences, actual.sequences)
    assert len(expected.scores) == len(actual.scores)
    for step, (want, got) in enumerate(zip(expected.scores, actual.scores, strict=True)):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), f"step {step}: -inf pattern differs"
        diff = (want[finite] - got[finite]).abs().max().item() if finite.any() else 0.0
        assert diff <= atol, f"step {step}: scores differ by {diff} (tolerance {atol})"
    if getattr(expected, "sequences_scores", None) is not None:
        torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, atol=atol, rtol=0)


# --- the tolerance of padded calls ----------------------------------------------------------------------------------
def _rows_per_input(model, kwargs: dict) -> int:
    """Rows of the model's cache per input of the call: `max(num_beams, num_return_sequences)`, or for Whisper (whose
    generate repeats each input per returned sequence before upstream's generate expands beams) their product."""
    config = model.generation_config
    num_beams = kwargs.get("num_beams", config.num_beams) or 1
    num_sequences = kwargs.get("num_return_sequences", config.num_return_sequences) or 1
    if model.config.model_type == "whisper":
        return num_beams * num_sequences
    return max(num_beams, num_sequences)


def _mask_upstream_infers(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask upstream's generate infers for decoder-only `input_ids` given without one
    (transformers==5.24.0, `_prepare_attention_mask_for_generation`: `input_ids != pad_token_id` where the pad token
    occurs and is not an EOS token, else ones; encoder-decoder inputs get none)."""
    config = model.generation_config
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)


def batch_size_of(inputs: dict) -> int:
    """The number of inputs of a generate call's `inputs` (its main tensor's, or its encoder outputs')."""
    value = next(iter(inputs.values()))
    return (value[0] if isinstance(value, ModelOutput) else value).shape[0]


def _extend_rows(value, batch_size: int, num_rows: int):
    """`value` with its first axis extended from `batch_size` to `num_rows` by copies of its first row."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size:
        return torch.cat([value, value[:1].expand(num_rows - batch_size, *value.shape[1:])])
    if isinstance(value, ModelOutput):
        return type(value)(**{key: _extend_rows(item, batch_size, num_rows) for key, item in value.items()})
    return value


def padded_like_the_policy(model, inputs: dict, *, num_inputs: int, encoder_len: int | None, prompt_len: int | None):
    """`inputs` padded for upstream's own `model` as a fixed-shape policy pads them: `num_inputs` inputs (copies of the
    first), encoder outputs right-padded with zeros to `encoder_len` and masked (models that read a cross-attention
    mask), a decoder-only prompt left-padded to `prompt_len` with masked pad tokens. Returns `(inputs, num_prompt_pad)`."""
    batch_size = batch_size_of(inputs)
    padded = {key: _extend_rows(value, batch_size, num_inputs) for key, value in inputs.items()}
    if not model.config.is_encoder_decoder and padded.get("attention_mask") is None:
        padded["attention_mask"] = _mask_upstream_infers(model, padded["input_ids"])
    num_prompt_pad = 0
    if model.config.is_encoder_decoder:
        reads_cross_mask = model.config.model_type != "whisper"
        if reads_cross_mask and encoder_len is not None:
            if "encoder_outputs" not in padded:
                with torch.no_grad():
                    padded["encoder_outputs"] = model.get_encoder()(**padded)
                # the encoder's inputs are now its outputs; a decoder prompt (`decoder_input_ids`) stays
                for key in [key for key in padded if key not in ("encoder_outputs", "attention_mask")]:
                    if not key.startswith("decoder_"):
                        del padded[key]
            hidden = padded["encoder_outputs"][0]
            mask = padded.get("attention_mask")
            mask = torch.ones(hidden.shape[:2], dtype=torch.long) if mask is None else mask
            num_pad = encoder_len - hidden.shape[1]
            padded["encoder_outputs"] = BaseModelOutput(last_hidden_state=F.pad(hidden, (0, 0, 0, num_pad)))
            padded["attention_mask"] = F.pad(mask, (0, num_pad))
    elif prompt_len is not None:
        input_ids = padded["input_ids"]
        num_prompt_pad = prompt_len - input_ids.shape[1]
        pad = model.generation_config.pad_token_id
        padded["input_ids"] = F.pad(input_ids, (num_prompt_pad, 0), value=0 if pad is None else pad)
        padded["attention_mask"] = F.pad(padded["attention_mask"], (num_prompt_pad, 0))
    return padded, num_prompt_pad


def upstream_movement(
    upstream,
    inputs: dict,
    expected,
    *,
    num_inputs: int,
    cache_len: int,
    encoder_len: int | None = None,
    prompt_len: int | None = None,
    seed: int = 0,
    **kwargs,
) -> float:
    """How far upstream's own scores (`expected`, its DynamicCache run of `inputs`) move, on this machine, when upstream
    runs the same call padded as a fixed-shape policy pads it (`padded_like_the_policy`), with its own StaticCache of
    `cache_len` positions (self-attention then spans them all, the unwritten ones masked, as a padded cache's does)."""
    padded, num_prompt_pad = padded_like_the_policy(
        upstream, inputs, num_inputs=num_inputs, encoder_len=encoder_len, prompt_len=prompt_len
    )
    kwargs = {**kwargs, "return_dict_in_generate": True, "output_scores": True}
    for total in ("max_length", "min_length"):  # total lengths count the prompt, which grew by its left padding
        if kwargs.get(total) is not None:
            kwargs[total] += num_prompt_pad
    kwargs.pop("compile_config", None)  # the reference runs eagerly
    if upstream.config.is_encoder_decoder:
        # Upstream's `EncoderDecoderCache.crop` refuses a StaticCache, so candidate decoding cannot run on it: the
        # equivalent run decodes without candidates, which for greedy decoding gives the same tokens.
        kwargs.pop("assistant_model", None)
        kwargs.pop("prompt_lookup_num_tokens", None)
    kwargs.update(cache_implementation="static", max_cache_len=cache_len)
    batch_size = batch_size_of(inputs)
    if kwargs.get("do_sample") and num_inputs > batch_size and "logits_processor" not in kwargs:
        # Upstream samples its padding rows too: its generator is put back after each step where the unpadded run
        # leaves it, as a padded flexible call's is (what the sampling tests check against DynamicCache's tokens),
        # so that this run samples the same tokens and measures the scores alone.
        sampling = RealRowsSampling(batch_size=batch_size, padded_batch_size=num_inputs)
        kwargs.update(logits_processor=LogitsProcessorList([sampling.processor]))
        kwargs.update(stopping_criteria=StoppingCriteriaList([sampling.criterion]))
    torch.manual_seed(seed)
    moved = upstream.generate(**own_copy(padded), **kwargs)
    # An equivalent run gives the same tokens; one that does not is no measure of float noise (it padded or masked
    # differently), and would make any difference look tolerable.
    rows = expected.sequences.shape[0]
    assert torch.equal(
        moved.sequences[:rows, -len(expected.scores) :], expected.sequences[:, -len(expected.scores) :]
    ), (
        "upstream's padded run gave other tokens than its unpadded one: it is not an equivalent run",
        expected.sequences,
        moved.sequences,
    )
    return score_difference(expected, moved)


def padded_call_atol(upstream, flex, inputs: dict, expected, actual, *, seed: int = 0, **kwargs) -> float:
    """The score tolerance of `actual`, the padded flexible call of `inputs` whose DynamicCache reference is
    `expected`: `SCORE_ATOL` plus `MOVEMENT_MARGIN` times what upstream's own scores move on the call padded to the
    shapes `flex`'s cache ran it at (its rows, the positions its self-attention spans, its encoder length, its prompt
    length: read from the cache)."""
    cache = flex.flexible_cache
    num_inputs = max(cache.batch_size // _rows_per_input(flex, kwargs), batch_size_of(inputs))
    self_attention = getattr(cache, "self_attention_cache", cache)
    cache_len = max(
        [self_attention.max_cache_len]  # all layers sliding: upstream's own sliding layers span their window
        + [
            self_attention.get_mask_sizes(1, layer_idx)[0]  # the capacity, or the call's length bucket
            for layer_idx, spec in enumerate(self_attention.layer_specs)
            if spec.layer_type == "full_attention"
        ]
    )
    encoder_len = prompt_len = None
    if flex.config.is_encoder_decoder:
        encoder_len = cache.get_encoder_length()
    else:  # the cache holds the padded prompt and every new token but the last
        prompt_len = int(cache.get_seq_length()) - len(actual.scores) + 1
    moved = upstream_movement(
        upstream,
        inputs,
        expected,
        num_inputs=num_inputs,
        cache_len=cache_len,
        encoder_len=encoder_len,
        prompt_len=prompt_len,
        seed=seed,
        **kwargs,
    )
    return SCORE_ATOL + MOVEMENT_MARGIN * moved


def assert_same_padded_generation(upstream, flex, inputs: dict, expected, actual, *, seed: int = 0, **kwargs) -> float:
    """`assert_same_generation` with the tolerance of a padded call (`padded_call_atol`); returns that tolerance, which
    a continuation of `actual`'s cache (run at the same padded shapes) can reuse."""
    atol = padded_call_atol(upstream, flex, inputs, expected, actual, seed=seed, **kwargs)
    assert_same_generation(expected, actual, atol=atol)
    return atol
