"""Exported programs (torch.export, run with torch) against upstream's eager model with its DynamicCache.

One export (module fixture) serves every test of a model: the point is that one program, with one set of cache
buffers, serves every batch and length within its capacities, in any order of calls.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, SuppressTokensAtBeginLogitsProcessor
from transformers.models.llama import modeling_llama

from tests.export.helpers import (
    CAPACITY,
    NEW_TOKENS,
    ONE_LAYER,
    SHAPES,
    T5_VARIED,
    assert_close_logits,
    assert_matches_eager_for_every_shape,
    assert_same_greedy,
)
from tests.helpers import in_double, python_calls
from tests.model_cases import (
    BART,
    GEMMA3_TEXT,
    GPT2,
    JAMBA,
    LLAMA,
    M2M_100,
    MARIAN,
    MBART,
    MISTRAL,
    PEGASUS,
    PHI3,
    PIX2STRUCT,
    QWEN2,
    QWEN3,
    T5,
    WHISPER,
    WHISPER_MAX_SOURCE_POSITIONS,
)
from transformers_flexcache.export import (
    ExportableDecoderOnly,
    ExportableEncoderDecoder,
    ExportedPrograms,
    export_decoder_only,
    export_encoder_decoder,
    generate,
    greedy_generate,
)
from transformers_flexcache.export.rewrites import KERNEL_BMM
from transformers_flexcache.models.source_check import original_code

# Whisper's log-mel features always give max_source_positions encoder positions: only the batch varies.
WHISPER_FEATURE_SHAPES = [(4, WHISPER_MAX_SOURCE_POSITIONS), (1, WHISPER_MAX_SOURCE_POSITIONS)]
LLAMA_CAPACITY = {"max_batch_size": CAPACITY["max_batch_size"], "max_cache_len": 10 + NEW_TOKENS}


@pytest.fixture(scope="module")
def t5():
    upstream, flex = T5_VARIED.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY)


@pytest.fixture(scope="module")
def bart():
    upstream, flex = BART.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY)


@pytest.fixture(scope="module")
def whisper_encoder_states():
    # Encoder outputs of any length up to max_encoder_len: the dynamic encoder length, through the cross mask that
    # model_overrides/whisper.py adds.
    upstream, flex = WHISPER.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY, encoder_input="encoder_hidden_states")


@pytest.fixture(scope="module")
def whisper_features():
    upstream, flex = ONE_LAYER["whisper"].build(seed=1)
    capacity = {**CAPACITY, "max_encoder_len": WHISPER_MAX_SOURCE_POSITIONS}
    return upstream, export_encoder_decoder(flex, **capacity)  # encoder_input defaults to input_features


@pytest.fixture(scope="module")
def pix2struct():
    upstream, flex = PIX2STRUCT.build(seed=1)
    return upstream, export_encoder_decoder(flex, **CAPACITY)  # encoder_input defaults to flattened_patches


@pytest.fixture(scope="module")
def llama():
    upstream, flex = LLAMA.build()
    return upstream, export_decoder_only(flex, **LLAMA_CAPACITY)


def _fresh(programs: ExportedPrograms) -> ExportedPrograms:
    """The same programs and buffers with a runner that has started no sequence."""
    return ExportedPrograms(programs.wrapper, programs.programs)


@pytest.mark.parametrize(
    ("programs_fixture", "case", "shapes"),
    [
        pytest.param("t5", T5_VARIED, SHAPES, id="t5"),
        pytest.param("bart", BART, SHAPES, id="bart"),
        pytest.param("whisper_encoder_states", WHISPER, SHAPES, id="whisper-encoder_hidden_states"),
        pytest.param("whisper_features", ONE_LAYER["whisper"], WHISPER_FEATURE_SHAPES, id="whisper-input_features"),
        pytest.param("pix2struct", PIX2STRUCT, SHAPES, id="pix2struct-flattened_patches"),
        pytest.param("llama", LLAMA, SHAPES, id="llama"),
    ],
)
def test_exported_model_matches_eager_generate_for_every_shape_with_one_program(
    request, programs_fixture, case, shapes
):
    upstream, programs = request.getfixturevalue(programs_fixture)
    pointers = [b.data_ptr() for b in programs.wrapper.buffers()]
    assert_matches_eager_for_every_shape(programs, upstream, case, shapes, seed=1)
    assert [b.data_ptr() for b in programs.wrapper.buffers()] == pointers, "a cache buffer was reallocated"


@pytest.mark.parametrize(
    "case",
    [
        MARIAN,  # a BART copy upstream, through FlexBartAttentionMixin
        MISTRAL,  # the generic route; every layer a sliding window of 4, shorter than the calls
        *(pytest.param(case, marks=pytest.mark.slow) for case in (M2M_100, MBART, PEGASUS)),
        *(pytest.param(case, marks=pytest.mark.slow) for case in (QWEN2, QWEN3, PHI3, GPT2, GEMMA3_TEXT)),
    ],
    ids=lambda case: case.name,
)
def test_exported_bart_copies_and_generic_decoder_only_models_match_eager_generate(case):
    upstream, flex = case.build(seed=1)
    if upstream.config.is_encoder_decoder:
        programs = export_encoder_decoder(flex, **CAPACITY)
    else:
        programs = export_decoder_only(flex, **LLAMA_CAPACITY)
    # Prompts and decoding past the window of the sliding-window layers: the program stores every position and the
    # model's sliding mask hides those that DynamicSlidingWindowLayer would have dropped.
    assert_matches_eager_for_every_shape(programs, upstream, case, SHAPES, seed=1)


def test_exported_t5_logits_keep_the_d_model_output_scaling(t5):
    upstream, programs = t5
    # tests/model_cases.py unties the tiny T5's output embeddings but keeps their d_model**-0.5 scaling, as t5-small.
    assert upstream.config.scale_decoder_outputs
    inputs = T5_VARIED.make_inputs(2, 5, torch.Generator().manual_seed(3))
    start = torch.zeros(2, 1, dtype=torch.long)
    want = upstream(**inputs, decoder_input_ids=start).logits
    exact = in_double(upstream)(**inputs, decoder_input_ids=start).logits
    runner = _fresh(programs)
    states = runner.encoder(inputs["input_ids"], inputs["attention_mask"])
    got = runner.text_decoder(start, states, torch.arange(1), inputs["attention_mask"])
    assert_close_logits(got, want, exact, "first step")


def test_llama_forward_method_is_the_llm_runner_entry_on_row_zero_and_restarts_at_position_zero(llama):
    upstream, programs = llama
    runner = _fresh(programs)
    for seed in (5, 6):  # two sequences on the same buffers: the second starts over at position 0
        prompt = LLAMA.make_inputs(1, 6, torch.Generator().manual_seed(seed))["input_ids"]
        expected = upstream.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens = prompt
        logits = runner.forward(prompt, torch.arange(prompt.shape[1]))
        for _ in range(NEW_TOKENS - 1):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=-1)
            logits = runner.forward(next_token, torch.tensor([tokens.shape[1] - 1]))
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
        assert torch.equal(tokens, expected), (seed, tokens, expected)


@pytest.mark.parametrize(
    ("batch_size", "encoder_len", "message"),
    [
        pytest.param(5, 4, r"batch_size=5 exceeds max_batch_size=4 .* max_batch_size=5 or more", id="batch"),
        pytest.param(2, 11, r"encoder_len=11 exceeds max_encoder_len=10 .* max_encoder_len=11 or more", id="encoder"),
    ],
)
def test_encoder_refuses_inputs_over_capacity_with_value_limit_and_fix(t5, batch_size, encoder_len, message):
    _, programs = t5
    input_ids = torch.full((batch_size, encoder_len), 5)
    with pytest.raises(ValueError, match=message):
        _fresh(programs).encoder(input_ids, torch.ones_like(input_ids))


def test_text_decoder_refuses_a_position_past_max_cache_len(t5):
    _, programs = t5
    runner = _fresh(programs)
    input_ids = torch.full((2, 4), 5)
    states = runner.encoder(input_ids, torch.ones_like(input_ids))
    with pytest.raises(ValueError, match=r"decoder_len=9 exceeds max_cache_len=8 .* max_cache_len=9 or more"):
        runner.text_decoder(torch.zeros(2, 1), states, torch.tensor([8]), torch.ones_like(input_ids))


def test_generate_refuses_more_new_tokens_than_cache_positions(t5):
    _, programs = t5
    with pytest.raises(ValueError, match=r"max_new_tokens=9 .* needs max_cache_len=9"):
        generate(programs, torch.full((1, 4), 5), max_new_tokens=9, decoder_start_token_id=0)


def test_text_decoder_refuses_to_run_before_an_encoder_call_started_a_sequence(t5):
    _, programs = t5
    with pytest.raises(ValueError, match=r"text_decoder was called before encoder; call encoder"):
        _fresh(programs).text_decoder(torch.zeros(2, 1), torch.zeros(2, 4, 32), torch.tensor([0]), torch.ones(2, 4))


def test_text_decoder_refuses_another_batch_than_the_encoder_call_and_more_than_one_token(t5):
    _, programs = t5
    runner = _fresh(programs)
    input_ids = torch.full((2, 4), 5)
    runner.encoder(input_ids, torch.ones_like(input_ids))
    with pytest.raises(ValueError, match=r"text_decoder got batch and encoder length \(3, 4\), but encoder started"):
        runner.text_decoder(torch.zeros(3, 1), torch.zeros(3, 4, 32), torch.tensor([0]), torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"text_decoder takes one token per call, got 2"):
        runner.text_decoder(torch.zeros(2, 2), torch.zeros(2, 4, 32), torch.arange(2), torch.ones(2, 4))


def test_decode_refuses_to_run_before_prefill_and_forward_refuses_more_than_one_row(llama):
    _, programs = llama
    runner = _fresh(programs)
    mask = torch.ones(2, LLAMA_CAPACITY["max_cache_len"])
    with pytest.raises(ValueError, match=r"decode was called before prefill; call prefill"):
        runner.decode(torch.ones(2, 1), mask, torch.zeros(2, 1), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"forward takes tokens \[1, S\] \(row 0 only\), got \(2, 3\)"):
        runner.forward(torch.ones(2, 3), torch.arange(3))


def test_prefill_and_decode_refuse_positions_and_masks_that_the_program_would_not_use_and_stay_usable(llama):
    upstream, programs = llama
    runner = _fresh(programs)
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(4))
    attention_mask = inputs["attention_mask"]
    assert (attention_mask == 0).any(), "the prompt must be left-padded for this test"
    mask = torch.zeros(2, LLAMA_CAPACITY["max_cache_len"], dtype=torch.long)
    mask[:, :5] = attention_mask
    counted = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    with pytest.raises(ValueError, match=r"position_ids=.* are not the mask's: .* pass those"):
        runner.prefill(inputs["input_ids"], mask, torch.arange(5).expand(2, 5), torch.arange(5))
    with pytest.raises(ValueError, match=r"prefill starts a sequence at position 0, got .* starting at 1"):
        runner.prefill(inputs["input_ids"], mask, counted, torch.arange(1, 6))
    runner.prefill(inputs["input_ids"], mask, counted, torch.arange(5))
    changed = mask.clone()
    changed[:, 5] = 1
    changed[0, 4] = 0
    with pytest.raises(ValueError, match=r"attention_mask\[:, :6\] differs from the sequence's"):
        runner.decode(torch.ones(2, 1), changed, counted[:, -1:] + 1, torch.tensor([5]))
    # Nothing ran: generate on the same buffers gives upstream's tokens.
    expected = upstream.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(greedy_generate(runner, **inputs, max_new_tokens=NEW_TOKENS), expected)


def test_llm_runner_forward_after_a_padded_prefill_finds_row_zero_unpadded(llama):
    upstream, programs = llama
    runner = _fresh(programs)
    padded = LLAMA.make_inputs(3, 6, torch.Generator().manual_seed(8))
    padded["attention_mask"][0, :2] = 0  # row 0's mask in the program now hides positions 0 and 1
    greedy_generate(runner, **padded, max_new_tokens=2)
    prompt = LLAMA.make_inputs(1, 6, torch.Generator().manual_seed(9))["input_ids"]
    expected = upstream.generate(prompt, max_new_tokens=2, do_sample=False)
    logits = runner.forward(prompt, torch.arange(6))
    first = logits[:, -1].argmax(-1, keepdim=True)
    second = runner.forward(first, torch.tensor([6]))[:, -1].argmax(-1, keepdim=True)
    assert torch.equal(torch.cat([prompt, first, second], dim=-1), expected)


def _key_consumers(program, buffer_part: str, passes=()) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(last node of the chain, its consumer) from each key buffer whose name holds `buffer_part`, following
    single-use views and the ops in `passes` (the consumers, as a list, where there are several)."""
    buffers = program.graph_signature.inputs_to_buffers
    views = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
    write = torch.ops.aten.index_put_.default
    found = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and buffer_part in buffers.get(node.name, ""):
            reached = node
            while True:  # along the reads (a self-attention buffer is read from its write: index_put_)
                users = [user for user in reached.users if user.target != torch.ops.aten.sym_size.int]
                if len(users) != 1 or users[0].target not in (*views, write, *passes):
                    break
                reached = users[0]
            found.append((reached, users[0] if len(users) == 1 else users))
    return found


