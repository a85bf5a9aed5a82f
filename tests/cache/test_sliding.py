"""Sliding-window layers against upstream's: DynamicSlidingWindowLayer (exact) and StaticSlidingWindowLayer (padded).

Each test writes the same keys and values into our cache and upstream's, step by step (a prefill longer than the
window, then decoding past it), and compares what `update` returns and what `get_mask_sizes` says before each step:
the masks upstream builds from those sizes then cover exactly the returned keys. Whole generate streams of
sliding-window models (Mistral, Qwen2 and Gemma3 with windows of 4) run in the `MODEL_CASES` matrix; Gemma2 runs here,
through the generic route's `convert`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, Qwen2Config, StaticCache

from tests.helpers import assert_same_generation, generate_both
from tests.model_cases import MISTRAL, QWEN2
from transformers_flexcache import convert, zoo
from transformers_flexcache.cache import (
    FlexiblePaddedSlidingWindowLayer,
    FlexibleSlidingWindowLayer,
    FlexibleStaticCache,
    FlexibleStaticLayer,
)

WINDOW = zoo.TINY_SLIDING_WINDOW
# New tokens per update: a prefill longer than the window, then single decoding steps past it.
STEPS = [7, 1, 1, 1, 1, 1, 1]


def _states(config, batch_size: int, num_new: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # -> 2 x [B, H, S, D]
    shape = (batch_size, config.num_key_value_heads, num_new, config.hidden_size // config.num_attention_heads)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _run_both(config, ours, theirs, *, batch_size: int, steps: list[int], layer_idx: int, seed: int = 0):
    """Write the same states into both caches; assert equal mask sizes before and equal returns after each step."""
    generator = torch.Generator().manual_seed(seed)
    for num_new in steps:
        assert ours.get_mask_sizes(num_new, layer_idx) == theirs.get_mask_sizes(num_new, layer_idx)
        keys, values = _states(config, batch_size, num_new, generator)
        got = ours.update(keys, values, layer_idx)
        want = theirs.update(keys, values, layer_idx)
        for got_tensor, want_tensor in zip(got, want, strict=True):
            assert torch.equal(got_tensor, want_tensor[:batch_size])
        assert int(ours.get_seq_length(layer_idx)) == int(theirs.get_seq_length(layer_idx))


def test_exact_sliding_layer_returns_what_dynamic_sliding_window_layer_returns_past_the_window():
    config = MISTRAL.build_config()
    ours = FlexibleStaticCache(config=config, max_batch_size=3, max_cache_len=20)
    assert all(isinstance(layer, FlexibleSlidingWindowLayer) for layer in ours.layers)
    _run_both(config, ours, DynamicCache(config=config), batch_size=2, steps=STEPS, layer_idx=0)


def test_padded_sliding_layer_returns_what_static_sliding_window_layer_returns_past_the_window():
    config = MISTRAL.build_config()
    ours = FlexibleStaticCache(config=config, max_batch_size=3, max_cache_len=20, shape_policy="padded")
    assert all(isinstance(layer, FlexiblePaddedSlidingWindowLayer) for layer in ours.layers)
    # Upstream's static cache allocates at the batch of its first call: ours serves 3 of its 3 rows here.
    _run_both(config, ours, StaticCache(config=config, max_cache_len=20), batch_size=3, steps=STEPS, layer_idx=0)


@pytest.mark.parametrize("shape_policy", ["exact", "padded"])
def test_a_continuation_of_several_tokens_past_the_window_matches_upstream(shape_policy):
    config = MISTRAL.build_config()
    ours = FlexibleStaticCache(config=config, max_batch_size=2, max_cache_len=30, shape_policy=shape_policy)
    theirs = DynamicCache(config=config) if shape_policy == "exact" else StaticCache(config=config, max_cache_len=30)
    # 2 tokens, then 3 (the row becomes full), 1, then 5 at once on a full row (a continuation).
    _run_both(config, ours, theirs, batch_size=2, steps=[2, 3, 1, 5, 1], layer_idx=1)


@pytest.mark.parametrize("shape_policy", ["padded", "bucketed"])
@pytest.mark.parametrize(
    "writes",
    [[7, 1, 1], [2, 1], [3, -2, 1], [2, 1, -1, 1, 1, 1, 1]],
    ids=["a prefill past the window", "within the window", "a crop", "full after a crop"],
)
def test_reset_of_a_fixed_shape_sliding_layer_zeroes_everything_written(shape_policy, writes):
    # reset zeroes only the slots written since the last reset: they must then all hold zeros, whether the row
    # filled the window (and shifted), stayed within it, or was cropped. `writes`: new tokens, or a crop (negative).
    config = MISTRAL.build_config()
    cache = FlexibleStaticCache(config=config, max_batch_size=3, max_cache_len=20, shape_policy=shape_policy)
    assert all(isinstance(layer, FlexiblePaddedSlidingWindowLayer) for layer in cache.layers)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):  # the second round starts from a reset cache
        for write in writes:
            for layer_idx in range(len(cache.layers)):
                if write < 0:
                    cache.crop(write)
                else:
                    cache.update(*_states(config, 2, write, generator), layer_idx)
        storages = [tensor for layer in cache.layers for tensor in layer.storages()]
        assert all(storage.any() for storage in storages)
        cache.reset()
        assert not any(storage.any() for storage in storages), "reset left a written value in the storage"


def test_hybrid_cache_holds_full_layers_at_max_cache_len_and_sliding_ones_at_the_window():
    config = QWEN2.build_config()  # layer 0 full attention, layer 1 a sliding window of 4
    cache = FlexibleStaticCache(config=config, max_batch_size=3, max_cache_len=20)
    full, sliding = cache.layers
    assert type(full) is FlexibleStaticLayer and isinstance(sliding, FlexibleSlidingWindowLayer)
    assert full.keys.shape == sliding.keys.shape == (0, 2, 0, 8)
    assert [tuple(layer._key_storage.shape) for layer in cache.layers] == [(3, 2, 20, 8), (3, 2, WINDOW, 8)]
    assert cache.is_sliding == [False, True]
    assert cache.nbytes == FlexibleStaticCache.nbytes_for(config=config, max_batch_size=3, max_cache_len=20)
    assert cache.nbytes == 3 * 2 * (20 + WINDOW) * 8 * 2 * 4  # rows x heads x positions x head dim x (k, v) x fp32


def test_a_window_longer_than_max_cache_len_allocates_only_max_cache_len():
    config = MISTRAL.build_config()
    cache = FlexibleStaticCache(config=config, max_batch_size=2, max_cache_len=3)
    assert [layer.window_len for layer in cache.layers] == [3, 3]
    assert cache.max_cache_len == 3 and cache.layers[0].is_croppable


def test_growing_max_cache_len_past_the_window_reallocates_no_sliding_layer():
    config = MISTRAL.build_config()  # every layer a sliding window
    cache = FlexibleStaticCache(config=config, max_batch_size=2, max_cache_len=WINDOW)
    pointers = cache.data_ptrs()
    cache.grow(max_cache_len=50)
    assert cache.max_cache_len == 50
    assert cache.data_ptrs() == pointers and cache.num_allocations == 1
    cache.grow(max_batch_size=3)
    assert cache.data_ptrs() != pointers and cache.num_allocations == 2


def test_crop_rolls_back_before_the_window_drops_positions_and_refuses_after():
    config = MISTRAL.build_config()
    cache = FlexibleStaticCache(config=config, max_batch_size=1, max_cache_len=20)
    generator = torch.Generator().manual_seed(0)
    cache.update(*_states(config, 1, 3, generator), 0)
    cache.crop(-1)
    assert cache.get_seq_length(0) == 2 and cache.layers[0].keys.shape[2] == 2
    cache.update(*_states(config, 1, 4, generator), 0)  # 6 positions: 2 have left the window
    with pytest.raises(ValueError, match=r"cannot roll back a sliding-window layer .* sliding_window=4"):
        cache.crop(-1)
    assert cache.get_seq_length(0) == 6


def test_get_kv_of_a_sliding_layer_refuses_more_positions_than_it_holds():
    config = MISTRAL.build_config()
    cache = FlexibleStaticCache(config=config, max_batch_size=2, max_cache_len=20)
    with pytest.raises(ValueError, match=r"length=5 exceeds the 4 positions .*\(sliding_window=4"):
        cache.get_kv(0, batch_size=1, length=5)


def _gemma2_config() -> Gemma2Config:
    # Gemma2 alternates sliding-window and full layers (sliding first); eager attention only in transformers 5.24.
    config = zoo._decoder_only_tiny(Gemma2Config, head_dim=8, sliding_window=WINDOW)
    config._attn_implementation = "eager"
    return config


@pytest.mark.parametrize("shape_policy", ["exact", "padded", "bucketed"])
def test_gemma2_converted_through_the_generic_route_matches_dynamic_cache_past_the_window(shape_policy):
    config = _gemma2_config()
    torch.manual_seed(0)
    upstream = Gemma2ForCausalLM(config).eval()
    flex = Gemma2ForCausalLM(config).eval()
    flex.load_state_dict(upstream.state_dict())
    convert(flex)
    cache_config = {"max_batch_size": 3, "max_cache_len": 24, "max_prompt_len": 10, "shape_policy": shape_policy}
    generator = torch.Generator().manual_seed(1)
    for batch_size, prompt_len in [(3, 10), (1, 6), (2, 9)]:  # prompts longer than the window of 4
        inputs = QWEN2.make_inputs(batch_size, prompt_len, generator)
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config=cache_config, max_new_tokens=8, do_sample=False
        )
        assert_same_generation(expected, actual)
    assert flex.flexible_cache.num_allocations == 1


def test_a_window_longer_than_the_cache_keeps_one_prefill_graph_when_sdpa_could_drop_the_mask():
    # With max_cache_len < sliding_window a sliding mask spans no more than the cache, and for an unpadded prompt SDPA
    # would drop it (is_causal); the padded policy builds it anyway, so prefills without and with padding share a graph.
    case = dataclasses.replace(
        QWEN2,
        build_config=lambda: zoo._decoder_only_tiny(
            Qwen2Config, use_sliding_window=True, sliding_window=64, max_window_layers=1
        ),
    )
    upstream, flex = case.build("sdpa")
    counter = CompileCounter()
    flex.forward = torch.compile(flex.forward, backend=counter, fullgraph=True)
    cache_config = {"max_batch_size": 2, "max_cache_len": 16, "max_prompt_len": 8, "shape_policy": "padded"}
    generator = torch.Generator().manual_seed(2)
    for batch_size, prompt_len in [(1, 8), (1, 5), (2, 8)]:  # the first prompt fills max_prompt_len: no padding
        inputs = case.make_inputs(batch_size, prompt_len, generator)
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config=cache_config, max_new_tokens=3, do_sample=False
        )
        assert_same_generation(expected, actual)
    assert counter.frame_count == 2  # the prefill and the decode step


def test_bucketed_sliding_layer_attends_over_the_call_bucket_while_no_position_can_leave():
    # A window of 64 over a cache of 24 positions: the layer is a full-attention one of 24 slots, and a call attends
    # over its decoder length bucket (prompt bucket + new tokens), as the full-attention layer does, with
    # DynamicCache's tokens.
    case = dataclasses.replace(
        QWEN2,
        build_config=lambda: zoo._decoder_only_tiny(
            Qwen2Config, use_sliding_window=True, sliding_window=64, max_window_layers=1
        ),
    )
    upstream, flex = case.build("sdpa")
    cache_config = {
        "max_batch_size": 2,
        "max_cache_len": 24,
        "max_prompt_len": 8,
        "shape_policy": "bucketed",
        "buckets": {"max_cache_len": [8, 16], "max_prompt_len": [4]},
    }
    generator = torch.Generator().manual_seed(3)
    spans = []
    for batch_size, prompt_len, new_tokens in [(2, 8, 8), (1, 3, 3), (2, 5, 10)]:
        inputs = case.make_inputs(batch_size, prompt_len, generator)
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config=cache_config, max_new_tokens=new_tokens, do_sample=False
        )
        assert_same_generation(expected, actual)
        layers = flex.flexible_cache.layers
        assert [getattr(layer, "is_sliding", False) for layer in layers] == [False, True]
        spans.append({layer.get_mask_sizes(1)[0] for layer in layers})
    assert spans == [{16}, {8}, {24}]
