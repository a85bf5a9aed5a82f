"""Class-level behaviour that upstream's own model tests check: our override classes answer as upstream's classes.

Upstream decides several things from the class itself rather than from its modules: whether it is custom code (from
its `__module__`), whether its experts and attention kernels can be switched (from the source of its module), and
whether it can generate (from its direct bases). Each test compares an override class with its upstream class.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from safetensors.torch import save_file
from transformers import GenerationMixin
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from model_overrides.whisper import FlexWhisperForConditionalGeneration
from tests.helpers import assert_within_float_noise, in_double
from tests.model_cases import JAMBA, MODEL_CASES, PIX2STRUCT, T5, WHISPER
from transformers_flexcache.generate.mixin import FlexCacheInnerGenerateMixin

CASE_IDS = [case.name for case in MODEL_CASES]


@pytest.mark.parametrize("case", MODEL_CASES, ids=CASE_IDS)
def test_override_is_custom_code_exactly_when_its_upstream_class_is(case):
    assert case.flex_class.is_custom_code() == case.upstream_class.is_custom_code() is False


@pytest.mark.parametrize("case", [T5, PIX2STRUCT, WHISPER], ids=["t5", "pix2struct", "whisper"])
def test_weights_missing_from_a_checkpoint_are_initialized_as_upstream_initializes_them(case):
    upstream, _ = case.build()
    with tempfile.TemporaryDirectory() as folder:
        upstream.save_pretrained(folder)
        # A checkpoint with no weights at all: every parameter and buffer is initialized by `from_pretrained`.
        save_file({}, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        torch.manual_seed(0)
        expected = case.upstream_class.from_pretrained(folder).state_dict()
        torch.manual_seed(0)
        actual = case.flex_class.from_pretrained(folder).state_dict()
    differing = [key for key in expected if not torch.equal(expected[key], actual[key])]
    assert differing == []


@pytest.mark.parametrize("case", MODEL_CASES, ids=CASE_IDS)
def test_override_lists_generation_mixin_among_its_direct_bases(case):
    assert GenerationMixin in case.flex_class.__bases__
    assert case.flex_class.can_generate()


def test_whisper_inner_generate_mixin_stays_right_before_generation_mixin_in_the_mro():
    mro = FlexWhisperForConditionalGeneration.__mro__
    assert mro.index(GenerationMixin) == mro.index(FlexCacheInnerGenerateMixin) + 1
    # Whisper's own generate comes first, and calls upstream's through the inner mixin.
    assert mro.index(WHISPER.upstream_class) < mro.index(FlexCacheInnerGenerateMixin)


@pytest.fixture(autouse=True)
def uncached_kernel_checks(monkeypatch):
    """Forget the answers upstream caches on each class, so that no test depends on which class was asked first (a
    subclass inherits its base's cached answer)."""
    for case in MODEL_CASES:
        for cls in (case.flex_class, case.upstream_class):
            for name in ("_can_set_experts_implementation_cached_value", "_can_set_attn_implementation_cached_value"):
                if name in vars(cls):
                    monkeypatch.delattr(cls, name)


@pytest.mark.parametrize("case", MODEL_CASES, ids=CASE_IDS)
def test_override_can_switch_attention_and_experts_kernels_when_its_upstream_class_can(case):
    assert case.flex_class._can_set_attn_implementation() == case.upstream_class._can_set_attn_implementation()
    assert case.flex_class._can_set_experts_implementation() == case.upstream_class._can_set_experts_implementation()


def _jamba_pair(**kwargs):
    # Each model gets its own config: the experts implementation is stored on it. Ours is built first, so that its
    # class is asked before upstream's.
    torch.manual_seed(0)
    flex = JAMBA.flex_class._from_config(JAMBA.build_config(), **kwargs).eval()
    upstream = JAMBA.upstream_class._from_config(JAMBA.build_config(), **kwargs).eval()
    upstream.load_state_dict(flex.state_dict())
    return upstream, flex


def test_jamba_runs_upstreams_default_experts_kernel(monkeypatch):
    calls = []
    grouped_mm = ALL_EXPERTS_FUNCTIONS["grouped_mm"]

    def counted_grouped_mm(*args, **kwargs):
        calls.append(1)
        return grouped_mm(*args, **kwargs)

    # Not the eager loop over a data-dependent set of experts, which `torch.compile(fullgraph=True)` refuses in
    # upstream's test_generate_compile_model_forward_fullgraph.
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._local_mapping, "grouped_mm", counted_grouped_mm)
    upstream, flex = _jamba_pair()
    assert flex.config._experts_implementation == upstream.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        flex(torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0)))
    assert calls, "the experts ran another kernel than grouped_mm"


def test_jamba_accepts_grouped_mm_when_asked_for_it():
    _, flex = _jamba_pair(experts_implementation="grouped_mm")
    assert flex.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_jamba_set_experts_implementation_switches_the_kernel_and_logits_equal_upstreams(implementation):
    upstream, flex = _jamba_pair(experts_implementation="eager" if implementation != "eager" else "grouped_mm")
    flex.set_experts_implementation(implementation)
    upstream.set_experts_implementation(implementation)
    assert flex.config is not upstream.config
    assert flex.config._experts_implementation == upstream.config._experts_implementation == implementation
    input_ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = upstream(input_ids).logits, flex(input_ids).logits
        assert_within_float_noise(actual, expected, lambda: in_double(upstream)(input_ids).logits)
