"""The compiled path on CPU: `compile_config_for_cpu()`, and freezing that is in force while a flexible generate traces.

Dynamo decides while tracing whether parameters become graph constants (torch==2.13.0 reads inductor's global
`freezing` then), so `torch.compile(options={"freezing": True})` alone is ignored; `compile_settings` puts it in force
for the flexible fixed-shape generate calls that ask for it. A recording backend sees what dynamo hands to inductor.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from tests.helpers import (
    assert_same_generation,
    assert_same_padded_generation,
    assert_within_float_noise,
    generate_both,
    in_double,
)
from tests.model_cases import BART, LLAMA, T5
from transformers_flexcache import compile_config_for_cpu, cpu, linear_kernels
from transformers_flexcache.compilation import compile_settings
from transformers_flexcache.linear_kernels import (
    Int8DotExpansion,
    Int8DotProducts,
    Int8FbgemmMatmuls,
    Int8FloatGemms,
    OneDNNLinears,
    OneRowLinears,
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


def test_onednn_linear_kernels_are_an_inductor_post_grad_pass_and_configs_with_it_compare_equal():
    config = compile_config_for_cpu(
        linear_kernels="onednn", one_row_linears="library", int8_linears="library", decode_attention="library"
    )
    assert config.options == {"freezing": True, "post_grad_custom_post_pass": (OneDNNLinears(),)}
    # upstream's generate keeps its compiled call while the config compares equal
    assert (
        compile_config_for_cpu(
            linear_kernels="onednn", one_row_linears="library", int8_linears="library", decode_attention="library"
        )
        == config
    )
    assert OneDNNLinears().uuid() == OneDNNLinears().uuid()


def test_one_row_linears_run_first_and_each_pass_keys_inductor_s_cache_apart():
    config = compile_config_for_cpu(
        linear_kernels="onednn", one_row_linears="inductor", int8_linears="library", decode_attention="library"
    )
    assert config.options["post_grad_custom_post_pass"] == (OneRowLinears(), OneDNNLinears())
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
        "post_grad_custom_post_pass": (OneRowLinears(),),
    }
    assert OneRowLinears().uuid() == OneRowLinears().uuid() != OneDNNLinears().uuid()


@pytest.mark.parametrize(("vendor", "expected"), [("GenuineIntel", "library"), ("AuthenticAMD", "inductor")])
def test_auto_one_row_linears_are_inductor_s_where_the_cpu_is_not_intel_s(vendor, expected):
    with cpu.forced(vendor=vendor):
        assert linear_kernels.resolve_one_row_linears("auto") == expected


def test_int8_dot_products_are_marked_before_freezing_and_expanded_first_after_it():
    # Float GEMMs are written before freezing too, so that it folds the weights' conversion into float copies.
    config = compile_config_for_cpu(
        linear_kernels="onednn", one_row_linears="inductor", int8_linears="inductor", decode_attention="library"
    )
    assert config.options["joint_custom_post_pass"] == (Int8DotProducts(), Int8FloatGemms())
    assert config.options["post_grad_custom_post_pass"] == (Int8DotExpansion(), OneRowLinears(), OneDNNLinears())
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
    assert config.options["joint_custom_post_pass"] == (Int8FbgemmMatmuls(), Int8DotProducts())
    assert config.options["post_grad_custom_post_pass"] == (Int8DotExpansion(), OneRowLinears(), OneDNNLinears())
    assert len({Int8FbgemmMatmuls().uuid(), Int8DotProducts().uuid()}) == 2


@pytest.mark.parametrize(
    ("facts", "fbgemm", "expected"),
    [
        ({"vnni": False}, True, "fbgemm"),
        ({"vnni": True}, True, "fbgemm"),
        ({"amx": True}, True, "library"),
        ({"vnni": True}, False, "library"),
        ({"vnni": False}, False, "inductor"),
    ],
    ids=["no-vnni", "vnni", "amx", "vnni-without-fbgemm", "neither"],
)
def test_auto_int8_linears_are_fbgemm_s_where_torch_has_fbgemm_and_the_cpu_no_amx(
    monkeypatch, facts, fbgemm, expected
):
    monkeypatch.setattr(linear_kernels, "has_fbgemm", lambda: fbgemm)
    with cpu.forced(**facts):
        assert linear_kernels.resolve_int8_linears("auto") == expected
        passes = compile_config_for_cpu().options.get("joint_custom_post_pass")
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


def compiled_linear_ops(rows: int, **kernels) -> set[str]:
    """The ops a frozen compiled two-linear model (with and without bias) runs on `rows` rows under
    `compile_config_for_cpu(**kernels)`; its outputs checked against eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False)).eval()
    inputs = torch.randn(rows, 16)
    config = compile_config_for_cpu(**kernels)
    with torch.no_grad(), compile_settings(config):
        compiled = torch.compile(model, backend="inductor", dynamic=False, options=config.options)
        actual = compiled(inputs)
        with torch.profiler.profile() as profile:
            compiled(inputs)
    assert_within_float_noise(actual, model(inputs), in_double(model)(inputs.double()))
    return {event.key for event in profile.key_averages()}


