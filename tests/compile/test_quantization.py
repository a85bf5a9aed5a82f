"""`quantize(model, "int8")`: CTranslate2's int8 scheme with torchao, refused with the reason where it cannot apply.

The reference of a quantized model is the same quantized model run eagerly with upstream's DynamicCache: random
weights make int8 tokens differ from fp32's, so fp32 is not the oracle here. The override in eager mode at the call's
own shapes computes what upstream computes. Compiled int8 (frozen inductor: int8 GEMMs with the scales folded in),
and padded shapes in eager mode, compute the float activations that int8 quantizes in another order (and the
compiled graph quantizes them in its own kernels); where an activation lands on the other side of an int8 rounding
boundary, scores move by about a quantization step. Such moves stay below what quantizing every weight and activation
moves the model's scores from float32, which `int8_atol` measures on the running machine, on the same inputs (the
float32 model against its int8 copy, eagerly): measured on an AMD EPYC Zen 4 (VNNI), one thread, the moves were 0.06
to 0.83 of it (T5, Marian, Llama; 7 and 8 bits; oneDNN's and FBGEMM's kernels). So scores are within `INT8_MARGIN`
times it, up to the step where a row's tokens part, and tokens may part only at a step whose scores are within it
(`assert_int8_scores`): no tolerance here is tuned to one CPU (issue 46).

Every CPU-dependent route runs on every machine that can run it: the CPU's answers are forced (`compile.cpu.forced`) where a
route is right on any CPU (7-bit weights through oneDNN's, FBGEMM's or inductor's kernels), and the 8-bit routes
through FBGEMM's and oneDNN's kernels run where the CPU has VNNI, and say which CPU they skipped on elsewhere; under
-m slow the 7-bit route runs again in a child process capped at AVX2, where FBGEMM's AVX2 kernels run.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import GPT2Config, GPT2LMHeadModel

from tests.helpers import (
    counting_compile_config,
    generate_both,
    own_copy,
    python_calls,
    score_difference,
    ulp_floor,
)
from tests.model_cases import JAMBA, LLAMA, MARIAN, T5
from transformers_flexcache import compile_config_for_cpu, quantize
from transformers_flexcache.cache.placement import cross_attention_projections
from transformers_flexcache.compile import cpu
from transformers_flexcache.compile.config import FlexCompileConfig
from transformers_flexcache.compile.encoder import (
    compiled_encoder,
    cross_attention_projector,
    has_int8_variants,
)
from transformers_flexcache.compile.passes.int8_linears import (
    FBGEMM_MIN_OUTPUTS,
    Int8FloatGemms,
    has_fbgemm,
    int8_fbgemm_mm,
    resolve_int8_linears,
)
from transformers_flexcache.compile.quantization import int8_bits, quantization_of

pytest.importorskip("torchao")

INT8_MARGIN = 2.0  # stated in the module docstring: compiled and padded int8 moves are below int8's own movement


def int8_atol(case, inputs: dict, expected, **kwargs) -> float:
    """`INT8_MARGIN` times how far int8 moves upstream's own scores on `inputs` (`expected`: its eager int8 run with
    DynamicCache, made with generation arguments `kwargs`) from its float32 model's (the same seeded weights),
    measured here; never less than `ulp_floor` of its scores (tests/helpers.py)."""
    floats, _ = case.build("sdpa")
    kwargs = {key: value for key, value in kwargs.items() if key not in ("compile_config", "cache_config")}
    kwargs.pop("cache_implementation", None)
    torch.manual_seed(0)
    reference = floats.generate(**own_copy(inputs), **kwargs, output_scores=True, return_dict_in_generate=True)
    return max(INT8_MARGIN * score_difference(expected, reference), ulp_floor(expected.scores))


def eager_int8(upstream, case, inputs: dict, **kwargs):
    """`upstream`'s eager int8 run of `inputs` (DynamicCache) with scores, and its tolerance (`int8_atol`)."""
    torch.manual_seed(0)
    expected = upstream.generate(**own_copy(inputs), **kwargs, output_scores=True, return_dict_in_generate=True)
    return expected, int8_atol(case, inputs, expected, **kwargs)


def assert_int8_scores(expected, actual, atol: float) -> None:
    """What a compiled or padded int8 run (`actual`) can honestly be held to against eager int8 of the same quantized
    model (`expected`), row by row (module docstring: the integer products are exact, the float parts between them
    are not, and a rounding they move can move a whole quantization step):

    - each step's scores within `atol` (`int8_atol`) of the reference's, while the row's tokens agree;
    - the row's token parting only where the reference's margin between its own token and the one taken instead is
      at most `2 * atol` (scores within `atol` of the reference's can flip no larger margin); from there on the row
      continues another sequence and is not compared;
    - a run that ends at another step than the reference's only after a row parted (no row may stop or go on alone).
    """
    rows, new, new_actual = expected.sequences.shape[0], len(expected.scores), len(actual.scores)
    assert actual.sequences.shape[0] == rows, (expected.sequences.shape, actual.sequences.shape)
    prompt = expected.sequences.shape[1] - new
    assert actual.sequences.shape[1] - new_actual == prompt, (expected.sequences.shape, actual.sequences.shape)
    assert torch.equal(expected.sequences[:, :prompt], actual.sequences[:, :prompt])  # the prompt
    agreeing = list(range(rows))
    for step in range(min(new, new_actual)):
        want, got = expected.scores[step][:rows], actual.scores[step][:rows]
        for row in agreeing:
            finite = torch.isfinite(want[row])
            assert torch.equal(finite, torch.isfinite(got[row])), f"step {step}, row {row}: -inf pattern differs"
            difference = (want[row][finite] - got[row][finite]).abs().max().item()
            assert difference <= atol, (
                f"step {step}, row {row}: scores differ by {difference:.3g} (int8 tolerance {atol:.3g})"
            )
        parted = []
        for row in agreeing:
            token, taken = expected.sequences[row, prompt + step].item(), actual.sequences[row, prompt + step].item()
            if token != taken:
                margin = (want[row, token] - want[row, taken]).item()
                assert margin <= 2 * atol, (
                    f"step {step}, row {row}: token {taken} taken for {token}, whose score leads by {margin:.3g} "
                    f"(more than twice the int8 tolerance {atol:.3g}: no move within the tolerance takes it)"
                )
                parted.append(row)
        agreeing = [row for row in agreeing if row not in parted]
        if not agreeing:
            return
    assert new == new_actual, f"{new_actual} steps against the reference's {new}, with rows {agreeing} agreeing"


