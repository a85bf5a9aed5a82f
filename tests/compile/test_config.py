"""`compile_config_for_cpu()`: the inductor passes and settings it asks for, and the plug-ins' settings that are kept out
of `torch.compile`'s arguments.

Dynamo decides while tracing whether parameters become graph constants (torch==2.13.0 reads inductor's global
`freezing` then), so `torch.compile(options={"freezing": True})` alone is ignored; `compile_settings` puts it in force
for the flexible fixed-shape generate calls that ask for it (`compile.hooks.CompileHooks.call_context`). A recording
backend sees what dynamo hands to inductor.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from tests.helpers import (
    assert_same_generation,
    generate_both,
)
from tests.model_cases import LLAMA
from transformers_flexcache import compile_config_for_cpu
from transformers_flexcache.compile import cpu
from transformers_flexcache.compile.config import FlexCompileConfig, compile_settings
from transformers_flexcache.compile.passes import (
    Int8DotExpansion,
    Int8DotProducts,
    Int8FbgemmMatmuls,
    Int8FloatGemms,
    OneDNNLinears,
    OneRowLinears,
    fp32_linears,
    int8_linears,
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def recording_backend(seen: list):
    """A backend that records, per graph, whether freezing was on and how many parameters are graph constants."""

    def backend(graph_module, example_inputs, **kwargs):
        constants = sum(node.op == "get_attr" for node in graph_module.graph.nodes)
        seen.append({"freezing": torch._inductor.config.freezing, "constants": constants})
        return graph_module.forward

    return backend


def test_compile_config_for_cpu_freezes_weights_without_dynamic_shapes_and_compiles_on_cpu():
    config = compile_config_for_cpu(
        linear_kernels="mkl", one_row_linears="library", int8_linears="library", decode_attention="library"
    )
    assert config.backend == "inductor" and config.dynamic is False and config.fullgraph is True
    assert config.options == {"freezing": True} and config.mode is None
    assert config._compile_all_devices is True
    options = compile_config_for_cpu(
        linear_kernels="mkl",
        one_row_linears="library",
        int8_linears="library",
        decode_attention="library",
        cpp_wrapper=True,
    ).options
    assert options == {"freezing": True, "cpp_wrapper": True}


def test_onednn_linear_kernels_are_a_pass_before_freezing_and_configs_with_it_compare_equal():
    # before freezing: the packed copies are then frozen constants of the graph inductor's FX graph cache keys on
    config = compile_config_for_cpu(
        linear_kernels="onednn", one_row_linears="library", int8_linears="library", decode_attention="library"
    )
    assert config.options == {"freezing": True, "joint_custom_post_pass": (OneDNNLinears(one_row=True),)}
    # upstream's generate keeps its compiled call while the config compares equal
    assert (
        compile_config_for_cpu(
            linear_kernels="onednn", one_row_linears="library", int8_linears="library", decode_attention="library"
        )
        == config
    )
    assert OneDNNLinears().uuid() == OneDNNLinears().uuid() != OneDNNLinears(one_row=False).uuid()


def test_one_row_linears_run_first_and_each_pass_keys_inductor_s_cache_apart():
    config = compile_config_for_cpu(
        linear_kernels="onednn", one_row_linears="inductor", int8_linears="library", decode_attention="library"
    )
    # both before freezing: the one-row linears rewritten, so that inductor packs none of them (MKL or oneDNN)
    assert config.options["joint_custom_post_pass"] == (OneRowLinears(), OneDNNLinears(one_row=False))
    assert "post_grad_custom_post_pass" not in config.options
    assert (
        compile_config_for_cpu(
            linear_kernels="onednn", one_row_linears="inductor", int8_linears="library", decode_attention="library"
        )
        == config
    )
    assert compile_config_for_cpu(
        linear_kernels="mkl", one_row_linears="inductor", int8_linears="library", decode_attention="library"
    ).options == {
        "freezing": True,
        "joint_custom_post_pass": (OneRowLinears(),),
    }
    assert OneRowLinears().uuid() == OneRowLinears().uuid() != OneDNNLinears().uuid()


@pytest.mark.parametrize(("vendor", "expected"), [("GenuineIntel", "library"), ("AuthenticAMD", "inductor")])
def test_auto_one_row_linears_are_inductor_s_where_the_cpu_is_not_intel_s(vendor, expected):
    with cpu.forced(vendor=vendor):
        assert fp32_linears.resolve_one_row_linears("auto") == expected


def test_int8_dot_products_are_marked_before_freezing_and_expanded_first_after_it():
    # Float GEMMs are written before freezing too, so that it folds the weights' conversion into float copies.
    config = compile_config_for_cpu(
        linear_kernels="onednn", one_row_linears="inductor", int8_linears="inductor", decode_attention="library"
    )
    assert config.options["joint_custom_post_pass"] == (
        Int8DotProducts(),
        Int8FloatGemms(),
        OneRowLinears(),
        OneDNNLinears(one_row=False),
    )
    assert config.options["post_grad_custom_post_pass"] == (Int8DotExpansion(),)
    assert (
        compile_config_for_cpu(
            linear_kernels="onednn", one_row_linears="inductor", int8_linears="inductor", decode_attention="library"
        )
        == config
    )
    passes = (Int8DotProducts(), Int8FloatGemms(), Int8DotExpansion(), OneRowLinears())
    assert len({graph_pass.uuid() for graph_pass in passes}) == 4


def test_fbgemm_int8_linears_are_marked_before_freezing_with_dot_products_for_fewer_rows():
    config = compile_config_for_cpu(
        linear_kernels="onednn", one_row_linears="inductor", int8_linears="fbgemm", decode_attention="library"
    )
    assert config.options["joint_custom_post_pass"] == (
        Int8FbgemmMatmuls(),
        Int8DotProducts(),
        OneRowLinears(),
        OneDNNLinears(one_row=False),
    )
    assert config.options["post_grad_custom_post_pass"] == (Int8DotExpansion(),)
    assert len({Int8FbgemmMatmuls().uuid(), Int8DotProducts().uuid()}) == 2


@pytest.mark.parametrize(
    ("facts", "fbgemm", "expected"),
    [
        ({"vnni": False}, True, "fbgemm"),
        # AMX removed where the case is a CPU without it: forced() keeps the flags it is not told to change, and on
        # an AMX CPU (Sapphire Rapids) the case would otherwise be the AMX one
        ({"vnni": True, "amx": False}, True, "fbgemm"),
        ({"amx": True}, True, "library"),
        ({"vnni": True, "amx": False}, False, "library"),
        ({"vnni": False}, False, "inductor"),
    ],
    ids=["no-vnni", "vnni", "amx", "vnni-without-fbgemm", "neither"],
)
def test_auto_int8_linears_are_fbgemm_s_where_torch_has_fbgemm_and_the_cpu_no_amx(
    monkeypatch, facts, fbgemm, expected
):
    monkeypatch.setattr(int8_linears, "has_fbgemm", lambda: fbgemm)
    with cpu.forced(**facts):
        assert int8_linears.resolve_int8_linears("auto") == expected
        options = compile_config_for_cpu(linear_kernels="mkl", one_row_linears="library").options
        passes = options.get("joint_custom_post_pass")
    assert (
        passes
        == {
            "library": None,
            "fbgemm": (Int8FbgemmMatmuls(), Int8DotProducts()),
            "inductor": (Int8DotProducts(), Int8FloatGemms()),
        }[expected]
    )


def test_unknown_int8_linears_are_refused_with_the_choices():
    with pytest.raises(
        ValueError, match=r"int8_linears='vnni' is not one of \('auto', 'fbgemm', 'inductor', 'library'\)"
    ):
        compile_config_for_cpu(int8_linears="vnni")


def test_unknown_one_row_linears_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"one_row_linears='mv' is not one of \('auto', 'inductor', 'library'\)"):
        compile_config_for_cpu(one_row_linears="mv")


@pytest.mark.parametrize(
    ("vendor", "expected"), [("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), (None, "onednn")]
)
def test_auto_linear_kernels_are_mkl_on_intel_cpus_only_as_ctranslate2_chooses(vendor, expected):
    with cpu.forced(vendor=vendor):
        assert fp32_linears.resolve_linear_kernels("auto") == expected
        options = compile_config_for_cpu(decode_attention="library", int8_linears="library").options  # no int8 pass
    # "auto": both passes, each taking the linears its plan gives it (measured per shape, else this rule)
    one_row, onednn = options["joint_custom_post_pass"]
    assert onednn.plan == one_row.plan and onednn.plan.measured
    assert onednn.plan.base == expected


def test_unknown_linear_kernels_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"linear_kernels='blas' is not one of \('auto', 'onednn', 'mkl'\)"):
        compile_config_for_cpu(linear_kernels="blas")


def test_compile_settings_put_freezing_in_force_for_the_context_only():
    assert torch._inductor.config.freezing is False
    with compile_settings(compile_config_for_cpu()):
        assert torch._inductor.config.freezing is True
    assert torch._inductor.config.freezing is False
    with compile_settings(CompileConfig()):  # nothing asked: nothing changed
        assert torch._inductor.config.freezing is False


@pytest.mark.parametrize("shape_policy", ["padded", "bucketed"])
def test_freezing_asked_in_compile_config_options_turns_parameters_into_constants_of_the_decode_graph(shape_policy):
    upstream, flex = LLAMA.build("sdpa")
    seen = []
    compile_config = CompileConfig(
        backend=recording_backend(seen), fullgraph=True, dynamic=False, mode=None, options={"freezing": True}
    )
    compile_config._compile_all_devices = True
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(0))
    cache_config = {"shape_policy": shape_policy, "max_batch_size": 2, "max_cache_len": 12, "max_prompt_len": 6}
    expected, actual = generate_both(
        upstream,
        flex,
        inputs,
        cache_config=cache_config,
        max_new_tokens=4,
        do_sample=False,
        compile_config=compile_config,
    )
    assert_same_generation(expected, actual)
    assert [graph["freezing"] for graph in seen] == [True]
    # every weight of the tiny Llama that a decode step reads is a graph constant, none a graph input
    assert seen[0]["constants"] >= sum(1 for name, _ in flex.named_parameters() if "embed_tokens" not in name)
    assert torch._inductor.config.freezing is False  # put back after the call


def test_compile_encoder_is_kept_out_of_torch_compiles_arguments_and_of_equality():
    config = FlexCompileConfig(fullgraph=True, compile_encoder=True)
    assert "compile_encoder" not in config.to_dict()
    assert config == FlexCompileConfig(fullgraph=True, compile_encoder=False)  # the same decode graphs
    assert compile_config_for_cpu().compile_encoder and not compile_config_for_cpu(encoder=False).compile_encoder


def test_step_guards_are_kept_out_of_torch_compiles_arguments_and_of_equality_and_checked():
    config = FlexCompileConfig(fullgraph=True, step_guards="every")
    assert "step_guards" not in config.to_dict() and config == FlexCompileConfig(fullgraph=True)
    assert compile_config_for_cpu().step_guards == "first"
    with pytest.raises(ValueError, match=r"step_guards='never' is not one of \('first', 'every'\)"):
        compile_config_for_cpu(step_guards="never")
