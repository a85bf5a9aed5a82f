"""`/v1/completions` for translation (encoder-decoder) models through OpenAI's client on 127.0.0.1: beam search, the
n best hypotheses with their scores, log probabilities, a target prefix, echo and the score of a given translation,
each against upstream's `generate` (DynamicCache) or forward on the request alone, for tiny seeded T5, BART and
Marian models. Log probabilities and scores are equal to upstream's float32 ones within their float noise, derived on
the running machine from the same quantities computed by `in_double(upstream)` (`assert_answers_within_float_noise`,
`assert_sequence_scores_within_float_noise`)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.helpers import in_double

from .helpers import (
    TIMEOUT,
    assert_answers_within_float_noise,
    assert_sequence_scores_within_float_noise,
    new_tokens,
    openai_client,
    reference,
    tiny_server,
)

CAPACITIES = {"max_batch_size": 8, "max_cache_len": 40, "max_encoder_len": 32}
SOURCES = ["helloWorld42", "abcXYZ", "theQuickFox9"]


@pytest.fixture(scope="module", params=["t5", "bart", "marian"])
def server(request, tmp_path_factory):
    """`(base_url, upstream model, tokenizer)` of a server on the tiny translation model."""
    with tiny_server(request.param, tmp_path_factory, cache_config=CAPACITIES) as served:
        yield served


def create(base_url: str, **kwargs):
    """A completion through OpenAI's client; fields OpenAI's signature lacks go in `extra_body`."""
    named = {"prompt", "max_tokens", "n", "temperature", "seed", "logprobs", "echo", "best_of", "stream", "stop"}
    extra = {name: kwargs.pop(name) for name in list(kwargs) if name not in named}
    return openai_client(base_url).completions.create(model="tiny", extra_body=extra or None, **kwargs)


def start_token(upstream) -> int:
    return upstream.generation_config.decoder_start_token_id


def upstream_generate(upstream, tokenizer, source, **kwargs):
    """Upstream's generate on one source, with its scores and logits."""
    return reference(
        upstream, tokenizer, source, return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs
    )


def assert_scores_are_generates(upstream, tokenizer, source, response, expected, **kwargs):
    """The choices' `sequence_score`s are upstream's beam search scores (`expected`, its `upstream_generate` of
    `source` with `kwargs`) within their float noise: the same generate run in float64."""
    exact = upstream_generate(in_double(upstream), tokenizer, source, **kwargs)
    scores = [choice.model_extra["sequence_score"] for choice in response.choices]
    assert_sequence_scores_within_float_noise(upstream, scores, expected, exact, prompt_len=1)


def own_rows(upstream, sequences, *, skip: int) -> list[list[int]]:
    """Each sequence's own new tokens after `skip` decoder columns, up to its EOS."""
    return new_tokens(upstream, sequences[:, skip - 1 :], 0)


def test_beam_search_returns_the_n_best_hypotheses_of_generate_with_their_scores(server):
    base_url, upstream, tokenizer = server
    for source in SOURCES:
        expected = upstream_generate(
            upstream, tokenizer, source, max_new_tokens=12, num_beams=4, num_return_sequences=3
        )
        response = create(base_url, prompt=source, max_tokens=12, n=3, num_beams=4, return_token_ids=True)
        rows = own_rows(upstream, expected.sequences, skip=1)
        assert [choice.model_extra["token_ids"] for choice in response.choices] == rows
        assert [choice.text for choice in response.choices] == [
            tokenizer.decode(row, skip_special_tokens=True) for row in rows
        ]
        kwargs = {"max_new_tokens": 12, "num_beams": 4, "num_return_sequences": 3}
        assert_scores_are_generates(upstream, tokenizer, source, response, expected, **kwargs)
        scores = [choice.model_extra["sequence_score"] for choice in response.choices]
        assert scores == sorted(scores, reverse=True)  # best first
        assert len({tuple(row) for row in rows}) == 3  # three hypotheses, not one
    # the sources give hypotheses of their own (the tiny model's output varies with its input)
    firsts = {create(base_url, prompt=source, max_tokens=12, num_beams=4).choices[0].text for source in SOURCES}
    assert len(firsts) > 1


