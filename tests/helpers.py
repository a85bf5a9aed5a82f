"""Comparison helpers: our generate against upstream's with DynamicCache, on the same inputs.

Tolerances (issue 46: no tolerance in the suite is a literal tuned to one CPU; `utils/check_tolerances.py` lists any
that is). Tokens must be equal, always. Scores are equal bit for bit, or within a tolerance derived on the running
machine from upstream's own movement on the same inputs:
- Float noise (`float_noise`): how far upstream's float32 scores lie from the same model's float64 scores on the same
  inputs, on this machine: the rounding error of upstream's own computation. A computation of the same math in
  another order (views of a larger buffer, padded shapes, inductor's fused kernels) lies about as far from the exact
  result, so within `NOISE_MARGIN` times it of upstream's. A call run at its own shapes (the exact policy) usually
  gives upstream's scores bit for bit, and then nothing is derived; where it does not, `assert_same_generation`
  derives the float noise of the reference `generate_both` recorded.
- A padded call (`shape_policy="padded"` or `"bucketed"`) runs at more rows and over longer, masked lengths than the
  DynamicCache run it is compared with. Float sums change with those shapes (matmul kernels block by rows, reductions
  by length), by amounts that depend on the CPU: Marian's tolerance of 2e-5, measured on an Intel machine, failed at
  6e-5 to 7.3e-5 on an AMD EPYC (AVX-512) with equal tokens (issue 21). `upstream_movement` runs upstream's own model,
  with its own StaticCache spanning what the call's cache spans, on the call padded as the policy pads it (the batch
  extended by copies of its first input, encoder outputs right-padded and masked, decoder-only prompts left-padded
  with masked pad tokens), and measures how far upstream's scores move from its DynamicCache run; the call may differ
  by `MOVEMENT_MARGIN` times that, plus `NOISE_MARGIN` times the float noise where it differs by more (a compiled
  call also sums in inductor's order; `padded_call_atol`). The margin
  covers what that upstream run cannot pad as the flexible cache does: Whisper's encoder outputs (upstream's Whisper
  reads no cross-attention mask, so only its batch is extended).
- The floor (issue 58). A derived tolerance can come out at a few ulps (upstream's padded run moving a score by one
  ulp, say), below what yet another summation order moves: on an AMD EPYC Zen 3 (AVX2, no AVX-512) with one torch
  thread, Gemma3's padded scores moved by 1.8e-7 against a derived 1.5e-7. So every derived tolerance is at least
  `FLOOR_ULPS` float32 ulps of the largest |score| compared (`ulp_floor`), and a score tolerance at least the
  reference's own float noise (its float32 run against float64), whichever is larger. `tests/test_tolerances.py` shows
  each derivation holding at one torch thread and at two.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import CompileConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import ModelOutput

from transformers_flexcache.generate.padded_sampling import RealRowsSampling

# Each side of a comparison of two float32 computations of the same math lies about one float noise from the exact
# result; different summation orders at every operation (inductor's fusions, XNNPACK's kernels) add up to a few.
NOISE_MARGIN = 8.0
MOVEMENT_MARGIN = 2.0
# The least a derived tolerance may be, in float32 ulps of the largest magnitude compared. A float32 dot product of n
# terms summed in another order (another kernel's blocking, thread count or vector width) moves by up to about
# log2(n) ulps of its largest partial sum, and the tiny models chain a few such sums per layer (hidden size 32-64,
# two layers, vocabularies of ~100). Measured on an AMD EPYC Zen 4, every model case, padded and exact calls of
# batch 1-3 against DynamicCache, at one and two threads and with ATen forced to AVX2: up to 4.8 ulps where only the
# order differs (Gemma3, AVX2, one thread; the Zen 3 failure was 6); Whisper's padded calls reach 23, within their
# derived movement, which the floor never lowers. 16 ulps is 2.5 times the worst order-only move, and 2e-6 relative:
# a masking or indexing slip moves scores by thousands of times more.
FLOOR_ULPS = 16


def ulp_floor(*values) -> float:
    """`FLOOR_ULPS` float32 ulps of the largest finite magnitude in `values` (tensors, or sequences of them): the least
    tolerance a derived one is given."""
    largest = 0.0
    for value in values:
        for tensor in value if isinstance(value, list | tuple) else (value,):
            finite = tensor[torch.isfinite(tensor)]
            if finite.numel():
                largest = max(largest, finite.abs().max().item())
    if largest == 0.0:
        return 0.0
    return FLOOR_ULPS * 2.0 ** (math.frexp(largest)[1] - 24)  # float32: 24 significant bits


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


@dataclasses.dataclass(frozen=True)
class Reference:
    """How an upstream output was made (`generate_both` records it on the output as `.reference`), so that a
    tolerance can be derived from it when scores are not bit-equal."""

    upstream: torch.nn.Module
    inputs: dict
    kwargs: dict
    rng_state: torch.Tensor  # the CPU generator's state when the call started
    previous: Reference | None = None  # the call whose returned cache this one continues


# upstream's returned caches -> the reference of the call that returned them, for a call that continues one
_RETURNED_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHE_ARGUMENTS = ("cache", "past_key_values")


def upstream_generate(upstream, inputs: dict, *, seed: int | None = None, **kwargs):
    """Upstream's generate of `inputs` (DynamicCache unless `kwargs` say otherwise), with scores (on `seed`, where
    given), recording its `.reference` so that a tolerance can be derived from it (`assert_same_generation`); a call
    that continues a cache an earlier `upstream_generate` returned records that call too."""
    if seed is not None:
        torch.manual_seed(seed)
    rng_state = torch.get_rng_state()
    expected = upstream.generate(
        **own_copy(inputs), **{"return_dict_in_generate": True, "output_scores": True, **kwargs}
    )
    return record_reference(expected, upstream, inputs, kwargs, rng_state)


def record_reference(expected, upstream, inputs: dict, kwargs: dict, rng_state: torch.Tensor):
    """`expected` (upstream's generate output of `inputs` with `kwargs`, started from the generator state
    `rng_state`) with its `.reference` recorded; returned."""
    continued = next((kwargs[key] for key in _CACHE_ARGUMENTS if kwargs.get(key) is not None), None)
    kwargs = {key: value for key, value in kwargs.items() if key not in ("return_dict_in_generate", "output_scores")}
    previous = _RETURNED_BY.get(continued) if continued is not None else None
    expected.reference = Reference(upstream, own_copy(inputs), kwargs, rng_state, previous)
    if getattr(expected, "cache", None) is not None:
        _RETURNED_BY[expected.cache] = expected.reference
    return expected


def generate_both(upstream, flex, inputs: dict, *, cache_config: dict | None = None, seed: int = 0, **kwargs):
    """Run upstream (DynamicCache) and flex (`flexible_static`) generate with the same inputs and seed."""
    common = {"return_dict_in_generate": True, "output_scores": True, **kwargs}
    expected = upstream_generate(upstream, inputs, seed=seed, **kwargs)
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


def assert_same_generation(expected, actual, *, atol: float | None = None) -> None:
    """Same tokens, and every step's scores (and beam scores, if any) bit for bit or within `atol`; where `atol` is
    not given and the scores are not bit-equal, within `NOISE_MARGIN` times the float noise of upstream's run (its
    `.reference`, which `generate_both` records). Never less than `ulp_floor` of the scores, nor than the reference's
    own float noise."""
    assert torch.equal(expected.sequences, actual.sequences), (expected.sequences, actual.sequences)
    assert (expected.scores is None) == (actual.scores is None)
    pairs = list(zip(expected.scores or (), actual.scores or (), strict=True))
    if getattr(expected, "sequences_scores", None) is not None:
        pairs.append((expected.sequences_scores, actual.sequences_scores))
    differences = []
    for step, (want, got) in enumerate(pairs):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), f"step {step}: -inf pattern differs"
        assert torch.equal(want[~finite], got[~finite]), f"step {step}: infinities differ"
        differences.append((want[finite] - got[finite]).abs().max().item() if finite.any() else 0.0)
    if max(differences, default=0.0) == 0.0:
        return
    if atol is None:
        atol = noise_atol(expected)  # never below its floors
    else:
        atol = max(atol, ulp_floor([want for want, _ in pairs]))
        if max(differences) > atol and getattr(expected, "reference", None) is not None:
            atol = max(atol, reference_noise(expected))  # the other floor: the reference's own float noise
    for step, difference in enumerate(differences):
        assert difference <= atol, f"step {step}: scores differ by {difference} (tolerance {atol}, derived)"


# --- float noise: the rounding error of upstream's own computation ------------------------------------------------
def to_double(value):
    """`value` with its floating tensors (also inside model outputs and lists) in float64."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, ModelOutput):
        return type(value)(**{key: to_double(item) for key, item in value.items()})
    if isinstance(value, dict):
        return {key: to_double(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_double(item) for item in value)
    return value


def exact_generation(upstream, inputs: dict, *, seed=0, previous: Reference | None = None, **kwargs):
    """Upstream's generate of `inputs` run in float64 (a copy of the model, and of an assistant model), with
    DynamicCache, from the same random state (`seed`: an int, or a generator state): the exact reference of a float32
    run's noise. A compiled or cached argument of the float32 run is left out; a call that continued the cache of
    `previous` continues that call's float64 replay."""
    cache_argument = next((key for key in _CACHE_ARGUMENTS if kwargs.get(key) is not None), None)
    kwargs = {
        key: in_double(value) if isinstance(value, torch.nn.Module) else value
        for key, value in kwargs.items()
        if key not in _NOT_REPLAYED
    }
    kwargs.update(return_dict_in_generate=True, output_scores=True)
    double = in_double(upstream, sdpa=not kwargs.get("output_attentions"))
    if previous is not None:
        before = exact_generation(
            previous.upstream, previous.inputs, seed=previous.rng_state, previous=previous.previous, **previous.kwargs
        )
        kwargs[cache_argument] = before.cache
        double = before.double_model
    elif cache_argument is not None:
        raise AssertionError(
            f"the call continues a cache ({cache_argument}=) that no upstream_generate returned: its float64 replay "
            "cannot continue it; make the earlier call with upstream_generate"
        )
    if isinstance(seed, torch.Tensor):
        torch.set_rng_state(seed)
    else:
        torch.manual_seed(seed)
    exact = double.generate(**to_double(own_copy(inputs)), **kwargs)
    exact.double_model = double
    return exact


def float_noise(upstream, inputs: dict, expected, *, seed: int = 0, **kwargs) -> float:
    """How far `expected` (upstream's float32 run of `inputs`, with DynamicCache) lies from the same model's run in
    float64 on the same inputs and seed (`exact_generation`), on this machine: the largest score difference up to the
    first step at which their tokens part (`score_difference`)."""
    return score_difference(expected, exact_generation(upstream, inputs, seed=seed, **kwargs))


def in_double(module: torch.nn.Module, *, sdpa: bool = True) -> torch.nn.Module:
    """A float64 copy of `module` as it is now, to compute the exact reference of a float32 output. The same math in
    other kernels where float64 needs them: mixture-of-experts layers run their experts as the eager loop (torch's
    grouped matmul takes no float64), and eager attention runs as SDPA, because in float64 upstream's eager attention
    turns the fully masked query rows of left padding into NaN (its mask value, float64's minimum, overflows when
    added), which the padded positions' keys and values then carry into the real rows' sums (`sdpa=False` keeps it:
    SDPA returns no attention weights)."""
    double = copy.deepcopy(module).to(torch.float64)
    config = getattr(double, "config", None)
    if getattr(config, "_experts_implementation", None) not in (None, "eager"):
        double.set_experts_implementation("eager")
    if (
        sdpa
        and getattr(config, "_attn_implementation", None) == "eager"
        and hasattr(double, "set_attn_implementation")
    ):
        try:
            double.set_attn_implementation("sdpa")
        except (ValueError, ImportError):  # a model without SDPA keeps eager attention
            pass
    return double


def assert_within_float_noise(actual, expected, exact, *, margin: float = NOISE_MARGIN) -> None:
    """`actual` (a tensor, or a tuple of them) equals `expected`, a float32 reference, bit for bit, or lies within
    `margin` times `expected`'s float noise: its largest distance from `exact`, the same computation in float64 on the
    same inputs, on this machine, or within `ulp_floor` of `expected` where that is larger. `exact` may be a function
    that returns it, called only when not bit-equal."""
    if isinstance(actual, torch.Tensor):
        actual, expected = (actual,), (expected,)
    if all(torch.equal(got, want) for got, want in zip(actual, expected, strict=True)):
        return
    exact = exact() if callable(exact) else exact
    exact = (exact,) if isinstance(exact, torch.Tensor) else exact
    for got, want, reference in zip(actual, expected, exact, strict=True):
        assert got.shape == want.shape == reference.shape, (got.shape, want.shape, reference.shape)
        if torch.equal(got, want):
            continue
        noise = (want.double() - reference.double()).abs().max().item()
        difference = (got.double() - want.double()).abs().max().item()
        atol = max(margin * noise, ulp_floor(want))
        assert difference <= atol, (
            f"differs from the float32 reference by {difference:.3g}, over {margin} times its float noise {noise:.3g}"
            f" (and its floor of {FLOOR_ULPS} ulps: tolerance {atol:.3g})"
        )


# arguments of a float32 run that its float64 replay leaves out (the replay runs eagerly, on a DynamicCache)
_NOT_REPLAYED = ("compile_config", "cache_implementation", "cache_config", "past_key_values", "cache")


def noise_atol(expected) -> float:
    """`NOISE_MARGIN` times the float noise of upstream's run that gave `expected` (`reference_noise`), or
    `ulp_floor` of its scores where that is larger."""
    return max(NOISE_MARGIN * reference_noise(expected), ulp_floor(expected.scores))


def reference_noise(expected) -> float:
    """The float noise of upstream's run that gave `expected` (its `.reference`): how far its scores lie from the same
    call's in float64 (`exact_generation`), on this machine."""
    reference = getattr(expected, "reference", None)
    assert reference is not None, (
        "scores are not bit-equal and the upstream output records no reference to derive a tolerance from: make it "
        "with generate_both, or pass a derived atol"
    )
    exact = exact_generation(
        reference.upstream, reference.inputs, seed=reference.rng_state, previous=reference.previous, **reference.kwargs
    )
    return score_difference(expected, exact)


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
    `expected`: `MOVEMENT_MARGIN` times what upstream's own scores move on the call padded to the shapes `flex`'s cache
    ran it at (its rows, the positions its self-attention spans, its encoder length, its prompt length: read from the
    cache), plus `NOISE_MARGIN` times upstream's float noise on the call (`float_noise`) where the scores differ by
    more than the first; never less than `ulp_floor` of the scores."""
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
    floor = ulp_floor(expected.scores)
    if score_difference(expected, actual) <= max(MOVEMENT_MARGIN * moved, floor):
        return max(MOVEMENT_MARGIN * moved, floor)
    # a compiled call also sums in inductor's order: its float noise on top
    noise = float_noise(upstream, inputs, expected, seed=seed, **kwargs)
    return max(MOVEMENT_MARGIN * moved + NOISE_MARGIN * noise, floor)


def assert_same_padded_generation(upstream, flex, inputs: dict, expected, actual, *, seed: int = 0, **kwargs) -> float:
    """`assert_same_generation` with the tolerance of a padded call (`padded_call_atol`); returns that tolerance, which
    a continuation of `actual`'s cache (run at the same padded shapes) can reuse."""
    atol = padded_call_atol(upstream, flex, inputs, expected, actual, seed=seed, **kwargs)
    assert_same_generation(expected, actual, atol=atol)
    return atol


REPO_ROOT = Path(__file__).resolve().parents[1]


def run_on_two_ranks(child: Path, folder: Path, *, timeout: float) -> list[dict]:
    """`python child folder` under `torchrun` on two CPU ranks (gloo), one OpenMP thread each, bounded by `timeout`
    seconds; returns what each rank wrote to `folder/rank{0,1}.json`."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    result = subprocess.run(
        [*command, str(child), str(folder)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"torchrun failed (rc={result.returncode}):\n{result.stderr[-4000:]}"
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]