def test_whisper_text_decoder_reads_its_fixed_length_cross_keys_whole_and_as_the_first_operand_of_bmm(
    whisper_features,
):
    # ExecuTorch copies every slice: reading rows [:B] of the 1500-position buffers would copy them at every step.
    _, programs = whisper_features
    consumers = _key_consumers(programs.programs["text_decoder"], "cross_keys")
    assert len(consumers) == programs.wrapper.num_layers
    for reached, consumer in consumers:
        assert consumer.target == torch.ops.aten.bmm.default and consumer.args[0] is reached, consumer


def test_only_the_matmuls_over_whisper_s_whole_cross_buffers_are_marked_for_executorch_s_kernels(whisper_features, t5):
    # XNNPACK's bmm is 2-3x slower than ExecuTorch's kernel over 1500 positions (rewrites.py); marked ones stay out.
    def marked(node) -> bool:
        return bool(node.meta.get("custom", {}).get(KERNEL_BMM))

    whisper = whisper_features[1].programs["text_decoder"]
    over_cross = {
        consumer
        for part in ("cross_keys", "cross_values")
        for _, consumer in _key_consumers(whisper, part)
        if consumer.target == torch.ops.aten.bmm.default
    }
    assert len(over_cross) == 2 * whisper_features[1].wrapper.num_layers
    bmms = [node for node in whisper.graph.nodes if node.target == torch.ops.aten.bmm.default]
    assert {node for node in bmms if marked(node)} == over_cross
    assert len(bmms) > len(over_cross)  # the self-attention's stay with XNNPACK
    for program in t5[1].programs.values():  # keys of at most the capacities: all with XNNPACK
        assert not any(marked(node) for node in program.graph.nodes)