@pytest.mark.parametrize(
    ("fields", "generate_kwargs"),
    [
        ({"n": 2, "num_beams": 3, "length_penalty": 0.3}, {"num_beams": 3, "length_penalty": 0.3}),
        ({"n": 2, "num_beams": 3, "early_stopping": True}, {"num_beams": 3, "early_stopping": True}),
        ({"n": 2, "num_beams": 3, "early_stopping": "never"}, {"num_beams": 3, "early_stopping": "never"}),
        ({"n": 2, "use_beam_search": True, "best_of": 4}, {"num_beams": 4}),
        ({"n": 3, "use_beam_search": True}, {"num_beams": 3}),
    ],
    ids=["length-penalty", "early-stopping", "never-stop", "vllm-best-of", "vllm-n"],
)
def test_beam_search_fields_are_generates_arguments(server, fields, generate_kwargs):
    base_url, upstream, tokenizer = server
    n = fields["n"]
    kwargs = {"max_new_tokens": 10, "num_return_sequences": n, **generate_kwargs}
    expected = upstream_generate(upstream, tokenizer, SOURCES[0], **kwargs)
    response = create(base_url, prompt=SOURCES[0], max_tokens=10, return_token_ids=True, **fields)
    assert [choice.model_extra["token_ids"] for choice in response.choices] == own_rows(
        upstream, expected.sequences, skip=1
    )
    assert_scores_are_generates(upstream, tokenizer, SOURCES[0], response, expected, **kwargs)


def test_seeded_beam_sampling_is_generates_with_that_seed(server):
    base_url, upstream, tokenizer = server
    kwargs = {"max_new_tokens": 10, "num_beams": 3, "num_return_sequences": 2, "do_sample": True, "temperature": 0.8}
    expected = upstream_generate(upstream, tokenizer, SOURCES[1], seed=21, **kwargs)
    response = create(
        base_url, prompt=SOURCES[1], max_tokens=10, n=2, num_beams=3, temperature=0.8, seed=21, return_token_ids=True
    )
    assert [choice.model_extra["token_ids"] for choice in response.choices] == own_rows(
        upstream, expected.sequences, skip=1
    )
    assert_scores_are_generates(upstream, tokenizer, SOURCES[1], response, expected, seed=21, **kwargs)


def expected_logprobs(upstream, output, rows: list[list[int]], *, top: int) -> list[tuple[torch.Tensor, list]]:
    """Per row: upstream's log probability of each own token (`compute_transition_scores` on the raw logits, which
    it normalizes) and the `top` most likely token ids with theirs."""
    beam_indices = output.get("beam_indices")
    transition = upstream.compute_transition_scores(
        output.sequences[:, -len(output.logits) :] if beam_indices is None else output.sequences,
        output.logits,
        beam_indices,
        normalize_logits=True,
    )
    expected = []
    for row, tokens in enumerate(rows):
        tops = []
        for step in range(len(tokens)):
            source = row if beam_indices is None else int(beam_indices[row, step])
            values, ids = torch.log_softmax(output.logits[step][source], dim=-1).topk(top)
            tops.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
        expected.append((transition[row, : len(tokens)], tops))
    return expected


def exact_logprobs(upstream, tokenizer, source: str, target: list[int]) -> torch.Tensor:
    """The float64 reference of upstream's log probabilities of `target`'s positions, `[len(target), V]`: the
    teacher-forced forward of `in_double(upstream)` on those tokens.

    Each generated token's log probability (`compute_transition_scores` of generate's logits; for a beam hypothesis,
    the logits of the beam it extended) is the model's log probability given the tokens before it, which one forward
    of the float32 run's own tokens computes exactly. A float64 `generate` could choose other tokens (a near tie
    decided the other way), after which its log probabilities are of other prefixes; the forward is defined on the
    float32 run's tokens always."""
    return teacher_forced(in_double(upstream), tokenizer, source, target)


def assert_logprobs_within_float_noise(answered: tuple[list, list], expected: tuple, exact: torch.Tensor, tokens):
    """A choice's `(token_logprobs, tops)` (`answered_logprobs`) are upstream's float32 `expected` ones within their
    float noise against `exact` (`exact_logprobs` of `tokens`): each token's, and those of the tokens in each
    position's expected top (the answered top holds the same tokens, and the chosen one)."""
    token_logprobs, tops = answered
    want_logprobs, want_tops = expected
    assert_answers_within_float_noise(token_logprobs, want_logprobs, exact[range(len(tokens)), tokens])
    assert len(tops) == len(want_tops) == len(tokens)
    positions, ids = zip(*((position, k) for position, top in enumerate(want_tops) for k in top), strict=True)
    for top, want_top, token in zip(tops, want_tops, tokens, strict=True):
        assert set(top) == set(want_top) | {token}
    assert_answers_within_float_noise(
        [tops[position][k] for position, k in zip(positions, ids, strict=True)],
        torch.tensor([want_tops[position][k] for position, k in zip(positions, ids, strict=True)]),
        exact[list(positions), list(ids)],
    )


