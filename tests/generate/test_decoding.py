"""Every decoding path of generate(cache_implementation="flexible_static") against upstream's DynamicCache.

Greedy, seeded sampling, beam search, several returned sequences, plain-tensor and dict outputs with scores and
logits, minimum and maximum new tokens, rows that stop at EOS before others, and padding on each side the model
allows; parametrized over `MODEL_CASES`. Inputs are padded batches (row 0 half padding, see `ModelCase.make_inputs`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.helpers import assert_same_generation, assert_within_float_noise, exact_generation, generate_both
from tests.model_cases import MODEL_CASES

BATCH_SIZE, INPUT_LEN, NEW_TOKENS = 3, 6, 5
# Greater than any vocabulary here, so never generated: with it as EOS every row runs to max_new_tokens.
NEVER_GENERATED = 1_000_000

STRATEGIES = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "top_k": 8, "temperature": 0.7},
    "beam_search_2": {"do_sample": False, "num_beams": 2},
    "beam_search_3": {"do_sample": False, "num_beams": 3},
    "sampling_2_sequences": {"do_sample": True, "top_k": 8, "num_return_sequences": 2},
    "beam_search_3_with_2_sequences": {"do_sample": False, "num_beams": 3, "num_return_sequences": 2},
}
CASES = [pytest.param(case, id=case.name) for case in MODEL_CASES]


def _padding_sides(case) -> tuple[str, ...]:
    if case.padding_sides is not None:
        return case.padding_sides
    if "attention_mask" not in case.make_inputs(2, 4, torch.Generator().manual_seed(0)):
        return ()
    return ("left", "right") if case.build_config().is_encoder_decoder else ("left",)


def _inputs(case, seed: int = 0) -> dict:
    length = case.decoding_input_len or INPUT_LEN
    return case.make_inputs(BATCH_SIZE, length, torch.Generator().manual_seed(seed))


def _with(case, **kwargs) -> dict:
    """The case's generate kwargs, with `kwargs` taking precedence."""
    return {**case.generate_kwargs, **kwargs}


def _repad(inputs: dict, side: str) -> dict:
    """The same rows with their padding moved to `side`: every [B, L, ...] tensor follows the attention mask."""
    # attention_mask: [B, L]; 0 sorts first, so a stable sort of the mask puts padding left, of 1 - mask right.
    mask = inputs["attention_mask"]
    order = torch.argsort(mask if side == "left" else 1 - mask, dim=1, stable=True)
    rows = torch.arange(mask.shape[0])[:, None]
    return {
        key: value[rows, order] if torch.is_tensor(value) and value.shape[:2] == mask.shape else value
        for key, value in inputs.items()
    }


class _EosInRow0At(LogitsProcessor):
    """At decoding step `step`, batch row 0 (all its beams) may only choose `eos_token_id`, if EOS is allowed there.

    Makes row 0 stop early on purpose, whatever the tiny model prefers, while the other rows decode freely. Other
    tokens of row 0 become -inf and EOS keeps its own score, so scores stay comparable within float tolerance. The
    step is counted from the length of the first `input_ids` it sees (models' generate differ in what they prepend).
    """

    def __init__(self, *, eos_token_id: int, step: int, num_beams: int):
        self.eos_token_id, self.step, self.num_beams = eos_token_id, step, num_beams
        self.start_len = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # input_ids: [B * num_beams, L], scores: [B * num_beams, V]; row 0's beams come first
        if self.start_len is None:
            self.start_len = input_ids.shape[1]
        row_0 = scores[: self.num_beams]
        at_step = input_ids.shape[1] == self.start_len + self.step
        if not at_step or not torch.isfinite(row_0[:, self.eos_token_id]).all():
            return scores
        forced = torch.full_like(row_0, -torch.inf)
        forced[:, self.eos_token_id] = row_0[:, self.eos_token_id]
        return torch.cat([forced, scores[self.num_beams :]])


def _eos_for_row_0_at_step(upstream, case, inputs, strategy: str, *, step: int) -> dict:
    """generate kwargs that end row 0 with EOS at decoding step `step` (if EOS is allowed then).

    EOS is a token that upstream's own run of the same strategy (with an EOS that is never generated) gives no row,
    so the other rows run to max_new_tokens.
    """
    torch.manual_seed(0)
    kwargs = _with(case, max_new_tokens=NEW_TOKENS, eos_token_id=NEVER_GENERATED, **STRATEGIES[strategy])
    sequences = upstream.generate(**inputs, **kwargs)
    vocab_size = upstream.config.get_text_config().vocab_size
    eos_token_id = min(set(range(3, vocab_size)) - set(sequences.flatten().tolist()))
    processor = _EosInRow0At(eos_token_id=eos_token_id, step=step, num_beams=STRATEGIES[strategy].get("num_beams", 1))
    return {"eos_token_id": eos_token_id, "logits_processor": LogitsProcessorList([processor])}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("case", CASES)
