"""ExecuTorch's runtime with XNNPACK: fp32 and quantized (torchao) one-layer exports against eager `generate`.

The CLI tests (tests/export/test_cli.py) cover every model type with portable kernels; here the XNNPACK delegate
runs, including its dynamically quantized linears.
"""

from __future__ import annotations

import pytest
import torch

from tests.export.conftest import LLAMA_MAX_CACHE_LEN, needs_executorch
from tests.export.helpers import ONE_LAYER, assert_matches_eager_for_every_shape, same_token_steps
from tests.helpers import assert_within_float_noise, ulp_floor
from transformers_flexcache.export import ExecuTorchPrograms, export_model
from transformers_flexcache.export.quantize import quantize_model_

pytestmark = needs_executorch

LLAMA_CAPACITY = {"max_batch_size": 3, "max_cache_len": 12}
SHAPES = [(3, 6), (1, 3), (2, 5)]
NEW_TOKENS = 6
# XNNPACK's dynamically quantized kernels against torchao's eager emulation of the same quantized model, measured on
# the tiny Llama (logits up to ~0.5): int8 weights agree to 1.5e-7, 8da4w (int4 weights in groups of 32) to 3.6e-3,
# which flipped 1 greedy token in 6 on such flat logits. So the logits are compared under teacher forcing (both see
# the eager model's tokens), within QUANTIZED_MARGIN times what quantizing moves the model's own logits from float32
# on the same inputs, on this machine (the activations' rounding that the two kernels may do differently is part of
# that movement): a wrong computation (errors of the logits' own size) would exceed it.
QUANTIZED_MARGIN = 2.0


def _lowered(model, tmp_path, **capacity):
    programs = export_model(model, **capacity)
    return ExecuTorchPrograms(programs.to_executorch(tmp_path / "model.pte", backend="xnnpack"))


def _teacher_forced_logits(runner, input_ids, attention_mask, tokens) -> torch.Tensor:
    """Logits `[N, B, V]` of the program for each step of `tokens` `[B, P + N]` (prompt, then the tokens fed)."""
    # input_ids, attention_mask: [B, P]; tokens: [B, P + N]
    batch_size, prompt_len = input_ids.shape
    mask = torch.zeros(batch_size, runner.capacities["max_cache_len"], dtype=torch.long)
    mask[:, :prompt_len] = attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    steps = [runner.prefill(input_ids, mask, position_ids, torch.arange(prompt_len))[:, -1]]
    position_ids = position_ids[:, -1:]
    for position in range(prompt_len, tokens.shape[1] - 1):
        mask[:, position] = 1
        position_ids = position_ids + 1
        logits = runner.decode(tokens[:, position : position + 1], mask, position_ids, torch.tensor([position]))
        steps.append(logits[:, -1])
    return torch.stack(steps)


@pytest.mark.parametrize("mode", [pytest.param("8da4w"), pytest.param("int8", marks=pytest.mark.slow)])
def test_quantized_xnnpack_export_computes_the_logits_of_the_same_quantized_model_in_eager_torch(tmp_path, mode):
    case = ONE_LAYER["llama"]
    _, flex = case.build(seed=1)
    _, floats = case.build(seed=1)  # the same weights, left in float32
    assert quantize_model_(flex, mode) > 0
    runner = _lowered(flex, tmp_path, **LLAMA_CAPACITY)
    generator = torch.Generator().manual_seed(3)
    for batch_size, prompt_len in SHAPES:
        inputs = case.make_inputs(batch_size, prompt_len, generator)
        # The oracle is the quantized model itself, eager, with upstream's DynamicCache.
        common = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "return_dict_in_generate": True}
        expected = flex.generate(**inputs, **common, output_logits=True)
        unquantized = floats.generate(**inputs, **common, output_logits=True)
        steps = same_token_steps(expected.sequences, unquantized.sequences, NEW_TOKENS)
        movement = (torch.stack(expected.logits)[:steps] - torch.stack(unquantized.logits)[:steps]).abs().max()
        got = _teacher_forced_logits(runner, inputs["input_ids"], inputs["attention_mask"], expected.sequences)
        diff = (got - torch.stack(expected.logits)).abs().max().item()
        limit = max(QUANTIZED_MARGIN * movement.item(), ulp_floor(torch.stack(expected.logits)))
        assert diff <= limit, f"{mode} batch={batch_size}: logits differ by {diff:.3g}, over {limit:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["t5", "bart", "whisper", "pix2struct", "llama"])