def top_logprobs(logprobs: torch.Tensor, count: int) -> list[dict]:
    """Per position of `logprobs` (`[L, V]`): its `count` most likely token ids with their log probabilities."""
    values, ids = logprobs.topk(count)
    return [dict(zip(*pair, strict=True)) for pair in zip(ids.tolist(), values.tolist(), strict=True)]


def answered_logprobs(choice) -> tuple[list, list]:
    """`(token_logprobs, [{token id: logprob}])` of a choice answered with `return_tokens_as_token_ids`."""
    logprobs = choice.logprobs
    tops = [
        {int(name.removeprefix("token_id:")): value for name, value in top.items()} for top in logprobs.top_logprobs
    ]
    return logprobs.token_logprobs, tops


@pytest.mark.parametrize(
    ("fields", "generate_kwargs"),
    [
        ({"temperature": 0}, {"do_sample": False}),
        ({"n": 3, "num_beams": 4}, {"num_beams": 4, "num_return_sequences": 3}),
        ({"n": 2, "temperature": 0.9, "seed": 3}, {"do_sample": True, "temperature": 0.9, "num_return_sequences": 2}),
    ],
    ids=["greedy", "beams", "samples"],
)
def test_logprobs_are_the_models_log_probabilities_of_generates_tokens(server, fields, generate_kwargs):
    base_url, upstream, tokenizer = server
    seed = fields.get("seed")
    output = upstream_generate(upstream, tokenizer, SOURCES[2], seed=seed, max_new_tokens=10, **generate_kwargs)
    rows = own_rows(upstream, output.sequences, skip=1)
    expected = expected_logprobs(upstream, output, rows, top=3)
    response = create(
        base_url,
        prompt=SOURCES[2],
        max_tokens=10,
        logprobs=3,
        return_token_ids=True,
        return_tokens_as_token_ids=True,
        **fields,
    )
    for choice, tokens, want in zip(response.choices, rows, expected, strict=True):
        assert choice.model_extra["token_ids"] == tokens
        logprobs = choice.logprobs
        assert logprobs.tokens == [f"token_id:{token}" for token in tokens]
        token_logprobs, tops = answered_logprobs(choice)
        exact = exact_logprobs(upstream, tokenizer, SOURCES[2], tokens)
        assert_logprobs_within_float_noise((token_logprobs, tops), want, exact, tokens)
        for top, token, value in zip(tops, tokens, token_logprobs, strict=True):
            assert top[token] == pytest.approx(value)  # the chosen token is there, in the top or beside it
        # offsets: where each token's text starts in the choice's text
        assert logprobs.text_offset == [
            len(tokenizer.decode(tokens[:index], skip_special_tokens=True)) for index in range(len(tokens))
        ]


def test_logprobs_name_each_token_by_its_text(server):
    base_url, upstream, tokenizer = server
    response = create(base_url, prompt=SOURCES[0], max_tokens=8, temperature=0, logprobs=0, return_token_ids=True)
    (choice,) = response.choices
    tokens = choice.model_extra["token_ids"]
    assert choice.logprobs.tokens == [tokenizer.decode([token]) for token in tokens]
    assert [list(top) for top in choice.logprobs.top_logprobs] == [[name] for name in choice.logprobs.tokens]


def prefix_of(upstream, tokenizer, source: str) -> list[int]:
    """Three tokens the model would not choose first by itself (the start of another source's greedy output), each a
    character of the tokenizer (ids 3-64: decoded and tokenized again, a text gives the same ids)."""
    other = upstream_generate(upstream, tokenizer, source[::-1], max_new_tokens=3, min_new_tokens=3, do_sample=False)
    free = own_rows(upstream, other.sequences, skip=1)[0]
    return [token if 3 <= token < 65 else 3 + token % 62 for token in free]


