"""Each layer's storage where the model runs that layer, with the heads and dtype of its projections (`placement.py`).

- accelerate `device_map` with layers offloaded to disk (the model's own device is then `meta`): flexible generate
  equals DynamicCache's, and every layer's storage is on the layer's execution device.
- Several devices without several devices: accelerate hooks that name other execution devices (as a multi-GPU
  `device_map` sets them) give each layer's spec that device, and the per-device sizes follow, before anything is
  allocated.
- Heads from the key projection (a tensor-parallel shard holds fewer), dtype from its weight.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.hooks import AlignDevicesHook, SequentialHook
from torch import nn

import transformers_flexcache
from tests.helpers import assert_same_generation, generate_both
from tests.model_cases import JAMBA, LLAMA, T5
from transformers_flexcache import FlexibleEncoderDecoderCache, FlexibleStaticCache
from transformers_flexcache.cache.placement import attention_modules, layer_specs_for_model

CPU = torch.device("cpu")
CAPACITY = {"max_batch_size": 3, "max_cache_len": 16}

# Tied weights (T5's shared/encoder/decoder embeddings) cannot go to disk: upstream's from_pretrained then compares
# meta tensors and raises NotImplementedError (transformers==5.24.0, its own T5ForConditionalGeneration too).
OFFLOADED = {
    "llama": {
        "model.embed_tokens": "disk",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    },
    "t5": {
        "shared": "cpu",
        "encoder.embed_tokens": "cpu",
        "decoder.embed_tokens": "cpu",
        "encoder.block.0": "disk",
        "encoder.block.1": "cpu",
        "encoder.final_layer_norm": "cpu",
        "encoder.dropout": "cpu",
        "decoder.block.0": "disk",
        "decoder.block.1": "cpu",
        "decoder.final_layer_norm": "cpu",
        "decoder.dropout": "cpu",
        "lm_head": "cpu",
    },
}


def _offloaded(case, tmp_path):
    upstream, flex = case.build()
    flex.save_pretrained(tmp_path / "model")
    loaded = type(flex).from_pretrained(
        tmp_path / "model", device_map=OFFLOADED[case.name], offload_folder=str(tmp_path / "offload")
    )
    return upstream, loaded.eval()


def _storage_devices(cache) -> set[torch.device]:
    caches = (
        [cache.self_attention_cache, cache.cross_attention_cache]
        if hasattr(cache, "cross_attention_cache")
        else [cache]
    )
    return {tensor.device for part in caches for layer in part.layers for tensor in layer.storages()}


@pytest.mark.parametrize("shape_policy", ["exact", "padded"])
@pytest.mark.parametrize("case", [pytest.param(LLAMA, id="llama"), pytest.param(T5, id="t5")])
def test_layers_offloaded_to_disk_generate_like_dynamic_cache_with_storage_on_their_execution_device(
    case, shape_policy, tmp_path
):
    upstream, flex = _offloaded(case, tmp_path)
    if case is LLAMA:
        assert flex.device.type == "meta"  # the embeddings are on disk: model.device is no place for storage
    config = {**CAPACITY, "shape_policy": shape_policy}
    config.update({"max_encoder_len": 8} if flex.config.is_encoder_decoder else {"max_prompt_len": 8})
    generator = torch.Generator().manual_seed(0)
    for batch_size, length in ((2, 6), (3, 4)):
        expected, actual = generate_both(
            upstream, flex, case.make_inputs(batch_size, length, generator), cache_config=config, max_new_tokens=4
        )
        assert_same_generation(expected, actual)
    cache = actual.cache
    specs = cache.layer_specs + (cache.cross_layer_specs if flex.config.is_encoder_decoder else [])
    assert {spec.device for spec in specs} == {CPU} and _storage_devices(cache) == {CPU}
    assert transformers_flexcache.held_nbytes(flex) == {"cpu": cache.nbytes}


def _hook(module: nn.Module, device) -> None:
    # The hook accelerate's dispatch puts on a module (`_hf_hook`), set without moving anything: only its
    # `execution_device` is read, and there is no second device here to move to.
    module._hf_hook = SequentialHook(AlignDevicesHook(execution_device=device, io_same_device=True))


def test_each_layer_gets_the_execution_device_that_its_hook_names():
    _, flex = LLAMA.build()
    _hook(flex.model.layers[0], torch.device("cuda", 0))
    _hook(flex.model.layers[1], 1)  # accelerate writes GPU indices as ints
    self_specs, cross_specs = layer_specs_for_model(flex)
    assert [spec.device for spec in self_specs] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert cross_specs is None
    per_device = FlexibleStaticCache.nbytes_per_device_for(layer_specs=self_specs, **CAPACITY)
    one_layer = 3 * 2 * 16 * (8 + 8) * 4  # rows x kv heads x positions x (key + value head dims) x fp32 bytes
    assert per_device == {"cuda:0": one_layer, "cuda:1": one_layer}


def test_a_hook_on_a_decoder_block_places_its_self_and_cross_attention_storage():
    _, flex = T5.build()
    _hook(flex.decoder.block[1], torch.device("cuda", 1))  # the block's hook, not one on its attention modules
    self_specs, cross_specs = layer_specs_for_model(flex)
    devices = [torch.device("cpu"), torch.device("cuda", 1)]
    assert [spec.device for spec in self_specs] == devices and [spec.device for spec in cross_specs] == devices
    per_device = FlexibleEncoderDecoderCache.nbytes_per_device_for(
        layer_specs=self_specs, cross_layer_specs=cross_specs, max_encoder_len=5, **CAPACITY
    )
    one_layer = 3 * 4 * (16 + 5) * (8 + 8) * 4  # rows x heads x (decoder + encoder positions) x head dims x bytes
    assert per_device == {"cpu": one_layer, "cuda:1": one_layer}


def test_attention_modules_of_every_decoder_layer_are_found_with_their_cross_attention():
    for case, own_types, cross_types in (
        (LLAMA, ["LlamaAttention"] * 2, []),
        (JAMBA, ["JambaMambaMixer", "JambaAttention"], []),
        (T5, ["FlexT5Attention"] * 2, ["FlexT5Attention"] * 2),
    ):
        _, flex = case.build()
        own, cross = attention_modules(flex)
        assert [type(own[i]).__name__ for i in sorted(own)] == own_types
        assert [type(cross[i]).__name__ for i in sorted(cross)] == cross_types
        if cross:
            assert all(cross[i] is flex.decoder.block[i].layer[1].EncDecAttention for i in cross)


def test_the_storage_holds_the_heads_that_the_key_projection_produces_and_refuses_others():
    upstream, flex = LLAMA.build()
    # A tensor-parallel rank's key projection holds a shard: here one of the two kv heads (head dim 8).
    shard = nn.Linear(32, 8, bias=False)
    flex.model.layers[0].self_attn.k_proj = shard
    self_specs, _ = layer_specs_for_model(flex)
    assert [spec.num_heads for spec in self_specs] == [1, 2]
    cache = FlexibleStaticCache.for_model(flex, **CAPACITY)
    assert cache.nbytes == FlexibleStaticCache.nbytes_for(layer_specs=self_specs, **CAPACITY)
    with pytest.raises(ValueError, match=r"layer 0 got keys/values of \(heads, head_dim\) \(2, 8\)/\(2, 8\), but "):
        cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    assert cache.get_seq_length(0) == 0


def test_storage_has_the_dtype_of_the_model_and_follows_it_when_the_model_changes_dtype(caplog):
    upstream, flex = LLAMA.build()
    upstream, flex = upstream.to(torch.bfloat16), flex.to(torch.bfloat16)
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(1))
    expected, actual = generate_both(upstream, flex, inputs, max_new_tokens=4)
    assert torch.equal(expected.sequences, actual.sequences)
    assert {spec.dtype for spec in actual.cache.layer_specs} == {torch.bfloat16}
    assert actual.cache.dtype == torch.bfloat16
    bf16_bytes = transformers_flexcache.held_nbytes(flex)["cpu"]

    upstream, flex = upstream.float(), flex.float()
    expected, actual = generate_both(upstream, flex, inputs, max_new_tokens=4)
    assert_same_generation(expected, actual)
    # The pool holds one storage of the new kind; the bfloat16 one was freed with a warning.
    assert actual.cache.dtype == torch.float32
    assert transformers_flexcache.held_nbytes(flex) == {"cpu": 2 * bf16_bytes}
    assert "is rebuilt for a call of another kind" in caplog.text


def test_placement_held_between_calls_follows_hooks_modules_projections_and_config_values():
    # The specs are held per model between calls (they are read at every generate call) and read anew when what
    # they come from changes.
    _, flex = T5.build()
    first, first_cross = layer_specs_for_model(flex)
    assert layer_specs_for_model(flex) == (first, first_cross)
    _hook(flex.decoder.block[1], torch.device("cuda", 1))
    self_specs, cross_specs = layer_specs_for_model(flex)
    assert [spec.device for spec in self_specs] == [CPU, torch.device("cuda", 1)] == [s.device for s in cross_specs]
    del flex.decoder.block[1]._hf_hook
    assert layer_specs_for_model(flex) == (first, first_cross)

    cross = flex.decoder.block[0].layer[1].EncDecAttention
    replaced = type(cross)(flex.config, has_relative_attention_bias=False, layer_idx=0)
    replaced.k = nn.Linear(cross.k.in_features, 8, bias=False)  # one head of 8
    flex.decoder.block[0].layer[1].EncDecAttention = replaced
    assert attention_modules(flex)[1][0] is replaced
    assert [spec.num_heads for spec in layer_specs_for_model(flex)[1]] == [1, first_cross[1].num_heads]

    flex.decoder.block[0].layer[0].SelfAttention.k.to(torch.bfloat16)
    assert layer_specs_for_model(flex)[0][0].dtype == torch.bfloat16

    flex.config.d_kv = 4  # the head dim the config gives
    assert {spec.k_head_dim for spec in layer_specs_for_model(flex)[0]} == {4}


def test_the_placement_held_for_a_model_does_not_keep_it_alive():
    import gc
    import weakref

    _, flex = T5.build()
    layer_specs_for_model(flex)
    model = weakref.ref(flex)
    del flex
    gc.collect()
    assert model() is None


def test_a_config_value_that_cannot_be_compared_reads_the_placement_at_every_call():
    _, flex = T5.build()
    flex.config.some_tensor = torch.ones(3)  # `==` of dicts holding it raises
    first = layer_specs_for_model(flex)
    assert layer_specs_for_model(flex) == first
    flex.config.d_kv = 4
    assert {spec.k_head_dim for spec in layer_specs_for_model(flex)[0]} == {4}