def test_xnnpack_export_of_each_model_type_generates_eager_tokens(tmp_path, model_type):
    from tests.export.test_cli import SHAPES as CLI_SHAPES

    case = ONE_LAYER[model_type]
    upstream, flex = case.build(seed=1)
    # The CLI test's shapes and capacities: decoder-only prompts of up to 9 tokens need their own positions too.
    capacity = {"max_batch_size": 3, "max_cache_len": 8 if flex.config.is_encoder_decoder else LLAMA_MAX_CACHE_LEN}
    if flex.config.is_encoder_decoder and model_type != "whisper":
        capacity["max_encoder_len"] = 10
    elif model_type == "whisper":
        capacity["max_encoder_len"] = flex.config.max_source_positions
    runner = _lowered(flex, tmp_path, **capacity)
    assert_matches_eager_for_every_shape(runner, upstream, case, CLI_SHAPES[model_type], seed=4)


@pytest.mark.parametrize(
    "model_type, mode",
    [
        # Two XNNPACK lowerings of each model compared byte for byte (a minute on a slow CPU): all with -m slow.
        pytest.param("llama", "none", marks=pytest.mark.slow),
        pytest.param("llama", "8da4w", marks=pytest.mark.slow),
        pytest.param("t5", "none", marks=pytest.mark.slow),
        pytest.param("bart", "none", marks=pytest.mark.slow),
    ],
)
def test_one_decomposition_per_method_writes_the_program_of_to_edge_transform_and_lower(
    tmp_path, monkeypatch, model_type, mode
):
    from transformers_flexcache.export import lowering

    case = ONE_LAYER[model_type]
    _, flex = case.build(seed=1)
    if mode != "none":
        quantize_model_(flex, mode)
    capacity = {"max_batch_size": 3, "max_cache_len": 8}
    if flex.config.is_encoder_decoder:
        capacity["max_encoder_len"] = 10
    # Each lowering gets programs of its own (ExecuTorch's passes consume a program's constants).
    ours = export_model(flex, **capacity).to_executorch(tmp_path / "ours.pte", backend="xnnpack")
    monkeypatch.setattr(lowering, "_ops_taken_whole", lambda programs, partitioner: None)
    theirs = export_model(flex, **capacity).to_executorch(tmp_path / "theirs.pte", backend="xnnpack")
    with open(ours, "rb") as file:
        ours_bytes = file.read()
    with open(theirs, "rb") as file:
        assert ours_bytes == file.read()


def test_a_linear_that_xnnpack_refuses_sends_the_lowering_through_to_edge_transform_and_lower():
    from torch.nn import functional as F

    from transformers_flexcache.export import lowering

    class WeightAsInput(torch.nn.Module):
        def forward(self, x, weight):
            return F.linear(x, weight)

    class WeightAsParameter(torch.nn.Linear):
        pass

    partitioner = lowering._partitioners("xnnpack")[0]
    refused = torch.export.export(WeightAsInput(), (torch.randn(2, 4), torch.randn(3, 4)))
    taken = torch.export.export(WeightAsParameter(4, 3), (torch.randn(2, 4),))
    assert lowering._ops_taken_whole({"forward": taken}, partitioner) == [torch.ops.aten.linear.default]
    assert lowering._ops_taken_whole({"forward": refused, "other": taken}, partitioner) is None


def test_matmuls_marked_for_executorch_s_kernels_stay_out_of_xnnpack_and_compute_the_same():
    from executorch.exir import to_edge_transform_and_lower

    from transformers_flexcache.export import lowering
    from transformers_flexcache.export.rewrites import KERNEL_BMM

    class Attention(torch.nn.Module):
        def forward(self, key, query):
            with torch.fx.traceback.annotate({KERNEL_BMM: True}):
                marked = torch.bmm(key, query.transpose(1, 2))
            return torch.bmm(key, query.transpose(1, 2)) + marked

    inputs = (torch.randn(2, 30, 4), torch.randn(2, 1, 4))
    with torch.fx.traceback.preserve_node_meta():
        exported = torch.export.export(Attention(), inputs)
    edge = to_edge_transform_and_lower(exported, partitioner=lowering._partitioners("xnnpack"))
    nodes = [str(node.target) for node in edge.exported_program().graph.nodes if node.op == "call_function"]
    assert sum("call_delegate" in target for target in nodes) >= 1
    assert sum("aten.bmm" in target for target in nodes) == 1  # the marked one, outside the delegate
    program = edge.to_executorch()
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(program.buffer).load_method("forward")
    exact = Attention()(*(tensor.double() for tensor in inputs))
    assert_within_float_noise(method.execute(list(inputs))[0], Attention()(*inputs), exact)