@pytest.mark.parametrize("fields", [{"temperature": 0}, {"n": 2, "num_beams": 3}], ids=["greedy", "beams"])
def test_a_target_prefix_starts_the_decoder_as_generate_with_decoder_input_ids(server, fields):
    base_url, upstream, tokenizer = server
    source = SOURCES[0]
    prefix = prefix_of(upstream, tokenizer, source)
    decoder_input_ids = torch.tensor([[start_token(upstream), *prefix]])
    kwargs = {"num_beams": fields.get("num_beams", 1), "num_return_sequences": fields.get("n", 1), "do_sample": False}
    expected = upstream_generate(
        upstream, tokenizer, source, decoder_input_ids=decoder_input_ids, max_new_tokens=8, **kwargs
    )
    rows = own_rows(upstream, expected.sequences, skip=1 + len(prefix))
    for given in (prefix, tokenizer.decode(prefix)):  # token ids, and the text they are
        response = create(base_url, prompt=source, max_tokens=8, target_prefix=given, return_token_ids=True, **fields)
        assert [choice.model_extra["token_ids"] for choice in response.choices] == rows
        assert response.usage.prompt_tokens == len(tokenizer(source)["input_ids"]) + len(prefix)
        if "num_beams" in fields:
            assert_scores_are_generates(
                upstream,
                tokenizer,
                source,
                response,
                expected,
                decoder_input_ids=decoder_input_ids,
                max_new_tokens=8,
                **kwargs,
            )
    free = create(base_url, prompt=source, max_tokens=8, return_token_ids=True, **fields)
    assert [choice.model_extra["token_ids"] for choice in free.choices] != rows  # the prefix changed the output


def teacher_forced(upstream, tokenizer, source: str, target: list[int]) -> torch.Tensor:
    """Upstream's log probabilities `[len(target), V]` of each target position given the source and the target
    before it: one forward of the whole target."""
    inputs = tokenizer(source, return_tensors="pt")
    decoder_input_ids = torch.tensor([[start_token(upstream), *target[:-1]]])
    with torch.no_grad():
        logits = upstream(**inputs, decoder_input_ids=decoder_input_ids).logits
    return torch.log_softmax(logits[0], dim=-1)


def test_echo_with_max_tokens_zero_scores_a_given_translation_as_one_forward(server):
    base_url, upstream, tokenizer = server
    source = SOURCES[1]
    eos = upstream.generation_config.eos_token_id
    target = [*prefix_of(upstream, tokenizer, source), 7, 30, eos]  # a whole translation: its end is scored too
    expected = teacher_forced(upstream, tokenizer, source, target)
    exact = exact_logprobs(upstream, tokenizer, source, target)
    response = create(
        base_url,
        prompt=source,
        max_tokens=0,
        echo=True,
        logprobs=2,
        target_prefix=target,
        return_tokens_as_token_ids=True,
    )
    (choice,) = response.choices
    assert choice.text == tokenizer.decode(target, skip_special_tokens=True)
    assert choice.finish_reason == "length" and response.usage.completion_tokens == 0
    want = (expected[range(len(target)), target], top_logprobs(expected, 2))
    assert_logprobs_within_float_noise(answered_logprobs(choice), want, exact, target)
    # a list of sources, one translation each
    other = [*prefix_of(upstream, tokenizer, SOURCES[2]), eos]
    both = create(
        base_url, prompt=[source, SOURCES[2]], max_tokens=0, echo=True, logprobs=0, target_prefix=[target, other]
    )
    assert [choice.index for choice in both.choices] == [0, 1]
    assert_answers_within_float_noise(
        both.choices[0].logprobs.token_logprobs, want[0], exact[range(len(target)), target]
    )
    second = teacher_forced(upstream, tokenizer, SOURCES[2], other)
    second_exact = exact_logprobs(upstream, tokenizer, SOURCES[2], other)
    assert_answers_within_float_noise(
        both.choices[1].logprobs.token_logprobs,
        second[range(len(other)), other],
        second_exact[range(len(other)), other],
    )


def test_echo_with_logprobs_gives_the_prefix_scores_then_the_completions(server):
    base_url, upstream, tokenizer = server
    source = SOURCES[2]
    prefix = prefix_of(upstream, tokenizer, source)
    decoder_input_ids = torch.tensor([[start_token(upstream), *prefix]])
    output = upstream_generate(
        upstream, tokenizer, source, decoder_input_ids=decoder_input_ids, max_new_tokens=6, do_sample=False
    )
    (row,) = own_rows(upstream, output.sequences, skip=1 + len(prefix))
    forced = teacher_forced(upstream, tokenizer, source, prefix)
    generated = upstream.compute_transition_scores(
        output.sequences[:, -len(output.logits) :], output.logits, normalize_logits=True
    )[0, : len(row)]
    prefix_text = tokenizer.decode(prefix)
    response = create(
        base_url, prompt=source, max_tokens=6, temperature=0, echo=True, logprobs=1, target_prefix=prefix_text
    )
    (choice,) = response.choices
    completion = tokenizer.decode(row, skip_special_tokens=True)
    assert choice.text == prefix_text + completion
    expected = torch.cat([forced[range(len(prefix)), prefix], generated])
    target = [*prefix, *row]
    exact = exact_logprobs(upstream, tokenizer, source, target)[range(len(target)), target]
    assert_answers_within_float_noise(choice.logprobs.token_logprobs, expected, exact)
    assert choice.logprobs.text_offset[len(prefix)] == len(prefix_text)


