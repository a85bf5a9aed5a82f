"""The CTranslate2 peer row of the benchmark: the same T5 or Marian model and stream through `ctranslate2.Translator`.

Design decisions:
- The model is converted with CTranslate2's own `TransformersConverter` (fp32), handed the model in memory through
  its `load_model` hook: the weights converted are exactly those the torch strategies run, and nothing is saved or
  reloaded (a reload would also re-tie an untied T5 output layer, see `bench_models`). The converter still reads
  the config and a tokenizer from a folder: the config is saved there, with a word-level tokenizer whose token `i`
  is id `i` (the converter only reads the vocabulary and special tokens from it). No download; any T5 converts, and
  any Marian whose pad token is its last id, as in opus-mt checkpoints (the converter drops that id and starts
  decoding from a zero embedding, which is what the pad token's embedding is).
- CTranslate2 takes token strings; ids are mapped through the converted model's own vocabulary file, both ways.
  Rows are passed unpadded (CTranslate2 batches variable lengths itself), which is what the attention mask tells
  transformers.
- Same decoding as the torch strategies: greedy (`beam_size=1`), exactly `new_tokens` tokens
  (`min_decoding_length = max_decoding_length`), the same number of intra-op threads, and the compute type of the
  run: `float32`, or `bfloat16` with `--dtype bfloat16`. Beside it, `ctranslate2-int8` (`compute_type="int8"`, or
  `"int8_bfloat16"`) when the run has int8 strategies: CTranslate2 quantizes the converted float weights when it loads
  them (int8 weights per row, activations quantized per token at run time), the scheme `quantize(model, "int8")`
  follows.
- CTranslate2 grows its caches internally and exposes no allocation figures: those are None in its row. Step
  times come from its per-token callback, which is called after each decoding step.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import ctranslate2
import torch
from ctranslate2.converters import TransformersConverter
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from .measure import CallRecord, PeakRss

NAME = "ctranslate2"
INT8_NAME = "ctranslate2-int8"
# CTranslate2's compute type for each dtype of the run, in float and in int8.
COMPUTE_TYPES = {"float32": ("float32", "int8"), "bfloat16": ("bfloat16", "int8_bfloat16")}


def supported_compute_types() -> set[str]:
    """The compute types CTranslate2 runs on this CPU (its build and the CPU's instructions)."""
    return set(ctranslate2.get_supported_compute_types("cpu"))


class _InMemoryConverter(TransformersConverter):
    """`TransformersConverter` that converts an already-loaded model instead of loading one from its folder."""

    def __init__(self, model, folder: str):
        super().__init__(folder)
        self._model = model

    def load_model(self, model_class, model_name_or_path, **kwargs):
        return self._model


def write_identity_tokenizer(config, path: str) -> None:
    """Save to `path` a tokenizer whose vocabulary maps token `i` to id `i` for every id of `config.vocab_size`."""
    names = {config.pad_token_id: "<pad>", config.eos_token_id: "</s>"}
    names.setdefault(2, "<unk>")
    vocab = {names.get(i, f"t{i}"): i for i in range(config.vocab_size)}
    unk = names[2]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab=vocab, unk_token=unk)),
        pad_token=names[config.pad_token_id],
        eos_token=names[config.eos_token_id],
        unk_token=unk,
    )
    tokenizer.save_pretrained(path)


class CTranslate2Runner:
    """Runs the stream of a T5 or Marian model through a CTranslate2 translator converted from the same weights."""

    def __init__(
        self,
        translator: ctranslate2.Translator,
        vocabulary: list[str],
        workdir,
        *,
        name: str = NAME,
        compute_type: str = "float32",
    ):
        self.name = name
        self.compute_type = compute_type
        self.int8 = compute_type.startswith("int8")
        self.exact = compute_type == "float32"  # held to DynamicCache's tokens (fp32 runs)
        self.translator = translator
        self.vocabulary = vocabulary
        self.index = {token: i for i, token in enumerate(vocabulary)}
        self._workdir = workdir  # kept until the runner goes away

    @classmethod
    def from_model(
        cls, model, *, threads: int, compute_types: dict[str, str] | None = None
    ) -> list[CTranslate2Runner]:
        """Runners of `model` converted once (float32 weights), one per `{name: compute_type}` (default: fp32)."""
        workdir = tempfile.TemporaryDirectory(prefix="flexcache-ct2-")
        source = os.path.join(workdir.name, "transformers")
        target = os.path.join(workdir.name, "ctranslate2")
        model.config.save_pretrained(source)
        write_identity_tokenizer(model.config, source)
        _InMemoryConverter(model, source).convert(target, quantization="float32")
        with open(os.path.join(target, "shared_vocabulary.json")) as f:
            vocabulary = json.load(f)
        runners = []
        for name, compute_type in (compute_types or {NAME: "float32"}).items():
            translator = ctranslate2.Translator(
                target, device="cpu", compute_type=compute_type, intra_threads=threads, inter_threads=1
            )
            runners.append(cls(translator, vocabulary, workdir, name=name, compute_type=compute_type))
        return runners

    def run(self, inputs: dict, new_tokens: int) -> CallRecord:
        # inputs: input_ids, attention_mask [B, L] -> tokens [B, new_tokens]
        source = [
            [self.vocabulary[i] for i in row[mask.bool()].tolist()]
            for row, mask in zip(inputs["input_ids"], inputs["attention_mask"], strict=True)
        ]
        stamps: dict[int, float] = {}
        rss = PeakRss()

        def on_token(step) -> None:
            # Called once per row and step: the first call of a step stamps it.
            if step.step not in stamps:
                stamps[step.step] = time.perf_counter()
                rss.sample()

        rss.start()
        start = time.perf_counter()
        results = self.translator.translate_batch(
            source,
            beam_size=1,
            max_decoding_length=new_tokens,
            min_decoding_length=new_tokens,
            callback=on_token,
        )
        wall_s = time.perf_counter() - start
        rss.sample()
        tokens = torch.tensor([[self.index[token] for token in result.hypotheses[0]] for result in results])
        times = [stamps[step] for step in sorted(stamps)]
        return CallRecord(
            wall_s=wall_s,
            num_tokens=tokens.numel(),
            tokens=tokens,
            first_token_s=times[0] - start if times else None,
            step_s=[later - earlier for earlier, later in zip(times, times[1:], strict=False)],
            peak_rss_growth_bytes=rss.growth_bytes,
        )
