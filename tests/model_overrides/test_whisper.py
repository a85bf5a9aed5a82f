"""FlexWhisperForConditionalGeneration against upstream Whisper generating with its DynamicCache.

`tests/generate/test_generation.py` runs the model-agnostic streams on the `whisper` case; these tests cover what is
Whisper's own: its generate (beam search, sampling through `temperature`, the cache it rebuilds and returns),
encoder outputs shorter than the cross-attention capacity, and the cross-attention mask that the override adds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSpeechSeq2Seq
from transformers.modeling_outputs import BaseModelOutput

import transformers_flexcache
from model_overrides.whisper import FlexWhisperAttention, FlexWhisperDecoder, FlexWhisperForConditionalGeneration
from tests.helpers import (
    assert_same_generation,
    assert_within_float_noise,
    exact_generation,
    generate_both,
    in_double,
    own_copy,
    to_double,
    upstream_generate,
)
from tests.model_cases import WHISPER, WHISPER_MAX_SOURCE_POSITIONS, WHISPER_NUM_MEL_BINS
from transformers_flexcache import FlexibleEncoderDecoderCache

MAX_ENCODER_LEN = WHISPER_MAX_SOURCE_POSITIONS
CAPACITY = {"max_batch_size": 6, "max_cache_len": 16, "max_encoder_len": MAX_ENCODER_LEN}
ATTN = ["eager", "sdpa"]


def _encoder_outputs(model, batch_size: int, length: int, generator: torch.Generator) -> BaseModelOutput:
    """The encoder's output on random log-mel features, trimmed to its first `length` positions."""
    # features: [B, mel, 2 * max_source_positions] -> last_hidden_state [B, length, d_model]
    features = torch.randn(batch_size, WHISPER_NUM_MEL_BINS, 2 * WHISPER_MAX_SOURCE_POSITIONS, generator=generator)
    with torch.no_grad():
        hidden_states = model.model.encoder(features).last_hidden_state
    return BaseModelOutput(last_hidden_state=hidden_states[:, :length].contiguous())


def _padded(encoder_outputs: BaseModelOutput, generator: torch.Generator) -> tuple[BaseModelOutput, torch.Tensor]:
    """Encoder outputs padded to `MAX_ENCODER_LEN` with large random values, and the mask of the live positions."""
    # last_hidden_state: [B, L_enc, d] -> ([B, MAX_ENCODER_LEN, d], mask [B, MAX_ENCODER_LEN])
    hidden_states = encoder_outputs.last_hidden_state
    batch_size, length, d_model = hidden_states.shape
    junk = 100 * torch.randn(batch_size, MAX_ENCODER_LEN - length, d_model, generator=generator)
    mask = torch.zeros(batch_size, MAX_ENCODER_LEN, dtype=torch.long)
    mask[:, :length] = 1
    return BaseModelOutput(last_hidden_state=torch.cat([hidden_states, junk], dim=1)), mask


def _assert_returned_cache_lengths_match(expected, actual) -> None:
    assert actual.cache.get_seq_length() == expected.cache.get_seq_length()
    want = expected.cache.cross_attention_cache.get_seq_length()
    assert actual.cache.cross_attention_cache.get_seq_length() == want


# (batch, encoder length): large -> small -> large, batch 1..4, within CAPACITY.
ENCODER_STREAM = [(3, 12), (1, 4), (4, 9), (2, 1), (4, 12), (1, 7)]


@pytest.mark.parametrize("attn", ATTN)
def test_encoder_outputs_of_varying_length_match_dynamic_cache_on_one_storage(attn):
    upstream, flex = WHISPER.build(attn)
    generator = torch.Generator().manual_seed(0)
    pointers = []
    for batch_size, length in ENCODER_STREAM:
        inputs = {"encoder_outputs": _encoder_outputs(upstream, batch_size, length, generator)}
        expected, actual = generate_both(upstream, flex, inputs, cache_config=CAPACITY, max_new_tokens=6)
        assert_same_generation(expected, actual)
        _assert_returned_cache_lengths_match(expected, actual)
        assert actual.cache.cross_attention_cache.get_seq_length() == length
        pointers.append(flex.flexible_cache.data_ptrs())
    assert all(p == pointers[0] for p in pointers), "the storage was reallocated within capacity"
    assert flex.flexible_cache.num_allocations == 2  # one self-attention and one cross-attention storage


