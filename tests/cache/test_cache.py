"""FlexibleStaticCache / FlexibleEncoderDecoderCache on their own, against DynamicCache's contents."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, JambaForCausalLM, Qwen3NextConfig

from tests.model_cases import JAMBA, LLAMA, T5
from transformers_flexcache import FlexibleEncoderDecoderCache, FlexibleStaticCache

MAX_BATCH, MAX_LEN = 4, 16


def _cache(**overrides):
    kwargs = {"config": LLAMA.build_config(), "max_batch_size": MAX_BATCH, "max_cache_len": MAX_LEN, **overrides}
    return FlexibleStaticCache(**kwargs)


def _kv(batch_size, length, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, 2, length, 8, generator=generator), torch.randn(
        batch_size, 2, length, 8, generator=generator
    )


@pytest.mark.parametrize(("batch_size", "lengths"), [(1, [5, 1, 1]), (3, [7, 1]), (4, [16]), (2, [1, 1, 1, 1])])
def test_get_kv_returns_views_equal_to_what_a_dynamic_cache_holds(batch_size, lengths):
    flex, dynamic = _cache(), DynamicCache()
    for step, length in enumerate(lengths):
        for layer_idx in range(2):
            keys, values = _kv(batch_size, length, seed=10 * step + layer_idx)
            got = flex.update(keys, values, layer_idx)
            want = dynamic.update(keys, values, layer_idx)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    total = sum(lengths)
    for layer_idx in range(2):
        keys, values = flex.get_kv(layer_idx, batch_size, total)
        assert keys.shape == (batch_size, 2, total, 8)
        assert keys.data_ptr() == flex.layers[layer_idx].storages()[0].data_ptr(), (
            "get_kv must return a view, not a copy"
        )
        torch.testing.assert_close(
            (keys, values), (dynamic.layers[layer_idx].keys, dynamic.layers[layer_idx].values), rtol=0, atol=0
        )
    assert flex.get_seq_length() == dynamic.get_seq_length() == total
    assert flex.get_mask_sizes(1, 0) == dynamic.get_mask_sizes(1, 0)


def test_reset_keeps_the_storage_and_a_smaller_call_never_sees_what_a_larger_one_left():
    cache = _cache()
    pointers = cache.data_ptrs()
    big_keys, big_values = _kv(4, 10, seed=1)
    cache.update(big_keys, big_values, 0)
    cache.reset()
    small_keys, small_values = _kv(2, 3, seed=2)
    keys, values = cache.update(small_keys, small_values, 0)
    assert keys.shape == (2, 2, 3, 8)
    torch.testing.assert_close((keys, values), (small_keys, small_values), rtol=0, atol=0)
    assert cache.data_ptrs() == pointers
    assert cache.num_allocations == 1


def test_nbytes_for_matches_what_is_allocated():
    config = LLAMA.build_config()
    predicted = FlexibleStaticCache.nbytes_for(config=config, max_batch_size=3, max_cache_len=10, dtype=torch.float16)
    cache = FlexibleStaticCache(config=config, max_batch_size=3, max_cache_len=10, dtype=torch.float16)
    # 2 layers x (keys + values) x 3 rows x 2 kv heads x 10 positions x 8 head dim x 2 bytes
    assert predicted == cache.nbytes == 2 * 2 * 3 * 2 * 10 * 8 * 2


def test_encoder_decoder_nbytes_for_counts_both_caches():
    config = T5.build_config()
    predicted = FlexibleEncoderDecoderCache.nbytes_for(
        config=config, max_batch_size=2, max_cache_len=5, max_encoder_len=7
    )
    cache = FlexibleEncoderDecoderCache(config=config, max_batch_size=2, max_cache_len=5, max_encoder_len=7)
    assert predicted == cache.nbytes


def test_update_over_capacity_with_error_raises_before_writing_and_the_cache_stays_usable():
    cache = _cache(on_overflow="error")
    keys, values = _kv(2, 15, seed=3)
    cache.update(keys, values, 0)
    more_keys, more_values = _kv(2, 2, seed=4)
    with pytest.raises(
        ValueError, match=r"cache_len=17 exceeds max_cache_len=16; pass cache_config=\{\"max_cache_len\": 17\}"
    ):
        cache.update(more_keys, more_values, 0)
    assert cache.get_seq_length(0) == 15
    torch.testing.assert_close(cache.get_kv(0, 2, 15), (keys, values), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"batch_size=5 exceeds max_batch_size=4"):
        cache.early_initialization(5, 2, 8, torch.float32, "cpu")
    one_keys, one_values = _kv(2, 1, seed=5)
    got = cache.update(one_keys, one_values, 0)
    torch.testing.assert_close(
        got, (torch.cat([keys, one_keys], 2), torch.cat([values, one_values], 2)), rtol=0, atol=0
    )


def test_update_over_capacity_grows_geometrically_once_and_keeps_live_content(caplog):
    cache = _cache()
    keys, values = _kv(2, 15, seed=6)
    cache.update(keys, values, 0)
    more_keys, more_values = _kv(2, 3, seed=7)
    with caplog.at_level("WARNING", logger="transformers_flexcache"):
        got = cache.update(more_keys, more_values, 0)
    assert 'cache_config={"max_cache_len": 18}' in caplog.text
    # 18 positions are needed; the capacity at least doubles, so that growing token by token stays rare.
    assert cache.max_cache_len == 2 * 16 and cache.num_allocations == 2
    torch.testing.assert_close(
        got, (torch.cat([keys, more_keys], 2), torch.cat([values, more_values], 2)), rtol=0, atol=0
    )


def test_a_continuation_token_by_token_past_capacity_reallocates_a_logarithmic_number_of_times():
    cache = _cache()  # max_cache_len=16
    written = []
    for step in range(200):
        keys, values = _kv(2, 1, seed=100 + step)
        for layer_idx in range(len(cache.layers)):
            cache.update(keys, values, layer_idx)
        written.append(keys)
    # 16 -> 32 -> 64 -> 128 -> 256: four growths for 200 tokens, not 184.
    assert cache.num_allocations == 1 + 4
    torch.testing.assert_close(cache.get_kv(0, 2, 200)[0], torch.cat(written, 2), rtol=0, atol=0)


def test_a_different_batch_without_reset_is_refused_without_writing():
    cache = _cache()
    cache.update(*_kv(2, 3, seed=8), 0)
    with pytest.raises(ValueError, match=r"batch_size=3 differs from batch_size=2.*cache.reset\(\)"):
        cache.update(*_kv(3, 1, seed=9), 0)
    assert cache.get_seq_length(0) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, r"max_batch_size=0 must be a positive int"),
        ({"max_cache_len": 2.5}, r"max_cache_len=2.5 must be a positive int"),
        ({"on_overflow": "drop"}, r"on_overflow='drop' is not one of \('grow', 'error'\)"),
    ],
)
def test_bad_construction_arguments_are_refused_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _cache(**kwargs)


@pytest.mark.parametrize(("layer_idx", "batch_size", "length"), [(2, 1, 1), (0, 5, 1), (0, 1, 17)])
def test_get_kv_out_of_range_is_refused(layer_idx, batch_size, length):
    with pytest.raises(ValueError, match="out of range|must be between"):
        _cache().get_kv(layer_idx, batch_size, length)


def test_beam_reorder_permutes_live_rows_like_dynamic_cache():
    flex, dynamic = _cache(), DynamicCache()
    keys, values = _kv(3, 4, seed=11)
    flex.update(keys, values, 0)
    dynamic.update(keys, values, 0)
    beam_idx = torch.tensor([2, 0, 0])
    flex.reorder_cache(beam_idx)
    dynamic.reorder_cache(beam_idx)
    torch.testing.assert_close(
        flex.get_kv(0, 3, 4), (dynamic.layers[0].keys, dynamic.layers[0].values), rtol=0, atol=0
    )


# --- linear-attention (Mamba) layers, on the Jamba test config: layer 0 Mamba, layer 1 attention -----------------
# Per row: conv state [C=64, K=3], recurrent state [C=64, N=4].
CHANNELS, KERNEL, SSM_SIZE = 64, 3, 4


def _hybrid_cache(**overrides):
    kwargs = {"config": JAMBA.build_config(), "max_batch_size": MAX_BATCH, "max_cache_len": MAX_LEN, **overrides}
    return FlexibleStaticCache(**kwargs)


def _conv_inputs(batch_size, length, seed):  # -> [B, C, S]
    return torch.randn(batch_size, CHANNELS, length, generator=torch.Generator().manual_seed(seed))


def _ssm_state(batch_size, seed):  # -> [B, C, N]
    return torch.randn(batch_size, CHANNELS, SSM_SIZE, generator=torch.Generator().manual_seed(seed))


def _write_states(cache, batch_size, lengths, seed=0):
    """What a Mamba layer does: conv update per forward, then the recurrent state; returns what the cache returned."""
    returned = []
    for step, length in enumerate(lengths):
        conv = cache.update_conv_state(_conv_inputs(batch_size, length, seed + step), 0, conv_kernel_size=KERNEL)
        ssm = cache.update_recurrent_state(_ssm_state(batch_size, seed + 100 + step), 0)
        returned.append((conv.clone(), ssm.clone()))
    return returned


@pytest.mark.parametrize("lengths", [[1, 1, 1], [2, 1], [5, 1, 1], [4, 3]], ids=lambda v: "-".join(map(str, v)))
def test_linear_attention_states_match_a_dynamic_cache_through_prefill_and_decode(lengths):
    flex, dynamic = _hybrid_cache(), DynamicCache(config=JAMBA.build_config())
    assert flex.get_conv_state(0) is None and flex.get_recurrent_state(0) is None
    got, want = _write_states(flex, 3, lengths), _write_states(dynamic, 3, lengths)
    for (got_conv, got_ssm), (want_conv, want_ssm) in zip(got, want, strict=True):
        torch.testing.assert_close((got_conv, got_ssm), (want_conv, want_ssm), rtol=0, atol=0)
    torch.testing.assert_close(flex.get_conv_state(0), dynamic.get_conv_state(0), rtol=0, atol=0)
    torch.testing.assert_close(flex.get_recurrent_state(0), dynamic.get_recurrent_state(0), rtol=0, atol=0)
    assert flex.has_previous_state(0) and flex.has_previous_state()
    assert flex.is_linear == dynamic.is_linear == [True, False]


def test_linear_attention_getters_return_views_that_take_in_place_writes():
    cache = _hybrid_cache()
    pointers = cache.data_ptrs()
    _write_states(cache, 2, [4])
    conv, ssm = cache.get_conv_state(0), cache.get_recurrent_state(0)
    assert conv.shape == (2, CHANNELS, KERNEL) and ssm.shape == (2, CHANNELS, SSM_SIZE)
    # The model decodes with `conv_state.copy_(...)` and `state.copy_(...)`: those writes must reach the cache.
    conv.copy_(torch.full_like(conv, 7.0))
    ssm.copy_(torch.full_like(ssm, 9.0))
    assert torch.all(cache.get_conv_state(0) == 7.0) and torch.all(cache.get_recurrent_state(0) == 9.0)
    assert {conv.data_ptr(), ssm.data_ptr()} <= set(pointers)


def test_reset_clears_previous_state_keeps_linear_storage_and_a_smaller_call_sees_nothing_of_a_larger_one():
    flex, dynamic = _hybrid_cache(), DynamicCache(config=JAMBA.build_config())
    pointers = flex.data_ptrs()
    _write_states(flex, 4, [6, 1], seed=1)
    flex.reset()
    assert not flex.has_previous_state(0)
    assert flex.get_conv_state(0) is None and flex.get_recurrent_state(0) is None
    got, want = _write_states(flex, 2, [2, 1], seed=2), _write_states(dynamic, 2, [2, 1], seed=2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert flex.data_ptrs() == pointers and flex.num_allocations == 1


def test_beam_reorder_permutes_linear_states_like_dynamic_cache():
    flex, dynamic = _hybrid_cache(), DynamicCache(config=JAMBA.build_config())
    _write_states(flex, 3, [4])
    _write_states(dynamic, 3, [4])
    beam_idx = torch.tensor([2, 0, 0])
    flex.reorder_cache(beam_idx)
    dynamic.reorder_cache(beam_idx)
    torch.testing.assert_close(flex.get_conv_state(0), dynamic.get_conv_state(0), rtol=0, atol=0)
    torch.testing.assert_close(flex.get_recurrent_state(0), dynamic.get_recurrent_state(0), rtol=0, atol=0)


def test_linear_state_over_batch_capacity_with_error_raises_before_writing():
    cache = _hybrid_cache(on_overflow="error")
    with pytest.raises(
        ValueError, match=r"batch_size=5 exceeds max_batch_size=4; pass cache_config=\{\"max_batch_size\": 5\}"
    ):
        cache.update_conv_state(_conv_inputs(5, 3, seed=3), 0)
    assert not cache.has_previous_state(0) and cache.batch_size == 0
    with pytest.raises(ValueError, match=r"batch_size=5 exceeds max_batch_size=4"):
        cache.update_recurrent_state(_ssm_state(5, seed=4), 0)
    assert cache.num_allocations == 1


def test_growing_the_batch_capacity_keeps_the_live_linear_rows():
    cache = _hybrid_cache(max_batch_size=2)
    _write_states(cache, 2, [3])
    conv, ssm = cache.get_conv_state(0).clone(), cache.get_recurrent_state(0).clone()
    cache.grow(max_batch_size=3)
    assert cache.max_batch_size == 3 and cache.num_allocations == 2
    torch.testing.assert_close((cache.get_conv_state(0), cache.get_recurrent_state(0)), (conv, ssm), rtol=0, atol=0)


def test_a_linear_state_update_over_batch_capacity_grows_once_with_a_warning(caplog):
    cache, dynamic = _hybrid_cache(max_batch_size=2), DynamicCache(config=JAMBA.build_config())
    with caplog.at_level("WARNING", logger="transformers_flexcache"):
        got = _write_states(cache, 4, [3, 1])
    assert 'cache_config={"max_batch_size": 4}' in caplog.text
    assert cache.max_batch_size == 4 and cache.num_allocations == 2
    torch.testing.assert_close(got, _write_states(dynamic, 4, [3, 1]), rtol=0, atol=0)


def test_a_different_batch_for_linear_states_without_reset_is_refused_without_writing():
    cache = _hybrid_cache()
    _write_states(cache, 2, [3])
    before = cache.get_conv_state(0).clone()
    with pytest.raises(ValueError, match=r"batch_size=3 differs from batch_size=2.*cache.reset\(\)"):
        cache.update_conv_state(_conv_inputs(3, 1, seed=5), 0)
    torch.testing.assert_close(cache.get_conv_state(0), before, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.get_kv(0, 1, 1), r"layer 0 is a linear-attention layer, not an attention one"),
        (lambda c: c.update(*_kv(1, 1, seed=0), 0), r"layer 0 is a linear-attention layer"),
        (lambda c: c.get_conv_state(1), r"layer 1 is an attention layer, not a linear-attention one"),
        (lambda c: c.get_recurrent_state(0, state_idx=1), r"state_idx=1 is out of range"),
        (lambda c: c.update_conv_state(_conv_inputs(1, 2, 0), 0, conv_kernel_size=4), r"conv_kernel_size=4 differs"),
        (lambda c: c.update_conv_state(torch.zeros(1, 8, 2), 0), r"do not fit layer 0, allocated for \[batch, 64"),
        (lambda c: c.update_recurrent_state(torch.zeros(1, 64, 5), 0), r"do not fit layer 0, allocated for"),
    ],
    ids=["get_kv", "update", "get_conv_state", "state_idx", "kernel", "conv_shape", "recurrent_shape"],
)
def test_misuse_of_linear_attention_layers_is_refused_with_the_fix(call, message):
    cache = _hybrid_cache()
    with pytest.raises(ValueError, match=message):
        call(cache)
    assert cache.batch_size == 0


def test_a_list_of_recurrent_states_keeps_the_last_one_as_upstreams_linear_attention_layer_does():
    # transformers 5.25's mixer passes the last steps' states as a list when it records the past.
    cache = _hybrid_cache()
    cache.update_conv_state(_conv_inputs(2, 4, seed=6), 0)
    states = [_ssm_state(2, seed=7), _ssm_state(2, seed=8)]
    returned = cache.update_recurrent_state(states, 0)
    torch.testing.assert_close(returned, states[-1], rtol=0, atol=0)
    torch.testing.assert_close(cache.get_recurrent_state(0), states[-1], rtol=0, atol=0)


@pytest.mark.parametrize("shape_policy", ["exact", "padded"])
def test_the_length_of_a_mamba_layer_is_its_attention_layers_and_decode_counts_add_nothing(shape_policy):
    cache = _hybrid_cache(shape_policy=shape_policy)
    cache.update_conv_state(_conv_inputs(2, 5, seed=9), 0)
    cache.update(*_kv(2, 5, seed=9), 1)
    cache.layers[0].increase_count(0)  # what transformers 5.25 calls at a decode step; the attention update counts
    cache.update(*_kv(2, 1, seed=10), 1)
    assert int(cache.get_seq_length(0)) == int(cache.get_seq_length(1)) == int(cache.get_seq_length()) == 6


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c: c.activate_past_recording(), NotImplementedError, r"past recording .* not supported"),
        (
            lambda c: c.layers[0].activate_past_recording(recurrent_states_to_keep=2),  # transformers 5.25
            NotImplementedError,
            r"past recording .* not supported",
        ),
        (
            lambda c: c.layers[0].get_seq_length(),
            ValueError,
            r"no length axis .* cache.get_seq_length\(layer_idx\) answers a linear-attention layer",
        ),
    ],
    ids=["past_recording", "past_recording_of_states_to_keep", "layer_seq_length"],
)
def test_what_a_mamba_layer_cannot_answer_is_refused_with_the_reason(call, error, message):
    cache = _hybrid_cache()
    with pytest.raises(error, match=message):
        call(cache)


@pytest.mark.parametrize(("dtype", "conv_bytes", "recurrent_bytes"), [(torch.float32, 4, 4), (torch.bfloat16, 2, 4)])
def test_nbytes_for_counts_linear_attention_states(dtype, conv_bytes, recurrent_bytes):
    config = JAMBA.build_config()
    predicted = FlexibleStaticCache.nbytes_for(config=config, max_batch_size=3, max_cache_len=10, dtype=dtype)
    cache = FlexibleStaticCache(config=config, max_batch_size=3, max_cache_len=10, dtype=dtype)
    # attention layer: (keys + values) x 3 rows x 2 kv heads x 10 positions x 8 head dim;
    # Mamba layer: 3 rows x 64 channels x (3 conv positions, then 4 recurrent state entries, kept in float32)
    attention = 2 * 3 * 2 * 10 * 8 * conv_bytes
    mamba = 3 * CHANNELS * KERNEL * conv_bytes + 3 * CHANNELS * SSM_SIZE * recurrent_bytes
    assert predicted == cache.nbytes == attention + mamba


def test_recurrent_storage_has_the_dtype_of_upstreams_recurrent_state_for_a_bfloat16_model():
    config = JAMBA.build_config()
    torch.manual_seed(0)
    upstream = JambaForCausalLM(config).eval().to(torch.bfloat16)
    dynamic = DynamicCache(config=config)
    upstream(input_ids=torch.tensor([[5, 6, 7]]), cache=dynamic, use_cache=True)
    cache = FlexibleStaticCache(config=config, max_batch_size=1, max_cache_len=4, dtype=torch.bfloat16)
    _write_states(cache, 1, [3])
    assert cache.get_recurrent_state(0).dtype == dynamic.get_recurrent_state(0).dtype == torch.float32
    assert cache.get_conv_state(0).dtype == dynamic.get_conv_state(0).dtype == torch.bfloat16


def test_a_config_without_an_attention_layer_is_refused():
    config = JAMBA.build_config()
    config.attn_layer_period, config.attn_layer_offset = 4, 3  # layers 0 and 1 are both Mamba
    with pytest.raises(ValueError, match=r"JambaConfig has no full-attention layer"):
        FlexibleStaticCache(config=config, max_batch_size=1, max_cache_len=4)


def test_linear_attention_states_of_a_config_without_mamba_sizes_are_refused_not_guessed():
    # Qwen3-Next has linear-attention layers sized by other config names than Jamba's.
    config = Qwen3NextConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"cannot size the linear-attention states of Qwen3NextConfig.*mamba_d_conv"):
        FlexibleStaticCache(config=config, max_batch_size=1, max_cache_len=4)


# --- shape_policy="padded" ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch_size", "lengths"), [(1, [5, 1, 1]), (4, [7, 1]), (2, [16])])
def test_padded_update_returns_the_whole_capacity_and_matches_dynamic_cache_where_written(batch_size, lengths):
    flex, dynamic = _cache(shape_policy="padded"), DynamicCache()
    for step, length in enumerate(lengths):
        for layer_idx in range(2):
            keys, values = _kv(batch_size, length, seed=10 * step + layer_idx)
            got_keys, got_values = flex.update(keys, values, layer_idx)
            want_keys, want_values = dynamic.update(keys, values, layer_idx)
            assert got_keys.shape == (batch_size, 2, MAX_LEN, 8)
            written = want_keys.shape[2]
            torch.testing.assert_close(
                (got_keys[:, :, :written], got_values[:, :, :written]), (want_keys, want_values), rtol=0, atol=0
            )
            assert not got_keys[:, :, written:].any(), "positions not written yet must hold zeros"
    assert isinstance(flex.get_seq_length(), torch.Tensor) and flex.get_seq_length().item() == sum(lengths)
    assert flex.get_mask_sizes(1, 0) == (MAX_LEN, 0)


# Per case: the updates (rows, new positions) and crops (a negative count) since the last reset.
_WRITES_BEFORE_RESET = {
    "one prefill": [(4, 10)],
    "a smaller batch after a larger one": [(4, 3), (2, 1), (2, 1)],
    "a crop rolled back positions": [(3, 9), -6, (3, 1)],
    "two crops, the second after rewriting": [(2, 12), -10, (2, 5), -7],
    "the whole capacity": [(4, MAX_LEN)],
}


def _storages(cache) -> list[torch.Tensor]:
    return [tensor for layer in cache.layers for tensor in layer.storages()]


@pytest.mark.parametrize("shape_policy", ["padded", "bucketed"])
@pytest.mark.parametrize("writes", list(_WRITES_BEFORE_RESET.values()), ids=list(_WRITES_BEFORE_RESET))
def test_padded_reset_zeroes_everything_written_in_place(shape_policy, writes):
    # reset zeroes only the positions written since the last reset (below the longest live length, crops included):
    # every storage must then hold zeros only, whatever rows, lengths and crops came before.
    cache = _cache(shape_policy=shape_policy)
    pointers = cache.data_ptrs()
    for call in range(2):  # the second round starts from a reset cache
        for step, write in enumerate(writes):
            for layer_idx in range(2):
                if isinstance(write, int):
                    cache.crop(write)
                    continue
                cache.update(*_kv(*write, seed=100 * call + 10 * step + layer_idx), layer_idx)
        assert all(storage.any() for storage in _storages(cache)), "the case must have written every storage"
        cache.reset()
        assert cache.get_seq_length().item() == 0
        for storage in _storages(cache):
            assert not storage.any(), "reset left a written value in the storage"
        assert cache.data_ptrs() == pointers


@pytest.mark.parametrize(("shape_policy", "compileable"), [("exact", False), ("padded", True)])
def test_only_the_padded_policy_is_compileable(shape_policy, compileable):
    assert _cache(shape_policy=shape_policy).is_compileable is compileable
    encoder_decoder = FlexibleEncoderDecoderCache(
        config=T5.build_config(), max_batch_size=2, max_cache_len=5, max_encoder_len=7, shape_policy=shape_policy
    )
    assert encoder_decoder.is_compileable is compileable
    assert encoder_decoder.shape_policy == shape_policy
    # a hybrid model's Mamba layers too: upstream keeps SDPA's decode mask only for compileable caches
    assert _hybrid_cache(shape_policy=shape_policy).is_compileable is compileable


def test_padded_beam_reorder_permutes_rows_like_dynamic_cache_and_keeps_the_address():
    flex, dynamic = _cache(shape_policy="padded"), DynamicCache()
    keys, values = _kv(3, 4, seed=11)
    flex.update(keys, values, 0)
    dynamic.update(keys, values, 0)
    pointers = flex.data_ptrs()
    beam_idx = torch.tensor([2, 0, 0])
    flex.reorder_cache(beam_idx)
    dynamic.reorder_cache(beam_idx)
    torch.testing.assert_close(
        flex.get_kv(0, 3, 4), (dynamic.layers[0].keys, dynamic.layers[0].values), rtol=0, atol=0
    )
    assert flex.data_ptrs() == pointers


def test_padded_update_over_max_batch_size_is_refused_before_writing():
    cache = _cache(shape_policy="padded")
    with pytest.raises(ValueError, match=r"batch_size=5 exceeds max_batch_size=4.*\"max_batch_size\": 5"):
        cache.update(*_kv(5, 1, seed=12), 0)
    assert cache.get_seq_length().item() == 0


def test_padded_grow_keeps_the_written_content():
    cache = _cache(shape_policy="padded")
    keys, values = _kv(2, 3, seed=13)
    cache.update(keys, values, 0)
    cache.grow(max_batch_size=6, max_cache_len=20)
    assert (cache.max_batch_size, cache.max_cache_len, cache.num_allocations) == (6, 20, 2)
    torch.testing.assert_close(cache.get_kv(0, 2, 3), (keys, values), rtol=0, atol=0)
    assert cache.get_seq_length().item() == 3


def test_unknown_shape_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"shape_policy='fixed' is not one of \('exact', 'padded', 'bucketed'\)"):
        _cache(shape_policy="fixed")


@pytest.mark.parametrize("shape_policy", ["padded", "bucketed"])
def test_fixed_shape_storage_on_the_cpu_is_not_a_static_address_that_a_frozen_graph_would_bind(shape_policy):
    # Under freezing, dynamo makes a static-address tensor a graph attribute without an identity guard: a second cache
    # of the same shapes would run on the first one's storage. CUDA graphs need the mark; the CPU has none.
    config = LLAMA.build_config()
    cache = FlexibleStaticCache(config=config, max_batch_size=2, max_cache_len=8, shape_policy=shape_policy)
    keys = torch.zeros(2, config.num_key_value_heads, 3, config.head_dim)
    cache.update(keys, keys, 0)
    for storage in cache.layers[0].storages():
        assert not hasattr(storage, "_dynamo_static_input_type")
