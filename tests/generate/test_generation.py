"""generate(cache_implementation="flexible_static") against upstream's DynamicCache, over streams of calls."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GenerationConfig

from tests.helpers import assert_same_generation, generate_both
from tests.model_cases import MODEL_CASES

# (batch, prompt or encoder length, new tokens): large -> small -> large, all within the capacity below.
SHAPE_STREAM = [(4, 12, 6), (1, 5, 4), (3, 9, 6), (2, 3, 5), (4, 11, 6), (1, 12, 3)]
CAPACITY = {"max_batch_size": 4, "max_cache_len": 20, "max_encoder_len": 12}

CASE_AND_ATTN = [
    pytest.param(case, attn, id=f"{case.name}-{attn}") for case in MODEL_CASES for attn in case.attn_implementations
]
CASES = [pytest.param(case, id=case.name) for case in MODEL_CASES]
ENCODER_DECODER_CASES = [
    pytest.param(case, id=case.name) for case in MODEL_CASES if case.build_config().is_encoder_decoder
]


def _capacity_for(model):
    return {k: v for k, v in CAPACITY.items() if k != "max_encoder_len" or model.config.is_encoder_decoder}


@pytest.mark.parametrize(("case", "attn"), CASE_AND_ATTN)
def test_stream_of_calls_matches_dynamic_cache_on_one_storage(case, attn):
    upstream, flex = case.build(attn)
    generator = torch.Generator().manual_seed(1)
    pointers = []
    for batch_size, length, new_tokens in SHAPE_STREAM:
        inputs = case.make_inputs(batch_size, length, generator)
        expected, actual = generate_both(
            upstream,
            flex,
            inputs,
            cache_config=_capacity_for(flex),
            max_new_tokens=new_tokens,
            do_sample=False,
            **case.generate_kwargs,
        )
        assert_same_generation(expected, actual)
        assert actual.cache.get_seq_length() == expected.cache.get_seq_length()
        if flex.config.is_encoder_decoder:
            want = expected.cache.cross_attention_cache.get_seq_length()
            assert actual.cache.cross_attention_cache.get_seq_length() == want == length
        assert actual.cache is flex.flexible_cache  # the cache that ran the call, not a copy (Whisper's too)
        pointers.append(flex.flexible_cache.data_ptrs())
    assert all(p == pointers[0] for p in pointers), "the storage was reallocated within capacity"
    assert flex.flexible_cache.num_allocations == (2 if flex.config.is_encoder_decoder else 1)


@pytest.mark.parametrize("case", CASES)
def test_capacities_default_to_the_first_call_and_grow_once_with_a_warning(case, caplog):
    upstream, flex = case.build()
    generator = torch.Generator().manual_seed(2)
    small = case.make_inputs(2, 4, generator)
    generate_both(upstream, flex, small, max_new_tokens=3, do_sample=False, **case.generate_kwargs)
    first = flex.flexible_cache
    prompt_len = 0 if flex.config.is_encoder_decoder else small["input_ids"].shape[1]
    start_tokens = 1 if flex.config.is_encoder_decoder else 0
    # upstream sizes static caches to max_length - 1 = prompt (or decoder start) + new tokens - 1
    assert (first.max_batch_size, first.max_cache_len) == (2, prompt_len + start_tokens + 3 - 1)
    allocations = first.num_allocations

    big = case.make_inputs(3, 7, generator)
    with caplog.at_level(logging.WARNING, logger="transformers_flexcache"):
        expected, actual = generate_both(
            upstream, flex, big, max_new_tokens=5, do_sample=False, **case.generate_kwargs
        )
    assert_same_generation(expected, actual)
    assert "max_batch_size" in caplog.text and "cache_config" in caplog.text
    grown = flex.flexible_cache
    assert grown.data_ptrs() != first.data_ptrs() and grown.num_allocations > allocations
    assert grown.max_batch_size == 3
    # The second call reused the first one's storage, so the cache object the first call returned says so on use.
    with pytest.raises(ValueError, match=r"reused its storage; call cache.detach\(\)"):
        first.get_seq_length()


@pytest.mark.parametrize("case", CASES)
def test_over_capacity_with_on_overflow_error_raises_and_the_next_call_is_correct(case):
    upstream, flex = case.build()
    generator = torch.Generator().manual_seed(3)
    config = {**_capacity_for(flex), "on_overflow": "error"}
    ok = case.make_inputs(2, 6, generator)
    generate_both(upstream, flex, ok, cache_config=config, max_new_tokens=4, do_sample=False, **case.generate_kwargs)
    pointers = flex.flexible_cache.data_ptrs()

    too_big = case.make_inputs(CAPACITY["max_batch_size"] + 1, 6, generator)
    with pytest.raises(
        ValueError, match=r"batch_size=5 exceeds max_batch_size=4; pass cache_config=\{\"max_batch_size\": 5\}"
    ):
        flex.generate(
            **too_big,
            cache_implementation="flexible_static",
            cache_config=config,
            max_new_tokens=4,
            **case.generate_kwargs,
        )

    again = case.make_inputs(3, 8, generator)
    expected, actual = generate_both(
        upstream, flex, again, cache_config=config, max_new_tokens=4, do_sample=False, **case.generate_kwargs
    )
    assert_same_generation(expected, actual)
    assert flex.flexible_cache.data_ptrs() == pointers


@pytest.mark.parametrize("case", CASES)
def test_decoder_length_over_capacity_names_max_cache_len(case):
    _, flex = case.build()
    inputs = case.make_inputs(1, 4, torch.Generator().manual_seed(4))
    config = {"max_cache_len": 6, "on_overflow": "error"}
    with pytest.raises(ValueError, match=r"exceeds max_cache_len=6; pass cache_config=\{\"max_cache_len\": "):
        flex.generate(
            **inputs,
            cache_implementation="flexible_static",
            cache_config=config,
            max_new_tokens=10,
            **case.generate_kwargs,
        )


@pytest.mark.parametrize("case", ENCODER_DECODER_CASES)
def test_encoder_length_over_capacity_names_max_encoder_len(case):
    upstream, flex = case.build()
    generator = torch.Generator().manual_seed(5)
    config = {"max_encoder_len": 6, "on_overflow": "error"}
    with pytest.raises(
        ValueError, match=r"encoder_len=9 exceeds max_encoder_len=6; pass cache_config=\{\"max_encoder_len\": 9\}"
    ):
        flex.generate(
            **case.make_inputs(2, 9, generator),
            cache_implementation="flexible_static",
            cache_config=config,
            max_new_tokens=3,
            **case.generate_kwargs,
        )
    expected, actual = generate_both(
        upstream,
        flex,
        case.make_inputs(2, 6, generator),
        cache_config=config,
        max_new_tokens=3,
        do_sample=False,
        **case.generate_kwargs,
    )
    assert_same_generation(expected, actual)


@pytest.mark.parametrize("case", CASES)
def test_settings_saved_in_a_generation_config_are_used_and_the_file_loads_without_the_plugin(case, tmp_path):
    upstream, flex = case.build()
    flex.generation_config.update(max_new_tokens=4, do_sample=False, **case.generate_kwargs)
    # Set as attributes (update() would validate the name, which upstream only knows after register()).
    flex.generation_config.cache_implementation = "flexible_static"
    flex.generation_config.cache_config = {"max_batch_size": 5, "max_cache_len": 30, "max_encoder_len": 14}
    flex.save_pretrained(tmp_path)
    # Upstream's own loader reads it (it validates cache_implementation, which the saved form leaves unset).
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.cache_implementation is None
    assert loaded.flexible_static == {"max_batch_size": 5, "max_cache_len": 30, "max_encoder_len": 14}

    inputs = case.make_inputs(2, 6, torch.Generator().manual_seed(6))
    expected = upstream.generate(**inputs, max_new_tokens=4, do_sample=False, **case.generate_kwargs)
    for generate_kwargs in ({"generation_config": loaded}, {}):
        reloaded = type(flex).from_pretrained(tmp_path).eval()
        actual = reloaded.generate(**inputs, **generate_kwargs)
        assert torch.equal(expected, actual)
        assert reloaded.flexible_cache.max_batch_size == 5
        assert reloaded.flexible_cache.max_cache_len == 30


def test_a_call_naming_another_cache_overrides_a_saved_flexible_static_request():
    case = MODEL_CASES[0]
    upstream, flex = case.build()
    flex.generation_config.flexible_static = {"max_batch_size": 4}
    inputs = case.make_inputs(2, 6, torch.Generator().manual_seed(6))
    expected = upstream.generate(**inputs, max_new_tokens=3, do_sample=False, cache_implementation="static")
    actual = flex.generate(**inputs, max_new_tokens=3, do_sample=False, cache_implementation="static")
    assert torch.equal(expected, actual)
    assert flex.flexible_cache is None


def test_unknown_cache_config_key_is_refused_before_any_cache_exists():
    case = MODEL_CASES[0]
    _, flex = case.build()
    inputs = case.make_inputs(1, 4, torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match=r"\['max_len'\] are not understood.*valid keys"):
        flex.generate(**inputs, cache_implementation="flexible_static", cache_config={"max_len": 8}, max_new_tokens=2)
    assert flex.flexible_cache is None
