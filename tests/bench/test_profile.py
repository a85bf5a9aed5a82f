"""`bench-profile`: the grouping of profiler events into kernels of a decode step, and the command's options."""

from __future__ import annotations

import types

import pytest

from transformers_flexcache.__main__ import main
from transformers_flexcache.bench.profile import (
    ONE_ROW,
    OUTPUT_ONE_ROW,
    categorize,
    ct2_categorize,
    group_profile,
)

VOCAB = 32128


def event(name, start, end=None, shapes=None, parent=None, self_us=None):
    end = start + 1 if end is None else end
    return types.SimpleNamespace(
        name=name,
        time_range=types.SimpleNamespace(start=start, end=end),
        input_shapes=shapes or [],
        cpu_parent=parent,
        self_cpu_time_total=end - start if self_us is None else self_us,
    )


def test_linears_are_grouped_by_weight_shape_and_the_vocabulary_sized_one_is_the_output_layer():
    graph = event("## Call CompiledFxGraph abc ##", 0, 100)
    linear = event("mkldnn::_linear_pointwise", 1, shapes=[[4, 512], [2048, 512], [], [], [], []], parent=graph)
    output = event("mkldnn::_linear_pointwise", 2, shapes=[[4, 512], [VOCAB, 512], [], [], [], []], parent=graph)
    eager = event("aten::addmm", 3, shapes=[[512], [4, 512], [512, 512]])
    assert categorize(linear, VOCAB, True) == "linear 512x2048"
    assert categorize(output, VOCAB, True) == f"output layer 512x{VOCAB}"
    assert categorize(eager, VOCAB, False) == "linear 512x512 (eager)"


SHAPES = frozenset({(512, 512), (512, 2048), (2048, 512), (512, VOCAB)})


def test_each_linear_op_is_read_by_its_signature_and_a_transposed_product_by_the_model_s_shapes():
    graph = event("## Call CompiledFxGraph abc ##", 0, 100)
    # MKL: the packed weight is recorded as [packed size, 1]; the original weight (third) has the shape
    mkl = event("mkl::_mkl_linear", 1, shapes=[[4, 2048], [3293409, 1], [512, 2048], [], []], parent=graph)
    assert categorize(mkl, VOCAB, True, SHAPES) == "linear 2048x512"
    # inductor's transposed product W [N, K] @ x^T [K, rows]: once read as "linear 512x4"
    transposed = event("aten::mm", 2, shapes=[[2048, 512], [512, 4]], parent=graph)
    assert categorize(transposed, VOCAB, True, SHAPES) == "linear 512x2048"
    output = event("aten::mm", 3, shapes=[[VOCAB, 512], [512, 8]], parent=graph)
    assert categorize(output, VOCAB, True, SHAPES) == f"output layer 512x{VOCAB}"
    straight = event("aten::addmm", 4, shapes=[[512], [8, 512], [512, 512]], parent=graph)
    assert categorize(straight, VOCAB, True, SHAPES) == "linear 512x512"
    # a product that is no linear of the model: named with its rows
    other = event("aten::mm", 5, shapes=[[6, 64], [64, 4]], parent=graph)
    assert categorize(other, VOCAB, True, SHAPES) == "matmul 6x64x4"


def test_inductor_kernels_are_grouped_by_the_operations_they_are_named_after():
    names = {
        "graph_1_cpp_fused__scaled_dot_product_flash_attention_for_cpu_3": "attention",
        "graph_1_cpp_fused_add_mean_mul_pow_rsqrt_0": "layer norms",
        "graph_1_cpp_fused_mm_7": ONE_ROW,
        "graph_1_cpp_fused_index_copy_2": "other graph kernels (cache writes, residuals, copies)",
    }
    for name, group in names.items():
        assert categorize(event(name, 0), VOCAB, True) == group, name
    assert categorize(event("decode_step", 0), VOCAB, False) is None
    assert categorize(event("aten::argmax", 0), VOCAB, False) == "generate's tensor ops (outside the graph)"


def test_only_events_inside_steps_count_and_each_steps_last_dot_product_is_its_output_layer():
    events = [
        event("decode_step", 10, 20),
        event("graph_1_cpp_fused_mm_1", 11, 12),
        event("graph_1_cpp_fused_mm_2", 13, 16),  # the step's last dot product
        event("decode_step", 30, 40),
        event("graph_1_cpp_fused_mm_1", 31, 32),
        event("graph_1_cpp_fused_mm_2", 33, 36),
        event("graph_1_cpp_fused_mm_1", 50, 60),  # outside every step: not counted
    ]
    totals, steps, _ = group_profile(events, VOCAB)
    assert steps == 2
    assert totals[ONE_ROW] == 2 and totals[OUTPUT_ONE_ROW] == 6


def test_ctranslate2_symbols_are_grouped():
    assert ct2_categorize("dnnl::impl::cpu::x64::jit_avx2_gemm_f32") == "GEMMs (oneDNN sgemm / JIT)"
    assert ct2_categorize("ctranslate2::cpu::softmax<(ctranslate2::cpu::CpuIsa)2>") == "softmax"
    assert ct2_categorize("ctranslate2::cpu::rms_norm<(ctranslate2::cpu::CpuIsa)2>") == "layer norms"
    assert ct2_categorize("_PyEval_EvalFrameDefault") == "runtime, Python and the rest"


@pytest.mark.parametrize(
    ("option", "message"),
    [("--batches=0", "at least 1"), ("--batches=a", "comma-separated"), ("--new-tokens=2", "at least 3")],
)
def test_bench_profile_refuses_bad_options(option, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench-profile", option])
    assert message in capsys.readouterr().err
