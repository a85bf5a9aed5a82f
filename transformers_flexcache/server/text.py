"""A generated sequence as OpenAI's API returns it: its text, its finish reason, and the pieces of a stream.

Design decisions:
- The text of a sequence is `tokenizer.decode(new_tokens, skip_special_tokens=True)`, cut before the first stop
  sequence: OpenAI's API returns no stop sequence in the text, while `generate(stop_strings=...)` (which stops on it)
  keeps its tokens. The tokens are `generate`'s; only the text is cut.
- A sequence's own tokens end at its first EOS; one that stopped on a stop sequence while others of its request ran
  on is followed by padding, which is not its own (`usage` counts neither).
- A stream sends, at each step, what the decoded text gained and can no longer lose: not an incomplete character (a
  trailing U+FFFD), not trailing whitespace (decoding cleans spaces before punctuation), not the start of a possible
  stop sequence. Each step decodes the whole sequence again (at most `max_cache_len` tokens), so the pieces
  concatenate to the final text for any tokenizer whose decoding of a prefix, so trimmed, is a prefix of the
  decoding of the whole.
"""

from __future__ import annotations

from ..log import get_logger

logger = get_logger(__name__)


def own_tokens(new_tokens: list[int], *, eos_token_ids: set[int]) -> tuple[list[int], bool]:
    """`(tokens, ended)`: the new tokens up to and including the first EOS, and whether there was one."""
    for index, token in enumerate(new_tokens):
        if token in eos_token_ids:
            return new_tokens[: index + 1], True
    return new_tokens, False


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """`text` before the earliest stop sequence in it, and whether one was found."""
    positions = [position for position in (text.find(sequence) for sequence in stop) if position >= 0]
    if not positions:
        return text, False
    return text[: min(positions)], True


class Sequence:
    """One generated sequence of a request (one of its `n`), decoded as OpenAI's API returns it.

    Args:
        tokenizer: the checkpoint's tokenizer.
        stop (`list[str]`): the request's stop sequences.
        eos_token_ids (`set[int]`): the model's EOS ids (its generation config's).
        pad_token_id (`int`, *optional*): the id `generate` pads finished sequences with.
    """

    def __init__(self, tokenizer, *, stop: list[str], eos_token_ids: set[int], pad_token_id: int | None):
        self.tokenizer = tokenizer
        self.stop = stop
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.streamed: list[int] = []
        self.sent = ""

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def final(self, new_tokens: list[int], *, max_tokens: int | None) -> tuple[str, str, list[int]]:
        """`(text, finish_reason, tokens)` of the finished sequence, from `generate`'s new tokens for it; `tokens`
        are its own (see the module docstring)."""
        tokens, ended = own_tokens(new_tokens, eos_token_ids=self.eos_token_ids)
        text, stopped = cut_at_stop(self.decode(tokens), self.stop)
        if stopped and not ended and self.pad_token_id is not None:
            while tokens and tokens[-1] == self.pad_token_id:  # the others of its request ran on
                tokens = tokens[:-1]
        at_limit = max_tokens is not None and len(tokens) >= max_tokens
        reason = "stop" if ended or stopped or not at_limit else "length"
        return text, reason, tokens

    # --- streams ----------------------------------------------------------------------------------------------
    def push(self, token: int) -> str:
        """The text that `token` adds and that can no longer change (often empty)."""
        self.streamed.append(token)
        tokens, _ = own_tokens(self.streamed, eos_token_ids=self.eos_token_ids)
        text, stopped = cut_at_stop(self.decode(tokens), self.stop)
        if not stopped:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._possible_stop_start(text)].rstrip()
        return self._send(text)

    def close(self, new_tokens: list[int], *, max_tokens: int | None) -> tuple[str, str, list[int]]:
        """The stream's last piece, the finish reason and the sequence's own tokens, from `generate`'s new tokens."""
        text, reason, tokens = self.final(new_tokens, max_tokens=max_tokens)
        return self._send(text), reason, tokens

    def _send(self, text: str) -> str:
        if not text.startswith(self.sent):
            # The tokenizer's decoding of a prefix was not a prefix of the decoding of more tokens, past what the
            # trimming above holds back: what was sent stays sent.
            if len(text) > len(self.sent):
                logger.warning("streamed text %r is not a prefix of the decoded text %r", self.sent, text)
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece

    def _possible_stop_start(self, text: str) -> int:
        """How many characters at the end of `text` could begin a stop sequence."""
        longest = 0
        for sequence in self.stop:
            for size in range(min(len(sequence) - 1, len(text)), longest, -1):
                if text.endswith(sequence[:size]):
                    longest = size
                    break
        return longest
