"""Jamba (Mamba layers plus attention layers) with `flexible_static`, against upstream's DynamicCache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.helpers import (
    assert_same_generation,
    assert_within_float_noise,
    exact_generation,
    generate_both,
    in_double,
)
from tests.model_cases import JAMBA
from transformers_flexcache import FlexibleStaticCache

CAPACITY = {"max_batch_size": 6, "max_cache_len": 24}
MAMBA_LAYER = 0  # layer 0 of the test config is Mamba, layer 1 attention


@pytest.fixture
def models():
    return JAMBA.build()


def test_mamba_states_stay_in_one_storage_across_calls_of_different_batches_and_equal_upstreams(models):
    upstream, flex = models
    generator = torch.Generator().manual_seed(10)
    state_pointers = set()
    for batch_size, length in [(4, 9), (1, 5), (3, 7)]:
        inputs = JAMBA.make_inputs(batch_size, length, generator)
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config=CAPACITY, max_new_tokens=4, do_sample=False
        )
        assert_same_generation(expected, actual)
        conv, ssm = actual.cache.get_conv_state(MAMBA_LAYER), actual.cache.get_recurrent_state(MAMBA_LAYER)
        assert conv.shape[0] == ssm.shape[0] == batch_size

        def exact_states(inputs=inputs):
            exact = exact_generation(upstream, inputs, max_new_tokens=4, do_sample=False).cache
            return exact.get_conv_state(MAMBA_LAYER), exact.get_recurrent_state(MAMBA_LAYER)

        want = expected.cache.get_conv_state(MAMBA_LAYER), expected.cache.get_recurrent_state(MAMBA_LAYER)
        assert_within_float_noise((conv, ssm), want, exact_states)
        state_pointers.add((conv.data_ptr(), ssm.data_ptr()))
    assert len(state_pointers) == 1, "the Mamba states were reallocated between calls"
    assert set(state_pointers.pop()) <= set(flex.flexible_cache.data_ptrs())
    assert flex.flexible_cache.num_allocations == 1


@pytest.mark.parametrize("num_beams", [2, 3])
def test_beam_search_matches_dynamic_cache_including_sequences_scores(models, num_beams):
    upstream, flex = models
    generator = torch.Generator().manual_seed(11)
    pointers = None
    # batch x num_beams rows: 2 x 3 = 6 at most, then fewer on the same storage.
    for batch_size, length in [(2, 8), (1, 4)]:
        inputs = JAMBA.make_inputs(batch_size, length, generator)
        expected, actual = generate_both(
            upstream,
            flex,
            inputs,
            cache_config=CAPACITY,
            max_new_tokens=5,
            num_beams=num_beams,
            num_return_sequences=num_beams,
            do_sample=False,
        )
        assert_same_generation(expected, actual)
        pointers = pointers or actual.cache.data_ptrs()
        assert actual.cache.data_ptrs() == pointers


def test_seeded_sampling_matches_dynamic_cache(models):
    upstream, flex = models
    generator = torch.Generator().manual_seed(12)
    for batch_size, length, seed in [(3, 6, 1), (2, 9, 2)]:
        inputs = JAMBA.make_inputs(batch_size, length, generator)
        expected, actual = generate_both(
            upstream,
            flex,
            inputs,
            cache_config=CAPACITY,
            seed=seed,
            max_new_tokens=5,
            do_sample=True,
            top_k=20,
            temperature=0.8,
            num_return_sequences=2,
        )
        assert_same_generation(expected, actual)


def test_reset_after_a_larger_batch_leaks_no_state_into_a_smaller_one(models):
    upstream, flex = models
    generator = torch.Generator().manual_seed(13)
    cache = FlexibleStaticCache(config=flex.config, max_batch_size=4, max_cache_len=16)
    with torch.no_grad():
        flex(**JAMBA.make_inputs(4, 8, generator), cache=cache, use_cache=True)
        small = JAMBA.make_inputs(2, 5, generator)
        with pytest.raises(ValueError, match=r"batch_size=2 differs from batch_size=4.*cache.reset\(\)"):
            flex(**small, cache=cache, use_cache=True)
        cache.reset()
        assert not cache.has_previous_state() and cache.get_conv_state(MAMBA_LAYER) is None

        dynamic = DynamicCache(config=upstream.config)
        want = upstream(**small, cache=dynamic, use_cache=True).logits
        got = flex(**small, cache=cache, use_cache=True).logits
        # one decode step reads the Mamba states that the prefill left
        step = {
            "input_ids": want[:, -1].argmax(-1, keepdim=True),
            "attention_mask": torch.cat([small["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1),
        }

        def exact():  # the same prefill and step in float64: the reference of the float32 runs' noise
            double, exact_cache = in_double(upstream), DynamicCache(config=upstream.config)
            prefill = double(**small, cache=exact_cache, use_cache=True).logits
            logits = double(**step, cache=exact_cache, use_cache=True).logits
            states = exact_cache.get_conv_state(MAMBA_LAYER), exact_cache.get_recurrent_state(MAMBA_LAYER)
            return prefill, logits, *states

        prefill = (got, want)
        want = upstream(**step, cache=dynamic, use_cache=True).logits
        got = flex(**step, cache=cache, use_cache=True).logits
        actual_states = cache.get_conv_state(MAMBA_LAYER), cache.get_recurrent_state(MAMBA_LAYER)
        expected_states = dynamic.get_conv_state(MAMBA_LAYER), dynamic.get_recurrent_state(MAMBA_LAYER)
        assert_within_float_noise((prefill[0], got, *actual_states), (prefill[1], want, *expected_states), exact)


def test_a_bfloat16_model_generates_as_upstream_with_its_recurrent_state_in_float32():
    upstream, flex = JAMBA.build()
    upstream, flex = upstream.to(torch.bfloat16), flex.to(torch.bfloat16)
    inputs = JAMBA.make_inputs(3, 6, torch.Generator().manual_seed(14))
    expected, actual = generate_both(upstream, flex, inputs, cache_config=CAPACITY, max_new_tokens=4, do_sample=False)
    assert_same_generation(expected, actual)
    assert actual.cache.get_recurrent_state(MAMBA_LAYER).dtype == torch.float32
    assert expected.cache.get_recurrent_state(MAMBA_LAYER).dtype == torch.float32


@pytest.mark.parametrize("shape_policy", ["exact", "padded"])
def test_the_length_at_a_mamba_layer_is_the_attention_layers_and_what_dynamic_cache_counts_at_every_step(
    models, shape_policy
):
    # transformers 5.25 answers `get_seq_length()` (layer 0, Mamba here) from the Mamba layer's own token count, 5.24
    # from the first attention layer; ours answers from the attention layer on both, and must agree with either.
    upstream, flex = models
    inputs = JAMBA.make_inputs(3, 6, torch.Generator().manual_seed(15))
    dynamic = DynamicCache(config=upstream.config)
    cache = FlexibleStaticCache(config=flex.config, max_batch_size=4, max_cache_len=16, shape_policy=shape_policy)
    step, steps, wants, gots = dict(inputs), [], [], []
    with torch.no_grad():
        for _ in range(4):
            steps.append(step)
            want = upstream(**step, cache=dynamic, use_cache=True).logits
            got = flex(**step, cache=cache, use_cache=True).logits
            wants.append(want[:, -1])
            gots.append(got[:, -1])
            length = int(dynamic.get_seq_length())
            assert length == step["attention_mask"].shape[1]
            assert int(cache.get_seq_length()) == int(cache.get_seq_length(MAMBA_LAYER)) == length
            assert int(cache.get_seq_length(1)) == int(dynamic.get_seq_length(1)) == length
            next_tokens = want[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([step["attention_mask"], torch.ones(3, 1, dtype=torch.long)], dim=1)
            step = {"input_ids": next_tokens, "attention_mask": mask}

        def exact():  # the same steps in float64, with DynamicCache: the reference of the float32 logits' noise
            double, exact_cache = in_double(upstream), DynamicCache(config=upstream.config)
            return tuple(double(**step, cache=exact_cache, use_cache=True).logits[:, -1] for step in steps)

        assert_within_float_noise(tuple(gots), tuple(wants), exact)


def test_assisted_generation_on_the_mamba_states_is_refused_as_past_recording(models):
    # transformers 5.24 refuses assisted generation for Jamba itself (a stateful model); 5.25 rolls Mamba states back
    # through past recording, which our fixed-size states refuse.
    upstream, flex = models
    _, assistant = JAMBA.build(seed=1)
    inputs = JAMBA.make_inputs(1, 5, torch.Generator().manual_seed(16))
    with pytest.raises((ValueError, NotImplementedError), match=r"past recording|stateful models"):
        flex.generate(**inputs, cache_implementation="flexible_static", assistant_model=assistant, max_new_tokens=4)