def _generated(sequences: list, scores: list) -> SimpleNamespace:
    """A greedy generate output of `sequences` (prompt and new tokens) with each new step's `scores`."""
    return SimpleNamespace(sequences=torch.tensor(sequences), scores=tuple(map(torch.tensor, scores)))


# eager int8's two rows of a one-token prompt and two new tokens over a vocabulary of 3
EAGER = _generated([[0, 1, 2], [0, 2, 2]], [[[0.0, 1.0, 0.5], [0.0, 0.2, 1.0]], [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]])


@pytest.mark.parametrize(
    ("sequences", "scores", "atol", "failure"),
    [
        # every score within 0.1: holds
        (
            [[0, 1, 2], [0, 2, 2]],
            [[[0.05, 1.0, 0.5], [0.0, 0.25, 1.0]], [[0.0, 0.05, 1.0], [0.0, 0.0, 0.95]]],
            0.1,
            None,
        ),
        # a score 0.2 away
        (
            [[0, 1, 2], [0, 2, 2]],
            [[[0.0, 1.0, 0.5], [0.0, 0.2, 1.0]], [[0.0, 0.0, 1.0], [0.2, 0.0, 1.0]]],
            0.1,
            "step 1, row 1: scores differ by 0.2",
        ),
        # row 0 parts at step 0 where eager's token leads by 0.5 (within 2 x 0.3), scores within 0.3: row 0 is not
        # compared after it, row 1 is
        (
            [[0, 2, 0], [0, 2, 2]],
            [[[0.0, 0.75, 0.76], [0.0, 0.2, 1.0]], [[9.0, 0.0, 0.0], [0.0, 0.0, 1.0]]],
            0.3,
            None,
        ),
        (
            [[0, 2, 0], [0, 2, 0]],
            [[[0.0, 0.75, 0.76], [0.0, 0.2, 1.0]], [[9.0, 0.0, 0.0], [9.0, 0.0, 1.0]]],
            0.3,
            "step 1, row 1: scores differ by 9",
        ),
        # a token taken where eager's leads by 0.5 and scores are equal: beyond what the tolerance lets part
        (
            [[0, 2, 2], [0, 2, 2]],
            [[[0.0, 1.0, 0.5], [0.0, 0.2, 1.0]], [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]],
            0.1,
            "leads",
        ),
        # one step fewer, with no row parted
        ([[0, 1], [0, 2]], [[[0.0, 1.0, 0.5], [0.0, 0.2, 1.0]]], 0.1, "1 steps against the reference's 2"),
    ],
    ids=["within", "beyond", "parted-at-a-near-tie", "beyond-in-the-other-row", "parted-at-a-wide-margin", "shorter"],
)
def test_the_int8_comparison_holds_what_it_states_and_fails_otherwise(sequences, scores, atol, failure):
    actual = _generated(sequences, scores)
    if failure is None:
        assert_int8_scores(EAGER, actual, atol)
    else:
        with pytest.raises(AssertionError, match=failure):
            assert_int8_scores(EAGER, actual, atol)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def quantized_pair(case):
    upstream, flex = case.build("sdpa")
    return quantize(upstream, "int8"), quantize(flex, "int8")


def cache_config_for(case, shape_policy: str) -> dict:
    return {
        "shape_policy": shape_policy,
        "max_batch_size": 4,
        "max_cache_len": 16,
        "max_prompt_len": 8,
        "max_encoder_len": 10,
    }


@pytest.mark.parametrize("case", [T5, MARIAN, LLAMA], ids=lambda case: case.name)
def test_every_linear_is_int8_and_embeddings_and_norms_stay_float(case):
    upstream, _ = quantized_pair(case)
    linears = [module for module in upstream.modules() if isinstance(module, torch.nn.Linear)]
    assert linears and all(type(module.weight).__name__ == "Int8Tensor" for module in linears)
    assert type(upstream.get_output_embeddings().weight).__name__ == "Int8Tensor"
    assert type(upstream.get_input_embeddings().weight) is torch.nn.Parameter
    assert quantization_of(upstream) == "int8"


@pytest.mark.parametrize("bits", [7, 8])
def test_int8_weights_use_7_bits_where_the_cpu_has_no_vnni(caplog, bits):
    # oneDNN's int8 GEMMs saturate 16-bit sums at 8 bits on CPUs without VNNI (AVX2): quantize() asks torchao for
    # 7-bit ranges there. Both sides are forced here, so each runs on every CPU.
    with cpu.forced(vnni=bits == 8), caplog.at_level("WARNING", logger="transformers_flexcache.compile.quantization"):
        assert int8_bits() == bits
        upstream, _ = quantized_pair(LLAMA)
    # ... and says there that int8 runs slower than float32 on such a CPU
    assert ("this CPU has no VNNI" in caplog.text) == (bits == 7)
    linears = [module for module in upstream.modules() if isinstance(module, torch.nn.Linear)]
    low = min(module.weight.qdata.min().item() for module in linears)
    high = max(module.weight.qdata.max().item() for module in linears)
    # torchao's symmetric scale (largest |w| / 63.5 or / 127.5) takes each row's largest weight to an end of the range
    assert (low, high) == ((-64, 63) if bits == 7 else (-128, 127))


