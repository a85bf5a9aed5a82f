"""Comparison helpers: our generate against upstream's with DynamicCache, on the same inputs."""

from __future__ import annotations

import torch

SCORE_ATOL = 1e-5


def generate_both(upstream, flex, inputs: dict, *, cache_config: dict | None = None, seed: int = 0, **kwargs):
    """Run upstream (DynamicCache) and flex (`flexible_static`) generate with the same inputs and seed."""
    common = {"return_dict_in_generate": True, "output_scores": True, **kwargs}
    torch.manual_seed(seed)
    expected = upstream.generate(**inputs, **common)
    torch.manual_seed(seed)
    actual = flex.generate(**inputs, cache_implementation="flexible_static", cache_config=cache_config or {}, **common)
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
