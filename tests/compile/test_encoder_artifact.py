"""Which graphs of the compiled encoder side a compiled artifact holds (`compile/encoder_artifact.py`), without
compiling one: the packed encoder where the model packs, the encoder itself where it does not (float16), an int8
model's cross-attention projections, each twice where an int8 model's encoder side compiles twice, none where the
encoder does not compile; an encoder that torch.export refuses fails the artifact with the reason. The graphs
compiled, loaded and served: tests/serving/test_artifact.py (slow)."""

from __future__ import annotations

import pytest
import torch

from tests.model_cases import MODEL_CASES
from transformers_flexcache.cache.placement import cross_attention_projections
from transformers_flexcache.compile import (
    compile_config_for_cpu,
    encoder_artifact_graphs,
    encoder_graph_names,
    quantize,
    write_artifact,
)


def t5(dtype=torch.float32, *, int8: bool = False):
    _, flex = next(case for case in MODEL_CASES if case.name == "t5").build("sdpa")
    flex = flex.to(dtype)
    if int8:
        pytest.importorskip("torchao")
        flex = quantize(flex, "int8")
    return flex, cross_attention_projections(flex, flex.config.num_decoder_layers)


def test_a_packing_model_s_artifact_holds_its_packed_encoder():
    model, projections = t5()
    assert encoder_graph_names(model, compile_config_for_cpu(), projections, max_positions=16) == ["packed_encoder"]


def test_a_model_that_does_not_pack_holds_its_encoder():
    model, projections = t5(torch.float16)  # float16 layers clamp over every position: no packing
    assert encoder_graph_names(model, compile_config_for_cpu(), projections, max_positions=16) == ["encoder"]


def test_an_encoder_that_does_not_compile_has_no_graphs():
    model, projections = t5()
    assert encoder_graph_names(model, compile_config_for_cpu(encoder=False), projections, max_positions=16) == []
    assert encoder_graph_names(model, compile_config_for_cpu(), projections, max_positions=1) == []  # eager


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
    assert encoder_graph_names(model, config, projections, max_positions=16) == names


def test_an_encoder_that_torch_export_refuses_fails_the_artifact_with_the_reason_and_writes_nothing(tmp_path):
    # float16 BART layers clamp where `isfinite(states).all()` fails: a branch on data, which torch.export refuses
    _, flex = next(case for case in MODEL_CASES if case.name == "bart").build("sdpa")
    flex = flex.to(torch.float16)
    config = compile_config_for_cpu()
    projections = cross_attention_projections(flex, len(flex.get_decoder().layers))
    graphs = encoder_artifact_graphs(flex, config, projections, max_rows=2, max_positions=8)
    assert list(graphs) == [("encoder",)]
    with pytest.raises(ValueError, match=r"graphs/encoder.pt2: torch.export refused it .*encoder=False"):
        write_artifact(tmp_path / "art", {}, graphs, config)
    assert not (tmp_path / "art").exists() and list(tmp_path.iterdir()) == []