def test_the_bits_follow_this_cpus_vnni_as_torchaos_check_does():
    from torchao.utils import should_reduce_range

    assert int8_bits() == (8 if cpu.detected().vnni else 7)
    if "amx_int8" not in cpu.detected().flags:  # torchao reads AVX512-VNNI alone
        assert int8_bits() == (7 if should_reduce_range(torch.device("cpu")) else 8)


@pytest.mark.parametrize("case", [T5, MARIAN, LLAMA], ids=lambda case: case.name)
def test_int8_flexible_cache_generates_the_eager_int8_dynamic_cache_tokens(case):
    upstream, flex = quantized_pair(case)
    generator = torch.Generator().manual_seed(0)
    for batch_size, length in [(3, 7), (1, 4)]:
        inputs = case.make_inputs(batch_size, length, generator)
        common = {"max_new_tokens": 5, "do_sample": False}
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config=cache_config_for(case, "exact"), **common
        )
        # at the call's own shapes: upstream's tokens, and its scores bit for bit or within int8's tolerance
        assert torch.equal(expected.sequences, actual.sequences)
        if score_difference(expected, actual) > 0:
            assert_int8_scores(expected, actual, int8_atol(case, inputs, expected, **common))


def _compiled_int8_stream(case, shape_policy: str):
    upstream, flex = quantized_pair(case)
    generator = torch.Generator().manual_seed(0)
    for batch_size, length in [(3, 7), (1, 4), (4, 8)]:
        inputs = case.make_inputs(batch_size, length, generator)
        expected, actual = generate_both(
            upstream,
            flex,
            inputs,
            cache_config=cache_config_for(case, shape_policy),
            max_new_tokens=5,
            do_sample=False,
            compile_config=compile_config_for_cpu(),
        )
        assert_int8_scores(expected, actual, int8_atol(case, inputs, expected, max_new_tokens=5, do_sample=False))


def test_compiled_int8_padded_t5_generates_the_eager_int8_dynamic_cache_tokens():
    # Frozen inductor: int8 GEMMs with folded scales (about half a minute of compiling).
    _compiled_int8_stream(T5, "padded")


def t5_projection(model):
    """The function that projects encoder states into a T5 decoder layer's cross-attention keys and values."""
    return cross_attention_projections(model, model.config.num_decoder_layers)[0]


def test_a_compiled_int8_call_projects_cross_attention_in_graphs_of_their_own():
    # torchao's eager int8 linear recomputes row sums at every call: where the encoder compiles, the first decoder
    # step's cross-attention projections run compiled too, in one graph with dynamic shapes (its rows unbacked: one for
    # a single row and more), and none runs as Python. The tracing backend runs the graphs as traced: scores against
    # eager int8.
    upstream, flex = quantized_pair(T5)
    counter = CompileCounter()
    compile_config = counting_compile_config(counter, FlexCompileConfig)
    generator = torch.Generator().manual_seed(0)
    common = {"max_new_tokens": 4, "do_sample": False}
    with python_calls(t5_projection(flex)) as eager_calls:  # the spy sees an eager call's projections
        flex.generate(**T5.make_inputs(2, 6, generator), cache_implementation="flexible_static", **common)
    assert len(eager_calls) == flex.config.num_decoder_layers
    for batch_size, length in [(3, 9), (1, 5), (4, 10), (2, 7)]:
        inputs = T5.make_inputs(batch_size, length, generator)
        with python_calls(t5_projection(flex)) as calls:
            expected, actual = generate_both(
                upstream,
                flex,
                inputs,
                cache_config=cache_config_for(T5, "padded"),
                compile_config=compile_config,
                **common,
            )
        assert calls == [], (batch_size, length)
        assert_int8_scores(expected, actual, int8_atol(T5, inputs, expected, **common))
    # the decode step; the encoder and the projections (their rows unbacked: one graph each for a single row and more)
    assert counter.frame_count == 1 + 1 + 1


def test_float32_cross_attention_projections_stay_eager():
    # Compiled, they gained nothing in float32 (compiled_encoder.py): the projector runs each layer's in Python.
    _, flex = T5.build("sdpa")
    projector = cross_attention_projector(
        flex, counting_compile_config(CompileCounter(), FlexCompileConfig), [t5_projection(flex)]
    )
    with python_calls(t5_projection(flex)) as calls:
        projector(torch.randn(2, 5, flex.config.d_model))
    assert len(calls) == 1


def int8_requests(upstream, case, *, seed: int, new_tokens: int) -> tuple[list, dict, list]:
    """Four one-row requests of `case` (4, 6, 8, 10 positions), their greedy arguments (with scores), and the eager
    int8 reference's outputs and tolerances (`eager_int8`)."""
    generator = torch.Generator().manual_seed(seed)
    stream = [case.make_inputs(1, 4 + 2 * i, generator) for i in range(4)]
    common = {"max_new_tokens": new_tokens, "do_sample": False}
    expected = [eager_int8(upstream, case, inputs, **common) for inputs in stream]
    return stream, {**common, "output_scores": True, "return_dict_in_generate": True}, expected


