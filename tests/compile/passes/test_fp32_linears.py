"""`compile.passes.fp32_linears`: the inductor passes that run a frozen step's linears on oneDNN, as dot products at one row,
and share one packed copy of each weight between graphs; outputs within the float noise of the eager ones.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    assert_within_float_noise,
    in_double,
)
from transformers_flexcache import compile_config_for_cpu
from transformers_flexcache.compile.config import compile_settings
from transformers_flexcache.compile.passes import fp32_linears


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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


def test_onednn_pass_runs_the_frozen_linears_on_onednn_with_the_eager_outputs():
    ops = compiled_linear_ops(3, linear_kernels="onednn", one_row_linears="library")
    assert "mkldnn::_linear_pointwise" in ops and "mkl::_mkl_linear" not in ops


def test_graphs_of_different_rows_share_one_onednn_copy_of_each_weight_packed_anew_once_it_changes(monkeypatch):
    # Each frozen graph held a packed copy of every weight of its own: a model compiled at several shapes held as many
    # copies of its weights as graphs. One copy now serves all graphs of several rows; a changed weight is repacked.
    shared = fp32_linears.SharedOneDNNWeights()
    monkeypatch.setattr(fp32_linears, "ONEDNN_WEIGHTS", shared)
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
    shared = fp32_linears.SharedOneDNNWeights()
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
