"""A padded encoder call run on its real tokens only (`transformers_flexcache/models/packing.py`): the overrides' packed
encoders (T5, Marian, BART) against upstream's encoder on the same inputs, and the compiled encoder's choice of it."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from tests.helpers import assert_within_float_noise, in_double
from tests.model_cases import BART, MARIAN, MBART, T5
from transformers_flexcache.compile.config import FlexCompileConfig
from transformers_flexcache.compile.encoder import compiled_encoder, packs_encoder
from transformers_flexcache.models.packing import PackedRows, real_positions

# The packed encoder runs its linears on other rows than upstream's (a GEMM of N tokens, not B x L): float rounding,
# within the float noise of upstream's own encoding (tests/helpers.py, `assert_within_float_noise`).


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def padded_call(batch: int, length: int, pads: list[int], side: str = "right", seed: int = 0):
    """Random tokens, row `r` padded by `pads[r]` positions on `side` (pad id 0)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 90, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, num_pad in enumerate(pads):
        if num_pad:
            attention_mask[row, :num_pad] = 0 if side == "left" else 1
            attention_mask[row, length - num_pad :] = 1 if side == "left" else 0
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask


def upstream_encoding(upstream, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's encoder states of the call, and the same in float64 (the exact reference of their float noise)."""
    with torch.no_grad():
        return tuple(
            model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            for model in (upstream, in_double(upstream))
        )


def assert_packed_encoding(upstream_states: tuple, actual: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Upstream's states (`upstream_encoding`) at the real positions, zeros at the padding (where upstream computes
    states that every consumer masks)."""
    expected, exact = upstream_states
    real = attention_mask.bool()
    assert_within_float_noise(actual[real], expected[real], exact[real])
    assert torch.equal(actual[~real], torch.zeros_like(actual[~real]))
    assert expected[~real].abs().max() > 0.1  # upstream's padding states are not zeros: the test can tell them apart


def test_packed_rows_gather_the_real_tokens_and_put_them_back():
    attention_mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    states = torch.arange(6.0).view(2, 3, 1) + 1
    rows = PackedRows.of(attention_mask, real_positions(attention_mask))
    assert rows.index.tolist() == [0, 1, 4, 5]
    packed = rows.pack(states)
    assert packed.flatten().tolist() == [1.0, 2.0, 5.0, 6.0]
    assert rows.unpack(packed).flatten().tolist() == [1.0, 2.0, 0.0, 0.0, 5.0, 6.0]


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("case", [T5, MARIAN, BART], ids=["t5", "marian", "bart"])
def test_the_packed_encoder_gives_upstream_s_states_at_the_real_positions(case, side, attn_implementation):
    upstream, flex = case.build(attn_implementation)
    input_ids, attention_mask = padded_call(4, 9, [0, 3, 5, 8], side)
    with torch.no_grad():
        encoding = flex._flex_encode_packed(
            flex.get_encoder(), input_ids, attention_mask, real_positions(attention_mask)
        )
    assert type(encoding) is type(upstream.get_encoder()(input_ids=input_ids, attention_mask=attention_mask))
    expected = upstream_encoding(upstream, input_ids, attention_mask)
    assert_packed_encoding(expected, encoding.last_hidden_state, attention_mask)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(T5, id="t5"),
        pytest.param(MARIAN, id="marian", marks=pytest.mark.slow),  # compiles: 8-10 s each on 2 cores
        pytest.param(BART, id="bart", marks=pytest.mark.slow),
    ],
)
def test_the_compiled_encoder_packs_calls_in_one_graph_for_every_shape(case):
    # The first call has 2 rows of 2 tokens, all real (as a warm-up's): with dynamo's duck sizing its graph would
    # hold for rows == length only, and the next calls would compile again. The rows are unbacked: single rows (with
    # and without padding) run in the same graph, where a dynamic size of 1 would get a graph of its own.
    upstream, flex = case.build("sdpa")
    counter = CompileCounter()
    config = FlexCompileConfig(backend=lambda graph, inputs, **kwargs: counter(graph, inputs), fullgraph=True)
    encoder = compiled_encoder(flex, config)
    assert packs_encoder(flex)
    calls = [
        (2, 2, [0, 0]),
        (4, 7, [0, 2, 6, 3]),
        (1, 6, [0]),
        (3, 5, [1, 0, 0]),
        (1, 8, [3]),
        (2, 9, [0, 0]),
        (5, 5, [4, 0, 0, 0, 0]),
    ]
    with torch.no_grad():
        for batch, length, pads in calls:
            input_ids, attention_mask = padded_call(batch, length, pads, seed=batch)
            encoding = encoder(input_ids=input_ids, attention_mask=attention_mask)
            expected = upstream_encoding(upstream, input_ids, attention_mask)
            if any(pads):
                assert_packed_encoding(expected, encoding.last_hidden_state, attention_mask)
            else:
                assert_within_float_noise(encoding.last_hidden_state, *expected)
            # the rows are unbacked on views: the caller's tensors carry no mark into their own compiled functions
            assert not any(hasattr(tensor, "_dynamo_unbacked_indices") for tensor in (input_ids, attention_mask))
    assert counter.frame_count == 1


def test_calls_the_packed_encoder_does_not_take_run_the_encoder_as_it_is():
    upstream, flex = T5.build("sdpa")
    counter = CompileCounter()
    config = FlexCompileConfig(backend=lambda graph, inputs, **kwargs: counter(graph, inputs), fullgraph=True)
    encoder = compiled_encoder(flex, config)
    input_ids, attention_mask = padded_call(3, 6, [2, 0, 0])
    with torch.no_grad():
        # one real token in all, or no mask: the encoder as it is, its padding states upstream's
        one_token = attention_mask.clone()
        one_token[:, 1:], one_token[1:] = 0, 0
        lone = encoder(input_ids=input_ids, attention_mask=one_token)  # one real token in all
        assert_within_float_noise(lone.last_hidden_state, *upstream_encoding(upstream, input_ids, one_token))
        unmasked = encoder(input_ids=input_ids)
        assert_within_float_noise(unmasked.last_hidden_state, *upstream_encoding(upstream, input_ids, None))
    assert counter.frame_count == 2  # the plain graphs: with a mask, without
    assert not packs_encoder(flex.to(torch.float16))  # its layers clamp on a check over every position


def test_an_encoder_that_does_not_pack_compiles_one_graph_for_every_shape_too():
    # mBART has no packed encoder: its calls run the encoder as it is, also without duck sizing, so that a first call
    # of 2 rows of 2 tokens (the serving engine's warm-up) does not give a graph for rows == length only.
    upstream, flex = MBART.build("sdpa")
    counter = CompileCounter()
    config = FlexCompileConfig(backend=lambda graph, inputs, **kwargs: counter(graph, inputs), fullgraph=True)
    encoder = compiled_encoder(flex, config)
    assert not packs_encoder(flex)
    with torch.no_grad():
        for batch, length, pads in [(2, 2, [0, 0]), (3, 7, [0, 2, 4]), (4, 4, [1, 0, 0, 0])]:
            input_ids, attention_mask = padded_call(batch, length, pads, seed=batch)
            encoding = encoder(input_ids=input_ids, attention_mask=attention_mask)
            assert_within_float_noise(
                encoding.last_hidden_state, *upstream_encoding(upstream, input_ids, attention_mask)
            )
    assert counter.frame_count == 1