@pytest.mark.parametrize("num_beams", [2, 3])
def test_beam_search_matches_dynamic_cache_with_the_same_sequence_scores(num_beams):
    upstream, flex = WHISPER.build()
    generator = torch.Generator().manual_seed(1)
    for batch_size, length in [(2, 12), (1, 5), (2, 9)]:
        inputs = WHISPER.make_inputs(batch_size, length, generator)
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config=CAPACITY, max_new_tokens=5, num_beams=num_beams
        )
        assert expected.sequences_scores is not None
        assert_same_generation(expected, actual)  # includes sequences_scores within 1e-5
        _assert_returned_cache_lengths_match(expected, actual)
    assert flex.flexible_cache.num_allocations == 2


def test_seeded_sampling_matches_dynamic_cache():
    # Whisper's generate samples when `temperature` > 0 (it sets `do_sample` from it).
    upstream, flex = WHISPER.build()
    generator = torch.Generator().manual_seed(2)
    for seed, (batch_size, length) in enumerate([(3, 12), (1, 6), (2, 10)]):
        inputs = WHISPER.make_inputs(batch_size, length, generator)
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config=CAPACITY, seed=seed, max_new_tokens=6, temperature=0.8
        )
        assert_same_generation(expected, actual)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_returned_cache_reports_the_lengths_written_not_the_capacity(num_beams):
    upstream, flex = WHISPER.build()
    inputs = WHISPER.make_inputs(2, 5, torch.Generator().manual_seed(3))
    config = {"max_batch_size": 6, "max_cache_len": 30, "max_encoder_len": MAX_ENCODER_LEN}
    expected, actual = generate_both(
        upstream, flex, inputs, cache_config=config, max_new_tokens=4, num_beams=num_beams
    )
    assert_same_generation(expected, actual)
    # decoder start token + 4 new tokens, the last of which is never fed back; 5 encoder positions
    assert actual.cache.get_seq_length() == expected.cache.get_seq_length() == 4
    assert actual.cache.cross_attention_cache.get_seq_length() == expected.cache.cross_attention_cache.get_seq_length()
    assert actual.cache.cross_attention_cache.get_seq_length() == 5
    assert (flex.flexible_cache.max_cache_len, flex.flexible_cache.max_encoder_len) == (30, MAX_ENCODER_LEN)
    # Upstream's Whisper copies rows 0..B-1 of its cache; ours is the flexible cache itself, which holds every row the
    # call ran (with beams, B x num_beams rows, as any other model's generate returns): its first rows are those.
    assert actual.cache is flex.flexible_cache and actual.cache.batch_size == 2 * num_beams
    lengths = {"self_attention_cache": 4, "cross_attention_cache": 5}

    def exact_kv():  # the same call in float64: the reference of the float32 keys' and values' noise
        exact = exact_generation(upstream, inputs, max_new_tokens=4, num_beams=num_beams).cache
        return [(layer.keys, layer.values) for name in lengths for layer in getattr(exact, name).layers]

    got, want = [], []
    for sub_cache, length in lengths.items():
        for layer_idx, layer in enumerate(getattr(expected.cache, sub_cache).layers):
            got += getattr(actual.cache, sub_cache).get_kv(layer_idx, 2, length)
            want += [layer.keys, layer.values]
    assert_within_float_noise(tuple(got), tuple(want), lambda: tuple(t for kv in exact_kv() for t in kv))


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("num_beams", [1, 2])
def test_padded_encoder_outputs_with_encoder_attention_mask_match_unpadded_ones(attn, num_beams):
    upstream, flex = WHISPER.build(attn)
    generator = torch.Generator().manual_seed(4)
    encoder_outputs = _encoder_outputs(upstream, 2, 5, generator)
    padded, mask = _padded(encoder_outputs, generator)
    common = {"max_new_tokens": 5, "num_beams": num_beams, "return_dict_in_generate": True, "output_scores": True}
    expected = upstream_generate(upstream, {"encoder_outputs": encoder_outputs}, **common)
    actual = flex.generate(
        encoder_outputs=padded,
        encoder_attention_mask=mask,
        cache_implementation="flexible_static",
        cache_config=CAPACITY,
        **common,
    )
    assert_same_generation(expected, actual)
    # the padded positions are written (a fixed shape) but masked
    assert actual.cache.cross_attention_cache.get_seq_length() == MAX_ENCODER_LEN


