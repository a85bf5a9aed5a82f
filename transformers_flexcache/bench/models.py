"""The models that `transformers-flexcache bench` runs: upstream config classes, seeded random weights, no downloads.

Design decisions:
- Each `BenchModel` names an upstream model class and two configs of `transformers_flexcache.zoo` (shared with the
  tests): a real-sized one (t5-small, bart-base, opus-mt-en-de, whisper-tiny, a ~100M-parameter Llama, and with
  `--models qwen2` a ~100M-parameter Qwen2) for the default run, and the tiny one for `--quick`. Weights are random
  and seeded, so a benchmark needs no network and every run sees the same model.
- The zoo unties output embeddings (see its docstring): with tied embeddings these random models mostly repeat the
  token they just read, whatever the input, and equal tokens would prove little.
- Inputs are random token ids that avoid special tokens (so no row starts or stops early; Marian's pad token is its
  last id, the others are small), with rows of different
  lengths padded as tokenizers pad them: right for encoder-decoder models, left for decoder-only ones. Whisper
  takes random log-mel features; its encoder only accepts `2 * max_source_positions` frames, so its encoder length
  is fixed and only its batch varies.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, PreTrainedConfig

from .. import zoo


@dataclass(frozen=True)
class BenchModel:
    """A model the benchmark can run.

    Args:
        name: the `--models` name, equal to the upstream `model_type`.
        upstream_class_name: the upstream model class's name in `transformers` (`upstream_class`, imported when first
            used: the command line's help imports no model code); its override is looked up by it.
        build_config: the real-sized config of the default run.
        build_quick_config: a tiny config for `--quick`.
        description: what the real-sized config stands for, for the report.
        input_kind: `"tokens"` (ids and mask) or `"features"` (Whisper's log-mel features).
        default_max_batch_size: the largest batch of the default stream when it differs from the others'.
        ctranslate2_peer: whether the run adds a CTranslate2 row (models its converter takes: T5, Marian).
    """

    name: str
    upstream_class_name: str
    build_config: Callable[[], PreTrainedConfig]
    build_quick_config: Callable[[], PreTrainedConfig]
    description: str
    input_kind: str = "tokens"
    default_max_batch_size: int | None = None
    ctranslate2_peer: bool = False

    @property
    def upstream_class(self) -> type:
        return getattr(transformers, self.upstream_class_name)

    def encoder_len(self, config: PreTrainedConfig, length: int) -> int:
        """Encoder positions that a call of input length `length` fills (fixed for Whisper)."""
        return config.max_source_positions if self.input_kind == "features" else length

    def make_inputs(
        self, config: PreTrainedConfig, batch_size: int, length: int, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """Generate inputs for one call: `batch_size` rows of at most `length` tokens (or Whisper features)."""
        if self.input_kind == "features":
            frames = 2 * config.max_source_positions
            return {"input_features": torch.randn(batch_size, config.num_mel_bins, frames, generator=generator)}
        return _token_inputs(config, batch_size, length, generator)


def _special_ids(config: PreTrainedConfig) -> set[int]:
    ids = set()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "unk_token_id"):
        value = getattr(config, name, None)
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return ids


def _token_inputs(config: PreTrainedConfig, batch_size: int, length: int, generator: torch.Generator) -> dict:
    # input_ids, attention_mask: [B, length]; row 0 is full length, the others between length/2 and length.
    # Ordinary tokens lie between the small special ids and the first special id above them (Marian's pad: the last).
    special = _special_ids(config) | {2}
    low = max(i for i in special if i < config.vocab_size // 2) + 1
    high = min([i for i in special if i >= low] + [config.vocab_size])
    if low >= high:
        raise ValueError(f"vocab_size={config.vocab_size} leaves no ordinary token between the special ids {special}")
    input_ids = torch.randint(low, high, (batch_size, length), generator=generator)
    row_lens = torch.randint((length + 1) // 2, length + 1, (batch_size,), generator=generator)
    row_lens[0] = length
    positions = torch.arange(length)
    if config.is_encoder_decoder:
        attention_mask = (positions[None, :] < row_lens[:, None]).long()  # right padding
    else:
        attention_mask = (positions[None, :] >= length - row_lens[:, None]).long()  # left padding
    input_ids[attention_mask == 0] = config.pad_token_id
    return {"input_ids": input_ids, "attention_mask": attention_mask}


BENCH_MODELS = {
    model.name: model
    for model in [
        BenchModel(
            "t5",
            "T5ForConditionalGeneration",
            zoo.REAL_CONFIGS["t5"],
            zoo.TINY_CONFIGS["t5"],
            "t5-small-sized T5 with untied embeddings",
            ctranslate2_peer=True,
        ),
        BenchModel(
            "bart",
            "BartForConditionalGeneration",
            zoo.REAL_CONFIGS["bart"],
            zoo.TINY_CONFIGS["bart"],
            "bart-base-sized BART with untied embeddings",
        ),
        BenchModel(
            "marian",
            "MarianMTModel",
            zoo.REAL_CONFIGS["marian"],
            zoo.TINY_CONFIGS["marian"],
            "opus-mt-en-de-sized Marian (translation) with untied embeddings",
            ctranslate2_peer=True,
        ),
        BenchModel(
            "whisper",
            "WhisperForConditionalGeneration",
            zoo.REAL_CONFIGS["whisper"],
            zoo.TINY_CONFIGS["whisper"],
            "whisper-tiny-sized Whisper with untied embeddings",
            input_kind="features",
            # Each row runs the 1500-position encoder (about a second on one core): batches up to 8 would take most
            # of the run's time.
            default_max_batch_size=2,
        ),
        BenchModel(
            "llama", "LlamaForCausalLM", zoo.REAL_CONFIGS["llama"], zoo.TINY_CONFIGS["llama"], "~100M-parameter Llama"
        ),
        BenchModel(
            "qwen2", "Qwen2ForCausalLM", zoo.REAL_CONFIGS["qwen2"], zoo.TINY_CONFIGS["qwen2"], "~100M-parameter Qwen2"
        ),
    ]
}
# The default run: the translation models (T5, BART, Marian), speech (Whisper) and a decoder-only model (Llama).
DEFAULT_MODELS = ("t5", "bart", "marian", "whisper", "llama")


def build_models(
    model: BenchModel, *, quick: bool, checkpoint: str | None = None, seed: int = 0, with_override: bool = True
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(upstream model, override model or None) with identical weights, in eval mode, fp32.

    The override is a deep copy of the upstream model converted in place, so both hold the same weights without
    initializing twice.
    """
    from ..models.registry import convert

    if checkpoint is not None:
        upstream = model.upstream_class.from_pretrained(checkpoint, dtype=torch.float32)
    else:
        config = model.build_quick_config() if quick else model.build_config()
        torch.manual_seed(seed)
        upstream = model.upstream_class(config)
    upstream.eval()
    flex = convert(copy.deepcopy(upstream)).eval() if with_override else None
    return upstream, flex


def bench_model_for_checkpoint(path: str) -> BenchModel:
    """The `BenchModel` whose model type matches the checkpoint folder `path`.

    Raises:
        ValueError: the checkpoint's `model_type` is not one the benchmark knows.
    """
    model_type = AutoConfig.from_pretrained(path).model_type
    if model_type not in BENCH_MODELS:
        raise ValueError(
            f"the checkpoint at {path} has model_type={model_type!r}; the benchmark runs {sorted(BENCH_MODELS)}"
        )
    return BENCH_MODELS[model_type]