def test_decoder_steps_read_cached_keys_as_the_first_operand_of_bmm(t5):
    # XNNPACK's bmm takes no transposed operand: bmm(query, key^T) would copy every cached key transposed each step.
    _, programs = t5
    for part in ("self_keys", "cross_keys"):
        consumers = _key_consumers(programs.programs["text_decoder"], part, passes=(torch.ops.aten.slice.Tensor,))
        assert consumers
        for reached, consumer in consumers:
            assert consumer.target == torch.ops.aten.bmm.default and consumer.args[0] is reached, (part, consumer)


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
    features = torch.zeros(2, WHISPER.build_config().num_mel_bins, 20)
    with pytest.raises(ValueError, match=r"encoder needs input_features \[batch, num_mel_bins, 24\]"):
        _fresh(programs).encoder(features)
    with pytest.raises(ValueError, match=r"this program takes input_features, got \['input_ids'\]"):
        generate(programs, torch.ones(2, 12, dtype=torch.long), max_new_tokens=2, decoder_start_token_id=1)


@pytest.mark.parametrize("programs_fixture", ["llama", "t5", "bart"])
def test_sampled_generate_draws_the_tokens_of_upstream_sampling_under_the_same_seed(request, programs_fixture):
    upstream, programs = request.getfixturevalue(programs_fixture)
    case = {"llama": LLAMA, "t5": T5_VARIED, "bart": BART}[programs_fixture]
    inputs = case.make_inputs(3, 6, torch.Generator().manual_seed(7))
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "max_new_tokens": NEW_TOKENS}
    config = upstream.generation_config
    token_ids = {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id}
    if case is not LLAMA:
        token_ids["decoder_start_token_id"] = config.decoder_start_token_id
        token_ids["forced_eos_token_id"] = getattr(config, "forced_eos_token_id", None)
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        expected = upstream.generate(**inputs, **sampling)
        torch.manual_seed(seed)
        tokens = generate(programs, **inputs, **sampling, **token_ids)
        assert torch.equal(tokens, expected), (seed, tokens, expected)


