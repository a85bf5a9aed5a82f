"""The in-flight engine against `generate` alone: every request's tokens equal upstream's DynamicCache on that request
alone, whatever runs beside it and whenever it was admitted.

The oracle of each request is upstream's model generating it alone (seeded with the request's seed where it samples),
computed before the engine starts: the engine switches torch's global generator per request while its workers run,
so a reference drawn from it at the same time would interleave. Every wait is bounded (`TIMEOUT`).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import CompileConfig

from tests.helpers import assert_same_generation, counting_compile_config, own_copy, record_reference
from tests.model_cases import MODEL_CASES, WHISPER_MAX_SOURCE_POSITIONS
from transformers_flexcache.serving import (
    Engine,
    EngineClosedError,
    QueueFullError,
    RequestCancelledError,
)

TIMEOUT = 120  # seconds: any wait longer than this is a hang
# Cases whose whole stream runs by default (the first version's models, a BART copy, the hybrid and all-sliding
# generic models); the others run with -m slow.
DEFAULT_CASES = {"llama", "t5", "bart", "whisper", "jamba", "pix2struct", "marian", "gemma3_text"}


def cases() -> list:
    return [
        pytest.param(case, id=case.name, marks=[] if case.name in DEFAULT_CASES else [pytest.mark.slow])
        for case in MODEL_CASES
    ]


def capacities(model, *, seats: int = 4) -> dict:
    config = {"max_batch_size": seats, "max_cache_len": 40}
    if model.config.is_encoder_decoder:
        config["max_encoder_len"] = 16
    return config


def request_stream(case, *, num_requests: int = 6) -> list[tuple[dict, dict, int]]:
    """`(inputs, generate kwargs, seed)` of one-row requests of varied lengths and decoding methods."""
    generator = torch.Generator().manual_seed(7)
    methods = [
        {"num_beams": 2, "num_return_sequences": 2, "output_scores": True, "return_dict_in_generate": True},
        {"do_sample": True, "top_k": 20},
        {},
        {"min_new_tokens": 4},
        {"do_sample": True, "num_return_sequences": 2},
        {"num_beams": 3, "length_penalty": 0.5},
    ]
    stream = []
    for index in range(num_requests):
        length = WHISPER_MAX_SOURCE_POSITIONS if case.name == "whisper" else 3 + (5 * index) % 11
        kwargs = {"max_new_tokens": 4 + (3 * index) % 9, **methods[index % len(methods)], **case.generate_kwargs}
        stream.append((case.make_inputs(1, length, generator), kwargs, 1000 + index))
    return stream


def reference(upstream, inputs: dict, kwargs: dict, seed: int):
    torch.manual_seed(seed)
    rng_state = torch.get_rng_state()
    expected = upstream.generate(**own_copy(inputs), **kwargs)
    if isinstance(expected, torch.Tensor):
        return expected
    return record_reference(expected, upstream, inputs, kwargs, rng_state)


def assert_same_output(expected, actual) -> None:
    """Tokens equal; scores bit for bit or within upstream's float noise on the request (`assert_same_generation`):
    the engine runs a request's rows batched with others, which sums floats in other orders."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), (actual.tolist(), expected.tolist())
        return
    assert_same_generation(expected, actual)


