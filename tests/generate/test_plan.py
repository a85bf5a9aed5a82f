"""One generate call, one object (`generate/plan.py`): the call plan, its one capacity question, and what it carries.

- Every flexible call asks its model's pool one capacity question, whatever the model, shape policy and decoding
  strategy; a fixed-shape call asks it before anything is padded (so a refusal pads nothing).
- `CallPlan.resolve(model, kwargs)` states the need of a request without running it: the need `generate` then states.
- The plans of running calls are one context variable: none is left after a call, and each thread has its own.
- A lease's `before_reuse` hook runs before the same thread's next lease reuses its storage.
- The encoder-decoder cache is two halves sharing one lifecycle; the cross half holds `max_encoder_len`.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from transformers import GenerationConfig, GenerationMixin

from tests.helpers import (
    assert_same_padded_generation,
    assert_within_float_noise,
    exact_generation,
    generate_both,
    own_copy,
)
from tests.model_cases import BART, LLAMA, MODEL_CASES, T5, WHISPER
from transformers_flexcache.cache import (
    CacheConfig,
    CacheKind,
    FlexibleCrossAttentionCache,
    FlexibleEncoderDecoderCache,
    FlexibleStaticCache,
    Need,
    decide,
    layer_specs_for_model,
)
from transformers_flexcache.cache.lifecycle import FlexibleStorage
from transformers_flexcache.cache.linear_attention import LinearAttentionStates
from transformers_flexcache.generate import plan
from transformers_flexcache.generate import policies as padding
from transformers_flexcache.generate.plan import CallPlan
from transformers_flexcache.generate.pool import CachePool

CASES = [pytest.param(case, id=case.name) for case in MODEL_CASES]
STRATEGIES = {  # the first call of a test runs greedy, the second beam search
    "greedy": {"do_sample": False},
    "beams, 2 sequences": {"do_sample": False, "num_beams": 2, "num_return_sequences": 2},
}


def _config(model, shape_policy: str) -> dict:
    config = {"shape_policy": shape_policy, "max_batch_size": 8, "max_cache_len": 24}
    config.update({"max_encoder_len": 12} if model.config.is_encoder_decoder else {"max_prompt_len": 8})
    return config


class _Questions:
    """Counts `CachePool.decide` (the capacity question) and records the needs that plans ask it with."""

    def __init__(self, monkeypatch):
        self.count, self.needs = 0, []
        decide, ask = CachePool.decide, CallPlan.ask

        def counting_decide(pool, *args, **kwargs):
            self.count += 1
            return decide(pool, *args, **kwargs)

        def recording_ask(call_plan, need, **kwargs):
            self.needs.append(need)
            return ask(call_plan, need, **kwargs)

        monkeypatch.setattr(CachePool, "decide", counting_decide)
        monkeypatch.setattr(CallPlan, "ask", recording_ask)


@pytest.mark.parametrize("shape_policy", ["exact", "padded", "bucketed"])
@pytest.mark.parametrize("case", CASES)
def test_every_flexible_call_asks_its_pool_one_capacity_question(case, shape_policy, monkeypatch):
    upstream, flex = case.build()
    questions = _Questions(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    # Whisper: log-mel features (its generate cannot repeat `encoder_outputs` for several returned sequences)
    for (batch_size, length), strategy in zip([(2, 5), (1, 7)], STRATEGIES, strict=True):
        inputs = case.make_inputs(batch_size, case.decoding_input_len or length, generator)
        kwargs = {"max_new_tokens": 3, **STRATEGIES[strategy], **case.generate_kwargs}
        before = questions.count
        expected, actual = generate_both(upstream, flex, inputs, cache_config=_config(flex, shape_policy), **kwargs)
        assert questions.count - before == 1, f"{strategy}: {questions.count - before} questions for one call"
        assert torch.equal(expected.sequences, actual.sequences)


def test_a_padded_call_over_max_cache_len_is_refused_before_anything_is_padded(monkeypatch):
    # The door asks the one question with every need of the call, decoder positions included: before 21, a padded call
    # over max_cache_len was refused only when its cache was leased, after its inputs had been padded.
    _, flex = T5.build()
    padded = []
    pad_rows = padding.pad_rows
    monkeypatch.setattr(padding, "pad_rows", lambda *args: (padded.append(args), pad_rows(*args))[1])
    config = {"shape_policy": "padded", "max_batch_size": 4, "max_cache_len": 8, "on_overflow": "error"}
    with pytest.raises(ValueError, match=r"cache_len=12 exceeds max_cache_len=8; pass cache_config="):
        flex.generate(
            **T5.make_inputs(2, 5, torch.Generator().manual_seed(1)),
            cache_implementation="flexible_static",
            cache_config=config,
            max_new_tokens=12,
        )
    assert padded == [] and flex.flexible_cache is None


# --- the generation config, resolved once ---------------------------------------------------------------------------
class _Resolutions:
    """Counts upstream's `GenerationMixin._prepare_generation_config` (what a resolution of the config runs)."""

    def __init__(self, monkeypatch):
        self.count = 0
        upstream = GenerationMixin._prepare_generation_config

        def counting(model, *args, **kwargs):
            self.count += 1
            return upstream(model, *args, **kwargs)

        monkeypatch.setattr(GenerationMixin, "_prepare_generation_config", counting)