def test_rows_of_different_encoder_lengths_in_one_padded_batch_match_each_row_alone():
    upstream, flex = WHISPER.build()
    generator = torch.Generator().manual_seed(5)
    lengths = [5, 9, 12]
    rows = [_encoder_outputs(upstream, 1, length, generator) for length in lengths]
    padded_rows, masks = zip(*(_padded(row, generator) for row in rows), strict=True)
    actual = flex.generate(
        encoder_outputs=BaseModelOutput(last_hidden_state=torch.cat([p.last_hidden_state for p in padded_rows])),
        encoder_attention_mask=torch.cat(masks),
        cache_implementation="flexible_static",
        cache_config=CAPACITY,
        max_new_tokens=6,
        return_dict_in_generate=True,
        output_scores=True,
    )
    for row, encoder_outputs in enumerate(rows):
        # The row alone, repeated to the same batch size: CPU kernels for another batch size round differently
        # (upstream alone against itself at batch 1 and 3 differs by up to 2e-5 at these weights).
        repeated = {
            "encoder_outputs": BaseModelOutput(
                last_hidden_state=encoder_outputs.last_hidden_state.repeat(len(lengths), 1, 1)
            )
        }
        expected = upstream.generate(
            **own_copy(repeated), max_new_tokens=6, return_dict_in_generate=True, output_scores=True
        )
        num_tokens = expected.sequences.shape[1]
        assert torch.equal(actual.sequences[row, :num_tokens], expected.sequences[0]), row
        assert_within_float_noise(
            tuple(actual.scores[step][row] for step in range(len(expected.scores))),
            tuple(want[0] for want in expected.scores),
            lambda repeated=repeated: tuple(
                want[0] for want in exact_generation(upstream, repeated, max_new_tokens=6).scores
            ),
        )


