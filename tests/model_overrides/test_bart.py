"""BART override: what is specific to it, each output against upstream's DynamicCache on the same seeded model.

The stream of calls, capacities and overflow errors are covered for BART by `tests/generate/test_generation.py`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

import transformers_flexcache
from model_overrides.bart import FlexBartForConditionalGeneration
from tests.helpers import assert_same_generation, generate_both
from tests.model_cases import BART, VOCAB
from transformers_flexcache.cache import FlexibleStaticLayer

# Far larger than any call below: every call leaves unused rows and encoder positions in the storage.
LARGE = {"max_batch_size": 9, "max_cache_len": 24, "max_encoder_len": 20}


def _right_padded(lengths: list[int], generator: torch.Generator) -> dict:
    """Token rows of the given lengths, right-padded to the longest (pad id 0, mask 0)."""
    # -> input_ids, attention_mask: [len(lengths), max(lengths)]
    input_ids = torch.randint(3, VOCAB, (len(lengths), max(lengths)), generator=generator)
    attention_mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_right_padded_rows_match_dynamic_cache_after_a_longer_encoder_call(attn):
    upstream, flex = BART.build(attn)
    generator = torch.Generator().manual_seed(10)
    for lengths in ([16, 3, 9], [7, 2, 5, 1]):  # the second call's encoder is shorter than what the first wrote
        expected, actual = generate_both(
            upstream, flex, _right_padded(lengths, generator), cache_config=LARGE, max_new_tokens=6, do_sample=False
        )
        assert_same_generation(expected, actual)
        assert actual.cache.get_encoder_length() == max(lengths)


@pytest.mark.parametrize("mask", ["all ones", "absent"])
def test_unpadded_encoder_matches_dynamic_cache_in_a_larger_cross_cache(mask):
    # Upstream's StaticCache gives wrong logits here (it attends to unwritten cross slots); exact views must not.
    upstream, flex = BART.build()
    inputs = {"input_ids": torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(11))}
    if mask == "all ones":
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    expected, actual = generate_both(upstream, flex, inputs, cache_config=LARGE, max_new_tokens=5, do_sample=False)
    assert_same_generation(expected, actual)


@pytest.mark.parametrize(("num_beams", "num_return_sequences"), [(2, 1), (3, 2)])
def test_beam_search_matches_dynamic_cache_with_sequence_scores(num_beams, num_return_sequences):
    upstream, flex = BART.build()
    inputs = _right_padded([9, 4, 6], torch.Generator().manual_seed(12))
    expected, actual = generate_both(
        upstream,
        flex,
        inputs,
        cache_config=LARGE,
        max_new_tokens=6,
        num_beams=num_beams,
        num_return_sequences=num_return_sequences,
        do_sample=False,
    )
    assert_same_generation(expected, actual)  # sequences_scores within 1e-5 included


def test_seeded_sampling_matches_dynamic_cache_across_calls():
    upstream, flex = BART.build()
    generator = torch.Generator().manual_seed(13)
    for seed, lengths in [(0, [12, 5]), (1, [4, 3, 2])]:
        expected, actual = generate_both(
            upstream,
            flex,
            _right_padded(lengths, generator),
            cache_config=LARGE,
            seed=seed,
            max_new_tokens=6,
            do_sample=True,
            top_k=0,
            temperature=1.5,
        )
        assert_same_generation(expected, actual)


def test_cross_attention_reads_the_cache_only_through_get_kv(monkeypatch):
    # Upstream's BartAttention reads `.layers[i].keys/.values`; the override must not reach them at all.
    def forbidden(layer):
        raise AssertionError("cache internals `.keys`/`.values` were read")

    upstream, flex = BART.build()
    inputs = _right_padded([8, 3], torch.Generator().manual_seed(14))
    monkeypatch.setattr(FlexibleStaticLayer, "keys", property(forbidden))
    monkeypatch.setattr(FlexibleStaticLayer, "values", property(forbidden))
    expected, actual = generate_both(upstream, flex, inputs, cache_config=LARGE, max_new_tokens=4, do_sample=False)
    assert_same_generation(expected, actual)


def test_auto_model_for_seq2seq_lm_builds_the_override_after_register():
    transformers_flexcache.register()
    try:
        model = AutoModelForSeq2SeqLM.from_config(BART.build_config())
    finally:
        transformers_flexcache.unregister()
    assert type(model) is FlexBartForConditionalGeneration