@pytest.mark.parametrize("shape_policy", ["padded", "bucketed"])
@pytest.mark.parametrize("case", CASES)
def test_a_fixed_shape_call_resolves_its_generation_config_once(case, shape_policy, monkeypatch):
    # The door resolves the config before it pads; upstream's generate takes that one instead of resolving it again.
    upstream, flex = case.build()
    generator = torch.Generator().manual_seed(3)
    for (batch_size, length), strategy in zip([(2, 5), (1, 7)], STRATEGIES, strict=True):
        inputs = case.make_inputs(batch_size, case.decoding_input_len or length, generator)
        kwargs = {"max_new_tokens": 3, **STRATEGIES[strategy], **case.generate_kwargs}
        resolutions = _Resolutions(monkeypatch)
        flex.generate(
            **own_copy(inputs),
            cache_implementation="flexible_static",
            cache_config=_config(flex, shape_policy),
            **kwargs,
        )
        if case is not WHISPER:  # Whisper's own generate resolves the config before it calls upstream's (twice)
            assert resolutions.count == 1, f"{strategy}: resolved {resolutions.count} times"
        monkeypatch.undo()
        expected, actual = generate_both(upstream, flex, inputs, cache_config=_config(flex, shape_policy), **kwargs)
        assert_same_padded_generation(upstream, flex, inputs, expected, actual, **kwargs)


def test_a_call_with_a_generation_config_and_options_runs_as_upstream_resolves_it(monkeypatch):
    # The options that upstream's generate reads after resolving (output_attentions, in the model kwargs too; the
    # lengths from the given config, the sampling from the call) reach it as its own resolution gives them.
    upstream, flex = BART.build()
    inputs = BART.make_inputs(3, 6, torch.Generator().manual_seed(4))
    given = GenerationConfig(max_new_tokens=4, do_sample=False, num_beams=1)
    options = {"output_attentions": True, "return_dict_in_generate": True, "output_scores": True}
    expected = upstream.generate(**own_copy(inputs), generation_config=given, **options)
    resolutions = _Resolutions(monkeypatch)
    actual = flex.generate(
        **own_copy(inputs),
        generation_config=given,
        cache_implementation="flexible_static",
        cache_config={"shape_policy": "bucketed", "max_batch_size": 4, "max_cache_len": 8, "max_encoder_len": 8},
        **options,
    )
    assert resolutions.count == 1
    assert_same_padded_generation(upstream, flex, inputs, expected, actual, generation_config=given, **options)
    assert len(actual.decoder_attentions) == len(expected.decoder_attentions) == 4
    exact = exact_generation(upstream, inputs, generation_config=given, **options)
    for want, got, reference in zip(
        expected.cross_attentions[0], actual.cross_attentions[0], exact.cross_attentions[0], strict=True
    ):
        assert_within_float_noise(got[:3, :, :, :6], want, reference)
    assert given.max_new_tokens == 4 and given.cache_implementation is None  # the caller's config unchanged