def test_a_compiled_engine_projects_int8_requests_cross_attention_in_its_warmed_up_graphs():
    from transformers_flexcache.serving import Engine

    upstream, flex = quantized_pair(T5)
    stream, common, expected = int8_requests(upstream, T5, seed=5, new_tokens=5)
    counter = CompileCounter()
    config = {"shape_policy": "padded", "max_batch_size": 4, "max_cache_len": 16, "max_encoder_len": 12}
    with python_calls(t5_projection(flex)) as calls:  # in the engine's thread too
        with Engine(
            flex, cache_config=config, compile_config=counting_compile_config(counter, FlexCompileConfig)
        ) as engine:
            engine.warmup()
            warm = counter.frame_count
            handles = [engine.submit(**inputs, **common) for inputs in stream]
            outputs = [handle.result(timeout=120) for handle in handles]
    assert warm == 1 + 1 + 1  # the decode step; the encoder and the projections (every rows)
    assert counter.frame_count == warm and calls == []
    for (want, atol), got in zip(expected, outputs, strict=True):
        assert_int8_scores(want, got, atol)


def recording_compile_config(compiled: list) -> FlexCompileConfig:
    """`compile_config_for_cpu(int8_linears="inductor")`'s int8 passes on a backend that runs each graph as traced
    and appends to `compiled` which kernels inductor would have given it: `"float_gemms"` (the config's own) or
    `"library"` (the compile without `Int8FloatGemms`)."""

    def backend(graph_module, example_inputs, options=None, **kwargs):
        passes = (options or {}).get("joint_custom_post_pass", ())
        compiled.append("float_gemms" if Int8FloatGemms() in passes else "library")
        return graph_module.forward

    config = FlexCompileConfig(
        backend=backend, fullgraph=True, mode=None, options={"joint_custom_post_pass": (Int8FloatGemms(),)}
    )
    config._compile_all_devices = True
    return config


def test_an_int8_encoder_runs_float_gemms_up_to_128_positions_and_the_library_s_int8_kernels_beyond():
    # Float32 GEMMs of the integers beat oneDNN's int8 linears on a CPU without VNNI at few rows, and lose at many
    # (compiled_encoder.py): the compiled encoder has one compile of each, chosen by the call's batch x positions.
    _, flex = quantized_pair(T5)
    floats, _ = T5.build("sdpa")  # the same weights in float32: what int8 moves the encoder's states by
    compiled = []
    encoder = compiled_encoder(flex, recording_compile_config(compiled))
    generator = torch.Generator().manual_seed(0)
    for batch, positions, expected in [
        (3, 9, ["float_gemms"]),  # 27 positions: several rows
        (4, 32, []),  # 128: the same graph
        (4, 33, ["library"]),  # 132
        (2, 70, []),
        (1, 200, []),  # a single row: float GEMMs at any length, in the graph of several (its rows unbacked)
    ]:
        ids = torch.randint(3, 99, (batch, positions), generator=generator)
        before = len(compiled)
        with torch.no_grad():
            out = encoder(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True)
            want = flex.get_encoder()(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True)
            unquantized = floats.get_encoder()(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True)
        assert compiled[before:] == expected, (batch, positions)
        movement = (want.last_hidden_state - unquantized.last_hidden_state).abs().max().item()
        atol = max(INT8_MARGIN * movement, ulp_floor(want.last_hidden_state))
        assert (out.last_hidden_state - want.last_hidden_state).abs().max().item() <= atol


def test_warmups_compile_both_kernels_of_an_int8_encoder_so_that_no_call_compiles():
    # generate's warmup() and the engine's: the int8 encoder's graphs of float GEMMs (any rows) and of the library's
    # kernels (many positions), and the projections' alike, wherever the capacities reach them.
    from transformers_flexcache import warmup
    from transformers_flexcache.serving import Engine

    upstream, flex = quantized_pair(T5)
    compiled = []
    compile_config = recording_compile_config(compiled)
    generator = torch.Generator().manual_seed(2)
    config = {"shape_policy": "padded", "max_batch_size": 4, "max_cache_len": 16, "max_encoder_len": 40}
    common = {"max_new_tokens": 3, "do_sample": False}
    warmup(
        flex,
        lambda b, n: T5.make_inputs(b, n, generator),
        cache_config=config,
        compile_config=compile_config,
        **common,
    )
    # the decode step; the encoder and the projections: up to 128 positions (one row or more), and more
    assert sorted(compiled) == ["float_gemms"] * 3 + ["library"] * 2
    # cut from the padded rows and positions (a single row of 39: strides of 40), and not
    for batch, positions in [(1, 39), (4, 36), (3, 10), (2, 2), (4, 40)]:
        inputs = T5.make_inputs(batch, positions, generator)
        expected, actual = generate_both(
            upstream, flex, inputs, cache_config=config, compile_config=compile_config, **common
        )
        assert_int8_scores(expected, actual, int8_atol(T5, inputs, expected, **common))
    assert len(compiled) == 5, compiled
    torch._dynamo.reset()
    compiled.clear()
    with Engine(flex, cache_config=config, compile_config=compile_config) as engine:
        engine.warmup()
        assert sorted(compiled) == ["float_gemms"] * 3 + ["library"] * 2
        stream = [T5.make_inputs(1, 36 + i, generator) for i in range(4)]
        scored = {**common, "output_scores": True, "return_dict_in_generate": True}
        outputs = [handle.result(timeout=120) for handle in [engine.submit(**inputs, **scored) for inputs in stream]]
    assert len(compiled) == 5  # no request compiled
    for inputs, got in zip(stream, outputs, strict=True):
        want, atol = eager_int8(upstream, T5, inputs, **common)
        assert_int8_scores(want, got, atol)