def test_sampled_generate_with_a_generator_repeats_for_its_seed_and_leaves_the_global_generator_alone(llama):
    _, programs = llama
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(8))
    kwargs = {"do_sample": True, "top_k": 0, "max_new_tokens": NEW_TOKENS}
    state = torch.get_rng_state()
    runs = [generate(programs, **inputs, **kwargs, generator=torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])  # 2 rows x 8 draws from a 99-token vocabulary: equal by chance ~never


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"temperature": 0.0}, r"temperature=0.0 must be > 0 when sampling", id="temperature"),
        pytest.param({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]", id="top_p"),
    ],
)
def test_sampled_generate_refuses_invalid_parameters_before_running(llama, kwargs, message):
    _, programs = llama
    runner = _fresh(programs)
    with pytest.raises(ValueError, match=message):
        generate(runner, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, do_sample=True, **kwargs)
    assert runner._started == {}, "a refused call ran a program"


def test_greedy_generate_is_generate_without_sampling(llama):
    upstream, programs = llama
    inputs = LLAMA.make_inputs(2, 4, torch.Generator().manual_seed(9))
    assert torch.equal(
        greedy_generate(programs, **inputs, max_new_tokens=4), generate(programs, **inputs, max_new_tokens=4)
    )
    assert_same_greedy(programs, upstream, inputs, "greedy", new_tokens=4)