def test_the_held_resolution_is_taken_once_and_only_for_the_same_arguments():
    plan = CallPlan(model=None, request=None, config=None, policy=None)
    given, resolved = GenerationConfig(), GenerationConfig(max_new_tokens=3, output_hidden_states=True)
    mask, length = torch.ones(2, 3), 3
    asked = {"max_new_tokens": length, "attention_mask": mask}

    def take(given_now, kwargs):
        plan.hold_resolved(given, asked, resolved)
        return plan.take_resolved(given_now, kwargs)

    padded_mask = torch.zeros(2, 4)
    taken, model_kwargs = take(
        given, {"max_new_tokens": length, "attention_mask": padded_mask, "encoder_outputs": mask}
    )
    assert taken is resolved and list(model_kwargs) == ["attention_mask", "encoder_outputs", "output_hidden_states"]
    assert model_kwargs["attention_mask"] is padded_mask and model_kwargs["encoder_outputs"] is mask
    assert model_kwargs["output_hidden_states"] is True
    assert plan.take_resolved(given, asked) is None  # once
    assert take(GenerationConfig(), asked) is None  # another config object
    assert take(given, {"attention_mask": mask}) is None  # an option missing
    assert take(given, {**asked, "max_new_tokens": 4}) is None  # an option of another value
    assert take(given, {**asked, "num_beams": 2}) is None  # another option


# --- CallPlan.resolve, for the serving engine -----------------------------------------------------------------------
RESOLVE_KWARGS = {
    "greedy": {"max_new_tokens": 4},
    "beams": {"max_new_tokens": 3, "num_beams": 3},
    "sampling, 2 sequences": {"max_new_tokens": 2, "do_sample": True, "num_return_sequences": 2},
    "max_length": {"max_length": 9},
    "default length": {},
}


@pytest.mark.parametrize("request_kwargs", list(RESOLVE_KWARGS))
@pytest.mark.parametrize("case", CASES)
def test_resolve_states_the_need_that_generate_then_states(case, request_kwargs, monkeypatch):
    _, flex = case.build()
    inputs = case.make_inputs(2, case.decoding_input_len or 6, torch.Generator().manual_seed(2))
    kwargs = {
        **inputs,
        **RESOLVE_KWARGS[request_kwargs],
        **case.generate_kwargs,
        "cache_implementation": "flexible_static",
        "cache_config": {"on_overflow": "grow"},
    }
    resolved = CallPlan.resolve(flex, kwargs)
    assert resolved.config == CacheConfig() and resolved.cache is None and resolved.reservation is None
    questions = _Questions(monkeypatch)
    flex.generate(**kwargs)
    (stated,) = questions.needs  # the exact policy asks when upstream prepares the cache, with upstream's numbers
    if case is WHISPER:
        # Whisper's generate starts each row with its initial tokens and adds them to `max_length`: resolve counts
        # the start token alone (documented), here the only one, so only `max_length` runs further.
        assert resolved.need.decoder_positions <= stated.decoder_positions
        resolved.need = dataclasses.replace(resolved.need, decoder_positions=stated.decoder_positions)
    assert resolved.need == stated


def test_resolve_counts_whispers_rows_as_its_generate_repeats_them():
    _, flex = WHISPER.build()
    inputs = WHISPER.make_inputs(2, WHISPER.decoding_input_len, torch.Generator().manual_seed(3))
    kwargs = {**inputs, "num_beams": 2, "num_return_sequences": 2, "cache_implementation": "flexible_static"}
    assert CallPlan.resolve(flex, kwargs).need.rows == 2 * 2 * 2


def test_resolve_of_a_request_without_the_flexible_cache_has_no_cache_config():
    _, flex = LLAMA.build()
    resolved = CallPlan.resolve(flex, {**LLAMA.make_inputs(1, 4, torch.Generator()), "max_new_tokens": 2})
    assert resolved.config is None and not resolved.flexible and resolved.need.decoder_positions == 5


# --- the running calls ------------------------------------------------------------------------------------------------
def test_no_plan_is_left_running_after_a_call_even_one_that_raised():
    _, flex = LLAMA.build()
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(4))
    flex.generate(**inputs, cache_implementation="flexible_static", max_new_tokens=2)
    assert plan.running_plans() == ()
    with pytest.raises(ValueError, match="exceeds max_batch_size=1"):
        flex.generate(
            **inputs,
            cache_implementation="flexible_static",
            cache_config={"max_batch_size": 1, "on_overflow": "error"},
            max_new_tokens=2,
        )
    assert plan.running_plans() == ()


def test_a_thread_sees_only_the_plans_of_its_own_calls():
    _, flex = LLAMA.build()
    seen_inside, seen_by_other = [], []
    other_looked = threading.Event()

    def look_from_another_thread():
        seen_by_other.append(plan.running_plans())
        other_looked.set()

    class Looking:  # a logits processor that looks at the running plans at its first step
        def __call__(self, input_ids, scores):
            if not seen_inside:
                seen_inside.append(plan.running_plans())
                thread = threading.Thread(target=look_from_another_thread)
                thread.start()
                thread.join(30)
            return scores

    from transformers import LogitsProcessorList

    flex.generate(
        **LLAMA.make_inputs(1, 4, torch.Generator()),
        cache_implementation="flexible_static",
        max_new_tokens=2,
        logits_processor=LogitsProcessorList([Looking()]),
    )
    assert other_looked.is_set()
    ((inside,),) = seen_inside
    assert inside.model is flex and inside.cache is not None and inside.request.flexible
    assert seen_by_other == [()]