def compiled_int_mm(
    inputs: torch.Tensor, weight: torch.Tensor, int8_linears: str, *, dynamic_rows: bool = False
) -> tuple[torch.Tensor, set[str]]:
    """`torch._int_mm(inputs, weight.T)` compiled under `compile_config_for_cpu(int8_linears=...)` (its rows dynamic
    with `dynamic_rows`, as in the compiled encoder), and the ops its second run called."""
    config = compile_config_for_cpu(int8_linears=int8_linears)
    compiled = torch.compile(
        lambda a, w: torch._int_mm(a, w.t()),
        backend="inductor",
        dynamic=None if dynamic_rows else False,
        options=config.options,
    )
    if dynamic_rows:
        torch._dynamo.mark_dynamic(inputs, 0)
    compiled(inputs, weight)
    with torch.profiler.profile() as profile:
        out = compiled(inputs, weight)
    return out, {event.key for event in profile.key_averages()}


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize(("features", "dtype"), [(512, torch.int8), (2048, torch.int8), (2048, torch.uint8)])
def test_int8_dot_products_equal_int_mm_bit_for_bit_up_to_8_rows(rows, features, dtype):
    inputs, weight = int8_operands(rows, features, dtype)
    expected = torch._int_mm(inputs, weight.t())
    if features > 1024:  # one float32 sum per output could not give these
        assert expected.abs().max() > 2**24 and (expected % 2 == 1).any()
    out, ops = compiled_int_mm(inputs, weight, "inductor")
    assert torch.equal(out, expected)
    assert ("aten::_int_mm" in ops) == (rows > 8)  # rewritten up to 8 rows, the library's beyond


def int8_operands(rows: int, features: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and a [24, features] int8 weight whose products, of one sign near the ends of the ranges, sum
    past 2**24 (where float32 holds even integers only) when `features` > 1024."""
    generator = torch.Generator().manual_seed(0)
    low, high = (100, 128) if dtype == torch.int8 else (200, 256)
    inputs = torch.randint(low, high, (rows, features), generator=generator).to(dtype)
    weight = torch.randint(-128, -100, (24, features), generator=generator, dtype=torch.int8)
    return inputs, weight


@pytest.mark.parametrize("rows", [2, 40])
@pytest.mark.parametrize(("features", "dtype"), [(512, torch.int8), (2048, torch.int8), (2048, torch.uint8)])
def test_int8_float_gemms_equal_int_mm_bit_for_bit_at_dynamic_rows(rows, features, dtype):
    inputs, weight = int8_operands(rows, features, dtype)
    expected = torch._int_mm(inputs, weight.t())
    if features > 1024:  # one float32 GEMM over all features could not give these
        assert expected.abs().max() > 2**24 and (expected % 2 == 1).any()
    out, ops = compiled_int_mm(inputs, weight, "inductor", dynamic_rows=True)
    assert torch.equal(out, expected)
    assert "aten::_int_mm" not in ops and "aten::mm" in ops


def test_int8_float_gemms_are_left_to_the_library_where_float32_gemms_may_round(monkeypatch):
    # Under a lower matmul precision float32 GEMMs may run in bf16 or tf32: not exact, so not used.
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    inputs, weight = int8_operands(9, 512, torch.int8)
    out, ops = compiled_int_mm(inputs, weight, "inductor", dynamic_rows=True)
    assert torch.equal(out, torch._int_mm(inputs, weight.t()))
    assert "aten::_int_mm" in ops


def seven_bit_operands(rows: int, features: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and a [24, features] 7-bit int8 weight (`quantize`'s on a CPU without VNNI) whose products, of one
    sign near the ends of the ranges, sum past 2**24 at 3072 int8 features or 2048 uint8 ones."""
    generator = torch.Generator().manual_seed(0)
    low, high = (100, 128) if dtype == torch.int8 else (200, 256)
    inputs = torch.randint(low, high, (rows, features), generator=generator).to(dtype)
    weight = torch.randint(-64, -50, (24, features), generator=generator, dtype=torch.int8)
    return inputs, weight


FBGEMM_OP = "quantized::linear_with_input_q_dq_qweight_dq_output_fp32"
# torch has FBGEMM on x86 only (where CI runs); elsewhere `int8_linears="auto"` never picks it.
needs_fbgemm = pytest.mark.skipif(not has_fbgemm(), reason="this torch has no FBGEMM (not an x86 build)")
needs_vnni = pytest.mark.skipif(
    not cpu.detected().vnni,
    reason="8-bit int8 through oneDNN's kernels is right only on a CPU with AVX512-VNNI or AMX; this one: "
    + cpu.detected().describe(),
)


@needs_fbgemm
@pytest.mark.parametrize("rows", [2, 9])
@pytest.mark.parametrize(
    ("features", "dtype"), [(512, torch.int8), (3072, torch.int8), (2048, torch.uint8), (37, torch.int8)]
)
def test_fbgemm_int8_products_equal_int_mm_bit_for_bit_from_3_rows_and_at_dynamic_rows(rows, features, dtype):
    inputs, weight = seven_bit_operands(rows, features, dtype)
    expected = torch._int_mm(inputs, weight.t())
    if features > 1024:  # one float32 result of FBGEMM over all features could not give these
        assert expected.abs().max() > 2**24 and (expected % 2 == 1).any()
    for dynamic_rows in (False, True):
        torch._dynamo.reset()
        out, ops = compiled_int_mm(inputs, weight, "fbgemm", dynamic_rows=dynamic_rows)
        assert torch.equal(out, expected)
        # 2 static rows: dot products, where they apply (features a multiple of 4)
        assert (FBGEMM_OP in ops) == (dynamic_rows or rows >= 3 or features % 4 != 0), ops
        assert "aten::_int_mm" not in ops


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 2])
def test_an_output_layers_int8_products_of_1_or_2_rows_run_on_fbgemm(rows):
    # A weight of FBGEMM_MIN_OUTPUTS outputs (a vocabulary's output layer) at the rows of a decode step of 1-2
    # sequences: FBGEMM's (faster there than the dot products), bit for bit `_int_mm`'s; one output fewer, dot products.
    generator = torch.Generator().manual_seed(rows)
    inputs = torch.randint(-128, 128, (rows, 512), generator=generator, dtype=torch.int8)
    weight = torch.randint(-64, 64, (FBGEMM_MIN_OUTPUTS, 512), generator=generator, dtype=torch.int8)
    for outputs, on_fbgemm in ((FBGEMM_MIN_OUTPUTS, True), (FBGEMM_MIN_OUTPUTS - 1, False)):
        torch._dynamo.reset()
        out, ops = compiled_int_mm(inputs, weight[:outputs], "fbgemm")
        assert torch.equal(out, torch._int_mm(inputs, weight[:outputs].t()))
        assert (FBGEMM_OP in ops) == on_fbgemm, ops
        assert "aten::_int_mm" not in ops


