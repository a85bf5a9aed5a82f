"""`bench/export_measure.py`'s stream and Whisper comparison (the real-sized measurement itself takes minutes)."""

from __future__ import annotations

import pytest
from transformers import SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor

from tests.model_cases import WHISPER
from transformers_flexcache.bench.export_measure import REAL_SIZED, _suppressing_processors, stream


@pytest.mark.parametrize("name", sorted(REAL_SIZED))
def test_measure_stream_stays_within_the_batch_capacity_and_reaches_it(name):
    model = REAL_SIZED[name]
    config = model.build_config()
    batches = [next(iter(call.values())).shape[0] for call in stream(model, config)]
    assert max(batches) == model.capacities["max_batch_size"] and min(batches) == 1, batches


def test_measure_applies_the_suppressing_processors_that_whispers_generate_applies():
    upstream, _ = WHISPER.build()
    config = upstream.generation_config
    config.suppress_tokens, config.begin_suppress_tokens = [3], [4, 5]
    processors = _suppressing_processors(upstream)
    assert [type(p) for p in processors] == [SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor]
    assert processors[1].begin_index == 1  # after the decoder start token
    config.suppress_tokens = config.begin_suppress_tokens = None
    assert _suppressing_processors(upstream) is None
