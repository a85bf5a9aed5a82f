"""torch.compile over a stream of generate calls of different shapes: one decode graph per fixed shape, and real inductor
with frozen weights giving DynamicCache's tokens.

Graphs are counted with `torch._dynamo.testing.CompileCounter` (it traces but does not compile, to keep CI fast);
every call's tokens and scores are compared with upstream's DynamicCache. `fullgraph=True`: a graph break would fail
the call instead of adding a graph. Upstream's `cache_implementation="static"` recompiles along the same stream;
that contrast is measured by `transformers-flexcache bench` with compiled strategies (docs/compile.md), not asserted
here. The frozen-inductor tests compile for real (a minute or two each).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import CompileConfig

from tests.helpers import (
    assert_same_padded_generation,
    assert_within_float_noise,
    generate_both,
    in_double,
    upstream_generate,
)
from tests.model_cases import BART, LLAMA, MODEL_CASES, T5
from transformers_flexcache import compile_config_for_cpu
from transformers_flexcache.compile.config import FlexCompileConfig
from transformers_flexcache.compile.encoder import packs_encoder


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# (batch, prompt or encoder length, new tokens): every call a new batch and length.
COMPILE_STREAM = [(4, 12, 3), (1, 5, 3), (3, 9, 2), (2, 3, 3), (4, 10, 2), (1, 7, 3)]

COMPILE_CAPACITY = {"max_batch_size": 4, "max_cache_len": 16, "max_encoder_len": 12, "max_prompt_len": 12}

# Each case compiles (traces) its model once per test, 5-25 s apiece on 2 cores: the default run keeps every model of
# the first version, one BART copy and the generic route's hybrid and all-sliding models; the others run with -m slow.
DEFAULT_CASES = {
    "generate": {"llama", "t5", "bart", "whisper", "jamba", "pix2struct", "marian", "qwen2", "mistral", "gemma3_text"},
    "forward": {"llama", "t5", "bart", "whisper", "jamba", "pix2struct"},
}


@pytest.mark.slow
@pytest.mark.parametrize("grad_mode", ["no_grad (generate's own)", "inference_mode"])
def test_frozen_inductor_bucketed_stream_after_warmup_gives_dynamic_cache_tokens(grad_mode):
    # Real inductor with frozen, prepacked weights (a minute or two of compiling): scores within float tolerance.
    from tests.model_cases import T5
    from transformers_flexcache import warmup

    upstream, flex = T5.build("sdpa")
    compile_config = compile_config_for_cpu()
    cache_config = {
        "shape_policy": "bucketed",
        "max_batch_size": 4,
        "max_cache_len": 8,
        "max_encoder_len": 12,
        "buckets": {"max_batch_size": [2], "max_encoder_len": [6]},
    }
    generator = torch.Generator().manual_seed(0)
    mode = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with mode:
        warmup(
            flex,
            lambda b, n: T5.make_inputs(b, n, generator),
            max_new_tokens=4,
            cache_config=cache_config,
            compile_config=compile_config,
        )
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for batch_size, length in [(3, 10), (1, 4), (4, 12), (2, 5)]:
            inputs = T5.make_inputs(batch_size, length, generator)
            expected, actual = generate_both(
                upstream,
                flex,
                inputs,
                cache_config=cache_config,
                max_new_tokens=4,
                do_sample=False,
                compile_config=compile_config,
            )
            assert_same_padded_generation(upstream, flex, inputs, expected, actual, max_new_tokens=4, do_sample=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("case", [LLAMA, T5, BART], ids=lambda case: case.name)
def test_frozen_one_row_decode_step_gives_dynamic_cache_tokens(case):
    # A batch of one in a one-row bucket: every linear of the decode step is inductor's dot product (BART's with
    # biases).
    upstream, flex = case.build("sdpa")
    cache_config = {
        "shape_policy": "bucketed",
        "max_batch_size": 2,
        "max_cache_len": 12,
        "buckets": {"max_batch_size": [1]},
    }
    cache_config.update({"max_prompt_len": 6} if case is LLAMA else {"max_encoder_len": 8})
    generator = torch.Generator().manual_seed(0)
    common = {"return_dict_in_generate": True, "output_scores": True, "max_new_tokens": 6, "do_sample": False}
    for length in (5, 3):
        inputs = case.make_inputs(1, length, generator)
        with torch.profiler.profile() as profile:
            expected, actual = generate_both(
                upstream,
                flex,
                inputs,
                cache_config=cache_config,
                compile_config=compile_config_for_cpu(one_row_linears="inductor", encoder=False),
                **common,
            )
        # tolerance: what upstream's own scores move at the shapes the cache ran (tests/helpers.py)
        assert_same_padded_generation(upstream, flex, inputs, expected, actual, **common)
    # The second call ran the compiled step (the first one's compiling ran the library's linears on the weights).
    ops = {event.key for event in profile.key_averages()}
    assert any(op.startswith("Torch-Compiled Region") for op in ops), ops
    assert not ops & {"mkl::_mkl_linear", "mkldnn::_linear_pointwise"}  # eager steps run aten's linear


@pytest.mark.slow
def test_a_frozen_compiled_graph_serves_the_cache_allocated_after_a_release_with_dynamic_cache_tokens():
    # Before: the graph held the released storage as a constant (a segmentation fault on the next call).
    from transformers_flexcache import release

    upstream, flex = LLAMA.build("sdpa")
    cache_config = {"shape_policy": "padded", "max_batch_size": 2, "max_cache_len": 12, "max_prompt_len": 6}
    generator = torch.Generator().manual_seed(0)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(2):
        inputs = LLAMA.make_inputs(2, 5, generator)
        expected, actual = generate_both(
            upstream,
            flex,
            inputs,
            cache_config=cache_config,
            max_new_tokens=4,
            do_sample=False,
            compile_config=compile_config_for_cpu(),
        )
        assert_same_padded_generation(upstream, flex, inputs, expected, actual, max_new_tokens=4, do_sample=False)
        release(flex)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # the second cache reused the graph


def cases(test: str) -> list:
    return [
        pytest.param(
            case,
            id=case.name,
            marks=[
                *([pytest.mark.xfail(reason=case.compile_opt_out, strict=True)] if case.compile_opt_out else []),
                *([] if case.name in DEFAULT_CASES[test] else [pytest.mark.slow]),
            ],
        )
        for case in MODEL_CASES
    ]


def counting_backend(counter: CompileCounter):
    # A function, not the counter: CompileConfig deep-copies its backend (a copied counter would count elsewhere),
    # and generate passes `mode=` to it.
    def backend(graph_module, example_inputs, **kwargs):
        return counter(graph_module, example_inputs)

    return backend


def padded_config(model) -> dict:
    keep = "max_encoder_len" if model.config.is_encoder_decoder else "max_prompt_len"
    config = {k: v for k, v in COMPILE_CAPACITY.items() if k not in ("max_encoder_len", "max_prompt_len") or k == keep}
    return {**config, "shape_policy": "padded"}


def run_stream(case, upstream, flex, counter: CompileCounter, **flex_kwargs) -> list[int]:
    """Generate each shape of COMPILE_STREAM with both models, check outputs, return the graph count after each."""
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for batch_size, length, new_tokens in COMPILE_STREAM:
        inputs = case.make_inputs(batch_size, length, generator)
        common = {
            "return_dict_in_generate": True,
            "output_scores": True,
            "max_new_tokens": new_tokens,
            "do_sample": False,
            **case.generate_kwargs,
        }
        expected = upstream_generate(upstream, inputs, **common)
        actual = flex.generate(
            **inputs, cache_implementation="flexible_static", cache_config=padded_config(flex), **common, **flex_kwargs
        )
        assert_same_padded_generation(upstream, flex, inputs, expected, actual, **common)
        graphs.append(counter.frame_count)
    return graphs


@pytest.mark.parametrize("case", cases("generate"))
def test_padded_stream_with_generate_compile_config_compiles_the_decode_step_once(case):
    upstream, flex = case.build("sdpa")
    counter = CompileCounter()
    compile_config = CompileConfig(backend=counting_backend(counter), fullgraph=True)
    compile_config._compile_all_devices = True  # generate compiles on CPU only when asked to
    graphs = run_stream(case, upstream, flex, counter, compile_config=compile_config)
    # generate compiles the decode step: one graph, traced during the first call (an encoder-decoder call's first
    # decoder step runs in it too: test_first_decoder_step_...; a decoder-only prefill runs eagerly)
    assert graphs == [1] * len(COMPILE_STREAM)


@pytest.mark.parametrize("case", cases("forward"))
def test_padded_stream_with_compiled_forward_compiles_prefill_and_decode_once(case):
    upstream, flex = case.build("sdpa")
    counter = CompileCounter()
    flex.forward = torch.compile(flex.forward, backend=counter, fullgraph=True)
    graphs = run_stream(case, upstream, flex, counter)
    # the first call traces the prefill (the first decoder step for encoder-decoder models) and the decode step
    assert graphs == [2] * len(COMPILE_STREAM)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, id=case.name, marks=[] if case.name in ("t5", "bart", "whisper") else [pytest.mark.slow])
        for case in MODEL_CASES
        if case.build_config().is_encoder_decoder
    ],
)
def test_compile_encoder_compiles_a_token_encoder_once_at_the_padded_shapes(case):
    # compile_config_for_cpu()'s FlexCompileConfig also compiles the encoder of a fixed-shape call, at its padded rows
    # and encoder length: one more graph over the whole stream. Whisper's log-mel encoder stays eager (token inputs
    # only), as it does under upstream's plain CompileConfig (the tests above).
    upstream, flex = case.build("sdpa")
    counter = CompileCounter()
    compile_config = FlexCompileConfig(backend=counting_backend(counter), fullgraph=True, compile_encoder=True)
    compile_config._compile_all_devices = True
    graphs = run_stream(case, upstream, flex, counter, compile_config=compile_config)
    # one encoder graph with dynamic shapes for calls of several rows, and one for a single row (the second call),
    # but where the encoder packs its real tokens (T5, BART, Marian): its rows are unbacked, one graph for both
    token_inputs = case.upstream_class.main_input_name == "input_ids"
    if not token_inputs:
        assert graphs == [1] * len(COMPILE_STREAM)
    elif packs_encoder(flex):
        assert graphs == [2] * len(COMPILE_STREAM)
    else:
        assert graphs == [2] + [3] * (len(COMPILE_STREAM) - 1)


def running_backend(counter: CompileCounter, runs: list):
    """`counting_backend` whose graphs also count their runs in `runs`."""

    def backend(graph_module, example_inputs, **kwargs):
        graph = counter(graph_module, example_inputs)

        def run(*args):
            runs.append(len(args))
            return graph(*args)

        return run

    return backend


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, id=case.name, marks=[] if case.name in ("t5", "bart", "pix2struct") else [pytest.mark.slow])
        for case in MODEL_CASES
        if case.build_config().is_encoder_decoder and case.name != "whisper"
    ],
)
def test_first_decoder_step_of_a_compiled_fixed_shape_call_runs_in_the_decode_graph(case):
    # Upstream runs an encoder-decoder call's first decoder step eagerly; here it runs in the compiled decode graph
    # (its cross-attention keys projected beforehand): the graph runs once per new token, and no graph is added.
    # A decoder prompt of two tokens is a prefill of two positions: eager, as upstream's.
    upstream, flex = case.build("sdpa")
    counter, runs = CompileCounter(), []
    compile_config = CompileConfig(backend=running_backend(counter, runs), fullgraph=True)
    compile_config._compile_all_devices = True
    generator = torch.Generator().manual_seed(0)
    common = {"return_dict_in_generate": True, "output_scores": True, "do_sample": False, **case.generate_kwargs}
    start = upstream.generation_config.decoder_start_token_id
    for batch_size, length, new_tokens, prompt in [(3, 9, 3, 1), (1, 5, 4, 1), (2, 7, 3, 2), (4, 12, 3, 1)]:
        inputs = case.make_inputs(batch_size, length, generator)
        if prompt > 1:
            inputs["decoder_input_ids"] = torch.tensor([[start, 7]] * batch_size)
        runs.clear()
        kwargs = {**common, "max_new_tokens": new_tokens}
        expected = upstream_generate(upstream, inputs, **kwargs)
        actual = flex.generate(
            **inputs,
            cache_implementation="flexible_static",
            cache_config=padded_config(flex),
            compile_config=compile_config,
            **kwargs,
        )
        assert_same_padded_generation(upstream, flex, inputs, expected, actual, **kwargs)
        assert len(runs) == (new_tokens if prompt == 1 else new_tokens - 1), (batch_size, length, prompt)
    assert counter.frame_count == 1


def test_a_flexible_call_checks_every_guard_at_its_first_compiled_step_only(monkeypatch):
    # Each compiled forward records whether dynamo skips the guards that do not tell graphs apart, then runs eagerly.
    from transformers.modeling_utils import PreTrainedModel

    skipped = []

    def recording_compiled_call(model, compile_config):
        def call(*args, **kwargs):
            skipped.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)
            return model.__call__(*args, **kwargs)

        return call

    monkeypatch.setattr(PreTrainedModel, "get_compiled_call", recording_compiled_call)
    case = next(case for case in MODEL_CASES if case.name == "t5")
    upstream, flex = case.build("sdpa")
    inputs = case.make_inputs(2, 6, torch.Generator().manual_seed(0))
    common = {"max_new_tokens": 5, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    cache_config = {"shape_policy": "padded", **COMPILE_CAPACITY}
    expected = upstream_generate(upstream, inputs, **common)
    for step_guards, stance, want in [
        # the first step (its own compiled call), the first decode step, then the others
        ("first", None, [False, False, True, True, True]),
        ("every", None, [False] * 5),
        ("first", "eager_on_recompile", [False] * 5),  # a user's stance is left as it is
    ]:
        skipped.clear()
        config = compile_config_for_cpu(step_guards=step_guards)
        with torch.compiler.set_stance(stance) if stance else torch.compiler.set_stance("default"):
            actual = flex.generate(
                **inputs,
                **common,
                cache_implementation="flexible_static",
                cache_config=cache_config,
                compile_config=config,
            )
        assert skipped == want, (step_guards, stance)
        assert torch.equal(actual.sequences, expected.sequences)
        assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe
    # outside a flexible call (upstream's static cache) nothing is skipped
    skipped.clear()
    flex.generate(**inputs, **common, cache_implementation="static", compile_config=compile_config_for_cpu())
    assert skipped and not any(skipped)


def test_the_compiled_encoder_s_outputs_reach_the_fixed_shape_decode_graphs_without_symbolic_sizes():
    # torch stamps each output of a graph of dynamic shapes with its symbolic dimensions, and dynamo makes them
    # symbolic in the next graph it compiles for such a tensor: generate passes the encoder's outputs to every decode
    # step, whose graphs have fixed shapes. With the stamp, the bucketed policy's graph at the capacities held a
    # symbolic encoder length that the padded policy's did not, and the compile cache compiled the same graph twice.
    from transformers_flexcache.compile.encoder import _DYNAMIC_STAMP, compiled_encoder

    _, flex = T5.build("sdpa")
    compile_config = FlexCompileConfig(backend="aot_eager", fullgraph=True, compile_encoder=True)
    compile_config._compile_all_devices = True
    inputs = T5.make_inputs(3, 7, torch.Generator().manual_seed(0))
    inputs["attention_mask"][0, 5:] = 0  # rows of other lengths: the packed route, as generate's calls
    encoder = compiled_encoder(flex, compile_config)
    with torch.no_grad():
        states = encoder(**inputs, return_dict=True).last_hidden_state
        stamped = encoder.plain(**inputs, return_dict=True).last_hidden_state
        expected = flex.get_encoder()(**inputs, return_dict=True).last_hidden_state
    assert _DYNAMIC_STAMP in stamped.__dict__  # what torch does to the raw compiled encoder's outputs
    assert _DYNAMIC_STAMP not in states.__dict__
    real = inputs["attention_mask"].bool()

    def exact():
        with torch.no_grad():
            return in_double(flex.get_encoder())(**inputs, return_dict=True).last_hidden_state[real]

    assert_within_float_noise(states[real], expected[real], exact)