def fbgemm_int_mm(inputs: torch.Tensor, weight: torch.Tensor, out_dtype=torch.int32) -> torch.Tensor:
    """`int8_fbgemm_mm` as `Int8FbgemmMatmuls` calls it for `_int_mm(inputs, weight.T)`."""
    return int8_fbgemm_mm(inputs.float(), weight, 128 if inputs.dtype == torch.int8 else 0, out_dtype)


@needs_fbgemm
@pytest.mark.parametrize("features", [1024, 2048])
def test_fbgemm_int8_products_of_8_bit_weights_run_in_float64_with_a_warning_on_a_cpu_without_vnni(caplog, features):
    # FBGEMM's int8 products saturate on such weights without VNNI; exact in float64 instead, also where the graph
    # takes the op's result as float32 (1024 features: the sums reach 2**24 at most) and where it cannot (2048).
    # Forced (float64 is exact on any CPU).
    inputs, weight = int8_operands(9, features, torch.int8)  # weights -128..-101
    expected = torch._int_mm(inputs, weight.t())
    with cpu.forced(vnni=False), caplog.at_level(logging.WARNING, logger="transformers_flexcache"):
        assert torch.equal(fbgemm_int_mm(inputs, weight), expected)
        out, ops = compiled_int_mm(inputs, weight, "fbgemm")
    assert torch.equal(out, expected)
    assert "aten::_int_mm" not in ops
    assert "holds values beyond 7 bits (-128..-101)" in caplog.text


@needs_fbgemm
@needs_vnni
@pytest.mark.parametrize(("features", "dtype"), [(1024, torch.int8), (2048, torch.int8), (2048, torch.uint8)])
def test_fbgemm_int8_products_of_8_bit_weights_are_exact_on_a_vnni_cpu(caplog, features, dtype):
    # FBGEMM's VNNI kernels sum u8 x s8 products in 32 bits: 8-bit weights run on FBGEMM, `_int_mm`'s result bit for
    # bit, with sums past 2**24 (2048 features).
    inputs, weight = int8_operands(9, features, dtype)  # weights -128..-101
    expected = (inputs.long() @ weight.long().t()).to(torch.int32)
    with caplog.at_level(logging.WARNING, logger="transformers_flexcache"):
        assert torch.equal(fbgemm_int_mm(inputs, weight), expected)
        out, ops = compiled_int_mm(inputs, weight, "fbgemm")
    assert torch.equal(out, expected)
    assert FBGEMM_OP in ops and "beyond 7 bits" not in caplog.text


@needs_fbgemm
def test_a_weight_written_in_place_is_packed_for_fbgemm_again():
    inputs, weight = seven_bit_operands(4, 512, torch.int8)
    before = fbgemm_int_mm(inputs, weight)
    weight[:, :64] = 63
    after = fbgemm_int_mm(inputs, weight, torch.float32)
    assert torch.equal(after, torch._int_mm(inputs, weight.t()).float()) and not torch.equal(after.int(), before)


def test_fbgemm_int8_encoders_compile_once_for_every_size():
    # Float GEMMs of the integers (`"inductor"`) lose to oneDNN's int8 at many rows: two compiles; FBGEMM's do not.
    _, flex = quantized_pair(T5)
    assert not has_int8_variants(flex, compile_config_for_cpu(int8_linears="fbgemm"))
    assert has_int8_variants(flex, compile_config_for_cpu(int8_linears="inductor"))


# Every int8 route the code has, each forced on every CPU where it can be right: the CPU's answers are forced when
# the model is quantized (7 bits without VNNI, 8 with it) and when it compiles (which kernels `int8_linears="auto"`
# picks: FBGEMM's where torch has it and the CPU no AMX, oneDNN's on CPUs with AMX, inductor's dot products and float
# GEMMs where torch has no FBGEMM and the CPU no VNNI). 7-bit weights are exact on every kernel, so those routes run
# everywhere; 8-bit weights only where the CPU has VNNI (FBGEMM's and oneDNN's VNNI or AMX kernels sum in 32 bits),
# skipped with the CPU named elsewhere. Forcing answers changes what the package decides, not which instructions the
# libraries run: on a CPU with VNNI, `vnni=False` still runs FBGEMM's VNNI kernels (on 7-bit weights), so the 7-bit
# route's own AVX2 kernels (`vpmaddubsw`) run in a child process capped at AVX2 (`bench --isa`'s caps, -m slow).
# oneDNN's routes run Llama (T5 under -m slow: its oneDNN graphs compile for minutes), "inductor" under -m slow.
WITHOUT_VNNI, WITH_VNNI, WITH_AMX = {"vnni": False}, {"vnni": True, "amx": False}, {"amx": True}
INT8_ROUTES = [
    # (case, quantized on, compiled on, int8_linears, the route "auto" or the option resolves to)
    pytest.param(T5, WITHOUT_VNNI, WITHOUT_VNNI, "auto", "fbgemm", id="7-bit-fbgemm", marks=needs_fbgemm),
    pytest.param(T5, WITH_VNNI, WITH_VNNI, "auto", "fbgemm", id="8-bit-fbgemm-vnni", marks=[needs_fbgemm, needs_vnni]),
    pytest.param(LLAMA, WITHOUT_VNNI, WITH_AMX, "auto", "library", id="7-bit-onednn"),
    pytest.param(LLAMA, WITH_VNNI, WITH_AMX, "auto", "library", id="8-bit-onednn-amx", marks=needs_vnni),
    pytest.param(T5, WITHOUT_VNNI, WITH_AMX, "auto", "library", id="7-bit-onednn-t5", marks=pytest.mark.slow),
    pytest.param(
        T5, WITH_VNNI, WITH_AMX, "auto", "library", id="8-bit-onednn-amx-t5", marks=[needs_vnni, pytest.mark.slow]
    ),
    pytest.param(T5, WITHOUT_VNNI, WITHOUT_VNNI, "inductor", "inductor", id="7-bit-inductor", marks=pytest.mark.slow),
]
# A short mixed stream: rows and lengths change from call to call; the last call's shapes are the first's (no
# compile in it under either policy), so that its profile shows the kernels that ran.
INT8_STREAM = [(3, 7), (1, 4), (4, 8), (3, 7)]


