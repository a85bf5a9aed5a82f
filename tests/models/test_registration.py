"""register() / unregister() through transformers' AutoModel mappings, and convert(model) in place.

Every override in `catalogue.flex_model_classes()` is tested against every AutoModel class that upstream maps to the
class it overrides (found generically, as `register()` finds them), so a new override is covered when it is merged.
"""

from __future__ import annotations

import copy
import inspect
import sys

import pytest
import torch
from transformers import (
    BartForConditionalGeneration,
    GenerationConfig,
    JambaForCausalLM,
    LlamaForCausalLM,
    M2M100ForConditionalGeneration,
    MarianMTModel,
    MBartForConditionalGeneration,
    PegasusForConditionalGeneration,
    Pix2StructForConditionalGeneration,
    T5ForConditionalGeneration,
    WhisperForConditionalGeneration,
    XGLMConfig,
    XGLMForCausalLM,
)
from transformers.generation import configuration_utils as generation_configuration
from transformers.generation.utils import GenerationMixin

from tests.helpers import assert_same_generation, generate_both
from tests.model_cases import MODEL_CASES
from transformers_flexcache import convert, register, unregister
from transformers_flexcache.models.auto_classes import auto_classes_for, auto_mappings
from transformers_flexcache.models.catalogue import flex_model_classes


def _case_for(flex_class):
    case = next((case for case in MODEL_CASES if case.flex_class is flex_class), None)
    assert case is not None, f"{flex_class.__name__} has no ModelCase in tests/model_cases.py MODEL_CASES; add one"
    return case


FLEX_AND_AUTO = [
    pytest.param(flex_class, auto_class, id=f"{flex_class.__name__}-{auto_class.__name__}")
    for flex_class in flex_model_classes()
    for auto_class in auto_classes_for(flex_class.flex_upstream_class())
]
FLEX_CLASSES = [pytest.param(flex_class, id=flex_class.__name__) for flex_class in flex_model_classes()]
CASES = [pytest.param(case, id=case.name) for case in MODEL_CASES]


def _global_state():
    """Everything register() may change: each mapping's registrations, the cache names, the upstream hook."""
    extra_content = {id(mapping): dict(mapping._extra_content) for mapping in auto_mappings()}
    return (
        extra_content,
        generation_configuration.ALL_CACHE_IMPLEMENTATIONS,
        GenerationMixin._prepare_cache_for_generation,
    )


@pytest.fixture(autouse=True)
def unregistered():
    """Each test starts and ends with nothing registered and the cache name refused."""
    unregister()
    yield
    unregister()


def test_every_registered_class_names_an_imported_module_that_holds_it_and_has_a_file():
    # Issue 58: the generated classes named `transformers_flexcache.generic`, a module nobody imports, so that
    # upstream's own tests (`inspect.getfile(type(model))`, `sys.modules[cls.__module__]`) raised on them.
    register()
    registered = {
        flex_class
        for mapping in auto_mappings()
        for flex_class in mapping._extra_content.values()
        if isinstance(flex_class, type) and hasattr(flex_class, "flex_upstream_class")
    }
    assert set(flex_model_classes()) <= registered
    for flex_class in sorted(registered, key=lambda flex_class: flex_class.__name__):
        module = sys.modules[flex_class.__module__]
        assert getattr(module, flex_class.__qualname__) is flex_class, flex_class
        assert inspect.getfile(flex_class) == module.__file__


@pytest.mark.parametrize(
    ("upstream_class", "auto_class_name"),
    [
        (LlamaForCausalLM, "AutoModelForCausalLM"),
        (JambaForCausalLM, "AutoModelForCausalLM"),
        (T5ForConditionalGeneration, "AutoModelForSeq2SeqLM"),
        (BartForConditionalGeneration, "AutoModelForSeq2SeqLM"),
        (WhisperForConditionalGeneration, "AutoModelForSpeechSeq2Seq"),
        (Pix2StructForConditionalGeneration, "AutoModelForImageTextToText"),
        (MarianMTModel, "AutoModelForSeq2SeqLM"),
        (M2M100ForConditionalGeneration, "AutoModelForSeq2SeqLM"),
        (MBartForConditionalGeneration, "AutoModelForSeq2SeqLM"),
        (PegasusForConditionalGeneration, "AutoModelForSeq2SeqLM"),
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_the_auto_classes_found_for_an_upstream_class_include_the_one_users_load_it_with(
    upstream_class, auto_class_name
):
    assert auto_class_name in [auto_class.__name__ for auto_class in auto_classes_for(upstream_class)]


@pytest.mark.parametrize(("flex_class", "auto_class"), FLEX_AND_AUTO)
def test_after_register_from_config_builds_the_override_and_after_unregister_upstream(flex_class, auto_class):
    config = _case_for(flex_class).build_config()
    register()
    assert type(auto_class.from_config(config)) is flex_class
    unregister()
    assert type(auto_class.from_config(config)) is flex_class.flex_upstream_class()


@pytest.mark.parametrize(("flex_class", "auto_class"), FLEX_AND_AUTO)
def test_after_register_from_pretrained_loads_an_upstream_checkpoint_into_the_override(
    flex_class, auto_class, tmp_path
):
    case = _case_for(flex_class)
    upstream, _ = case.build()
    upstream.save_pretrained(tmp_path)
    register()
    loaded = auto_class.from_pretrained(tmp_path).eval()
    assert type(loaded) is flex_class
    want, got = upstream.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[name], got[name]) for name in want)
    # the reference: upstream's class loaded from the same folder, so that both run the attention that
    # from_pretrained picks (sdpa), not the eager one the seeded model was built with
    reference = case.upstream_class.from_pretrained(tmp_path).eval()
    assert reference.config._attn_implementation == loaded.config._attn_implementation
    inputs = case.make_inputs(2, 5, torch.Generator().manual_seed(0))
    expected, actual = generate_both(
        reference, loaded, inputs, max_new_tokens=3, do_sample=False, **case.generate_kwargs
    )
    assert_same_generation(expected, actual)