def test_exportable_wrapper_refuses_jamba_whose_mamba_layers_it_does_not_cover():
    _, flex = JAMBA.build()
    with pytest.raises(ValueError, match=r"has \['linear_attention'\] layers, which export does not cover"):
        ExportableDecoderOnly(flex, max_batch_size=2, max_cache_len=8)


def test_generate_applies_upstream_logits_processors_where_upstream_generate_applies_them(llama):
    upstream, programs = llama
    prompt_len = 5
    inputs = LLAMA.make_inputs(3, prompt_len, torch.Generator().manual_seed(10))
    config = upstream.generation_config
    token_ids = {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id}
    plain = generate(programs, **inputs, max_new_tokens=NEW_TOKENS, **token_ids)
    first = plain[:, prompt_len].unique().tolist()  # suppressing the first tokens it chose changes every row
    processors = LogitsProcessorList([SuppressTokensAtBeginLogitsProcessor(first, begin_index=prompt_len)])
    tokens = generate(programs, **inputs, max_new_tokens=NEW_TOKENS, logits_processor=processors, **token_ids)
    expected = upstream.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, begin_suppress_tokens=first)
    assert not torch.equal(tokens, plain)
    assert torch.equal(tokens, expected), (tokens, expected)


def test_an_export_traces_upstreams_own_code_behind_kernels_wrappers_and_holds_only_the_model_s_parameters():
    # transformers 5.25's `kernels` wraps LlamaAttention (`use_kernelized_func`) and turns `apply_rotary_pos_emb` into
    # a module called through a per-instance dispatch: the export must still trace upstream's function, and find no
    # state of the wrappers in the model.
    rotary = original_code(modeling_llama.apply_rotary_pos_emb)
    _, flex = ONE_LAYER["llama"].build()
    with python_calls(rotary) as calls:
        programs = export_decoder_only(flex, **LLAMA_CAPACITY)
    assert calls, "the exported programs do not run upstream's apply_rotary_pos_emb"
    parameters = set(dict(flex.named_parameters()))
    for name, program in programs.programs.items():
        held = {parameter.removeprefix("owner.model.") for parameter in program.graph_signature.parameters}
        assert held == parameters, name
