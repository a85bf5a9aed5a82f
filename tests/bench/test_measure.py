"""What the benchmark measures: bytes of a decode step, compile time apart from warm time."""

from __future__ import annotations

import pytest
import torch

from tests.model_cases import LLAMA, T5
from transformers_flexcache.bench.measure import CallRecord, DecodeStepBytes, summarize
from transformers_flexcache.bench.stream import bench_buckets


def test_decode_step_bytes_are_every_weight_the_step_reads_with_embeddings_by_rows_and_the_live_cache():
    upstream, _ = LLAMA.build("sdpa")
    config = upstream.config
    inputs = LLAMA.make_inputs(3, 5, torch.Generator().manual_seed(0))
    with DecodeStepBytes(upstream, step=3) as counted:  # the second decode step
        upstream.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    item = 4  # float32
    embedding = upstream.get_input_embeddings().weight
    everything_else = sum(p.numel() for p in upstream.parameters()) - embedding.numel()
    assert counted.weight_bytes == (everything_else + 3 * config.hidden_size) * item  # one token per row
    # before the second decode step the cache holds the prompt and one generated token per row, all layers
    head_dim = config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * item
    assert counted.cache_bytes == 3 * (5 + 1) * per_position


def record(wall_s, compile_s, batch_size=2, steps=(0.01, 0.02)):
    return CallRecord(
        wall_s=wall_s, num_tokens=4, tokens=torch.zeros(batch_size, 2), step_s=list(steps), compile_s=compile_s
    )


def test_compile_time_counts_warm_up_and_stream_and_the_warm_wall_time_leaves_the_stream_compile_out():
    figures = summarize([record(10.0, 8.0), record(1.0, 0.0)], warm_up=record(30.0, 29.0))
    assert figures["compile_s"] == pytest.approx(37.0)
    assert figures["wall_s"] == pytest.approx(11.0)
    assert figures["warm_wall_s"] == pytest.approx(3.0)
    assert figures["tokens_per_s"] == pytest.approx(8 / 3.0)


def test_largest_batch_step_is_the_median_step_of_the_calls_at_the_largest_batch():
    calls = [record(1.0, 0.0, batch_size=8, steps=(0.03, 0.05, 0.04)), record(1.0, 0.0, batch_size=1, steps=(0.01,))]
    assert summarize(calls)["largest_batch_step_ms"] == pytest.approx(40.0)


@pytest.mark.parametrize(
    ("encoder_decoder", "capacities", "expected"),
    [
        (
            True,
            {"max_batch_size": 8, "max_cache_len": 13, "max_encoder_len": 48},
            {"max_batch_size": [1, 2, 4, 6], "max_encoder_len": [48]},
        ),
        (
            True,
            {"max_batch_size": 8, "max_cache_len": 13, "max_encoder_len": 200},
            {"max_batch_size": [1, 2, 4, 6], "max_encoder_len": [100]},
        ),
        (
            False,
            {"max_batch_size": 8, "max_cache_len": 60, "max_prompt_len": 48},
            {"max_batch_size": [1, 4], "max_prompt_len": [12, 24, 36], "max_cache_len": [35]},
        ),
    ],
)
def test_bench_buckets_take_rows_in_quarters_the_encoder_length_halved_past_64_and_decoder_only_prompts_in_quarters(
    encoder_decoder, capacities, expected
):
    assert bench_buckets(capacities, encoder_decoder=encoder_decoder, new_tokens=12) == expected


def test_bench_buckets_of_a_decoder_only_model_make_six_decode_shapes_whatever_the_prompt_buckets():
    from transformers_flexcache.cache import CacheConfig
    from transformers_flexcache.generate.policies import POLICIES
    from transformers_flexcache.models.registry import convert

    upstream, _ = LLAMA.build("sdpa")
    model = convert(upstream)
    capacities = {"max_batch_size": 8, "max_cache_len": 59, "max_prompt_len": 48}
    buckets = bench_buckets(capacities, encoder_decoder=False, new_tokens=12)
    config = CacheConfig.parse({**capacities, "shape_policy": "bucketed", "buckets": buckets})
    shapes = POLICIES["bucketed"].call_shapes(model, config, max_new_tokens=12, expand=1)
    assert {shape.length for shape in shapes} == {12, 24, 36, 48}
    # generate compiles one decode graph per rows and decoder length: the prompt buckets add none
    assert {(shape.batch_size, shape.cache_len) for shape in shapes} == {
        (1, 35),
        (1, 59),
        (4, 35),
        (4, 59),
        (8, 35),
        (8, 59),
    }


