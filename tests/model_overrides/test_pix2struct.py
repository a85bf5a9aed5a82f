"""Pix2Struct override: what is specific to it, each output against upstream's DynamicCache on the same seeded model.

Upstream's text config defaults `use_cache=False`, so every upstream reference here is run with `use_cache=True`
(a DynamicCache). The stream of calls with varying patch counts, capacities and overflow errors are covered for
Pix2Struct by `tests/generate/test_generation.py`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, GenerationConfig

import transformers_flexcache
from model_overrides.pix2struct import FlexPix2StructForConditionalGeneration
from tests.helpers import assert_same_generation, upstream_generate
from tests.model_cases import PIX2STRUCT
from transformers_flexcache.cache import FlexibleStaticLayer

# Far larger than any call below: every call leaves unused rows and encoder positions in the storage.
LARGE = {"max_batch_size": 9, "max_cache_len": 24, "max_encoder_len": 20}
OUTPUTS = {"return_dict_in_generate": True, "output_scores": True}


def _patches(batch_size: int, num_patches: int, seed: int) -> dict:
    # -> flattened_patches: [B, num_patches, 2 + PATCH_DIM], attention_mask: [B, num_patches]; row 0 half padded
    return PIX2STRUCT.make_inputs(batch_size, num_patches, torch.Generator().manual_seed(seed))


def _reference(upstream, inputs: dict, seed: int = 0, **kwargs):
    return upstream_generate(upstream, inputs, seed=seed, use_cache=True, **OUTPUTS, **kwargs)


def _flexible(flex, inputs: dict, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return flex.generate(**inputs, cache_implementation="flexible_static", cache_config=LARGE, **OUTPUTS, **kwargs)


def test_flexible_static_turns_the_cache_on_although_the_text_config_defaults_use_cache_false():
    upstream, flex = PIX2STRUCT.build()
    assert flex.generation_config.use_cache is False  # inherited from Pix2StructTextConfig
    inputs = _patches(3, 10, seed=20)
    expected = _reference(upstream, inputs, max_new_tokens=5, do_sample=False)
    actual = _flexible(flex, inputs, max_new_tokens=5, do_sample=False)  # no use_cache passed
    assert_same_generation(expected, actual)
    assert actual.cache is not None and actual.cache is flex.flexible_cache
    # Written by this call: the decoder start plus all but the last new token, and every patch of the encoder.
    assert flex.flexible_cache.get_seq_length() == actual.sequences.shape[1] - 1
    assert flex.flexible_cache.get_encoder_length() == 10


def test_a_generation_config_naming_flexible_static_turns_the_cache_on_and_stays_unchanged():
    upstream, flex = PIX2STRUCT.build()
    # The form a GenerationConfig holds the request in without register() (register() also accepts
    # cache_implementation="flexible_static" there).
    config = GenerationConfig(flexible_static=LARGE, max_new_tokens=4, do_sample=False, **OUTPUTS)
    inputs = _patches(2, 7, seed=21)
    expected = _reference(upstream, inputs, max_new_tokens=4, do_sample=False)
    actual = flex.generate(**inputs, generation_config=config)
    assert_same_generation(expected, actual)
    assert flex.flexible_cache.get_seq_length() > 0
    assert config.use_cache is None  # the caller's config was not modified


def test_flexible_static_in_the_models_own_generation_config_turns_the_cache_on():
    upstream, flex = PIX2STRUCT.build()
    flex.generation_config.cache_implementation = "flexible_static"
    flex.generation_config.cache_config = LARGE
    inputs = _patches(2, 9, seed=29)
    expected = _reference(upstream, inputs, max_new_tokens=4, do_sample=False)
    actual = flex.generate(**inputs, max_new_tokens=4, do_sample=False, **OUTPUTS)
    assert_same_generation(expected, actual)
    assert flex.flexible_cache is not None and flex.flexible_cache.get_seq_length() > 0


def test_use_cache_false_passed_to_generate_keeps_the_cache_off():
    upstream, flex = PIX2STRUCT.build()
    inputs = _patches(2, 6, seed=22)
    expected = _reference(upstream, inputs, max_new_tokens=4, do_sample=False)
    actual = _flexible(flex, inputs, use_cache=False, max_new_tokens=4, do_sample=False)
    assert_same_generation(expected, actual)  # recomputing without a cache: same tokens, scores within float noise
    assert actual.cache is None
    assert flex.flexible_cache is None


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mask", ["half-padded row", "all ones", "absent"])
def test_fewer_patches_than_the_cross_cache_match_dynamic_cache_after_a_larger_call(mask, attn):
    # Upstream's StaticCache gives other tokens here with a full or absent mask (it attends to unwritten slots).
    upstream, flex = PIX2STRUCT.build(attn)
    for num_patches, seed in [(16, 23), (5, 24)]:
        inputs = _patches(3, num_patches, seed)
        if mask == "all ones":
            inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
            inputs["flattened_patches"][0, :, 2:].normal_(generator=torch.Generator().manual_seed(seed))
        elif mask == "absent":
            # The vision model then masks the all-zero (padding) patches itself; the decoder gets no cross mask.
            del inputs["attention_mask"]
        expected = _reference(upstream, inputs, max_new_tokens=5, do_sample=False)
        actual = _flexible(flex, inputs, max_new_tokens=5, do_sample=False)
        assert_same_generation(expected, actual)


@pytest.mark.parametrize(("num_beams", "num_return_sequences"), [(2, 1), (3, 2)])
def test_beam_search_matches_dynamic_cache_with_sequence_scores(num_beams, num_return_sequences):
    upstream, flex = PIX2STRUCT.build()
    inputs = _patches(3, 9, seed=25)
    kwargs = {"max_new_tokens": 6, "num_beams": num_beams, "num_return_sequences": num_return_sequences}
    expected = _reference(upstream, inputs, do_sample=False, **kwargs)
    actual = _flexible(flex, inputs, do_sample=False, **kwargs)
    assert_same_generation(expected, actual)  # sequences_scores within 1e-5 included


def test_seeded_sampling_matches_dynamic_cache_across_calls():
    upstream, flex = PIX2STRUCT.build()
    for seed, (batch_size, num_patches) in enumerate([(2, 13), (3, 4)]):
        inputs = _patches(batch_size, num_patches, seed=26 + seed)
        kwargs = {"max_new_tokens": 6, "do_sample": True, "top_k": 0, "temperature": 1.5}
        expected = _reference(upstream, inputs, seed=seed, **kwargs)
        actual = _flexible(flex, inputs, seed=seed, **kwargs)
        assert_same_generation(expected, actual)


def test_cross_attention_reads_the_cache_only_through_get_kv(monkeypatch):
    # Upstream's Pix2StructTextAttention reads `.layers[i].keys/.values`; the override must not reach them at all.
    def forbidden(layer):
        raise AssertionError("cache internals `.keys`/`.values` were read")

    upstream, flex = PIX2STRUCT.build()
    inputs = _patches(2, 8, seed=28)
    monkeypatch.setattr(FlexibleStaticLayer, "keys", property(forbidden))
    monkeypatch.setattr(FlexibleStaticLayer, "values", property(forbidden))
    expected = _reference(upstream, inputs, max_new_tokens=4, do_sample=False)
    actual = _flexible(flex, inputs, max_new_tokens=4, do_sample=False)
    assert_same_generation(expected, actual)


def test_auto_model_for_image_text_to_text_builds_the_override_after_register():
    transformers_flexcache.register()
    try:
        model = AutoModelForImageTextToText.from_config(PIX2STRUCT.build_config())
    finally:
        transformers_flexcache.unregister()
    assert type(model) is FlexPix2StructForConditionalGeneration
