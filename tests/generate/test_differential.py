"""Seeded random sequences of generate calls on one model, each against upstream's DynamicCache on the same weights.

Every call draws (from one seed per sequence; sequences alternate between the shape policies): a batch, a prompt or encoder length, new tokens, a decoding strategy
(greedy, beam search, seeded sampling, several returned sequences), capacities preset or left to grow, a prompt with
pad tokens and no `attention_mask` (the mask is then inferred, decoder-only models), or a continuation of the
previous call's cache. Each sequence runs one shape policy on one model, which keeps its pool across the sequences of
a test. Every output must equal DynamicCache's: the same tokens, scores within tolerance.

The default suite runs `DEFAULT_SEQUENCES` short sequences per model; `pytest -m slow` runs `SLOW_SEQUENCES` longer
ones. A failure names the seed and the calls that led to it.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import pytest
import torch

from tests.helpers import assert_same_generation, generate_both, padded_call_atol, upstream_generate
from tests.model_cases import LLAMA, MODEL_CASES, WHISPER

DEFAULT_SEQUENCES, DEFAULT_CALLS = 2, 4
SLOW_SEQUENCES, SLOW_CALLS = 12, 6
STRATEGIES = {
    "greedy": {"do_sample": False},
    "beams": {"do_sample": False, "num_beams": 2},
    "sampling": {"do_sample": True, "top_k": 8},
    "sampling, 2 sequences": {"do_sample": True, "top_k": 8, "num_return_sequences": 2},
    "beams, 2 sequences": {"do_sample": False, "num_beams": 2, "num_return_sequences": 2},
}
SHAPE_POLICIES = ("exact", "padded")  # alternating, so that every model runs both in the default suite
PRESET = {"max_batch_size": 8, "max_cache_len": 30, "max_encoder_len": 12, "max_prompt_len": 8}


@dataclass
class Step:
    """One drawn call, as a failure message shows it."""

    batch_size: int
    length: int
    new_tokens: int
    strategy: str
    preset: bool
    infer_mask: bool
    continuation: bool
    seed: int

    def describe(self) -> str:
        flags = [name for name in ("preset", "infer_mask", "continuation") if getattr(self, name)]
        return f"batch={self.batch_size} len={self.length} new={self.new_tokens} {self.strategy} {' '.join(flags)}"


@dataclass
class Sequence:
    case: object
    upstream: object
    flex: object
    shape_policy: str
    history: list[str] = field(default_factory=list)
    previous: tuple | None = None  # (upstream output, flexible output) that a continuation may continue
    previous_atol: float | None = None  # the score tolerance of the padded call that gave `previous`


def _draw(rng: random.Random, sequence: Sequence) -> Step:
    case, encoder_decoder = sequence.case, sequence.flex.config.is_encoder_decoder
    strategy = rng.choice(["greedy", *STRATEGIES])  # greedy twice as often: calls that a continuation may follow
    length = rng.randint(2, 8)
    if case is WHISPER and (rng.random() < 0.5 or "num_return_sequences" in STRATEGIES[strategy]):
        # Upstream's Whisper repeats `input_features` for several returned sequences, not `encoder_outputs`.
        length = case.decoding_input_len
    previous = sequence.previous
    continuation = (
        not encoder_decoder
        and previous is not None
        and previous[0].sequences.shape[0] == previous[1].sequences.shape[0]
        and strategy in ("greedy", "sampling")
        and rng.random() < 0.6
    )
    return Step(
        batch_size=previous[0].sequences.shape[0] if continuation else rng.randint(1, 3),
        length=length,
        new_tokens=rng.randint(1, 5),
        strategy=strategy,
        preset=rng.random() < 0.3,
        infer_mask=not encoder_decoder and not continuation and rng.random() < 0.3,
        continuation=continuation,
        seed=rng.randrange(2**31),
    )


def _run(sequence: Sequence, step: Step, generator: torch.Generator) -> None:
    case, flex = sequence.case, sequence.flex
    config = {"shape_policy": sequence.shape_policy}
    if step.preset:
        config.update({k: v for k, v in PRESET.items() if k != "max_encoder_len" or flex.config.is_encoder_decoder})
    kwargs = {"max_new_tokens": step.new_tokens, **STRATEGIES[step.strategy], **case.generate_kwargs}
    if step.continuation:
        expected_first, actual_first = sequence.previous
        new_ids = torch.randint(3, LLAMA.build_config().vocab_size, (step.batch_size, 2), generator=generator)
        common = {"return_dict_in_generate": True, "output_scores": True, **kwargs}
        expected = upstream_generate(
            sequence.upstream,
            {"input_ids": torch.cat([expected_first.sequences, new_ids], 1)},
            seed=step.seed,
            cache=expected_first.cache,
            **kwargs,
        )
        torch.manual_seed(step.seed)
        actual = flex.generate(
            input_ids=torch.cat([actual_first.sequences, new_ids], 1), cache=actual_first.cache, **common
        )
    else:
        inputs = case.make_inputs(step.batch_size, step.length, generator)
        if step.infer_mask:
            inputs.pop("attention_mask")  # row 0 starts with pad tokens: upstream infers the mask from them
        expected, actual = generate_both(
            sequence.upstream, flex, inputs, cache_config=config, seed=step.seed, **kwargs
        )
    if sequence.shape_policy == "exact":
        atol = None  # bit for bit, or derived from upstream's float noise (tests/helpers.py)
    elif step.continuation:  # it runs at the padded shapes of the call that filled its cache
        atol = sequence.previous_atol
    else:
        atol = padded_call_atol(sequence.upstream, flex, inputs, expected, actual, seed=step.seed, **kwargs)
    assert_same_generation(expected, actual, atol=atol)
    kept = "num_beams" not in STRATEGIES[step.strategy] and "num_return_sequences" not in STRATEGIES[step.strategy]
    sequence.previous = (expected, actual) if kept else None
    sequence.previous_atol = atol


def _run_sequences(case, num_sequences: int, num_calls: int, base_seed: int) -> None:
    upstream, flex = case.build()
    for index in range(num_sequences):
        seed = base_seed + zlib.crc32(case.name.encode()) % 10_000 + index  # other draws for each model
        rng = random.Random(seed)
        sequence = Sequence(case, upstream, flex, shape_policy=SHAPE_POLICIES[index % len(SHAPE_POLICIES)])
        generator = torch.Generator().manual_seed(seed)
        for _ in range(num_calls):
            step = _draw(rng, sequence)
            sequence.history.append(step.describe())
            try:
                _run(sequence, step, generator)
            except (AssertionError, Exception) as error:
                calls = "\n  ".join(sequence.history)
                raise AssertionError(
                    f"{case.name}, sequence seed {seed}, shape_policy={sequence.shape_policy}, calls:\n  {calls}\n"
                    f"failed with {type(error).__name__}: {error}"
                ) from error


CASES = [pytest.param(case, id=case.name) for case in MODEL_CASES]


@pytest.mark.parametrize("case", CASES)
def test_random_call_sequences_match_dynamic_cache(case):
    _run_sequences(case, DEFAULT_SEQUENCES, DEFAULT_CALLS, base_seed=1000)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_many_random_call_sequences_match_dynamic_cache(case):
    _run_sequences(case, SLOW_SEQUENCES, SLOW_CALLS, base_seed=2000)


def test_a_padded_call_without_attention_mask_masks_the_pad_tokens_of_its_prompt():
    # The case the fuzzer of issue 8 found: with padded calls, prompts are left-padded to max_prompt_len with a mask;
    # a call without one used to get a mask of ones, so that the pad tokens of its own prompt were attended.
    upstream, flex = LLAMA.build()
    inputs = {"input_ids": torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])}
    expected, actual = generate_both(
        upstream, flex, inputs, cache_config={"shape_policy": "padded", "max_prompt_len": 8}, max_new_tokens=6
    )
    assert_same_generation(expected, actual)