def test_decoding_strategy_matches_dynamic_cache(case, strategy):
    upstream, flex = case.build()
    inputs = _inputs(case)
    expected, actual = generate_both(
        upstream, flex, inputs, seed=3, **_with(case, max_new_tokens=NEW_TOKENS, **STRATEGIES[strategy])
    )
    assert_same_generation(expected, actual)
    num_sequences = STRATEGIES[strategy].get("num_return_sequences", 1)
    assert actual.sequences.shape[0] == BATCH_SIZE * num_sequences


@pytest.mark.parametrize("case", CASES)
def test_plain_tensor_output_matches_dynamic_cache(case):
    upstream, flex = case.build()
    inputs = _inputs(case, seed=1)
    expected, actual = generate_both(
        upstream,
        flex,
        inputs,
        **_with(case, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=False, output_scores=False),
    )
    assert torch.is_tensor(actual)
    assert torch.equal(expected, actual)


@pytest.mark.parametrize("case", CASES)
def test_returned_logits_of_beam_search_match_dynamic_cache(case):
    upstream, flex = case.build()
    inputs = _inputs(case, seed=2)
    expected, actual = generate_both(
        upstream, flex, inputs, **_with(case, max_new_tokens=NEW_TOKENS, num_beams=2, output_logits=True)
    )
    assert_same_generation(expected, actual)
    assert len(actual.logits) == len(expected.logits)
    # the raw logits: bit for bit, or within upstream's float noise on them (its float64 run of the same call)
    exact = exact_generation(
        upstream, inputs, **_with(case, max_new_tokens=NEW_TOKENS, num_beams=2, output_logits=True)
    )
    steps = next(
        (
            step + 1
            for step in range(len(expected.logits))
            if not torch.equal(
                expected.sequences[:, step - len(expected.logits)], exact.sequences[:, step - len(exact.logits)]
            )
        ),
        len(expected.logits),
    )
    assert_within_float_noise(actual.logits[:steps], expected.logits[:steps], exact.logits[:steps])


@pytest.mark.parametrize("strategy", ["greedy", "sampling", "beam_search_2"])
@pytest.mark.parametrize("case", CASES)
def test_rows_that_reach_eos_before_others_match_dynamic_cache(case, strategy):
    upstream, flex = case.build()
    inputs = _inputs(case, seed=4)
    eos = _eos_for_row_0_at_step(upstream, case, inputs, strategy, step=1)
    kwargs = _with(case, max_new_tokens=NEW_TOKENS, **eos, **STRATEGIES[strategy])
    expected, actual = generate_both(upstream, flex, inputs, **kwargs)
    start_len = expected.sequences.shape[1] - NEW_TOKENS  # prompt or decoder start tokens
    # The situation this test is about: row 0 ended with EOS at step 1, then padding; the other rows never did.
    # (Beam search fills with EOS where pad_token_id is 0: upstream's `pad_token_id or eos_token_id[0]`.)
    eos_token_id, pad_token_id = eos["eos_token_id"], upstream.generation_config.pad_token_id
    assert expected.sequences[0, start_len + 1] == eos_token_id, expected.sequences
    assert torch.isin(expected.sequences[0, start_len + 2 :], torch.tensor([pad_token_id, eos_token_id])).all()
    assert eos_token_id not in expected.sequences[1:]
    assert_same_generation(expected, actual)


@pytest.mark.parametrize("case", CASES)
def test_min_new_tokens_holds_back_eos_and_max_new_tokens_ends_like_dynamic_cache(case):
    upstream, flex = case.build()
    inputs = _inputs(case, seed=4)
    min_new_tokens = 3
    eos = _eos_for_row_0_at_step(upstream, case, inputs, "greedy", step=1)
    kwargs = _with(case, min_new_tokens=min_new_tokens, **eos, **STRATEGIES["greedy"])
    expected, actual = generate_both(upstream, flex, inputs, max_new_tokens=NEW_TOKENS, **kwargs)
    # The situation this test is about: EOS, which would end row 0 at step 1, is held back (-inf) there, so every
    # row runs to max_new_tokens.
    eos_token_id = eos["eos_token_id"]
    assert all(torch.isinf(expected.scores[step][:, eos_token_id]).all() for step in range(min_new_tokens))
    assert eos_token_id not in expected.sequences
    assert_same_generation(expected, actual)
    assert len(actual.scores) == NEW_TOKENS


PADDING = [pytest.param(case, side, id=f"{case.name}-{side}") for case in MODEL_CASES for side in _padding_sides(case)]


@pytest.mark.parametrize(("case", "side"), PADDING)
def test_padding_on_each_side_the_model_allows_matches_dynamic_cache(case, side):
    upstream, flex = case.build()
    inputs = _repad(_inputs(case, seed=5), side)
    mask = inputs["attention_mask"]
    assert mask[0, 0 if side == "left" else -1] == 0 and mask.sum() < mask.numel(), "row 0 is not padded on that side"
    expected, actual = generate_both(upstream, flex, inputs, **_with(case, max_new_tokens=NEW_TOKENS, do_sample=False))
    assert_same_generation(expected, actual)
