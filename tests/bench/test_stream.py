"""The stream's decoding: exactly `new_tokens` tokens per call, EOS suppressed as `min_new_tokens` would."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    ForcedEOSTokenLogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
)

from transformers_flexcache.bench.stream import NoEndOfSequence

EOS = 2


@pytest.mark.parametrize("eos_token_id", [EOS, [EOS, 5]])
def test_no_end_of_sequence_after_forced_eos_scores_as_min_new_tokens_before_it(eos_token_id):
    # upstream's order under min_new_tokens = max_new_tokens = 4 after a prompt of 1: the min-length processors, then
    # BART's forced EOS at the last position; the bench's: forced EOS, then NoEndOfSequence.
    torch.manual_seed(0)
    forced = ForcedEOSTokenLogitsProcessor(max_length=5, eos_token_id=EOS)
    upstream = LogitsProcessorList(
        [MinLengthLogitsProcessor(5, eos_token_id), MinNewTokensLengthLogitsProcessor(1, 4, eos_token_id), forced]
    )
    bench = LogitsProcessorList([forced, NoEndOfSequence(eos_token_id)])
    for length in range(1, 5):  # the 4 steps: the last one is forced to EOS
        input_ids = torch.randint(6, 20, (3, length))
        scores = torch.randn(3, 20)
        scores[:, EOS] = 10.0  # EOS would win every step
        assert torch.equal(bench(input_ids, scores.clone()), upstream(input_ids, scores.clone()))
    assert int(bench(input_ids, scores.clone()).argmax(-1)[0]) == EOS


def test_no_end_of_sequence_without_eos_changes_nothing():
    scores = torch.randn(2, 7)
    assert torch.equal(NoEndOfSequence(None)(torch.ones(2, 1, dtype=torch.long), scores), scores)
