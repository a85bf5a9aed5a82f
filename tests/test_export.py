"""Exported programs (torch.export, then ExecuTorch) against upstream's eager model with its DynamicCache.

One export (module fixture) serves every test of a model: the point is that one program, with one set of cache
buffers, serves every batch and length within its capacities, in any order of calls.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from tests.helpers import SCORE_ATOL
from tests.model_cases import (
    BART,
    LLAMA,
    MARIAN,
    T5,
    WHISPER,
    WHISPER_MAX_SOURCE_POSITIONS,
    _bart_config,
    _t5_config,
    _whisper_config,
)
from transformers_flexcache.export import (
    ExecuTorchPrograms,
    ExportableEncoderDecoder,
    export_decoder_only,
    export_encoder_decoder,
    greedy_generate,
)

CAPACITY = {"max_batch_size": 4, "max_cache_len": 8, "max_encoder_len": 10}
NEW_TOKENS = 8  # greedy decoding of 8 tokens uses 8 decoder positions: the whole max_cache_len
# (batch, encoder or prompt length), large -> small -> large, so stale cache content from a bigger call is present.
SHAPES = [(4, 10), (1, 3), (3, 7), (2, 10), (4, 1)]
# Whisper's log-mel features always give max_source_positions encoder positions: only the batch varies.
WHISPER_FEATURE_SHAPES = [
    (4, WHISPER_MAX_SOURCE_POSITIONS),
    (1, WHISPER_MAX_SOURCE_POSITIONS),
    (3, WHISPER_MAX_SOURCE_POSITIONS),
]
# ExecuTorch's kernels sum in another order than PyTorch's; measured up to 6e-5 of the logits' scale on these models.
EXECUTORCH_LOGITS_TOLERANCE = 1e-4

has_executorch = importlib.util.find_spec("executorch") is not None
needs_executorch = pytest.mark.skipif(not has_executorch, reason='needs pip install ".[executorch]"')


def _varied_t5_config(num_layers: int = 2):
    config = _t5_config()
    # With the default init the tiny T5 predicts the pad token at every step; larger weights make varied tokens
    # while the logits stay moderate (|logit| < 45).
    config.initializer_factor = 3.0
    # The zoo's T5 is v1.1-style (untied, unscaled); this one keeps t5-small's d_model**-0.5 output scaling, which
    # transformers' own exporter drops: the export must keep it.
    config.scale_decoder_outputs = True
    config.num_layers = config.num_decoder_layers = num_layers
    return config


T5_VARIED = dataclasses.replace(T5, build_config=_varied_t5_config)
# Lowering to ExecuTorch costs time per graph node: its test uses one layer each side.
T5_ONE_LAYER = dataclasses.replace(T5, build_config=lambda: _varied_t5_config(num_layers=1))


@pytest.fixture(scope="module")
def t5():
    upstream, flex = T5_VARIED.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY)


@pytest.fixture(scope="module")
def t5_one_layer():
    upstream, flex = T5_ONE_LAYER.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY)


def _one_layer_whisper_config():
    config = _whisper_config()
    config.encoder_layers = config.decoder_layers = 1
    return config


def _one_layer_bart_config():
    config = _bart_config()
    config.encoder_layers = config.decoder_layers = 1
    return config


def _one_layer_marian_config():
    config = MARIAN.build_config()
    config.encoder_layers = config.decoder_layers = 1
    return config


BART_ONE_LAYER = dataclasses.replace(BART, build_config=_one_layer_bart_config)
MARIAN_ONE_LAYER = dataclasses.replace(MARIAN, build_config=_one_layer_marian_config)
# Export time grows with the number of layers: the second Whisper program pair (features entry) uses one layer.
WHISPER_ONE_LAYER = dataclasses.replace(WHISPER, build_config=_one_layer_whisper_config)


@pytest.fixture(scope="module")
def bart():
    upstream, flex = BART.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY)


@pytest.fixture(scope="module")
def bart_one_layer():
    upstream, flex = BART_ONE_LAYER.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY)


@pytest.fixture(scope="module")
def marian_one_layer():
    upstream, flex = MARIAN_ONE_LAYER.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY)


@pytest.fixture(scope="module")
def whisper_encoder_states():
    # Encoder outputs of any length up to max_encoder_len: the dynamic encoder length, through the cross mask that
    # model_overrides/whisper.py adds.
    upstream, flex = WHISPER.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY, encoder_input="encoder_hidden_states")


@pytest.fixture(scope="module")
def whisper_features():
    upstream, flex = WHISPER_ONE_LAYER.build(seed=1)
    capacity = {**CAPACITY, "max_encoder_len": WHISPER_MAX_SOURCE_POSITIONS}
    return upstream, export_encoder_decoder(flex, **capacity)  # encoder_input defaults to input_features


@pytest.fixture(scope="module")
def llama():
    upstream, flex = LLAMA.build()
    capacity = {"max_batch_size": CAPACITY["max_batch_size"], "max_cache_len": 10 + NEW_TOKENS}
    return upstream, export_decoder_only(flex, **capacity)


def _generate_kwargs(upstream) -> dict:
    config = upstream.generation_config
    return {
        "decoder_start_token_id": config.decoder_start_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "forced_eos_token_id": getattr(config, "forced_eos_token_id", None),  # BART's generate forces EOS last
    }


def _program_inputs(inputs: dict) -> dict:
    """A model case's generate inputs as `greedy_generate` takes them (encoder outputs as a tensor)."""
    if "encoder_outputs" in inputs:
        return {"encoder_hidden_states": inputs["encoder_outputs"].last_hidden_state}
    return dict(inputs)