@pytest.mark.parametrize("rows", [1, 3])
def test_one_row_pass_runs_linears_of_one_row_as_inductor_s_dot_products_and_others_on_onednn(rows):
    ops = compiled_linear_ops(rows, linear_kernels="onednn", one_row_linears="inductor")
    assert "mkl::_mkl_linear" not in ops
    assert ("mkldnn::_linear_pointwise" in ops) == (rows > 1)


def test_one_row_dot_products_read_their_input_stored_once_not_recomputed_for_every_output():
    # Inductor would fuse the norm that makes a linear's input into the dot products and redo it for every output
    # (T5's output layer: six vector loads and a dozen operations per eight weights); the pass stores it first.
    from torch._inductor.utils import run_and_get_code

    class NormThenLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(64) + 0.5)
            self.linear = torch.nn.Linear(64, 96, bias=False)

        def forward(self, hidden, residual):
            hidden = hidden + residual
            return self.linear(self.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6))

    torch.manual_seed(0)
    model, inputs = NormThenLinear().eval(), (torch.randn(1, 64), torch.randn(1, 64))
    config = compile_config_for_cpu(linear_kernels="onednn", one_row_linears="inductor")
    with torch.no_grad(), compile_settings(config):
        compiled = torch.compile(model, backend="inductor", dynamic=False, options=config.options)
        actual, (code,) = run_and_get_code(compiled, *inputs)
    assert_within_float_noise(actual, model(*inputs), in_double(model)(*(tensor.double() for tensor in inputs)))
    # the C++ loop over the 96 outputs: a dot product of the stored input and the weight's row, no norm inside
    loops = [part for part in code.split("for(int64_t x0=") if part.split(";")[1].strip().endswith("(96L)")]
    assert len(loops) == 1 and "tmp_acc0_vec" in loops[0]
    dot_product = loops[0].split("= static_cast<float>(tmp_acc0);")[0]  # up to the store of each output
    assert "sqrt" not in dot_product and dot_product.count("::loadu(") == 2  # the stored input and the weight


@pytest.mark.parametrize(
    ("vendor", "expected"), [("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), (None, "onednn")]
)
def test_auto_linear_kernels_are_mkl_on_intel_cpus_only_as_ctranslate2_chooses(vendor, expected):
    with cpu.forced(vendor=vendor):
        assert linear_kernels.resolve_linear_kernels("auto") == expected
        options = compile_config_for_cpu(decode_attention="library", int8_linears="library").options  # no int8 pass
    assert ("post_grad_custom_post_pass" in options) == (expected == "onednn")


def test_unknown_linear_kernels_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"linear_kernels='blas' is not one of \('auto', 'onednn', 'mkl'\)"):
        compile_config_for_cpu(linear_kernels="blas")


def test_onednn_pass_runs_the_frozen_linears_on_onednn_with_the_eager_outputs():
    ops = compiled_linear_ops(3, linear_kernels="onednn", one_row_linears="library")
    assert "mkldnn::_linear_pointwise" in ops and "mkl::_mkl_linear" not in ops


def test_graphs_of_different_rows_share_one_onednn_copy_of_each_weight_packed_anew_once_it_changes(monkeypatch):
    # Each frozen graph held a packed copy of every weight of its own: a model compiled at several shapes held as many
    # copies of its weights as graphs. One copy now serves all graphs of several rows; a changed weight is repacked.
    shared = linear_kernels.SharedOneDNNWeights()
    monkeypatch.setattr(linear_kernels, "ONEDNN_WEIGHTS", shared)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False)).eval()
    config = compile_config_for_cpu(linear_kernels="onednn", one_row_linears="library", int8_linears="library")
    with torch.no_grad(), compile_settings(config):
        compiled = torch.compile(model, backend="inductor", dynamic=False, options=config.options)
        for rows in (2, 3):  # two graphs
            inputs = torch.randn(rows, 16)
            assert_within_float_noise(compiled(inputs), model(inputs), in_double(model)(inputs.double()))
        assert shared.packs == len(shared) == 2  # one copy per weight, not per graph
        model[2].weight.mul_(-1)  # in place: the same storage, new values
        inputs = torch.randn(4, 16)  # a third graph, frozen on the new values
        assert_within_float_noise(compiled(inputs), model(inputs), in_double(model)(inputs.double()))
        assert shared.packs == 3  # the changed weight packed anew (the first two graphs keep the old copy)


