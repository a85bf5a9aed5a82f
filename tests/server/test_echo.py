"""`/v1/completions` on a decoder-only model (tiny Llama) through OpenAI's client: `echo` returns the prompt, and with
`logprobs` its tokens' log probabilities (the first has none), `echo` with `max_tokens=0` is the score of the prompt
(OpenAI's way to score a text), and beam search returns generate's hypotheses and scores; each against upstream's
forward or `generate` on the request alone, within the float noise of upstream's float32 values (their distance from
the same quantities computed by `in_double(upstream)`, on the running machine). The encoder-decoder side is
tests/server/test_translation.py."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.helpers import in_double

from .helpers import (
    assert_answers_within_float_noise,
    assert_sequence_scores_within_float_noise,
    new_tokens,
    openai_client,
    reference,
    tiny_server,
)

PROMPT = "helloWorld42"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """`(base_url, upstream model, tokenizer)` of a tiny Llama server."""
    with tiny_server("llama", tmp_path_factory, cache_config={"max_batch_size": 4, "max_cache_len": 48}) as served:
        yield served


def prompt_logprobs(upstream, ids: list[int]) -> torch.Tensor:
    """Upstream's log probabilities `[len(ids) - 1, V]` of each prompt token after the first, in one forward."""
    with torch.no_grad():
        logits = upstream(input_ids=torch.tensor([ids])).logits
    return torch.log_softmax(logits[0, :-1], dim=-1)


def test_echo_with_max_tokens_zero_is_the_score_of_the_prompt(llama):
    base_url, upstream, tokenizer = llama
    ids = tokenizer(PROMPT)["input_ids"]
    expected = prompt_logprobs(upstream, ids)
    exact = prompt_logprobs(in_double(upstream), ids)
    response = openai_client(base_url).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0, seed=1234
    )
    (choice,) = response.choices
    assert choice.text == PROMPT and response.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([token]) for token in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    positions = range(len(ids) - 1)
    assert_answers_within_float_noise(
        logprobs.token_logprobs[1:], expected[positions, ids[1:]], exact[positions, ids[1:]]
    )
    top_ids = expected.topk(2).indices  # [len(ids) - 1, 2]
    answered = [
        top[tokenizer.decode([token])]
        for top, row in zip(logprobs.top_logprobs[1:], top_ids.tolist(), strict=True)
        for token in row
    ]
    assert_answers_within_float_noise(
        answered, expected.gather(1, top_ids).flatten(), exact.gather(1, top_ids).flatten()
    )
    assert logprobs.text_offset == list(range(len(PROMPT)))  # one character per token


def test_echo_returns_the_prompt_then_the_completion_with_their_log_probabilities(llama):
    base_url, upstream, tokenizer = llama
    ids = tokenizer(PROMPT)["input_ids"]
    output = reference(
        upstream,
        tokenizer,
        PROMPT,
        max_new_tokens=8,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    (row,) = new_tokens(upstream, output.sequences, len(ids))
    generated = upstream.compute_transition_scores(
        output.sequences[:, len(ids) :], output.logits, normalize_logits=True
    )[0, : len(row)]
    response = openai_client(base_url).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True, logprobs=1
    )
    (choice,) = response.choices
    assert choice.text == PROMPT + tokenizer.decode(row, skip_special_tokens=True)
    forced = prompt_logprobs(upstream, ids)[range(len(ids) - 1), ids[1:]]
    assert choice.logprobs.token_logprobs[0] is None
    # the float64 reference of every token's log probability, the generated ones too: the forward of the prompt and
    # the float32 run's tokens, each given the tokens before it (a float64 generate could choose other tokens after a
    # near tie; this forward is defined on the float32 run's own tokens always)
    whole = [*ids, *row]
    exact = prompt_logprobs(in_double(upstream), whole)[range(len(whole) - 1), whole[1:]]
    assert_answers_within_float_noise(choice.logprobs.token_logprobs[1:], torch.cat([forced, generated]), exact)
    assert choice.logprobs.text_offset[len(ids)] == len(PROMPT)
    plain = openai_client(base_url).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True
    )
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_beam_search_on_a_decoder_only_model_returns_generates_hypotheses_and_scores(llama):
    base_url, upstream, tokenizer = llama
    ids = tokenizer(PROMPT)["input_ids"]
    kwargs = {"max_new_tokens": 10, "num_beams": 3, "num_return_sequences": 2}
    output = reference(upstream, tokenizer, PROMPT, return_dict_in_generate=True, output_scores=True, **kwargs)
    exact = reference(
        in_double(upstream), tokenizer, PROMPT, return_dict_in_generate=True, output_scores=True, **kwargs
    )
    response = openai_client(base_url).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, n=2, extra_body={"num_beams": 3, "return_token_ids": True}
    )
    assert [choice.model_extra["token_ids"] for choice in response.choices] == new_tokens(
        upstream, output.sequences, len(ids)
    )
    scores = [choice.model_extra["sequence_score"] for choice in response.choices]
    assert_sequence_scores_within_float_noise(upstream, scores, output, exact, prompt_len=len(ids))


def test_a_target_prefix_is_refused_by_a_decoder_only_model(llama):
    base_url, _, _ = llama
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client(base_url).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"target_prefix": "abc"}
        )
    assert "append the prefix to the prompt" in raised.value.body["message"]
    assert raised.value.body["param"] == "target_prefix"