@pytest.mark.parametrize("case", cases())
def test_every_request_equals_generate_alone_when_submitted_from_several_threads(case):
    upstream, flex = case.build("sdpa")
    stream = request_stream(case)
    expected = [reference(upstream, inputs, kwargs, seed) for inputs, kwargs, seed in stream]
    handles: dict[int, object] = {}
    with Engine(flex, cache_config=capacities(flex)) as engine:

        def submit(indices):
            for index in indices:
                inputs, kwargs, seed = stream[index]
                handles[index] = engine.submit(**own_copy(inputs), seed=seed, **kwargs)
                time.sleep(0.01)  # later requests join a running batch

        threads = [threading.Thread(target=submit, args=(range(start, len(stream), 2),)) for start in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        outputs = [handles[index].result(timeout=TIMEOUT) for index in range(len(stream))]
        steps = sorted(handles[index].admitted_at_step for index in range(len(stream)))
    for want, got in zip(expected, outputs, strict=True):
        assert_same_output(want, got)
    # 6 requests of 1-3 seats on 4 seats: some joined a batch that was already decoding.
    assert steps[-1] > 0, steps


def test_the_engine_runs_the_model_under_the_torch_settings_of_the_thread_that_built_it():
    """torch's config is per thread (a ContextVar): the scheduler and request threads run in a copy of the context
    that built the engine, so that a raised recompile limit (or any other torch setting) applies to their compiles."""
    case = next(case for case in MODEL_CASES if case.name == "t5")
    _, flex = case.build("sdpa")
    seen = set()
    flex.register_forward_pre_hook(lambda module, args: seen.add(torch._dynamo.config.recompile_limit))
    raised = torch._dynamo.config.recompile_limit + 5
    with torch._dynamo.config.patch(recompile_limit=raised):
        engine = Engine(flex, cache_config=capacities(flex))
    with engine:
        inputs = case.make_inputs(1, 5, torch.Generator().manual_seed(0))
        engine.submit(**inputs, max_new_tokens=3).result(timeout=TIMEOUT)
    assert seen == {raised}


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_requests_without_a_mask_share_a_padded_batch_as_if_alone(name):
    # Admitted together, sources (or prompts) of different lengths are right-padded into one encoder call and one
    # prefill: the engine masks the padding itself when a request brings no attention mask.
    case = next(case for case in MODEL_CASES if case.name == name)
    upstream, flex = case.build("sdpa")
    generator = torch.Generator().manual_seed(13)
    stream = [{"input_ids": case.make_inputs(1, length, generator)["input_ids"]} for length in (9, 4, 12, 6)]
    expected = [upstream.generate(**inputs, max_new_tokens=6) for inputs in stream]
    with Engine(flex, cache_config=capacities(flex)) as engine:
        handles = [engine.submit(**inputs, max_new_tokens=6) for inputs in stream]
        outputs = [handle.result(timeout=TIMEOUT) for handle in handles]
        assert len({handle.admitted_at_step for handle in handles}) < len(handles)  # some were admitted together
    for want, got in zip(expected, outputs, strict=True):
        assert torch.equal(got, want)


def test_a_sampled_request_gives_the_same_tokens_whatever_runs_beside_it():
    case = next(case for case in MODEL_CASES if case.name == "llama")
    upstream, flex = case.build("sdpa")
    generator = torch.Generator().manual_seed(3)
    request = (case.make_inputs(1, 6, generator), {"do_sample": True, "max_new_tokens": 12})
    others = [(case.make_inputs(1, 4 + i, generator), {"do_sample": True, "max_new_tokens": 5 + i}) for i in range(5)]
    with Engine(flex, cache_config=capacities(flex)) as engine:
        alone = engine.submit(**request[0], seed=11, **request[1]).result(timeout=TIMEOUT)
        crowd = [engine.submit(**inputs, seed=20 + i, **kwargs) for i, (inputs, kwargs) in enumerate(others[:3])]
        beside = engine.submit(**request[0], seed=11, **request[1])
        crowd += [engine.submit(**inputs, seed=30 + i, **kwargs) for i, (inputs, kwargs) in enumerate(others[3:])]
        beside = beside.result(timeout=TIMEOUT)
        for handle in crowd:
            handle.result(timeout=TIMEOUT)
    assert torch.equal(alone, beside)
    assert torch.equal(alone, reference(upstream, request[0], request[1], 11))


def char_tokenizer():
    """A character-level tokenizer over the tiny models' 99 ids (what stop strings need to match text)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "</s>", "<unk>", *string.ascii_lowercase, *string.digits, *string.ascii_uppercase]
    vocab += [f"<x{i}>" for i in range(len(vocab), 99)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def test_stop_strings_stop_each_request_as_generate_does():
    case = next(case for case in MODEL_CASES if case.name == "t5")
    upstream, flex = case.build("sdpa")
    tokenizer = char_tokenizer()
    generator = torch.Generator().manual_seed(5)
    stream = [case.make_inputs(1, 5 + i, generator) for i in range(4)]
    free = [upstream.generate(**inputs, max_new_tokens=10, min_new_tokens=10) for inputs in stream]
    # Stop at the third new token of each request's own free run: every request stops at its own step.
    stops = [[tokenizer.decode(tokens[0, 3:4])] for tokens in free]
    common = {"max_new_tokens": 10, "min_new_tokens": 2}
    expected = [
        upstream.generate(**inputs, stop_strings=stop, tokenizer=tokenizer, **common)
        for inputs, stop in zip(stream, stops, strict=True)
    ]
    with Engine(flex, cache_config=capacities(flex), tokenizer=tokenizer) as engine:
        handles = [
            engine.submit(**inputs, stop_strings=stop, **common) for inputs, stop in zip(stream, stops, strict=True)
        ]
        outputs = [handle.result(timeout=TIMEOUT) for handle in handles]
    for want, got in zip(expected, outputs, strict=True):
        assert torch.equal(got, want)
    assert all(got.shape[1] < run.shape[1] for got, run in zip(outputs, free, strict=True))  # each stopped early


# --- admission and seats ----------------------------------------------------------------------------------------
def long_requests(case, count: int, *, new_tokens: int = 30) -> list[dict]:
    generator = torch.Generator().manual_seed(9)
    return [case.make_inputs(1, 4, generator) for _ in range(count)], {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
    }


def test_requests_are_admitted_first_come_first_served_and_a_large_one_is_not_overtaken():
    case = next(case for case in MODEL_CASES if case.name == "llama")
    _, flex = case.build("sdpa")
    generator = torch.Generator().manual_seed(2)
    with Engine(flex, cache_config=capacities(flex, seats=4)) as engine:
        small = {"max_new_tokens": 8, "min_new_tokens": 8}
        first = [engine.submit(**case.make_inputs(1, 4, generator), **small) for _ in range(3)]
        large = engine.submit(**case.make_inputs(1, 4, generator), num_beams=4, **small)  # all four seats
        later = [engine.submit(**case.make_inputs(1, 4, generator), **small) for _ in range(3)]
        for handle in [*first, large, *later]:
            handle.result(timeout=TIMEOUT)
    order = [handle.admitted_at for handle in [*first, large, *later]]
    assert order == sorted(order)  # nobody overtook the four-seat request waiting at the head of the queue
    assert large.admitted_at_step > first[0].admitted_at_step  # it waited for seats, and got them
    assert engine.stats["finished"] == 7


def test_a_finished_request_gives_its_seats_back_at_once():
    case = next(case for case in MODEL_CASES if case.name == "t5")
    _, flex = case.build("sdpa")
    generator = torch.Generator().manual_seed(4)
    with Engine(flex, cache_config=capacities(flex, seats=2)) as engine:
        short = engine.submit(**case.make_inputs(1, 5, generator), max_new_tokens=2, min_new_tokens=2)
        long = engine.submit(**case.make_inputs(1, 5, generator), max_new_tokens=30, min_new_tokens=30)
        short.result(timeout=TIMEOUT)
        joined = engine.submit(**case.make_inputs(1, 5, generator), max_new_tokens=2, min_new_tokens=2)
        joined.result(timeout=TIMEOUT)
        assert not long.done()  # the third request took the short one's seat while the long one ran
        long.result(timeout=TIMEOUT)
        assert engine.seats_in_use == 0
    assert joined.admitted_at_step > short.admitted_at_step


def test_steady_state_allocates_no_cache_storage():
    case = next(case for case in MODEL_CASES if case.name == "bart")
    _, flex = case.build("sdpa")
    generator = torch.Generator().manual_seed(6)
    with Engine(flex, cache_config=capacities(flex)) as engine:
        pointers, nbytes = engine.cache.data_ptrs(), engine.nbytes
        handles = [engine.submit(**case.make_inputs(1, 3 + i, generator), max_new_tokens=4 + i) for i in range(8)]
        for handle in handles:
            handle.result(timeout=TIMEOUT)
        assert engine.cache.data_ptrs() == pointers
        assert engine.nbytes == nbytes
        assert engine.cache.num_allocations == 2  # self- and cross-attention halves, once each
        assert Engine.nbytes_for(flex, capacities(flex)) == nbytes  # told before allocating


def test_iterating_a_handle_yields_the_new_tokens_as_decoded():
    case = next(case for case in MODEL_CASES if case.name == "llama")
    _, flex = case.build("sdpa")
    inputs = case.make_inputs(1, 5, torch.Generator().manual_seed(8))
    with Engine(flex, cache_config=capacities(flex)) as engine:
        greedy = engine.submit(**inputs, max_new_tokens=6, num_return_sequences=1)
        streamed = list(greedy)
        beams = engine.submit(**inputs, max_new_tokens=6, num_beams=2, num_return_sequences=2)
        beam_tokens = list(beams)
    result = greedy.result(timeout=TIMEOUT)
    assert torch.equal(torch.stack(streamed, dim=1), result[:, inputs["input_ids"].shape[1] :])
    assert all(tokens.shape == (1,) for tokens in streamed)
    assert torch.equal(torch.stack(beam_tokens, dim=1), beams.result(timeout=TIMEOUT)[:, 5:])


def test_iterating_a_whisper_handle_yields_every_token_of_its_result():
    # Whisper's generate returns the new tokens without its decoder prompt: none is skipped.
    case = next(case for case in MODEL_CASES if case.name == "whisper")
    _, flex = case.build("sdpa")
    inputs = case.make_inputs(1, WHISPER_MAX_SOURCE_POSITIONS, torch.Generator().manual_seed(8))
    with Engine(flex, cache_config=capacities(flex)) as engine:
        handle = engine.submit(**inputs, max_new_tokens=6)
        tokens = list(handle)
    assert torch.equal(torch.stack(tokens, dim=1), handle.result(timeout=TIMEOUT))
    assert handle.num_new_tokens == handle.result(timeout=TIMEOUT).shape[1]


# --- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"num_beams": 5}, "batch_size=5 exceeds max_batch_size=4"),
        ({"max_new_tokens": 44}, "cache_len=44 exceeds max_cache_len=40"),
        ({"input_len": 20}, "encoder_len=20 exceeds max_encoder_len=16"),
    ],
    ids=["beams", "decoder", "encoder"],
)
def test_a_request_that_can_never_fit_is_refused_at_submit_with_the_cache_config_that_fits(kwargs, expected):
    case = next(case for case in MODEL_CASES if case.name == "t5")
    _, flex = case.build("sdpa")
    kwargs = dict(kwargs)
    generator = torch.Generator().manual_seed(0)
    inputs = case.make_inputs(1, kwargs.pop("input_len", 5), generator)
    with Engine(flex, cache_config=capacities(flex)) as engine:
        with pytest.raises(ValueError, match=expected) as raised:
            engine.submit(**inputs, **{"max_new_tokens": 4, **kwargs})
        assert "cache_config=" in str(raised.value)
        assert engine.num_queued == 0 and engine.stats["submitted"] == 0
        # The engine goes on: the next request is served.
        served = engine.submit(**case.make_inputs(1, 5, generator), max_new_tokens=3, min_new_tokens=3)
        assert served.result(timeout=TIMEOUT).shape == (1, 4)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"batch": 2}, "takes one request: input_ids has batch 2"),
        ({"cache_implementation": "static"}, "does not take cache_implementation"),
        ({"output_attentions": True}, "does not take output_attentions"),
        ({"prompt_lookup_num_tokens": 3}, "does not take prompt_lookup_num_tokens"),
        ({"token_type_ids": torch.zeros(1, 5, dtype=torch.long)}, "does not take the model input 'token_type_ids'"),
        ({"use_cache": False}, "does not take use_cache=False"),
    ],
    ids=["batch", "cache", "attentions", "prompt-lookup", "unknown-input", "no-cache"],
)
def test_submit_refuses_what_it_cannot_serve_for_one_request(kwargs, expected):
    case = next(case for case in MODEL_CASES if case.name == "llama")
    _, flex = case.build("sdpa")
    kwargs = dict(kwargs)
    inputs = case.make_inputs(kwargs.pop("batch", 1), 5, torch.Generator().manual_seed(0))
    with Engine(flex, cache_config=capacities(flex)) as engine:
        with pytest.raises(ValueError, match=expected):
            engine.submit(**inputs, max_new_tokens=3, **kwargs)


def test_engine_construction_refuses_missing_capacities_and_upstream_models():
    case = next(case for case in MODEL_CASES if case.name == "t5")
    upstream, flex = case.build("sdpa")
    with pytest.raises(ValueError, match=r"needs \['max_encoder_len'\]"):
        Engine(flex, cache_config={"max_batch_size": 2, "max_cache_len": 8})
    with pytest.raises(ValueError, match="do not apply to the serving engine"):
        Engine(flex, cache_config={**capacities(flex), "max_concurrent_calls": 2})
    with pytest.raises(TypeError, match="convert"):
        Engine(upstream, cache_config=capacities(flex))
    with pytest.raises(ValueError, match="compile_config needs fixed shapes"):
        Engine(flex, cache_config=capacities(flex), compile_config=CompileConfig())


def test_a_full_queue_is_refused_with_a_retry_hint():
    case = next(case for case in MODEL_CASES if case.name == "llama")
    _, flex = case.build("sdpa")
    inputs, kwargs = long_requests(case, 4)
    with Engine(flex, cache_config=capacities(flex, seats=1), max_queue=2) as engine:
        running = engine.submit(**inputs[0], **kwargs)
        deadline = time.monotonic() + TIMEOUT
        while engine.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        queued = [engine.submit(**inputs[i], **kwargs) for i in (1, 2)]
        with pytest.raises(QueueFullError, match="max_queue=2") as raised:
            engine.submit(**inputs[3], **kwargs)
        assert raised.value.retry_after > 0
        for handle in [running, *queued]:
            handle.cancel()


# --- faults -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "t5"])
def test_a_request_whose_inputs_raise_in_the_model_fails_alone(name):
    case = next(case for case in MODEL_CASES if case.name == name)
    upstream, flex = case.build("sdpa")
    generator = torch.Generator().manual_seed(1)
    good = [case.make_inputs(1, 4 + i, generator) for i in range(3)]
    bad = case.make_inputs(1, 5, generator)
    bad["input_ids"][0, 2] = 10_000  # beyond the vocabulary: the embedding raises
    expected = [upstream.generate(**inputs, max_new_tokens=5) for inputs in good]
    with Engine(flex, cache_config=capacities(flex)) as engine:
        handles = [engine.submit(**inputs, max_new_tokens=5) for inputs in (good[0], bad, good[1], good[2])]
        with pytest.raises(IndexError):
            handles[1].result(timeout=TIMEOUT)
        outputs = [handles[i].result(timeout=TIMEOUT) for i in (0, 2, 3)]
        assert engine.stats["failed"] == 1
    for want, got in zip(expected, outputs, strict=True):
        assert torch.equal(got, want)


def test_a_cancelled_request_gives_its_seats_back_within_a_step():
    case = next(case for case in MODEL_CASES if case.name == "t5")
    upstream, flex = case.build("sdpa")
    inputs, kwargs = long_requests(case, 2, new_tokens=35)
    with Engine(flex, cache_config=capacities(flex, seats=1)) as engine:
        running = engine.submit(**inputs[0], **kwargs)
        tokens = iter(running)
        next(tokens), next(tokens)  # it is decoding
        waiting = engine.submit(**inputs[1], max_new_tokens=4)
        assert running.cancel()
        with pytest.raises(RequestCancelledError):
            running.result(timeout=TIMEOUT)
        # The one seat went to the waiting request, which runs as it would alone.
        assert torch.equal(waiting.result(timeout=TIMEOUT), upstream.generate(**inputs[1], max_new_tokens=4))
        assert engine.stats["cancelled"] == 1 and engine.seats_in_use == 0
        assert not running.cancel()  # already finished


def test_close_fails_running_and_queued_requests_and_refuses_new_ones():
    case = next(case for case in MODEL_CASES if case.name == "llama")
    _, flex = case.build("sdpa")
    inputs, kwargs = long_requests(case, 3, new_tokens=35)
    engine = Engine(flex, cache_config=capacities(flex, seats=1))
    running = engine.submit(**inputs[0], **kwargs)
    next(iter(running))
    queued = engine.submit(**inputs[1], **kwargs)
    engine.close(timeout=TIMEOUT)
    for handle in (running, queued):
        with pytest.raises(EngineClosedError):
            handle.result(timeout=TIMEOUT)
    with pytest.raises(EngineClosedError):
        engine.submit(**inputs[2], **kwargs)
    assert engine.nbytes == 0  # the seats' storage is freed


def test_leaving_the_context_finishes_what_was_submitted():
    case = next(case for case in MODEL_CASES if case.name == "bart")
    upstream, flex = case.build("sdpa")
    generator = torch.Generator().manual_seed(12)
    stream = [case.make_inputs(1, 4 + i, generator) for i in range(5)]
    with Engine(flex, cache_config=capacities(flex, seats=2)) as engine:
        handles = [engine.submit(**inputs, max_new_tokens=6) for inputs in stream]
    for inputs, handle in zip(stream, handles, strict=True):
        assert torch.equal(handle.result(timeout=0), upstream.generate(**inputs, max_new_tokens=6))


# --- compiled decode steps --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "t5",
        "jamba",
        pytest.param("whisper", marks=pytest.mark.slow),
        pytest.param("gemma3_text", marks=pytest.mark.slow),
    ],
)
def test_a_compiled_stream_compiles_nothing_after_warmup(name):
    torch._dynamo.reset()
    case = next(case for case in MODEL_CASES if case.name == name)
    upstream, flex = case.build("sdpa")
    stream = request_stream(case, num_requests=5)
    expected = [reference(upstream, inputs, kwargs, seed) for inputs, kwargs, seed in stream]
    counter = CompileCounter()
    config = {
        **capacities(flex),
        "shape_policy": "bucketed",
        "buckets": {"max_batch_size": [2, 4], "max_cache_len": [16, 40], "max_encoder_len": [16]},
    }
    try:
        with Engine(flex, cache_config=config, compile_config=counting_compile_config(counter)) as engine:
            shapes = engine.warmup()
            warm = counter.frame_count
            handles = [engine.submit(**own_copy(inputs), seed=seed, **kwargs) for inputs, kwargs, seed in stream]
            outputs = [handle.result(timeout=TIMEOUT) for handle in handles]
    finally:
        torch._dynamo.reset()
    assert shapes == 4 and 0 < warm <= shapes
    assert counter.frame_count == warm  # no request paid a compile
    for want, got in zip(expected, outputs, strict=True):
        assert_same_output(want, got)


def test_a_compiled_encoder_is_warmed_up_with_the_decode_step_and_serves_the_stream():
    # compile_config_for_cpu()'s FlexCompileConfig compiles the batched token encoder too, with dynamic shapes:
    # warmup() adds its graphs for one row and for several, and requests of any rows and lengths compile nothing.
    from transformers_flexcache.compile import FlexCompileConfig

    torch._dynamo.reset()
    case = next(case for case in MODEL_CASES if case.name == "t5")
    upstream, flex = case.build("sdpa")
    stream = request_stream(case, num_requests=5)
    expected = [reference(upstream, inputs, kwargs, seed) for inputs, kwargs, seed in stream]
    counter = CompileCounter()
    compile_config = counting_compile_config(counter, FlexCompileConfig)
    config = {**capacities(flex), "shape_policy": "padded"}
    try:
        with Engine(flex, cache_config=config, compile_config=compile_config) as engine:
            assert engine.warmup() == 1
            warm = counter.frame_count
            handles = [engine.submit(**own_copy(inputs), seed=seed, **kwargs) for inputs, kwargs, seed in stream]
            outputs = [handle.result(timeout=TIMEOUT) for handle in handles]
    finally:
        torch._dynamo.reset()
    assert warm == 1 + 1  # the decode step; the encoder, one graph for one row and several (T5's packs, rows unbacked)
    assert counter.frame_count == warm  # no request paid a compile
    for want, got in zip(expected, outputs, strict=True):
        assert_same_output(want, got)


def test_warmup_refuses_more_shapes_than_dynamo_keeps():
    case = next(case for case in MODEL_CASES if case.name == "llama")
    _, flex = case.build("sdpa")
    config = {**capacities(flex, seats=8), "max_cache_len": 512, "shape_policy": "bucketed"}
    with Engine(flex, cache_config=config, compile_config=counting_compile_config(CompileCounter())) as engine:
        assert len(engine.decode_shapes()) == 4 * 6  # seats 1, 2, 4, 8 x lengths 16 ... 512
        with pytest.raises(ValueError, match="recompile_limit"):
            engine.warmup()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda layer: layer.reorder_cache(torch.tensor([0])), "reorder_cache"),
        (lambda layer: layer.offload(), "offloading is not supported by a seat cache"),
        (lambda layer: layer.prefetch(), "offloading is not supported by a seat cache"),
        (lambda layer: layer.batch_repeat_interleave(2), "only defined for DynamicCache"),
        (lambda layer: layer.batch_select_indices(torch.tensor([0])), "only defined for DynamicCache"),
        (lambda layer: layer.crop(1), "cannot be cropped"),
    ],
    ids=["reorder_cache", "offload", "prefetch", "batch_repeat_interleave", "batch_select_indices", "crop"],
)
def test_seat_layers_of_both_kinds_refuse_what_moves_rows_outside_the_engine(call, message):
    from transformers_flexcache.cache import layer_specs_for_model
    from transformers_flexcache.cache.seats import FlexibleSeatCache

    jamba = next(case for case in MODEL_CASES if case.name == "jamba")
    _, flex = jamba.build()
    layer_specs, _ = layer_specs_for_model(flex)
    cache = FlexibleSeatCache(layer_specs=layer_specs, max_batch_size=2, max_cache_len=8)
    kinds = {type(layer).__name__: layer for layer in cache.layers}
    assert set(kinds) == {"FlexibleSeatLayer", "FlexibleSeatLinearAttentionLayer"}
    for layer in kinds.values():
        with pytest.raises((ValueError, NotImplementedError), match=message):
            call(layer)


def test_a_decode_step_writes_the_recurrent_state_it_is_handed_into_the_seats_and_answers_lengths_per_seat():
    # transformers 5.25's Jamba mixer hands a decode step's recurrent state back through `update_recurrent_state`
    # (5.24's writes the view in place), and asks `get_seq_length()` of layer 0, a Mamba layer.
    from transformers_flexcache.cache import layer_specs_for_model
    from transformers_flexcache.cache.seats import FlexibleSeatCache

    jamba = next(case for case in MODEL_CASES if case.name == "jamba")
    _, flex = jamba.build()
    layer_specs, _ = layer_specs_for_model(flex)
    cache = FlexibleSeatCache(layer_specs=layer_specs, max_batch_size=3, max_cache_len=8)
    (channels, state_size) = layer_specs[0].recurrent_shape
    cache.admit(torch.tensor([0, 1]), torch.ones(2, 4, dtype=torch.bool), torch.tensor([4, 3]))
    cache.begin_decode(span=2, window=5)
    assert cache.get_seq_length(0).tolist() == cache.get_seq_length(1).tolist() == [[4], [3]]
    state = torch.randn(2, channels, state_size, generator=torch.Generator().manual_seed(0))
    returned = cache.update_recurrent_state(state, 0)
    cache.end_step()
    torch.testing.assert_close(returned, state, rtol=0, atol=0)
    assert returned.data_ptr() in cache.data_ptrs()
    with pytest.raises(ValueError, match="only answered during a step of the serving engine"):
        cache.update_recurrent_state(state, 0)