def test_a_beam_search_stream_sends_each_hypothesis_whole_with_its_score(server):
    base_url, _, _ = server
    whole = create(base_url, prompt=SOURCES[0], max_tokens=10, n=2, num_beams=3)
    body = {"model": "tiny", "prompt": SOURCES[0], "max_tokens": 10, "n": 2, "num_beams": 3, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    last = {}
    texts = {}
    for event in events[:-1]:
        (choice,) = json.loads(event)["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            last[choice["index"]] = choice
    assert texts == {choice.index: choice.text for choice in whole.choices}
    assert {index: choice["sequence_score"] for index, choice in last.items()} == {
        choice.index: choice.model_extra["sequence_score"] for choice in whole.choices
    }


@pytest.mark.parametrize(
    ("fields", "param", "expected"),
    [
        ({"length_penalty": 0.5}, "length_penalty", "applies to beam search only"),
        ({"early_stopping": True}, "early_stopping", "applies to beam search only"),
        ({"n": 5, "num_beams": 4}, "n", "exceeds the beam width 4"),
        ({"n": 2, "best_of": 4, "temperature": 1.0}, "best_of", "not served without beam search"),
        ({"num_beams": 4, "use_beam_search": True, "best_of": 3}, "best_of", "both set the beam width"),
        ({"logprobs": 21}, "logprobs", "exceeds 20"),
        ({"logprobs": 1, "stream": True}, "stream", "logprobs is served without stream"),
        ({"echo": True, "stream": True}, "stream", "echo is served without stream"),
        ({"max_tokens": 0}, "max_tokens", "pass echo=true"),
        ({"max_tokens": 0, "echo": True, "num_beams": 2, "target_prefix": [5]}, "num_beams", "generates none"),
        ({"max_tokens": 0, "echo": True, "n": 2, "target_prefix": [5]}, "n", "one choice per prompt"),
        ({"target_prefix": [5, "EOS"]}, "target_prefix", "end token"),
        ({"target_prefix": [5, "EOS", 6], "max_tokens": 0, "echo": True}, "target_prefix", "before its last token"),
        ({"target_prefix": [[5], [6]]}, "target_prefix", "2 entries for 1 prompts"),
        ({"target_prefix": [5, 300]}, "target_prefix", "outside the model's vocabulary"),
        ({"target_prefix": []}, "target_prefix", "holds no target prefix"),
    ],
    ids=[
        "length-penalty",
        "early-stopping",
        "n-over-beams",
        "sampled-best-of",
        "two-widths",
        "logprobs-limit",
        "logprobs-stream",
        "echo-stream",
        "nothing",
        "scoring-beams",
        "scoring-n",
        "prefix-eos",
        "scored-eos",
        "prefix-count",
        "prefix-vocab",
        "prefix-empty",
    ],
)
def test_fields_that_would_change_nothing_or_cannot_be_served_get_400_naming_them(server, fields, param, expected):
    base_url, upstream, _ = server
    eos = upstream.generation_config.eos_token_id
    if "target_prefix" in fields:
        fields["target_prefix"] = [eos if token == "EOS" else token for token in fields["target_prefix"]]
    with pytest.raises(openai.BadRequestError) as raised:
        create(base_url, prompt=SOURCES[0], **{"max_tokens": 4, **fields})
    error = raised.value.body
    assert expected in error["message"] and error["param"] == param


def test_the_openai_client_gets_three_beams_with_extra_body(server):
    base_url, upstream, tokenizer = server
    client = openai_client(base_url)
    response = client.completions.create(model="tiny", prompt=SOURCES[0], n=3, extra_body={"num_beams": 4})
    expected = upstream_generate(
        upstream, tokenizer, SOURCES[0], max_new_tokens=16, num_beams=4, num_return_sequences=3
    )
    assert [choice.text for choice in response.choices] == [
        tokenizer.decode(row, skip_special_tokens=True) for row in own_rows(upstream, expected.sequences, skip=1)
    ]
