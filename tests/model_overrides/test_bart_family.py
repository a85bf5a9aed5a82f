"""Marian, M2M100, mBART and Pegasus: BART's override through `FlexBartAttentionMixin`, no copy of their own.

Every output is compared with upstream's DynamicCache on the same seeded model. The stream of calls, decoding
strategies, padding, capacities, compile and registration are covered for each of them by the `MODEL_CASES` matrix;
this file checks what sharing BART's change means: one forward, cross-attention only through the cache's accessors,
and exact views of a storage far larger than the calls.
"""

from __future__ import annotations

import sys

import pytest
import torch

from model_overrides.bart import FlexBartAttentionMixin
from tests.helpers import assert_same_generation, generate_both
from tests.model_cases import M2M_100, MARIAN, MBART, PEGASUS, VOCAB
from transformers_flexcache.cache import FlexibleStaticLayer

FAMILY = [pytest.param(case, id=case.name) for case in (MARIAN, M2M_100, MBART, PEGASUS)]
# Far larger than any call below: every call leaves unused rows and encoder positions in the storage.
LARGE = {"max_batch_size": 9, "max_cache_len": 24, "max_encoder_len": 20}


def _right_padded(lengths: list[int], generator: torch.Generator) -> dict:
    # -> input_ids, attention_mask: [len(lengths), max(lengths)], right-padded with pad id 0
    input_ids = torch.randint(3, VOCAB, (len(lengths), max(lengths)), generator=generator)
    attention_mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}


@pytest.mark.parametrize("case", FAMILY)
def test_the_attention_override_is_barts_forward_with_the_models_own_eager_attention(case):
    (upstream_attention, flex_attention), *others = case.flex_class._flex_module_classes.items()
    # Besides attention, only positional embeddings change (per-row positions of the serving engine).
    assert all(upstream_class.__name__.endswith("PositionalEmbedding") for upstream_class, _ in others)
    assert flex_attention.__bases__ == (FlexBartAttentionMixin, upstream_attention)
    assert flex_attention.forward is FlexBartAttentionMixin.forward
    upstream_module = sys.modules[upstream_attention.__module__]
    assert flex_attention._flex_eager_attention_forward is upstream_module.eager_attention_forward
    # The swap reached every attention module of the decoder (self, cross) and of the encoder.
    _, flex = case.build()
    kinds = {type(module) for module in flex.modules() if isinstance(module, upstream_attention)}
    assert kinds == {flex_attention}


@pytest.mark.parametrize("case", FAMILY)
def test_cross_attention_reads_the_cache_only_through_get_kv(case, monkeypatch):
    # Upstream's copies of BartAttention read `.layers[i].keys/.values`; the override must not reach them at all.
    def forbidden(layer):
        raise AssertionError("cache internals `.keys`/`.values` were read")

    upstream, flex = case.build()
    inputs = _right_padded([8, 3], torch.Generator().manual_seed(14))
    monkeypatch.setattr(FlexibleStaticLayer, "keys", property(forbidden))
    monkeypatch.setattr(FlexibleStaticLayer, "values", property(forbidden))
    expected, actual = generate_both(upstream, flex, inputs, cache_config=LARGE, max_new_tokens=4, do_sample=False)
    assert_same_generation(expected, actual)


@pytest.mark.parametrize("case", FAMILY)
def test_right_padded_rows_match_dynamic_cache_after_a_longer_encoder_call(case):
    upstream, flex = case.build("sdpa")
    generator = torch.Generator().manual_seed(10)
    for lengths in ([16, 3, 9], [7, 2, 5, 1]):  # the second call's encoder is shorter than what the first wrote
        expected, actual = generate_both(
            upstream, flex, _right_padded(lengths, generator), cache_config=LARGE, max_new_tokens=6, do_sample=False
        )
        assert_same_generation(expected, actual)
        assert actual.cache.get_encoder_length() == max(lengths)
    assert flex.flexible_cache.num_allocations == 2  # one self-attention and one cross-attention storage


@pytest.mark.parametrize("case", FAMILY)
def test_an_encoder_without_mask_matches_dynamic_cache_in_a_larger_cross_cache(case):
    # Upstream's StaticCache attends to unwritten cross slots here; exact views must not.
    upstream, flex = case.build()
    inputs = {"input_ids": torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(11))}
    expected, actual = generate_both(upstream, flex, inputs, cache_config=LARGE, max_new_tokens=5, do_sample=False)
    assert_same_generation(expected, actual)
