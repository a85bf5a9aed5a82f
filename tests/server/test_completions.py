"""`/v1/completions` through OpenAI's own client on 127.0.0.1: every completion has the tokens and text of upstream's
`generate` (DynamicCache) on that request alone, for a decoder-only model (Llama) and an encoder-decoder one (T5,
the prompt being the source text), greedy and seeded sampling, n samples, stop sequences, and streams whose chunks
concatenate to the completion."""

from __future__ import annotations

import json

import httpx
import pytest

from .helpers import TIMEOUT, new_tokens, openai_client, reference, tiny_server

CAPACITIES = {
    "llama": {"max_batch_size": 4, "max_cache_len": 64},
    "t5": {"max_batch_size": 4, "max_cache_len": 64, "max_encoder_len": 32},
}
PROMPT = "helloWorld42"


@pytest.fixture(scope="module", params=["llama", "t5"])
def server(request, tmp_path_factory):
    """`(base_url, upstream model, tokenizer)` of a server on the tiny model."""
    with tiny_server(request.param, tmp_path_factory, cache_config=CAPACITIES[request.param]) as served:
        yield served


def expected_choice(upstream, tokenizer, prompt, *, seed=None, stop=None, **kwargs) -> list[tuple[str, list[int]]]:
    """`(text, token_ids)` of each sequence upstream's generate gives the request alone."""
    if stop is not None:
        kwargs.update(stop_strings=stop, tokenizer=tokenizer)
    sequences = reference(upstream, tokenizer, prompt, seed=seed, **kwargs)
    prompt_len = len(tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else len(prompt)
    rows = new_tokens(upstream, sequences, prompt_len)
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
    if stop is not None:
        texts = [text.split(stop[0])[0] for text in texts]
    return list(zip(texts, rows, strict=True))


def answered(choice) -> tuple[str, list[int]]:
    return choice.text, choice.model_extra["token_ids"]


@pytest.mark.parametrize("prompt", [PROMPT, [5, 17, 42, 9, 63, 12]], ids=["text", "token-ids"])
def test_a_greedy_completion_has_the_tokens_and_text_of_generate_alone(server, prompt):
    base_url, upstream, tokenizer = server
    expected = expected_choice(upstream, tokenizer, prompt, max_new_tokens=12, do_sample=False)
    response = openai_client(base_url).completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    assert [answered(choice) for choice in response.choices] == expected
    choice = response.choices[0]
    assert choice.index == 0 and choice.finish_reason == ("stop" if len(expected[0][1]) < 12 else "length")
    prompt_len = len(choice.model_extra["prompt_token_ids"])
    assert prompt_len == (len(prompt) if isinstance(prompt, list) else len(tokenizer(prompt)["input_ids"]))
    assert response.usage.prompt_tokens == prompt_len
    assert response.usage.completion_tokens == len(expected[0][1])
    assert response.object == "text_completion" and response.model == "tiny"


def test_a_seeded_sampled_completion_has_the_tokens_of_generate_alone_with_that_seed(server):
    base_url, upstream, tokenizer = server
    expected = expected_choice(
        upstream, tokenizer, PROMPT, seed=1234, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9
    )
    response = openai_client(base_url).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0.8,
        top_p=0.9,
        seed=1234,
        extra_body={"return_token_ids": True},
    )
    assert [answered(choice) for choice in response.choices] == expected


def test_n_completions_are_generates_n_samples(server):
    base_url, upstream, tokenizer = server
    expected = expected_choice(
        upstream, tokenizer, PROMPT, seed=7, max_new_tokens=10, do_sample=True, num_return_sequences=3, temperature=1.0
    )
    response = openai_client(base_url).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, n=3, temperature=1.0, seed=7, extra_body={"return_token_ids": True}
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [answered(choice) for choice in response.choices] == expected
    assert len({tuple(tokens) for _, tokens in expected}) > 1  # three samples, not one
    assert response.usage.completion_tokens == sum(len(tokens) for _, tokens in expected)


def a_stop_sequence(upstream, tokenizer, *, seed: int) -> str:
    """A one-character token of the free sampled run, met after a few tokens (and not in the text before)."""
    tokens = expected_choice(upstream, tokenizer, PROMPT, seed=seed, max_new_tokens=20, do_sample=True)[0][1]
    for index in range(3, len(tokens)):
        piece = tokenizer.decode(tokens[index : index + 1])
        if len(piece) == 1 and piece.isalnum() and piece not in tokenizer.decode(tokens[:index]):
            return piece
    pytest.fail(f"the free run {tokenizer.decode(tokens)!r} has no character to stop on")


def test_a_stop_sequence_stops_as_generate_does_and_is_cut_from_the_text(server):
    base_url, upstream, tokenizer = server
    stop = a_stop_sequence(upstream, tokenizer, seed=11)
    expected = expected_choice(
        upstream, tokenizer, PROMPT, seed=11, stop=[stop], max_new_tokens=20, do_sample=True, temperature=1.0
    )
    response = openai_client(base_url).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=20,
        stop=stop,
        temperature=1.0,
        seed=11,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    assert answered(choice) == expected[0]
    assert stop not in choice.text and choice.finish_reason == "stop"
    assert tokenizer.decode(choice.model_extra["token_ids"]).endswith(stop)  # generate's tokens keep it
    assert len(choice.model_extra["token_ids"]) < 20


def test_several_prompts_are_one_request_each_in_order(server):
    base_url, upstream, tokenizer = server
    prompts = ["abc", "xyz12", "Q"]
    expected = [expected_choice(upstream, tokenizer, p, max_new_tokens=6, do_sample=False)[0] for p in prompts]
    response = openai_client(base_url).completions.create(
        model="tiny", prompt=prompts, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [answered(choice) for choice in response.choices] == expected


@pytest.mark.parametrize(
    "kwargs", [{"temperature": 0}, {"temperature": 0.9, "n": 2, "seed": 5}], ids=["greedy", "two-samples"]
)
def test_a_stream_concatenates_to_the_completion(server, kwargs):
    base_url, _, _ = server
    client = openai_client(base_url)
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **kwargs)
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=24, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    texts, reasons = {}, {}
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion" and len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            assert choice.index not in reasons  # one finish per choice, in its last chunk
            reasons[choice.index] = choice.finish_reason
    assert texts == {choice.index: choice.text for choice in whole.choices}
    assert reasons == {choice.index: choice.finish_reason for choice in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].text) > 1  # text came in pieces


def test_a_raw_stream_is_server_sent_events_ending_in_done(server):
    base_url, _, _ = server
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_model_list_names_the_served_model(server):
    base_url, _, _ = server
    client = openai_client(base_url)
    assert [model.id for model in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
