"""The generic route (`transformers_flexcache.models.generic`): decoder-only models that need no module change.

The listed types (`models.catalogue.GENERIC_MODEL_TYPES`) run the whole `MODEL_CASES` matrix; this file checks how a class is
judged from its source and its config, that a generated class is found by name like a written one, that a model type
outside the list converts and generates like DynamicCache, and that refusals name the function, the expression and
what would be needed.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import transformers
from transformers import (
    BlenderbotSmallConfig,
    BlenderbotSmallForConditionalGeneration,
    GPT2LMHeadModel,
    Llama4ForCausalLM,
    Llama4TextConfig,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen2ForCausalLM,
    XGLMConfig,
    XGLMForCausalLM,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import transformers_flexcache
from tests.helpers import assert_same_generation, generate_both
from tests.model_cases import GPT2, LLAMA
from transformers_flexcache import convert, register, saved, unregister, zoo
from transformers_flexcache.models import generic
from transformers_flexcache.models.catalogue import GENERIC_MODEL_TYPES
from transformers_flexcache.models.source_check import model_code


@pytest.fixture(autouse=True)
def unregistered():
    unregister()
    yield
    unregister()


def _xglm() -> XGLMForCausalLM:
    config = XGLMConfig(vocab_size=16, max_position_embeddings=8, d_model=8, num_layers=1, attention_heads=2)
    return XGLMForCausalLM(config)


def _olmo2_pair():
    # OLMo2: a decoder-only type outside GENERIC_MODEL_TYPES, with no module change needed.
    config = zoo._decoder_only_tiny(Olmo2Config)
    torch.manual_seed(0)
    upstream = Olmo2ForCausalLM(config).eval()
    flex = Olmo2ForCausalLM(config).eval()
    flex.load_state_dict(upstream.state_dict())
    return upstream, flex


@pytest.mark.parametrize("model_type", GENERIC_MODEL_TYPES)
def test_every_listed_type_is_judged_eligible_from_its_source(model_type):
    upstream_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    assert generic.reasons_against(upstream_class) == []
    assert generic.config_reasons_against(upstream_class, zoo.tiny_config(model_type)) == []


def test_the_source_check_reads_the_attention_that_the_decoder_layers_build():
    names = [name for name, *_ in model_code(Qwen2ForCausalLM)]
    for wanted in ("Qwen2ForCausalLM.forward", "Qwen2Model.forward", "Qwen2DecoderLayer.forward"):
        assert f"transformers.models.qwen2.modeling_qwen2.{wanted}" in names
    assert "transformers.models.qwen2.modeling_qwen2.Qwen2Attention.forward" in names


def test_a_generated_class_is_built_once_and_found_by_name_like_a_written_one():
    flex_class = generic.flex_class_for(Qwen2ForCausalLM)
    assert generic.flex_class_for(Qwen2ForCausalLM) is flex_class
    assert flex_class.__name__ == "FlexQwen2ForCausalLM" and flex_class.flex_upstream_class() is Qwen2ForCausalLM
    assert flex_class._flex_module_classes == {}  # no module change
    assert generic.FlexQwen2ForCausalLM is flex_class
    assert saved.override_class("FlexQwen2ForCausalLM") is flex_class
    assert pickle.loads(pickle.dumps(flex_class)) is flex_class
    # a pickle made when the classes named the package's `generic` module (GLOBAL opcode: module, name) still loads
    assert pickle.loads(b"ctransformers_flexcache.generic\nFlexQwen2ForCausalLM\n.") is flex_class


def test_a_class_with_a_written_override_gets_no_generated_one():
    with pytest.raises(TypeError, match=r"LlamaForCausalLM has a written override, model_overrides.llama.Flex"):
        generic.flex_class_for(LLAMA.upstream_class)
    assert saved.override_class("FlexLlamaForCausalLM") is LLAMA.flex_class


def test_a_type_outside_the_list_converts_generates_like_dynamic_cache_and_loads_by_name(tmp_path):
    upstream, flex = _olmo2_pair()
    assert convert(flex) is flex and type(flex).__name__ == "FlexOlmo2ForCausalLM"
    generator = torch.Generator().manual_seed(1)
    for batch_size, prompt_len in [(3, 7), (1, 4)]:
        inputs = LLAMA.make_inputs(batch_size, prompt_len, generator)
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config={"max_batch_size": 3, "max_cache_len": 16}, max_new_tokens=5
        )
        assert_same_generation(expected, actual)
    flex.save_pretrained(tmp_path)
    assert (
        'override_class("FlexOlmo2ForCausalLM", format_version=1)' in (tmp_path / "modeling_flexcache.py").read_text()
    )
    assert saved.override_class("FlexOlmo2ForCausalLM") is type(flex)


def test_a_model_whose_attention_reads_cache_internals_is_refused_naming_the_function_lines_and_fix():
    model = _xglm()
    with pytest.raises(TypeError) as refused:
        convert(model)
    message = str(refused.value)
    assert "XGLMForCausalLM has no flexcache override" in message
    assert (
        "XGLMAttention.forward (transformers/models/xglm/modeling_xglm.py) reads `cache.is_updated` (lines " in message
    )
    assert "`curr_cache.layers[self.layer_idx].keys` (line " in message
    assert "needed: an override in model_overrides/xglm.py" in message
    assert type(model) is XGLMForCausalLM


def test_a_layer_type_the_cache_does_not_hold_is_refused_naming_it():
    config = Llama4TextConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=16,
        intermediate_size_mlp=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=2,
    )
    with pytest.raises(TypeError, match=r"layer types \['chunked_attention'\] .*needed: a layer class for them"):
        convert(Llama4ForCausalLM(config))


def test_an_encoder_decoder_model_without_an_override_is_refused_by_the_generic_route():
    config = BlenderbotSmallConfig(
        vocab_size=16,
        d_model=8,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
    )
    with pytest.raises(TypeError, match=r"encoder-decoder config: cross-attention needs an override of its own"):
        convert(BlenderbotSmallForConditionalGeneration(config))


def test_gpt2_with_cross_attention_builds_but_is_refused_when_flexible_static_is_asked():
    config = GPT2.build_config()
    config.add_cross_attention = True  # GPT2 as the decoder of an EncoderDecoderModel
    model = GPT2.flex_class(config).eval()
    inputs = GPT2.make_inputs(1, 4, torch.Generator().manual_seed(0))
    assert model.generate(**inputs, max_new_tokens=2).shape == (1, 6)  # upstream's DynamicCache: unchanged
    with pytest.raises(ValueError, match=r"GPT2Attention.forward .* safe only with add_cross_attention=False"):
        model.generate(**inputs, max_new_tokens=2, cache_implementation="flexible_static")
    with pytest.raises(
        TypeError, match=r"GPT2LMHeadModel with this config cannot be converted: .*add_cross_attention"
    ):
        convert(GPT2LMHeadModel(config))


def test_a_reviewed_read_is_trusted_only_while_upstream_reads_exactly_what_was_reviewed(monkeypatch):
    (review,) = [review for review in generic.REVIEWED_READS if "GPT2Attention" in review.function]
    assert generic.reasons_against(GPT2LMHeadModel) == []
    narrower = generic.ReviewedReads(
        function=review.function,
        codes=review.codes - {"cache.is_updated"},
        why=review.why,
        holds=review.holds,
        condition=review.condition,
    )
    monkeypatch.setattr(generic, "REVIEWED_READS", (narrower,))
    (reason,) = generic.reasons_against(GPT2LMHeadModel)
    assert reason.startswith(
        "GPT2Attention.forward (transformers/models/gpt2/modeling_gpt2.py) reads `cache.is_updated`"
    )


def test_an_upstream_model_asked_for_flexible_static_is_told_whether_convert_can_help():
    register()
    xglm = _xglm()
    inputs = {"input_ids": torch.tensor([[5, 6, 7]])}
    with pytest.raises(ValueError, match=r"convert\(model\) would refuse it: .*XGLMAttention.forward"):
        xglm.generate(**inputs, cache_implementation="flexible_static", max_new_tokens=2)
    upstream, _ = _olmo2_pair()
    with pytest.raises(ValueError, match=r"convert it in place with transformers_flexcache.convert\(model\)$"):
        upstream.generate(**inputs, cache_implementation="flexible_static", max_new_tokens=2)
    assert transformers_flexcache.convert(upstream) is upstream  # and it can