def test_unregister_restores_every_auto_mapping_and_the_cache_name_exactly():
    before = _global_state()
    register()
    assert _global_state() != before
    unregister()
    assert _global_state() == before
    with pytest.raises(ValueError, match="flexible_static"):
        GenerationConfig(cache_implementation="flexible_static")


def test_register_twice_changes_nothing_more_and_one_unregister_restores_upstream():
    before = _global_state()
    register()
    once = _global_state()
    register()
    assert _global_state() == once
    unregister()
    assert _global_state() == before


def test_a_class_registered_before_register_is_restored_by_unregister():
    flex_class = flex_model_classes()[0]
    upstream_class = flex_class.flex_upstream_class()
    auto_class = auto_classes_for(upstream_class)[0]
    user_class = type(f"User{upstream_class.__name__}", (upstream_class,), {})
    config_class = upstream_class.config_class
    mapping = auto_class._model_mapping
    auto_class.register(config_class, user_class, exist_ok=True)
    try:
        register()
        assert mapping[config_class] is flex_class
        unregister()
        assert mapping[config_class] is user_class
    finally:
        mapping._extra_content.pop(config_class, None)


def test_register_accepts_flexible_static_and_an_upstream_model_asked_for_it_is_refused():
    register()
    GenerationConfig(cache_implementation="flexible_static").validate()
    case = MODEL_CASES[0]
    upstream, _ = case.build()
    inputs = case.make_inputs(1, 4, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"does not support cache_implementation='flexible_static'.*convert"):
        upstream.generate(**inputs, cache_implementation="flexible_static", max_new_tokens=2, **case.generate_kwargs)


def test_unregister_stays_undone_after_an_override_model_is_built_loaded_and_generates(tmp_path):
    before = _global_state()
    register()
    unregister()
    case = MODEL_CASES[0]
    upstream, flex = case.build()
    flex.save_pretrained(tmp_path)
    loaded = type(flex).from_pretrained(tmp_path)
    inputs = case.make_inputs(1, 4, torch.Generator().manual_seed(0))
    for model in (flex, loaded):
        model.generate(**inputs, cache_implementation="flexible_static", max_new_tokens=2, **case.generate_kwargs)
    assert _global_state() == before
    with pytest.raises(ValueError, match="flexible_static"):
        GenerationConfig(cache_implementation="flexible_static")


@pytest.mark.parametrize("case", CASES)
def test_an_override_model_generates_with_flexible_static_without_register(case):
    upstream, flex = case.build()
    before = _global_state()
    inputs = case.make_inputs(2, 5, torch.Generator().manual_seed(0))
    expected, actual = generate_both(upstream, flex, inputs, max_new_tokens=3, do_sample=False, **case.generate_kwargs)
    assert_same_generation(expected, actual)
    assert _global_state() == before


def test_unregister_leaves_a_patch_that_another_library_made_after_register_in_place():
    register()
    ours = GenerationMixin.__dict__["_prepare_cache_for_generation"]

    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    GenerationMixin._prepare_cache_for_generation = theirs
    try:
        unregister()
        assert GenerationMixin.__dict__["_prepare_cache_for_generation"] is theirs
        assert "flexible_static" not in generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    finally:
        GenerationMixin._prepare_cache_for_generation = ours.__wrapped_upstream__


@pytest.mark.parametrize("case", CASES)
def test_convert_swaps_the_class_in_place_keeping_parameter_storage_and_outputs(case):
    model, _ = case.build()
    reference = copy.deepcopy(model)
    pointers = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}

    converted = convert(model)

    assert converted is model
    assert type(model) is case.flex_class
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == pointers
    inputs = case.make_inputs(3, 6, torch.Generator().manual_seed(1))
    expected, actual = generate_both(
        reference, model, inputs, max_new_tokens=4, do_sample=False, **case.generate_kwargs
    )
    assert_same_generation(expected, actual)


@pytest.mark.parametrize("flex_class", FLEX_CLASSES)
def test_convert_leaves_an_override_model_as_it_is(flex_class):
    _, flex = _case_for(flex_class).build()
    assert convert(flex) is flex
    assert type(flex) is flex_class


def test_convert_refuses_an_unsupported_model_with_a_type_error_naming_the_supported_classes():
    # XGLM's attention reads the cache's `is_updated` and `.layers[i].keys` (upstream's cross-attention pattern).
    model = XGLMForCausalLM(
        XGLMConfig(vocab_size=16, max_position_embeddings=8, d_model=8, num_layers=1, attention_heads=2)
    )
    with pytest.raises(TypeError, match=r"XGLMForCausalLM has no flexcache override; supported classes are \[.*'"):
        convert(model)
    assert type(model) is XGLMForCausalLM
