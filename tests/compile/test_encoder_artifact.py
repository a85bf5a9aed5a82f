"""Which graphs of the compiled encoder side a compiled artifact holds (`compile/encoder_artifact.py`), without
compiling one: the packed encoder where the model packs, the encoder itself where it does not (float16), an int8
model's cross-attention projections, each twice where an int8 model's encoder side compiles twice, none where the
encoder does not compile. The graphs compiled, loaded and served: tests/serving/test_artifact.py (slow)."""

from __future__ import annotations

import pytest
import torch

from tests.model_cases import MODEL_CASES
from transformers_flexcache.cache.placement import cross_attention_projections
from transformers_flexcache.compile import compile_config_for_cpu, encoder_graph_names, quantize


def t5(dtype=torch.float32, *, int8: bool = False):
    _, flex = next(case for case in MODEL_CASES if case.name == "t5").build("sdpa")
    flex = flex.to(dtype)
    if int8:
        pytest.importorskip("torchao")
        flex = quantize(flex, "int8")
    return flex, cross_attention_projections(flex, flex.config.num_decoder_layers)


def test_a_packing_model_s_artifact_holds_its_packed_encoder():
    model, projections = t5()
    assert encoder_graph_names(model, compile_config_for_cpu(), projections) == ["packed_encoder"]


def test_a_model_that_does_not_pack_holds_its_encoder():
    model, projections = t5(torch.float16)  # float16 layers clamp over every position: no packing
    assert encoder_graph_names(model, compile_config_for_cpu(), projections) == ["encoder"]


def test_an_encoder_that_does_not_compile_has_no_graphs():
    model, projections = t5()
    assert encoder_graph_names(model, compile_config_for_cpu(encoder=False), projections) == []


@pytest.mark.parametrize(
    ("int8_linears", "names"),
    [
        ("fbgemm", ["packed_encoder", "projections"]),
        (
            "inductor",  # float32 GEMMs of the integers for few rows, oneDNN's int8 linears for many
            ["packed_encoder", "packed_encoder_library", "projections", "projections_library"],
        ),
    ],
)
def test_an_int8_model_s_artifact_holds_its_projections_and_each_compile(int8_linears, names):
    model, projections = t5(int8=True)
    config = compile_config_for_cpu(int8_linears=int8_linears)
    assert encoder_graph_names(model, config, projections) == names