# --- leases ---------------------------------------------------------------------------------------------------------
def _pool_and_reservation():
    _, flex = LLAMA.build()
    pool, kind = CachePool(owner_name="test"), CacheKind.for_model(flex, shape_policy="exact")
    reservation = pool.decide(Need(rows=2, decoder_positions=8), CacheConfig(), kind=kind)
    return pool, kind, reservation


def test_a_parked_leases_hook_runs_before_the_same_threads_next_lease_reuses_its_storage():
    pool, kind, reservation = _pool_and_reservation()
    first = pool.lease(kind=kind, reservation=reservation, need=reservation.need)
    seen = []
    first.before_reuse(lambda: seen.append(first.cache.is_stale))
    first.park()  # its call ended inside an enclosing one, which still reads the storage
    second = pool.lease(kind=kind, reservation=reservation, need=reservation.need)
    assert seen == [False] and first.cache.is_stale  # run while the kept object was still live
    assert second.cache.data_ptrs() == pool.caches()[0].data_ptrs()


def test_the_hooks_of_a_lease_given_back_are_dropped():
    pool, kind, reservation = _pool_and_reservation()
    first = pool.lease(kind=kind, reservation=reservation, need=reservation.need)
    seen = []
    first.before_reuse(lambda: seen.append("ran"))
    first.give_back()
    pool.lease(kind=kind, reservation=reservation, need=reservation.need)
    assert seen == []


# --- the caches ---------------------------------------------------------------------------------------------------
def test_the_encoder_decoder_cache_shares_one_lifecycle_with_the_caches_of_layers():
    for name in ("reserve", "renewed", "mark_stale", "free", "detach", "nbytes_per_device", "data_ptrs", "capacities"):
        assert getattr(FlexibleEncoderDecoderCache, name) is getattr(FlexibleStorage, name), name
        assert getattr(FlexibleStaticCache, name) is getattr(FlexibleStorage, name), name
    for name in ("get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state"):
        assert getattr(FlexibleStaticCache, name) is getattr(LinearAttentionStates, name), name


def test_the_cross_attention_cache_holds_and_names_max_encoder_len():
    _, flex = T5.build()
    _, cross_specs = layer_specs_for_model(flex)
    cross = FlexibleCrossAttentionCache(
        layer_specs=cross_specs, max_batch_size=2, max_encoder_len=5, on_overflow="error"
    )
    assert cross.capacities() == {"max_batch_size": 2, "max_encoder_len": 5} and cross.max_encoder_len == 5
    with pytest.raises(ValueError, match=r"length=6 must be between 0 and max_encoder_len=5"):
        cross.get_kv(0, 1, 6)
    keys = torch.zeros(1, cross_specs[0].num_heads, 6, cross_specs[0].k_head_dim)
    with pytest.raises(
        ValueError, match=r"encoder_len=6 exceeds max_encoder_len=5; pass cache_config=\{\"max_encoder_len\": 6"
    ):
        cross.update(keys, keys, 0)
    with pytest.raises(TypeError):
        FlexibleCrossAttentionCache(layer_specs=cross_specs, max_batch_size=2, max_cache_len=5)  # not a decoder length


def test_an_encoder_decoder_cache_reserved_by_hand_grows_both_halves_to_what_they_hold():
    cache = FlexibleEncoderDecoderCache(config=T5.build_config(), max_batch_size=2, max_cache_len=4, max_encoder_len=3)
    assert cache.capacities() == {"max_batch_size": 2, "max_cache_len": 4, "max_prompt_len": 0, "max_encoder_len": 3}
    need = Need(rows=3, decoder_positions=6, encoder_positions=5)
    cache.reserve(
        decide(cache.capacities(), need, CacheConfig(), geometric=True)
    )  # a continuation: the length doubles
    assert cache.capacities() == {"max_batch_size": 3, "max_cache_len": 8, "max_prompt_len": 0, "max_encoder_len": 5}
    assert cache.self_attention_cache.num_allocations == cache.cross_attention_cache.num_allocations == 2
