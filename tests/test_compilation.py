"""The compiled path on CPU: `compile_config_for_cpu()`, and freezing that is in force while a flexible generate traces.

Dynamo decides while tracing whether parameters become graph constants (torch==2.13.0 reads inductor's global
`freezing` then), so `torch.compile(options={"freezing": True})` alone is ignored; `compile_settings` puts it in force
for the flexible fixed-shape generate calls that ask for it. A recording backend sees what dynamo hands to inductor.
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from tests.helpers import assert_same_generation, generate_both
from tests.model_cases import LLAMA
from transformers_flexcache import compile_config_for_cpu
from transformers_flexcache.compilation import compile_settings


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
    config = compile_config_for_cpu()
    assert config.backend == "inductor" and config.dynamic is False and config.fullgraph is True
    assert config.options == {"freezing": True} and config.mode is None
    assert config._compile_all_devices is True
    assert compile_config_for_cpu(cpp_wrapper=True).options == {"freezing": True, "cpp_wrapper": True}


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
