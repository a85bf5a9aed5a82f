"""A sequence's text as OpenAI's API returns it (`server/text.py`): cut at EOS and before a stop sequence, the finish
reason, and stream pieces that hold back what could still change and concatenate to the text."""

from __future__ import annotations

import pytest

from tests.serving.test_engine import char_tokenizer
from transformers_flexcache.server.text import Sequence

EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def sequence(tokenizer, stop=()) -> Sequence:
    return Sequence(tokenizer, stop=list(stop), eos_token_ids={EOS}, pad_token_id=PAD)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def test_a_sequence_ends_at_its_eos_and_padding_after_it_is_not_its_own(tokenizer):
    tokens = [*ids(tokenizer, "abc"), EOS, PAD, PAD]
    assert sequence(tokenizer).final(tokens, max_tokens=6) == ("abc", "stop", tokens[:4])


def test_a_sequence_that_ran_to_max_tokens_finished_for_length(tokenizer):
    tokens = ids(tokenizer, "abcd")
    assert sequence(tokenizer).final(tokens, max_tokens=4) == ("abcd", "length", tokens)


def test_the_text_is_cut_before_the_first_stop_sequence_and_the_padding_after_it_dropped(tokenizer):
    tokens = [*ids(tokenizer, "xyzabq"), PAD, PAD]  # stopped on "ab" while another sequence ran on
    text, reason, own = sequence(tokenizer, stop=["q", "ab"]).final(tokens, max_tokens=8)
    assert (text, reason, own) == ("xyz", "stop", tokens[:6])


def test_stream_pieces_hold_back_a_possible_stop_sequence_and_concatenate_to_the_text(tokenizer):
    streamed = sequence(tokenizer, stop=["abc"])
    tokens = ids(tokenizer, "xyabxabc")
    pieces = [streamed.push(token) for token in tokens]
    # "a" and "ab" could begin "abc": held until the next character decides.
    assert pieces == ["x", "y", "", "", "abx", "", "", ""]
    last, reason, _ = streamed.close(tokens, max_tokens=8)
    assert "".join(pieces) + last == "xyabx" and reason == "stop"


def test_stream_pieces_without_stop_sequences_are_sent_as_they_come(tokenizer):
    streamed = sequence(tokenizer)
    tokens = [*ids(tokenizer, "hey"), EOS, PAD]
    pieces = [streamed.push(token) for token in tokens]
    assert pieces == ["h", "e", "y", "", ""]
    assert streamed.close(tokens, max_tokens=5) == ("", "stop", tokens[:4])
