"""What the source check reads behind the wrappers of `kernels` (`models.source_check.original_code`).

transformers 5.25 depends on `kernels`, whose decorators wrap the classes and functions transformers decorates:
`use_kernelized_func` replaces a class's `__init__` and `forward`, `use_kernel_forward_from_hub` turns a function into
an `nn.Module` instance. transformers 5.24 without `kernels` leaves them as they are. Either way the check must read
the model's own code, and follow the functions that the model calls: these tests fail if `kernels` changes how it
wraps them so that the check would read its wrapper, or nothing.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import JambaForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM
from transformers.models.jamba import modeling_jamba
from transformers.models.llama import modeling_llama

from transformers_flexcache.models.source_check import model_code, original_code, upstream_cache_reads


def _functions(upstream_class) -> dict:
    return {name: function for name, function, *_ in model_code(upstream_class)}


@pytest.mark.parametrize(
    ("upstream_class", "decorated"),
    [
        (LlamaForCausalLM, "transformers.models.llama.modeling_llama.LlamaAttention"),
        (JambaForCausalLM, "transformers.models.jamba.modeling_jamba.JambaMambaMixer"),
    ],
    ids=["llama-attention", "jamba-mixer"],
)
def test_the_source_check_reads_a_decorated_class_s_own_init_and_forward(upstream_class, decorated):
    functions = _functions(upstream_class)
    module = decorated.rsplit(".", 1)[0]
    for method, first_line in (("__init__", "def __init__(self, config"), ("forward", "def forward(")):
        function = functions[f"{decorated}.{method}"]
        assert function.__module__ == module
        assert first_line in inspect.getsource(function)  # after upstream's own decorators, if any


def test_the_source_check_follows_the_functions_that_kernels_turns_into_modules():
    assert "transformers.models.llama.modeling_llama.apply_rotary_pos_emb" in _functions(LlamaForCausalLM)
    # transformers 5.25's Jamba mixer reads and writes its cache in two such functions.
    jamba = _functions(JambaForCausalLM)
    for name in ("causal_conv1d_forward", "mamba_scan_forward"):
        if hasattr(modeling_jamba, name):
            assert f"transformers.models.jamba.modeling_jamba.{name}" in jamba
    assert upstream_cache_reads(JambaForCausalLM) == []


@pytest.mark.parametrize("upstream_class", [LlamaForCausalLM, JambaForCausalLM, Qwen2ForCausalLM])
def test_no_code_of_kernels_is_read_as_model_code(upstream_class):
    read = [name for name, function in _functions(upstream_class).items() if function.__module__.startswith("kernels")]
    assert not read


def test_original_code_sees_through_each_wrapper_of_the_installed_kernels():
    kernels = pytest.importorskip("kernels")

    def scale(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    class Layer(torch.nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.width = width

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return wrapped(x)

    own_init, own_forward = Layer.__init__, Layer.forward
    wrapped = kernels.use_kernel_forward_from_hub("FlexcacheProbeScale")(scale)
    Layer = kernels.use_kernelized_func(wrapped)(Layer)
    assert not inspect.isfunction(wrapped) and Layer.__init__ is not own_init  # what kernels does today
    assert original_code(wrapped) is scale
    assert original_code(Layer.__init__) is own_init
    assert original_code(Layer.forward) is own_forward
    assert torch.equal(Layer(3)(torch.ones(2)), 2 * torch.ones(2))


def test_original_code_leaves_what_kernels_did_not_wrap_as_it_is():
    assert original_code(modeling_llama.rotate_half) is modeling_llama.rotate_half
    assert original_code(modeling_llama.LlamaModel) is modeling_llama.LlamaModel