def test_bench_buckets_of_an_encoder_decoder_model_make_five_decode_shapes_at_the_default_stream():
    from transformers_flexcache.cache import CacheConfig
    from transformers_flexcache.generate.policies import POLICIES
    from transformers_flexcache.models.registry import convert

    upstream, _ = T5.build("sdpa")
    model = convert(upstream)
    capacities = {"max_batch_size": 8, "max_cache_len": 13, "max_encoder_len": 48}
    buckets = bench_buckets(capacities, encoder_decoder=True, new_tokens=12, min_encoder_len=8)
    config = CacheConfig.parse({**capacities, "shape_policy": "bucketed", "buckets": buckets})
    shapes = POLICIES["bucketed"].call_shapes(model, config, max_new_tokens=12, expand=1)
    # one decode graph per rows bucket, every one at the encoder length's capacity
    assert {(shape.batch_size, shape.length) for shape in shapes} == {(rows, 48) for rows in (1, 2, 4, 6, 8)}


def test_an_int8_decode_step_counts_int8_weights_by_their_int8_data_and_scales():
    pytest.importorskip("torchao")
    from transformers_flexcache import quantize

    upstream, _ = LLAMA.build("sdpa")
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(0))
    with DecodeStepBytes(upstream, step=3) as fp32:
        upstream.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    linears = [module for module in upstream.modules() if isinstance(module, torch.nn.Linear)]
    float_bytes = sum(4 * module.weight.numel() for module in linears)
    # int8 data, and per row an fp32 scale and an int8 zero point (torchao keeps one even for symmetric weights)
    int8_bytes = sum(module.weight.numel() + 5 * module.out_features for module in linears)
    quantize(upstream, "int8")
    with DecodeStepBytes(upstream, step=3) as int8:
        upstream.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert fp32.weight_bytes - int8.weight_bytes == float_bytes - int8_bytes


def test_top_margins_are_each_steps_best_score_minus_the_second_best():
    from transformers_flexcache.bench.measure import top_margins

    scores = (torch.tensor([[1.0, 3.0, 2.5], [0.0, 0.0, -1.0]]), torch.tensor([[5.0, -float("inf"), 1.0], [2, 1, 9]]))
    assert torch.equal(top_margins(scores), torch.tensor([[0.5, 4.0], [0.0, 7.0]]))


def test_step_by_batch_is_the_median_step_of_the_calls_at_each_batch_size():
    calls = [
        record(1.0, 0.0, batch_size=8, steps=(0.03, 0.05, 0.04)),
        record(1.0, 0.0, batch_size=1, steps=(0.01, 0.03)),
        record(1.0, 0.0, batch_size=1, steps=(0.02,)),
    ]
    assert summarize(calls)["step_ms_by_batch"] == pytest.approx({1: 20.0, 8: 40.0})


def test_scores_are_compared_only_at_steps_where_both_runs_had_the_same_prefix():
    from transformers_flexcache.bench.measure import same_prefix_score_diff

    def run(tokens, scores):
        return CallRecord(wall_s=1.0, num_tokens=4, tokens=torch.tensor(tokens), scores=torch.tensor(scores))

    reference = run([[1, 2, 3]], [[[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]])
    # step 0 and 1 scored the same prefix (the tokens part after step 1); step 2 did not and is left out
    other = run([[1, 5, 3]], [[[0.0, 1.5], [0.25, 1.0], [9.0, 9.0]]])
    assert same_prefix_score_diff(other, reference) == pytest.approx(0.5)
    assert same_prefix_score_diff(run([[1, 2, 3]], [[[0.0, 1.0]] * 3]), reference) == 0.0


def test_bench_buckets_leave_out_an_encoder_bucket_that_no_call_of_the_stream_fits():
    # Whisper's encoder length is always its capacity (1500): a half bucket would be one more graph, never used.
    capacities = {"max_batch_size": 2, "max_cache_len": 13, "max_encoder_len": 1500}
    buckets = bench_buckets(capacities, encoder_decoder=True, new_tokens=12, min_encoder_len=1500)
    assert buckets == {"max_batch_size": [1], "max_encoder_len": [1500]}


def test_bench_buckets_of_a_single_row_capacity_are_that_row():
    # a bucket list is never empty (CacheConfig refuses one): `--max-batch-size 1` runs at its one row
    capacities = {"max_batch_size": 1, "max_cache_len": 13, "max_encoder_len": 48}
    assert bench_buckets(capacities, encoder_decoder=True, new_tokens=12)["max_batch_size"] == [1]