@pytest.mark.parametrize("shape_policy", ["padded", "bucketed"])
@pytest.mark.parametrize(("case", "quantized_on", "compiled_on", "int8_linears", "route"), INT8_ROUTES)
def test_each_int8_route_generates_as_eager_int8_over_a_stream(
    case, quantized_on, compiled_on, int8_linears, route, shape_policy
):
    # Compiled flexible generate against eager generate of the same quantized model (upstream's, DynamicCache), call
    # by call: not bit for bit (the integer products are, the float parts between them are not: docs/compile.md,
    # "What 'exact' covers"), so `assert_int8_scores`: scores within `int8_atol`, tokens parting only at a margin
    # that the tolerance allows. "fbgemm" runs all but the decode steps of 1-2 rows on FBGEMM, and no library int8
    # linear at all; "inductor" the decode steps as dot products and the encoder and cross-attention projections as
    # float GEMMs, no library int8 linear but the one whose 37 features (the tiny T5's second feed-forward linear)
    # are no multiple of 4; "library" oneDNN's (or `_int_mm`), which the profile sees.
    with cpu.forced(**quantized_on):
        upstream, flex = quantized_pair(case)
        assert int8_bits() == (8 if quantized_on.get("vnni") else 7)
    generator = torch.Generator().manual_seed(0)
    common = {"max_new_tokens": 5, "do_sample": False}
    with cpu.forced(**compiled_on):
        assert resolve_int8_linears(int8_linears) == route
        compile_config = compile_config_for_cpu(int8_linears=int8_linears)
        for call, (batch_size, length) in enumerate(INT8_STREAM):
            inputs = case.make_inputs(batch_size, length, generator)
            expected, atol = eager_int8(upstream, case, inputs, **common)
            last = call == len(INT8_STREAM) - 1
            with torch.profiler.profile(record_shapes=True) if last else contextlib.nullcontext() as profile:
                actual = flex.generate(
                    **inputs,
                    **common,
                    output_scores=True,
                    return_dict_in_generate=True,
                    cache_implementation="flexible_static",
                    cache_config=cache_config_for(case, shape_policy),
                    compile_config=compile_config,
                )
            assert_int8_scores(expected, actual, atol)
    # a library int8 linear: oneDNN's (frozen) or `_int_mm` (whichever this CPU's inductor picks, and eager
    # prefills), in a decode step (up to 8 rows) or in the encoder and cross-attention projections (more)
    library_ops = ("onednn::qlinear_pointwise", "aten::_int_mm")
    events = profile.key_averages(group_by_input_shape=True)
    fbgemm_calls = sum(event.count for event in events if event.key == FBGEMM_OP)
    library = [(event.input_shapes[0], event.count) for event in events if event.key in library_ops]
    if route == "library":
        assert any(shape[0] <= 8 for shape, _ in library), library
        assert not case.build_config().is_encoder_decoder or any(shape[0] > 8 for shape, _ in library), library
        assert fbgemm_calls == 0
    elif route == "inductor":
        assert library and all(shape[0] <= 8 and shape[1] == 37 for shape, _ in library), library
        assert fbgemm_calls == 0
    else:
        assert library == [] and fbgemm_calls > 0, library