@pytest.mark.parametrize("attn", ATTN)
def test_an_all_ones_encoder_attention_mask_leaves_outputs_bitwise_equal(attn):
    upstream, flex = WHISPER.build(attn)
    generator = torch.Generator().manual_seed(6)
    inputs = WHISPER.make_inputs(3, 7, generator)
    expected, _ = generate_both(upstream, flex, inputs, cache_config=CAPACITY, max_new_tokens=5)
    actual = flex.generate(
        **inputs,
        encoder_attention_mask=torch.ones(3, 7, dtype=torch.long),
        cache_implementation="flexible_static",
        cache_config=CAPACITY,
        max_new_tokens=5,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert_same_generation(expected, actual, atol=0.0)


def test_padded_encoder_outputs_without_a_mask_change_the_output():
    # Why the mask exists: upstream builds no cross-attention mask, so padding is attended to.
    upstream, flex = WHISPER.build()
    generator = torch.Generator().manual_seed(7)
    encoder_outputs = _encoder_outputs(upstream, 2, 5, generator)
    padded, _ = _padded(encoder_outputs, generator)
    decoder_input_ids = torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad():
        want = upstream(encoder_outputs=encoder_outputs, decoder_input_ids=decoder_input_ids).logits
        got = flex(encoder_outputs=padded, decoder_input_ids=decoder_input_ids).logits
    assert (want - got).abs().max() > 1e-2


def test_an_encoder_attention_mask_of_another_length_is_refused_before_the_cache_is_written():
    upstream, flex = WHISPER.build()
    generator = torch.Generator().manual_seed(8)
    padded, mask = _padded(_encoder_outputs(upstream, 2, 5, generator), generator)
    cache = FlexibleEncoderDecoderCache(
        config=flex.config, max_batch_size=2, max_cache_len=8, max_encoder_len=MAX_ENCODER_LEN
    )
    with pytest.raises(ValueError, match=r"covers 7 encoder positions but the encoder outputs have 12.*\[batch, 12\]"):
        flex(
            encoder_outputs=padded,
            decoder_input_ids=torch.ones(2, 1, dtype=torch.long),
            encoder_attention_mask=mask[:, :7],
            cache=cache,
            use_cache=True,
        )
    assert cache.get_seq_length() == cache.get_encoder_length() == 0


def test_attentions_and_hidden_states_are_recorded_as_upstream_records_them():
    # The swapped decoder class must be registered for output capture, as upstream registers its own classes.
    upstream, flex = WHISPER.build()
    generator = torch.Generator().manual_seed(9)
    encoder_outputs = _encoder_outputs(upstream, 2, 7, generator)
    decoder_input_ids = torch.randint(3, 99, (2, 3), generator=generator)
    cache = FlexibleEncoderDecoderCache(
        config=flex.config, max_batch_size=4, max_cache_len=8, max_encoder_len=MAX_ENCODER_LEN
    )
    common = {"decoder_input_ids": decoder_input_ids, "output_attentions": True, "output_hidden_states": True}
    with torch.no_grad():
        want = upstream(encoder_outputs=encoder_outputs, **common)
        got = flex(encoder_outputs=encoder_outputs, cache=cache, use_cache=True, **common)
        exact = in_double(upstream)(encoder_outputs=to_double(encoder_outputs), **common)
    for key in ("decoder_attentions", "cross_attentions", "decoder_hidden_states"):
        assert got[key] is not None and len(got[key]) == len(want[key]), key
        assert_within_float_noise(tuple(got[key]), tuple(want[key]), tuple(exact[key]))


def test_register_and_convert_give_the_whisper_override():
    upstream, _ = WHISPER.build()
    transformers_flexcache.register()
    try:
        model = AutoModelForSpeechSeq2Seq.from_config(WHISPER.build_config())
        assert type(model) is FlexWhisperForConditionalGeneration
    finally:
        transformers_flexcache.unregister()
    keys = set(upstream.state_dict())
    converted = transformers_flexcache.convert(upstream)
    assert type(converted) is FlexWhisperForConditionalGeneration
    assert type(converted.model.decoder) is FlexWhisperDecoder
    assert type(converted.model.decoder.layers[0].encoder_attn) is FlexWhisperAttention
    assert set(converted.state_dict()) == keys


def _timestamp_models():
    """Upstream and override Whisper whose generation config allows timestamps, which long-form generation needs."""
    upstream, flex = WHISPER.build()
    for model in (upstream, flex):
        model.generation_config.no_timestamps_token_id = 60  # ids above it are timestamps in the tiny vocabulary
        model.generation_config.max_initial_timestamp_index = 5
    return upstream, flex


@pytest.mark.parametrize(
    "fallback",
    [
        pytest.param({}, id="no-fallback"),
        # rows whose average log-probability is below the threshold are generated again, a subset of the batch
        pytest.param({"temperature": (0.0, 0.0, 0.0), "logprob_threshold": -0.9}, id="greedy-fallback"),
    ],
)
def test_padded_long_form_generation_matches_dynamic_cache_as_rows_finish_at_different_segments(fallback):
    # Whisper's generate calls upstream's once per 30-second segment (here 24 frames), on the rows still running:
    # each of those calls is padded to max_batch_size, not the whole call, so rows finishing early stop nothing else.
    upstream, flex = _timestamp_models()
    generator = torch.Generator().manual_seed(8)
    features = torch.randn(3, WHISPER_NUM_MEL_BINS, 60, generator=generator)  # 2.5 segments
    attention_mask = torch.ones(3, 60, dtype=torch.long)
    attention_mask[0, 30:] = 0  # row 0 ends within the second segment, rows 1 and 2 run a third
    common = {"max_new_tokens": 5, "do_sample": False, "return_timestamps": True, **fallback}
    expected = upstream.generate(input_features=features, attention_mask=attention_mask, **common)
    config = {"shape_policy": "padded", "max_batch_size": 4, "max_cache_len": 20, "max_encoder_len": MAX_ENCODER_LEN}
    actual = flex.generate(
        input_features=features,
        attention_mask=attention_mask,
        cache_implementation="flexible_static",
        cache_config=config,
        **common,
    )
    assert torch.equal(actual, expected), (actual, expected)
    # the last segment ran 2 rows (or fewer, after a fallback) on all 4 rows of the cache
    assert flex.flexible_cache.batch_size == 4
