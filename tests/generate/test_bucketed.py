"""shape_policy="bucketed": each call padded to the next bucket of its rows and lengths, outputs equal DynamicCache's,
and a bounded number of graphs, known in advance and compiled by `warmup` before serving.

Graphs are counted with `torch._dynamo.testing.CompileCounter` (traced, not compiled), as in tests/compile/test_compiled_generate.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import CompileConfig

from tests.helpers import assert_same_generation, assert_same_padded_generation, generate_both
from tests.model_cases import LLAMA, MODEL_CASES, T5
from transformers_flexcache import warmup
from transformers_flexcache.cache import CacheConfig, layer_specs_from_config
from transformers_flexcache.generate.policies import POLICIES

# Buckets below the tiny capacities, so that calls of the streams below land in different ones.
BUCKETS = {"max_cache_len": [8], "max_encoder_len": [6], "max_prompt_len": [6]}  # batch: 1, 2, 4 (powers of two)
CAPACITY = {"max_batch_size": 4, "max_cache_len": 16, "max_encoder_len": 12, "max_prompt_len": 12}
# (batch, prompt or encoder length, new tokens)
STREAM = [(4, 12, 3), (1, 5, 3), (3, 9, 2), (2, 3, 3), (4, 10, 2), (1, 7, 3)]

CASES = [pytest.param(case, id=case.name) for case in MODEL_CASES]
# Counting graphs traces every bucket (30-90 s per model on the shared 2-core machine): Llama, the fastest, stands for
# the feature in the default run; the other models run with `-m slow`.
GRAPH_CASES = [
    pytest.param(case, id=case.name, marks=[] if case is LLAMA else [pytest.mark.slow]) for case in MODEL_CASES
]


def bucketed_config(model, **overrides) -> dict:
    keep = "max_encoder_len" if model.config.is_encoder_decoder else "max_prompt_len"
    capacities = {k: v for k, v in CAPACITY.items() if k not in ("max_encoder_len", "max_prompt_len") or k == keep}
    return {**capacities, "shape_policy": "bucketed", "buckets": BUCKETS, **overrides}


def live_shape(cache) -> tuple[int, int, int | None]:
    """(rows, decoder length bucket, encoder length) that the call ran at, read from its returned cache."""
    self_cache = getattr(cache, "self_attention_cache", cache)
    attention_layer = next(layer for layer in self_cache.layers if hasattr(layer, "window_len"))
    encoder_len = cache.get_encoder_length() if hasattr(cache, "get_encoder_length") else None
    return self_cache.batch_size, attention_layer.window_len, encoder_len


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def counting_backend(counter: CompileCounter):
    # A function, not the counter: CompileConfig deep-copies its backend, and generate passes `mode=` to it.
    def backend(graph_module, example_inputs, **kwargs):
        return counter(graph_module, example_inputs)

    return backend


# --- outputs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("batch_size", "length", "new_tokens"), [(3, 9, 3), (1, 5, 4), (2, 12, 2)])
def test_bucketed_greedy_generation_matches_dynamic_cache(case, batch_size, length, new_tokens):
    upstream, flex = case.build("sdpa")
    inputs = case.make_inputs(batch_size, length, torch.Generator().manual_seed(batch_size))
    expected, actual = generate_both(
        upstream,
        flex,
        inputs,
        cache_config=bucketed_config(flex),
        max_new_tokens=new_tokens,
        do_sample=False,
        **case.generate_kwargs,
    )
    assert_same_padded_generation(
        upstream, flex, inputs, expected, actual, max_new_tokens=new_tokens, do_sample=False, **case.generate_kwargs
    )


@pytest.mark.parametrize("case", CASES)
def test_bucketed_beam_search_matches_dynamic_cache(case):
    upstream, flex = case.build("sdpa")
    inputs = case.make_inputs(1, 7, torch.Generator().manual_seed(0))
    expected, actual = generate_both(
        upstream,
        flex,
        inputs,
        cache_config=bucketed_config(flex),
        max_new_tokens=3,
        num_beams=2,
        do_sample=False,
        **case.generate_kwargs,
    )
    assert_same_padded_generation(
        upstream,
        flex,
        inputs,
        expected,
        actual,
        max_new_tokens=3,
        num_beams=2,
        do_sample=False,
        **case.generate_kwargs,
    )


@pytest.mark.parametrize(
    ("case", "batch_size", "length", "new_tokens", "expected"),
    [
        # rows to the next power of two; decoder length (new tokens) to 8 or 16; encoder length to 6 or 12
        pytest.param(T5, 3, 5, 3, (4, 8, 6), id="t5-batch3-encoder5"),
        pytest.param(T5, 1, 9, 10, (1, 16, 12), id="t5-batch1-encoder9-long"),
        # decoder-only: the prompt is left-padded to 6 or 12, then prompt + new tokens - 1 to 8 or 16
        pytest.param(LLAMA, 2, 4, 3, (2, 8, None), id="llama-batch2-prompt4"),
        pytest.param(LLAMA, 1, 7, 2, (1, 16, None), id="llama-batch1-prompt7"),
    ],
)
def test_bucketed_call_runs_at_the_buckets_of_its_rows_and_lengths(case, batch_size, length, new_tokens, expected):
    upstream, flex = case.build("sdpa")
    inputs = case.make_inputs(batch_size, length, torch.Generator().manual_seed(0))
    reference, actual = generate_both(
        upstream, flex, inputs, cache_config=bucketed_config(flex), max_new_tokens=new_tokens, do_sample=False
    )
    assert_same_generation(reference, actual)
    assert live_shape(actual.cache) == expected
    assert actual.sequences.shape[0] == batch_size  # the padding rows are cut from the outputs


def test_bucketed_call_with_padded_policy_capacities_attends_over_the_whole_capacity_only_when_it_needs_to():
    # The same call under both fixed-shape policies: padded attends over max_cache_len, bucketed over its bucket.
    upstream, flex = T5.build("sdpa")
    inputs = T5.make_inputs(2, 5, torch.Generator().manual_seed(0))
    shapes = {}
    for policy in ("padded", "bucketed"):
        config = bucketed_config(flex, shape_policy=policy)
        if policy == "padded":
            del config["buckets"]
        _, actual = generate_both(upstream, flex, inputs, cache_config=config, max_new_tokens=3, do_sample=False)
        shapes[policy] = (actual.cache.self_attention_cache.batch_size, actual.cache.get_encoder_length())
    assert shapes == {"padded": (4, 12), "bucketed": (2, 6)}


# --- graphs --------------------------------------------------------------------------------------------------


def stream_buckets(model) -> set[tuple]:
    """The decode-step shapes that STREAM visits under `bucketed_config`, worked out by hand from BUCKETS:
    (rows, decoder length bucket, encoder length bucket) or (rows, decoder length bucket)."""

    def up(value, sizes):
        return next(size for size in sizes if size >= value)

    specs = layer_specs_from_config(model.config)
    # every layer a sliding window (Mistral): each layer holds `window` positions whatever the decoder length bucket
    sliding = all(spec.layer_type == "sliding_attention" for spec in specs)
    window = max(spec.sliding_window for spec in specs) if sliding else None
    visited = set()
    for batch_size, length, new_tokens in STREAM:
        rows = up(batch_size, [1, 2, 4])
        if model.config.is_encoder_decoder:
            visited.add((rows, up(new_tokens, [8, 16]), up(length, [6, 12])))
        else:
            span = up(up(length, [6, 12]) + new_tokens - 1, [8, 16])
            visited.add((rows, span if window is None else min(span, window)))
    return visited


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_bucketed_stream_compiles_one_decode_graph_per_bucket_it_visits(case):
    upstream, flex = case.build("sdpa")
    counter = CompileCounter()
    compile_config = CompileConfig(backend=counting_backend(counter), fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True
    generator = torch.Generator().manual_seed(0)
    for batch_size, length, new_tokens in STREAM:
        inputs = case.make_inputs(batch_size, length, generator)
        expected, actual = generate_both(
            upstream,
            flex,
            inputs,
            cache_config=bucketed_config(flex),
            max_new_tokens=new_tokens,
            do_sample=False,
            compile_config=compile_config,
            **case.generate_kwargs,
        )
        common = {"max_new_tokens": new_tokens, "do_sample": False, **case.generate_kwargs}
        assert_same_padded_generation(upstream, flex, inputs, expected, actual, **common)
    # Whisper's log-mel input (length 12, the tiny encoder's window) and its shorter encoder outputs land in the same
    # buckets as the token lengths of the other models.
    assert counter.frame_count == len(stream_buckets(flex))
    # ... and at most the number of shapes the policy announces in advance
    config = CacheConfig.parse(bucketed_config(flex))
    assert counter.frame_count <= len(POLICIES["bucketed"].call_shapes(flex, config, max_new_tokens=3))


def warm_then_stream(case, compile_config, config, counter: CompileCounter, *, padded: bool) -> tuple[list, int]:
    """`warmup()` under `config`, then STREAM, each call checked against upstream's DynamicCache (at the padded-call
    tolerance where `padded`, else the default one); returns the shapes warmed and the graphs counted after the
    warm-up (the caller compares them with `counter` after the stream)."""
    upstream, flex = case.build("sdpa")
    generator = torch.Generator().manual_seed(1)
    shapes = warmup(
        flex,
        lambda b, n: case.make_inputs(b, n, generator),
        max_new_tokens=3,
        cache_config=config(flex),
        compile_config=compile_config,
    )
    warmed = counter.frame_count
    for batch_size, length, new_tokens in STREAM:
        inputs = case.make_inputs(batch_size, length, generator)
        common = {"max_new_tokens": new_tokens, "do_sample": False}
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config=config(flex), compile_config=compile_config, **common
        )
        if padded:
            assert_same_padded_generation(upstream, flex, inputs, expected, actual, **common)
        else:
            assert_same_generation(expected, actual)
    return shapes, warmed


@pytest.mark.parametrize("case", [pytest.param(T5, id="t5", marks=pytest.mark.slow), pytest.param(LLAMA, id="llama")])
def test_warmup_compiles_every_bucket_so_that_a_stream_compiles_nothing_more(case):
    counter = CompileCounter()
    compile_config = CompileConfig(backend=counting_backend(counter), fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True
    shapes, warmed = warm_then_stream(case, compile_config, bucketed_config, counter, padded=False)
    # rows 1, 2, 4 x lengths 6, 12; every new-token count up to 3 stays in decoder length bucket 8, except after a
    # decoder-only prompt of 12 (12 + 3 - 1 > 8): then only bucket 16
    assert len(shapes) == 3 * 2
    assert warmed <= len(shapes)
    assert counter.frame_count == warmed


def test_warmup_compiles_the_encoder_of_every_bucket_too_when_the_config_asks():
    # FlexCompileConfig(compile_encoder=True), as compile_config_for_cpu() makes it: the encoder graphs are compiled
    # by warmup() beside the decode graphs; the stream (rows 1 to 4, lengths 3 to 12) then compiles nothing.
    from transformers_flexcache.compile import FlexCompileConfig

    counter = CompileCounter()
    compile_config = FlexCompileConfig(backend=counting_backend(counter), fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True
    # rows 2 and 4, encoder length 12
    shapes, warmed = warm_then_stream(
        T5, compile_config, lambda flex: bucketed_config(flex, buckets={"max_batch_size": [2]}), counter, padded=True
    )
    assert len(shapes) == 2
    # a decode graph per shape, and one encoder graph (dynamic shapes) for every rows: T5's packs its real tokens, its
    # rows unbacked (warmup()'s call of a single row, no bucket being one row here, compiles nothing more)
    assert warmed == 2 + 1
    assert counter.frame_count == warmed


def test_call_shapes_are_every_combination_of_buckets_known_before_any_call():
    _, flex = T5.build()
    config = CacheConfig.parse(
        {
            "shape_policy": "bucketed",
            "max_batch_size": 8,
            "max_cache_len": 32,
            "max_encoder_len": 48,
            "buckets": {"max_batch_size": [2, 8], "max_encoder_len": [16, 32]},
        }
    )
    shapes = POLICIES["bucketed"].call_shapes(flex, config, max_new_tokens=20)
    # rows 2, 8 x encoder lengths 16, 32, 48 x decoder lengths 16, 32 (20 new tokens reach the second)
    assert {(s.batch_size, s.length, s.cache_len) for s in shapes} == {
        (rows, length, window) for rows in (2, 8) for length in (16, 32, 48) for window in (16, 32)
    }
    assert all(s.max_new_tokens == (16 if s.cache_len == 16 else 20) for s in shapes)
    padded = CacheConfig.parse({**config.to_dict(), "shape_policy": "padded", "buckets": None})
    assert [
        (s.batch_size, s.length, s.cache_len) for s in POLICIES["padded"].call_shapes(flex, padded, max_new_tokens=20)
    ] == [(8, 48, 32)]


def test_warmup_refuses_more_shapes_than_dynamo_keeps_graphs_of_one_function():
    _, flex = T5.build()
    # dynamo's own patch: monkeypatch's undo deletes the attribute from dynamo's config module, breaking later tests
    with (
        torch._dynamo.config.patch(recompile_limit=2),
        pytest.raises(ValueError, match=r"6 shapes to compile exceed torch._dynamo.config.recompile_limit=2"),
    ):
        warmup(flex, lambda b, n: {}, max_new_tokens=3, cache_config=bucketed_config(flex))


def test_a_warmup_that_reaches_the_limit_with_another_models_graphs_says_why():
    # Every flexible model's forward is one function to dynamo: a copy's warm-up counts the first model's graphs too.
    import copy

    _, flex = LLAMA.build("sdpa")
    twin = copy.deepcopy(flex)
    config = {"max_batch_size": 2, "max_cache_len": 12, "max_prompt_len": 6, "shape_policy": "padded"}
    compile_config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # compile on the CPU too (upstream compiles CUDA only by default)

    def make_inputs(batch_size, length):
        return {"input_ids": torch.full((batch_size, length), 5), "attention_mask": torch.ones(batch_size, length)}

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            assert (
                len(warmup(flex, make_inputs, max_new_tokens=4, cache_config=config, compile_config=compile_config))
                == 1
            )
            # the copy at other capacities: a graph of its own (with frozen weights, as under compile_config_for_cpu,
            # even the same shapes make one: its weights are other constants)
            other = {**config, "max_batch_size": 3}
            with pytest.raises(RuntimeError, match=r"graphs compiled earlier in this process for other models"):
                warmup(twin, make_inputs, max_new_tokens=4, cache_config=other, compile_config=compile_config)
    finally:
        torch._dynamo.reset()


def test_warmup_refuses_the_exact_policy_and_unset_capacities():
    _, flex = T5.build()
    with pytest.raises(ValueError, match="fixed-shape policy"):
        warmup(flex, lambda b, n: {}, max_new_tokens=3, cache_config={"max_batch_size": 2})
    with pytest.raises(ValueError, match=r"set \['max_cache_len', 'max_encoder_len'\]"):
        warmup(flex, lambda b, n: {}, max_new_tokens=3, cache_config={"shape_policy": "bucketed", "max_batch_size": 2})


# --- config ----------------------------------------------------------------------------------------------------


def test_default_buckets_are_powers_of_two_up_to_the_capacity_which_is_always_the_last():
    config = CacheConfig(shape_policy="bucketed")
    assert config.buckets_of("max_batch_size", 8) == (1, 2, 4, 8)
    assert config.buckets_of("max_batch_size", 6) == (1, 2, 4, 6)
    assert config.buckets_of("max_encoder_len", 48) == (16, 32, 48)
    assert config.buckets_of("max_cache_len", 13) == (13,)
    assert [config.bucket_for("max_batch_size", b, capacity=8) for b in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_configured_buckets_above_the_capacity_are_not_used_and_survive_a_round_trip():
    config = CacheConfig.parse({"shape_policy": "bucketed", "buckets": {"max_batch_size": [1, 4, 16]}})
    assert config.buckets_of("max_batch_size", 8) == (1, 4, 8)
    assert CacheConfig.parse(config.to_dict()) == config
    assert config.to_dict()["buckets"] == {"max_batch_size": [1, 4, 16]}


@pytest.mark.parametrize(
    ("cache_config", "message"),
    [
        ({"buckets": {"max_batch_size": [1, 2]}}, 'only applies to shape_policy="bucketed"'),
        ({"shape_policy": "bucketed", "buckets": [1, 2]}, "must be a dict"),
        ({"shape_policy": "bucketed", "buckets": {"batch": [1, 2]}}, r"keys \['batch'\] are not bucketed shapes"),
        ({"shape_policy": "bucketed", "buckets": {"max_batch_size": []}}, "non-empty list"),
        ({"shape_policy": "bucketed", "buckets": {"max_batch_size": [4, 2]}}, "must be increasing"),
        ({"shape_policy": "bucketed", "buckets": {"max_batch_size": [0, 2]}}, "must be a positive int"),
    ],
)
def test_bad_buckets_are_refused_with_the_value_and_the_fix(cache_config, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig.parse(cache_config)
