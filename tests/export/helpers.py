"""Tiny export cases and the comparison with upstream's eager `generate` (DynamicCache), for tests/export/."""

from __future__ import annotations

import dataclasses

import torch

from tests.helpers import NOISE_MARGIN, in_double, to_double, ulp_floor
from tests.model_cases import (
    BART,
    GEMMA3_TEXT,
    GPT2,
    LLAMA,
    M2M_100,
    MARIAN,
    MBART,
    MISTRAL,
    PEGASUS,
    PHI3,
    PIX2STRUCT,
    QWEN2,
    QWEN3,
    T5,
    WHISPER,
    _bart_config,
    _llama_config,
    _pix2struct_config,
    _t5_config,
    _whisper_config,
)
from transformers_flexcache.export import generate

NEW_TOKENS = 8  # decoding 8 tokens after the start token uses 8 decoder positions
CAPACITY = {"max_batch_size": 4, "max_cache_len": 8, "max_encoder_len": 10}
# (batch, encoder or prompt length), large -> small -> large, so stale cache content from a bigger call is present.
SHAPES = [(4, 10), (1, 3), (3, 7), (2, 10), (4, 1)]
# Exported norms take their means as linears (rewrites.py), and ExecuTorch's kernels sum in another order than
# PyTorch's: a few fp32 ulps per op, which the varied tiny T5 below (initializer_factor 3, logits up to ~35) amplifies.
# So the program's logits are compared within NOISE_MARGIN times the float noise of upstream's own logits on the same
# inputs (their distance from upstream's float64 run, on this machine: tests/helpers.py), not a literal.


def _varied_t5_config(num_layers: int = 2):
    config = _t5_config()
    # With the default init the tiny T5 predicts the pad token at every step; larger weights make varied tokens
    # while the logits stay moderate (|logit| < 45).
    config.initializer_factor = 3.0
    # The zoo's T5 is v1.1-style (untied, unscaled); this one keeps t5-small's d_model**-0.5 output scaling, which
    # transformers' own exporter drops: the export must keep it.
    config.scale_decoder_outputs = True
    config.num_layers = config.num_decoder_layers = num_layers
    return config


def _one_layer(build_config, *names):
    def build():
        config = build_config()
        for name in names:
            setattr(config, name, 1)
        return config

    return build


def _one_layer_pix2struct():
    config = _pix2struct_config()
    config.text_config.num_layers = 1
    config.vision_config.num_hidden_layers = 1
    return config


T5_VARIED = dataclasses.replace(T5, build_config=_varied_t5_config)
# Lowering to ExecuTorch costs time per graph node: ExecuTorch tests use one layer per stack.
ONE_LAYER = {
    "llama": dataclasses.replace(LLAMA, build_config=_one_layer(_llama_config, "num_hidden_layers")),
    "t5": dataclasses.replace(T5, build_config=lambda: _varied_t5_config(num_layers=1)),
    "bart": dataclasses.replace(BART, build_config=_one_layer(_bart_config, "encoder_layers", "decoder_layers")),
    "whisper": dataclasses.replace(
        WHISPER, build_config=_one_layer(_whisper_config, "encoder_layers", "decoder_layers")
    ),
    "pix2struct": dataclasses.replace(PIX2STRUCT, build_config=_one_layer_pix2struct),
    **{
        case.name: dataclasses.replace(
            case, build_config=_one_layer(case.build_config, "encoder_layers", "decoder_layers")
        )
        for case in (MARIAN, M2M_100, MBART, PEGASUS)
    },
    # The generic decoder-only cases keep their two layers (Qwen2 and Gemma3 mix a full-attention and a
    # sliding-window layer, a window of 4), except Mistral: its one layer is a sliding-window one.
    **{case.name: case for case in (QWEN2, QWEN3, PHI3, GPT2, GEMMA3_TEXT)},
    "mistral": dataclasses.replace(MISTRAL, build_config=_one_layer(MISTRAL.build_config, "num_hidden_layers")),
}


def generate_kwargs(upstream) -> dict:
    config = upstream.generation_config
    return {
        "decoder_start_token_id": config.decoder_start_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "forced_eos_token_id": getattr(config, "forced_eos_token_id", None),  # BART's generate forces EOS last
    }


def program_inputs(inputs: dict) -> dict:
    """A model case's generate inputs as `generate(runner, ...)` takes them (encoder outputs as a tensor)."""
    inputs = {name: value for name, value in inputs.items() if name != "use_cache"}
    if "encoder_outputs" in inputs:
        return {"encoder_hidden_states": inputs["encoder_outputs"].last_hidden_state}
    return inputs


def assert_close_logits(
    got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, where: str, *, margin=NOISE_MARGIN
):
    """`got` within `margin` times the float noise of `want` (its distance from `exact`, the float64 computation), or
    within `ulp_floor` of `want` where that is larger (tests/helpers.py)."""
    noise = (want.double() - exact.double()).abs().max().item()
    diff = (got - want).abs().max().item()
    atol = max(margin * noise, ulp_floor(want))
    assert diff <= atol, (
        f"{where}: logits differ by {diff:.3g}, over {margin} times their float noise {noise:.3g} "
        f"(and its floor: tolerance {atol:.3g})"
    )


def assert_same_greedy(runner, upstream, inputs: dict, where: str, *, new_tokens: int = NEW_TOKENS) -> None:
    """Greedy tokens equal upstream generate's (DynamicCache), and every step's logits are within its float noise."""
    common = {"max_new_tokens": new_tokens, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    expected = upstream.generate(**inputs, **common)
    tokens, logits = generate(
        runner,
        **program_inputs(inputs),
        max_new_tokens=new_tokens,
        output_logits=True,
        **generate_kwargs(upstream),
    )
    assert torch.equal(tokens, expected.sequences), (where, tokens, expected.sequences)
    exact = in_double(upstream).generate(**to_double(inputs), **common)
    steps = same_token_steps(expected.sequences, exact.sequences, len(expected.logits))
    assert_close_logits(
        torch.stack(logits)[:steps], torch.stack(expected.logits)[:steps], torch.stack(exact.logits)[:steps], where
    )


def same_token_steps(sequences: torch.Tensor, other: torch.Tensor, steps: int) -> int:
    """The steps whose logits two runs share inputs for: up to and including the first whose tokens part."""
    for step in range(steps):
        if not torch.equal(sequences[:, step - steps], other[:, step - steps]):
            return step + 1
    return steps


def assert_matches_eager_for_every_shape(runner, upstream, case, shapes, *, seed: int) -> None:
    """For each (batch, length) in turn, on the same program and buffers: `assert_same_greedy`."""
    generator = torch.Generator().manual_seed(seed)
    for batch_size, length in shapes:
        inputs = {**case.make_inputs(batch_size, length, generator), **case.generate_kwargs}
        assert_same_greedy(runner, upstream, inputs, f"{case.name} batch={batch_size} length={length}")
