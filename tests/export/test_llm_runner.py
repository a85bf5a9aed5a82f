"""ExecuTorch's own C++ LLM runner (`executorch.extension.llm.runner.TextLLMRunner`) on our decoder-only `.pte`.

The `.pte` is the CLI's export of the tiny Llama (tests/export/conftest.py): its `forward` method and metadata
methods follow the runner's convention, and the same `forward`, after `start`, serves every batch from the same
memory plan (tests/export/test_cli.py). The runner never calls `start`: it finds row 0 unpadded, as the `.pte`
holds its mask. The
tokenizer is a byte-level BPE trained here on a few ASCII words, to exactly the model's 99 tokens: every token then
decodes to its own ASCII string, so the runner's text pieces name the tokens it generated.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.export.conftest import needs_executorch

pytestmark = needs_executorch

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bright jugs of mixed vodka".split()


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    text = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=99, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=[], show_progress=False
    )
    tokenizer.train_from_iterator(text, trainer)
    assert tokenizer.get_vocab_size() == 99  # the tiny Llama's vocabulary; ids 0, 1, 2 are pad, bos, eos
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path), tokenizer


@pytest.mark.parametrize("prompt", ["the lazy dog", "seven wizards"])
def test_text_llm_runner_generates_eager_greedy_tokens_from_our_pte(cli_exports, tokenizer_path, prompt):
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    upstream, pte = cli_exports["llama"][:2]
    path, tokenizer = tokenizer_path
    prompt_ids = tokenizer.encode(prompt).ids
    new_tokens = 8
    expected = upstream.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False)[0]
    expected_ids = expected[len(prompt_ids) :].tolist()
    if upstream.generation_config.eos_token_id in expected_ids:  # the runner stops at EOS and prints nothing for it
        expected_ids = expected_ids[: expected_ids.index(upstream.generation_config.eos_token_id)]

    runner = TextLLMRunner(pte, path)
    pieces = []
    runner.generate(prompt, GenerationConfig(echo=False, max_new_tokens=new_tokens, temperature=0.0), pieces.append)
    assert pieces == [tokenizer.decode([token]) for token in expected_ids], (pieces, expected_ids)
    assert len(expected_ids) > 2, "too few tokens to prove anything"
