"""Comparison helpers: our generate against upstream's with DynamicCache, on the same inputs."""

from __future__ import annotations

import copy

import torch
from transformers.utils import ModelOutput

SCORE_ATOL = 1e-5


def _own_copy(inputs: dict) -> dict:
    # Beam search and num_return_sequences expand `encoder_outputs` in place (GenerationMixin.
    # _expand_inputs_for_generation), so each generate gets its own shallow copy of model outputs it is given.
    return {key: copy.copy(value) if isinstance(value, ModelOutput) else value for key, value in inputs.items()}


def generate_both(upstream, flex, inputs: dict, *, cache_config: dict | None = None, seed: int = 0, **kwargs):
    """Run upstream (DynamicCache) and flex (`flexible_static`) generate with the same inputs and seed."""
    common = {"return_dict_in_generate": True, "output_scores": True, **kwargs}
    torch.manual_seed(seed)
    expected = upstream.generate(**_own_copy(inputs), **common)
    torch.manual_seed(seed)
    actual = flex.generate(
        **_own_copy(inputs), cache_implementation="flexible_static", cache_config=cache_config or {}, **common
    )
    return expected, actual


def assert_same_generation(expected, actual, *, atol: float = SCORE_ATOL) -> None:
    """Same tokens, and every step's scores (and beam scores, if any) within `atol`."""
    assert torch.equal(expected.sequences, actual.sequences), (expected.sequences, actual.sequences)
    assert len(expected.scores) == len(actual.scores)
    for step, (want, got) in enumerate(zip(expected.scores, actual.scores, strict=True)):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), f"step {step}: -inf pattern differs"
        diff = (want[finite] - got[finite]).abs().max().item() if finite.any() else 0.0
        assert diff <= atol, f"step {step}: scores differ by {diff}"
    if getattr(expected, "sequences_scores", None) is not None:
        torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, atol=atol, rtol=0)