def test_shared_onednn_copies_serve_every_row_count_but_one_and_live_as_long_as_a_graph_holds_them():
    shared = linear_kernels.SharedOneDNNWeights()
    weight = torch.randn(24, 16)
    several = shared.packed(weight, 2)
    assert shared.packed(weight, 8) is several and shared.packed(weight, None) is several
    one_row = shared.packed(weight, 1)  # oneDNN's one-row layout is another
    assert one_row is not several and shared.packs == len(shared) == 2
    inputs = torch.randn(5, 16)
    for packed in (several, one_row):
        assert_within_float_noise(
            torch.ops.mkldnn._linear_pointwise(inputs, packed, None, "none", [], ""),
            inputs @ weight.T,
            inputs.double() @ weight.double().T,
        )
    del several, one_row, packed
    assert len(shared) == 0  # held weakly: the graphs own them


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


@pytest.mark.slow
@pytest.mark.parametrize("grad_mode", ["no_grad (generate's own)", "inference_mode"])
def test_frozen_inductor_bucketed_stream_after_warmup_gives_dynamic_cache_tokens(grad_mode):
    # Real inductor with frozen, prepacked weights (a minute or two of compiling): scores within float tolerance.
    from tests.model_cases import T5
    from transformers_flexcache import warmup

    upstream, flex = T5.build("sdpa")
    compile_config = compile_config_for_cpu()
    cache_config = {
        "shape_policy": "bucketed",
        "max_batch_size": 4,
        "max_cache_len": 8,
        "max_encoder_len": 12,
        "buckets": {"max_batch_size": [2], "max_encoder_len": [6]},
    }
    generator = torch.Generator().manual_seed(0)
    mode = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with mode:
        warmup(
            flex,
            lambda b, n: T5.make_inputs(b, n, generator),
            max_new_tokens=4,
            cache_config=cache_config,
            compile_config=compile_config,
        )
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for batch_size, length in [(3, 10), (1, 4), (4, 12), (2, 5)]:
            inputs = T5.make_inputs(batch_size, length, generator)
            expected, actual = generate_both(
                upstream,
                flex,
                inputs,
                cache_config=cache_config,
                max_new_tokens=4,
                do_sample=False,
                compile_config=compile_config,
            )
            assert_same_padded_generation(upstream, flex, inputs, expected, actual, max_new_tokens=4, do_sample=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("case", [LLAMA, T5, BART], ids=lambda case: case.name)
def test_frozen_one_row_decode_step_gives_dynamic_cache_tokens(case):
    # A batch of one in a one-row bucket: every linear of the decode step is inductor's dot product (BART's with
    # biases).
    upstream, flex = case.build("sdpa")
    cache_config = {
        "shape_policy": "bucketed",
        "max_batch_size": 2,
        "max_cache_len": 12,
        "buckets": {"max_batch_size": [1]},
    }
    cache_config.update({"max_prompt_len": 6} if case is LLAMA else {"max_encoder_len": 8})
    generator = torch.Generator().manual_seed(0)
    common = {"return_dict_in_generate": True, "output_scores": True, "max_new_tokens": 6, "do_sample": False}
    for length in (5, 3):
        inputs = case.make_inputs(1, length, generator)
        with torch.profiler.profile() as profile:
            expected, actual = generate_both(
                upstream,
                flex,
                inputs,
                cache_config=cache_config,
                compile_config=compile_config_for_cpu(one_row_linears="inductor", encoder=False),
                **common,
            )
        # tolerance: what upstream's own scores move at the shapes the cache ran (tests/helpers.py)
        assert_same_padded_generation(upstream, flex, inputs, expected, actual, **common)
    # The second call ran the compiled step (the first one's compiling ran the library's linears on the weights).
    ops = {event.key for event in profile.key_averages()}
    assert any(op.startswith("Torch-Compiled Region") for op in ops), ops
    assert not ops & {"mkl::_mkl_linear", "mkldnn::_linear_pointwise"}  # eager steps run aten's linear


@pytest.mark.slow
def test_a_frozen_compiled_graph_serves_the_cache_allocated_after_a_release_with_dynamic_cache_tokens():
    # Before: the graph held the released storage as a constant (a segmentation fault on the next call).
    from transformers_flexcache import release

    upstream, flex = LLAMA.build("sdpa")
    cache_config = {"shape_policy": "padded", "max_batch_size": 2, "max_cache_len": 12, "max_prompt_len": 6}
    generator = torch.Generator().manual_seed(0)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(2):
        inputs = LLAMA.make_inputs(2, 5, generator)
        expected, actual = generate_both(
            upstream,
            flex,
            inputs,
            cache_config=cache_config,
            max_new_tokens=4,
            do_sample=False,
            compile_config=compile_config_for_cpu(),
        )
        assert_same_padded_generation(upstream, flex, inputs, expected, actual, max_new_tokens=4, do_sample=False)
        release(flex)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # the second cache reused the graph
