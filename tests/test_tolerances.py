"""No tolerance in the tests is a literal tuned to one CPU (`utils/check_tolerances.py`), and the derived ones work.

Every score tolerance is derived on the running machine from upstream's own movement on the same inputs
(tests/helpers.py), and the check below lists any literal one; it is checked here on a file written to fail it.
"""

from __future__ import annotations

import torch

from tests.helpers import NOISE_MARGIN, assert_same_generation, float_noise, generate_both, upstream_generate
from tests.model_cases import T5
from utils import check_tolerances


def test_no_test_compares_outputs_within_a_literal_tolerance():
    findings = check_tolerances.scan()
    assert not findings, "derive these from upstream's movement (tests/helpers.py) or compare exactly:\n" + "\n".join(
        str(finding) for finding in findings
    )
    assert not check_tolerances.stale_allowances()


def test_the_check_finds_every_kind_of_literal_tolerance(tmp_path):
    (tmp_path / "test_example.py").write_text(
        "import torch\n"
        "ATOL = 1e-5\n"
        "torch.testing.assert_close(a, b, atol=1e-4, rtol=0)\n"
        "torch.testing.assert_close(a, b)\n"
        "assert (a - b).abs().max() <= 2e-4\n"
        "torch.testing.assert_close(a, b, atol=0, rtol=0)\n"  # exact: fine
        "assert rng.random() < 0.5\n"  # not a difference: fine
        "assert (a - b).abs().max() > 1e-2\n"  # a lower bound (the outputs differ): fine
    )
    found = [(finding.line, finding.what) for finding in check_tolerances.scan(str(tmp_path))]
    assert found == [
        (2, "literal ATOL = 1e-05"),
        (3, "literal atol=0.0001"),
        (4, "assert_close with its default tolerance"),
        (5, "a difference bounded by the float literal 0.0002"),
    ]


def test_scores_that_differ_by_more_than_the_derived_float_noise_fail():
    upstream, flex = T5.build("sdpa")
    inputs = T5.make_inputs(2, 5, torch.Generator().manual_seed(0))
    expected, actual = generate_both(upstream, flex, inputs, max_new_tokens=3, do_sample=False)
    noise = float_noise(upstream, inputs, expected, max_new_tokens=3, do_sample=False)
    assert noise > 0  # float32 against float64: never exact on these models
    assert_same_generation(expected, actual)
    nudged = [scores.clone() for scores in actual.scores]
    nudged[1][0, 5] += 0.5 * NOISE_MARGIN * noise  # within the tolerance
    actual.scores = tuple(nudged)
    assert_same_generation(expected, actual)
    nudged[1][0, 5] += 2 * NOISE_MARGIN * noise  # beyond it
    actual.scores = tuple(nudged)
    try:
        assert_same_generation(expected, actual)
    except AssertionError as error:
        assert "derived" in str(error)
    else:
        raise AssertionError("a difference beyond the derived tolerance passed")


def test_a_continuation_replays_the_call_whose_cache_it_continues_in_float64():
    upstream, _ = T5.build("sdpa")
    generator = torch.Generator().manual_seed(1)
    first = T5.make_inputs(2, 5, generator)
    greedy = {"max_new_tokens": 2, "do_sample": False}
    before = upstream_generate(upstream, first, **greedy)
    turn = {**first, "decoder_input_ids": before.sequences}
    after = upstream_generate(upstream, turn, cache=before.cache, **greedy)
    assert after.reference.previous is before.reference
    nudged = [scores.clone() for scores in after.scores]
    nudged[0][1, 3] += 1e-7
    other = type(after)(sequences=after.sequences, scores=tuple(nudged))
    assert_same_generation(after, other)  # derived from the replayed pair of calls: 1e-7 is within float noise