def _prefill_inputs(runner, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(encoder input, encoder attention mask [B, L_enc]) of `prefill`; the mask is all ones where inputs have none."""
    encoder_input = _program_inputs(inputs)[runner.encoder_input]
    batch_size, encoder_len = encoder_input.shape[:2]
    if runner.encoder_input == "input_features":
        encoder_len = runner.capacities["max_encoder_len"]
    return encoder_input, inputs.get("attention_mask", torch.ones(batch_size, encoder_len, dtype=torch.long))


def _assert_close_logits(got: torch.Tensor, want: torch.Tensor, where: str, *, tolerance: float = SCORE_ATOL) -> None:
    """Within `tolerance` times the logits' scale (at least 1).

    Exported self-attention reads the whole cache row under a mask, as upstream's StaticCache does, so its sums run
    over more (masked) slots than DynamicCache's and round differently: a few fp32 ulps of the largest logit (the
    varied tiny T5's logits reach ~35), which spread to every logit through the layers.
    """
    limit = tolerance * max(1.0, want.abs().max().item())
    diff = (got - want).abs().max().item()
    assert diff <= limit, f"{where}: logits differ by {diff} > {limit}"


def _assert_same_greedy(runner, upstream, inputs: dict, where: str, *, tolerance: float = SCORE_ATOL) -> None:
    """Greedy tokens equal upstream generate's (DynamicCache), and every step's logits are within tolerance."""
    expected = upstream.generate(
        **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    tokens, logits = greedy_generate(
        runner, **_program_inputs(inputs), max_new_tokens=NEW_TOKENS, output_logits=True, **_generate_kwargs(upstream)
    )
    assert torch.equal(tokens, expected.sequences), (where, tokens, expected.sequences)
    _assert_close_logits(torch.stack(logits), torch.stack(expected.logits), where, tolerance=tolerance)


def _assert_seq2seq_matches_eager(
    runner, upstream, shapes, *, seed: int, case=T5_VARIED, tolerance: float = SCORE_ATOL
) -> None:
    """For each shape in turn: greedy decoding as `_assert_same_greedy`, then a decoder prefill of several tokens.

    The prefill takes the start token and the first two generated tokens at once; its logits must equal upstream's
    for those three steps.
    """
    generator = torch.Generator().manual_seed(seed)
    for batch_size, encoder_len in shapes:
        where = f"batch={batch_size} encoder_len={encoder_len}"
        inputs = case.make_inputs(batch_size, encoder_len, generator)
        _assert_same_greedy(runner, upstream, inputs, where, tolerance=tolerance)

        decoder_input_ids = upstream.generate(**inputs, max_new_tokens=2, do_sample=False)  # [B, 3]
        want = upstream(**inputs, decoder_input_ids=decoder_input_ids).logits
        got = runner.prefill(
            *_prefill_inputs(runner, inputs), decoder_input_ids, torch.arange(decoder_input_ids.shape[1])
        )
        _assert_close_logits(got, want, f"{where}, decoder prefill", tolerance=tolerance)


@pytest.mark.parametrize(
    ("programs_fixture", "case", "shapes"),
    [
        pytest.param("t5", T5_VARIED, SHAPES, id="t5"),
        pytest.param("bart", BART, SHAPES, id="bart"),
        # One layer each side: export time grows with the layers, and BART's case already covers two.
        pytest.param("marian_one_layer", MARIAN_ONE_LAYER, SHAPES, id="marian"),
        pytest.param("whisper_encoder_states", WHISPER, SHAPES, id="whisper-encoder_hidden_states"),
        pytest.param("whisper_features", WHISPER_ONE_LAYER, WHISPER_FEATURE_SHAPES, id="whisper-input_features"),
    ],
)
def test_exported_encoder_decoder_matches_eager_for_every_shape_with_one_program(
    request, programs_fixture, case, shapes
):
    upstream, programs = request.getfixturevalue(programs_fixture)
    pointers = [b.data_ptr() for b in programs.wrapper.buffers()]
    _assert_seq2seq_matches_eager(programs, upstream, shapes, seed=1, case=case)
    assert [b.data_ptr() for b in programs.wrapper.buffers()] == pointers, "a cache buffer was reallocated"


def test_exported_t5_logits_keep_the_d_model_output_scaling(t5):
    upstream, programs = t5
    # _varied_t5_config keeps the d_model**-0.5 output scaling of t5-small (with untied output embeddings).
    assert upstream.config.scale_decoder_outputs
    inputs = T5_VARIED.make_inputs(2, 5, torch.Generator().manual_seed(3))
    decoder_input_ids = torch.zeros(2, 1, dtype=torch.long)
    want = upstream(**inputs, decoder_input_ids=decoder_input_ids).logits
    got = programs.prefill(inputs["input_ids"], inputs["attention_mask"], decoder_input_ids, torch.arange(1))
    _assert_close_logits(got, want, "prefill")


@pytest.mark.parametrize(
    ("batch_size", "encoder_len", "num_decoder", "message"),
    [
        pytest.param(5, 4, 1, r"batch_size=5 exceeds max_batch_size=4 .* max_batch_size=5 or more", id="batch"),
        pytest.param(
            2, 11, 1, r"encoder_len=11 exceeds max_encoder_len=10 .* max_encoder_len=11 or more", id="encoder"
        ),
        pytest.param(2, 4, 9, r"decoder_len=9 exceeds max_cache_len=8 .* max_cache_len=9 or more", id="decoder"),
    ],
)
def test_exported_program_refuses_inputs_over_capacity_with_value_limit_and_fix(
    t5, batch_size, encoder_len, num_decoder, message
):
    _, programs = t5
    input_ids = torch.full((batch_size, encoder_len), 5)
    decoder_input_ids = torch.zeros(batch_size, num_decoder, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        programs.prefill(input_ids, torch.ones_like(input_ids), decoder_input_ids, torch.arange(num_decoder))


def test_greedy_generate_refuses_more_new_tokens_than_cache_positions(t5):
    _, programs = t5
    input_ids = torch.full((1, 4), 5)
    with pytest.raises(ValueError, match=r"max_new_tokens=9 .* needs max_cache_len=9"):
        greedy_generate(programs, input_ids, max_new_tokens=9, decoder_start_token_id=0)


def test_decode_refuses_a_batch_other_than_the_prefill_batch(t5):
    _, programs = t5
    input_ids = torch.full((2, 4), 5)
    programs.prefill(input_ids, torch.ones_like(input_ids), torch.zeros(2, 1, dtype=torch.long), torch.arange(1))
    with pytest.raises(ValueError, match=r"decode got batch 3 .* prefill started batch 2"):
        programs.decode(torch.zeros(3, 1, dtype=torch.long), torch.tensor([1]), torch.ones(3, 4, dtype=torch.long))


def test_exportable_wrapper_refuses_an_upstream_model_with_the_fix():
    upstream, _ = T5.build()
    with pytest.raises(TypeError, match=r"transformers_flexcache.convert\(model\)"):
        ExportableEncoderDecoder(upstream, **CAPACITY)


def test_whisper_features_export_refuses_an_encoder_length_other_than_max_source_positions():
    _, flex = WHISPER.build()
    with pytest.raises(ValueError, match=r"max_encoder_len=10, but .* max_source_positions=12 .* max_encoder_len=12"):
        ExportableEncoderDecoder(flex, **CAPACITY)


def test_exported_whisper_features_program_refuses_other_inputs_with_the_expected_shape(whisper_features):
    _, programs = whisper_features
    features = torch.zeros(2, WHISPER_ONE_LAYER.build_config().num_mel_bins, 20)
    with pytest.raises(ValueError, match=r"prefill needs input_features \[batch, num_mel_bins, 24\]"):
        programs.prefill(features, torch.ones(2, 10), torch.ones(2, 1), torch.arange(1))
    with pytest.raises(ValueError, match=r"this program takes input_features, got \['input_ids'\]"):
        greedy_generate(programs, torch.ones(2, 12, dtype=torch.long), max_new_tokens=2, decoder_start_token_id=1)


def test_exported_llama_matches_eager_generate_for_every_shape_with_one_program(llama):
    upstream, programs = llama
    generator = torch.Generator().manual_seed(4)
    for batch_size, prompt_len in SHAPES:
        inputs = LLAMA.make_inputs(batch_size, prompt_len, generator)
        _assert_same_greedy(programs, upstream, inputs, f"batch={batch_size} prompt_len={prompt_len}")


@needs_executorch
@pytest.mark.parametrize(
    ("programs_fixture", "case", "shapes", "backend"),
    [
        pytest.param("t5_one_layer", T5_ONE_LAYER, SHAPES, None, id="t5-portable"),
        pytest.param("t5_one_layer", T5_ONE_LAYER, SHAPES, "xnnpack", marks=pytest.mark.slow, id="t5-xnnpack"),
        # Export and lowering cost about 40 s per one-layer model (measured): one model runs by default.
        pytest.param("bart_one_layer", BART_ONE_LAYER, SHAPES, None, marks=pytest.mark.slow, id="bart-portable"),
        pytest.param("marian_one_layer", MARIAN_ONE_LAYER, SHAPES, None, marks=pytest.mark.slow, id="marian-portable"),
        pytest.param(
            "whisper_features",
            WHISPER_ONE_LAYER,
            WHISPER_FEATURE_SHAPES,
            None,
            marks=pytest.mark.slow,
            id="whisper-input_features-portable",
        ),
    ],
)
def test_executorch_program_generates_eager_tokens_for_every_shape_on_shared_buffers(
    request, tmp_path, programs_fixture, case, shapes, backend
):
    upstream, programs = request.getfixturevalue(programs_fixture)
    runner = ExecuTorchPrograms(programs.to_executorch(tmp_path / "model.pte", backend=backend))
    assert runner.capacities == programs.capacities and runner.is_encoder_decoder
    assert runner.encoder_input == programs.encoder_input
    # decode reads the cross-attention cache that prefill wrote: equal tokens need both methods to share the buffers
    # and the runtime to keep them between calls.
    _assert_seq2seq_matches_eager(runner, upstream, shapes, seed=5, case=case, tolerance=EXECUTORCH_LOGITS_TOLERANCE)
    too_many = case.make_inputs(5, shapes[0][1], torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match=r"batch_size=5 exceeds max_batch_size=4"):
        runner.prefill(*_prefill_inputs(runner, too_many), torch.zeros(5, 1), torch.arange(1))