@pytest.mark.slow
@needs_fbgemm
@pytest.mark.skipif(
    "avx512f" not in (cpu.detected().hardware_flags or cpu.detected().flags) or bool(cpu.detected().isa_limit),
    reason="this process runs AVX2 kernels already (the 7-bit route's own, in the default suite); this CPU: "
    + cpu.detected().describe(),
)
def test_the_7_bit_route_under_avx2_caps_generates_as_eager_int8(tmp_path):
    # The 7-bit FBGEMM route with FBGEMM's, oneDNN's, ATen's and inductor's AVX2 kernels: a child process started
    # with `bench --isa avx2`'s caps (an emulation of an AVX2 CPU's instructions) runs the route's test, where the
    # CPU answers no VNNI without being forced.
    from transformers_flexcache.bench.isa import isa_environment

    test = "tests/compile/test_quantization.py::test_each_int8_route_generates_as_eager_int8_over_a_stream"
    environ = {**os.environ, **isa_environment("avx2"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    probe = subprocess.run(
        [sys.executable, "-c", "from transformers_flexcache.compile import cpu; print(cpu.detected().vnni)"],
        env=environ,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "False", probe  # the child answers as an AVX2 CPU
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow",
            "-rs",
            f"{test}[7-bit-fbgemm-padded]",
            f"{test}[7-bit-fbgemm-bucketed]",
        ],
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        timeout=1800,
    )
    assert child.returncode == 0 and "2 passed" in child.stdout, child.stdout[-4000:] + child.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("case", [MARIAN, LLAMA], ids=lambda case: case.name)
@pytest.mark.parametrize("shape_policy", ["padded", "bucketed"])
def test_compiled_int8_generates_the_eager_int8_dynamic_cache_tokens(case, shape_policy):
    _compiled_int8_stream(case, shape_policy)


def test_a_tied_output_layer_is_untied_so_that_the_embedding_lookup_keeps_float_rows():
    config = T5.build_config()
    config.tie_word_embeddings = True
    model = T5.upstream_class(config).eval()
    assert model.lm_head.weight is model.shared.weight
    table = model.shared.weight.detach().clone()
    quantize(model, "int8")
    assert type(model.lm_head.weight).__name__ == "Int8Tensor"
    assert torch.equal(model.shared.weight, table)


def test_compiled_calls_from_before_quantizing_are_dropped():
    upstream, flex = T5.build("sdpa")
    upstream._compiled_call = object()  # what upstream's get_compiled_call caches: graphs with float weights frozen
    quantize(upstream, "int8")
    assert "_compiled_call" not in upstream.__dict__
    # ours, too: the compiled encoder side of an int8 model is compiled otherwise (`has_int8_variants`)
    config = compile_config_for_cpu(int8_linears="inductor")
    float_encoder = compiled_encoder(flex, config)
    assert compiled_encoder(flex, config) is float_encoder
    quantize(flex, "int8")
    assert compiled_encoder(flex, config) is not float_encoder


def _gpt2():
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize(
    ("make_model", "mode", "message"),
    [
        (lambda: LLAMA.build()[0], "int4", r"mode='int4' is not one of \('int8',\)"),
        (lambda: LLAMA.build()[0].to(torch.float16), "int8", r"torch.float16; int8 quantizes float32 or bfloat16"),
        (lambda: LLAMA.build()[0].to("meta"), "int8", r"is for the CPU .*; the model is on meta"),
        (lambda: torch.nn.Sequential(torch.nn.Embedding(4, 4)), "int8", r"no nn.Linear layer"),
        (lambda: JAMBA.build()[0], "int8", r"experts\.gate_up_proj of JambaExperts, fused \[2, 64, 32\]"),
        (_gpt2, "int8", r"c_attn\.weight of Conv1D, a transposed linear weight"),
    ],
    ids=["mode", "float16", "device", "no-linear", "jamba-experts", "gpt2-conv1d"],
)
def test_what_int8_cannot_quantize_is_refused_with_the_reason_and_left_unchanged(make_model, mode, message):
    model = make_model()
    before = {name: type(parameter) for name, parameter in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        quantize(model, mode)
    assert {name: type(parameter) for name, parameter in model.named_parameters()} == before


def test_a_model_quantized_already_is_refused():
    model = quantize(LLAMA.build()[0], "int8")
    with pytest.raises(ValueError, match="quantized already"):
        quantize(copy.deepcopy(model), "int8")


@pytest.mark.parametrize("case", [T5, LLAMA], ids=lambda case: case.name)
def test_the_serving_engine_serves_an_int8_model_as_its_eager_int8_generate(case):
    # `quantize` is the one option for the engine too: it takes the quantized model as it is.
    from transformers_flexcache.serving import Engine

    upstream, flex = quantized_pair(case)
    stream, common, expected = int8_requests(upstream, case, seed=4, new_tokens=6)
    capacities = {"max_batch_size": 4, "max_cache_len": 16}
    if flex.config.is_encoder_decoder:
        capacities["max_encoder_len"] = 12
    with Engine(flex, cache_config=capacities) as engine:
        handles = [engine.submit(**inputs, **common) for inputs in stream]
        outputs = [handle.result(timeout=120) for handle in handles]
    for (want, atol), got in zip(expected, outputs, strict=True):
        assert_int8_scores(want, got, atol)


def test_8_bit_int8_weights_are_refused_for_a_compiled_call_on_a_cpu_without_vnni():
    # A model quantized at 8 bits (on a CPU with VNNI) and compiled where the int8 kernels saturate: refused before the
    # call leases a cache or compiles; the eager call, and 7-bit weights, still run. Both CPUs are forced here.
    import transformers_flexcache.compile.quantization as quantization
    from transformers_flexcache.serving import Engine

    with cpu.forced(vnni=True):
        upstream, flex = quantized_pair(LLAMA)
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(0))
    cache_config = cache_config_for(LLAMA, "padded")
    common = {"max_new_tokens": 3, "do_sample": False}
    compiled = {"cache_implementation": "flexible_static", "cache_config": cache_config, **common}
    with cpu.forced(vnni=False):
        with pytest.raises(
            ValueError, match=r"8-bit ranges, which oneDNN's compiled int8 kernels saturate on this CPU"
        ):
            flex.generate(**inputs, **compiled, compile_config=compile_config_for_cpu())
        assert flex.flexible_cache is None  # nothing was leased
        with pytest.raises(ValueError, match=r"quantize the float model on this machine"):
            engine_capacities = {"shape_policy": "padded", "max_batch_size": 4, "max_cache_len": 16}
            Engine(flex, cache_config=engine_capacities, compile_config=compile_config_for_cpu())
        expected, atol = eager_int8(upstream, LLAMA, inputs, **common)
        actual = flex.generate(**inputs, **compiled, output_scores=True, return_dict_in_generate=True)
        assert_int8_scores(expected, actual, atol)  # eager: no int8 GEMM kernel

        _, seven_bits = quantized_pair(LLAMA)
        quantization.check_compiled_int8(seven_bits)  # 7-bit weights: no error
        quantization.check_compiled_int8(LLAMA.build("sdpa")[1])  # a float model: no error
