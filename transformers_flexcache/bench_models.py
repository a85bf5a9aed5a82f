"""The models that `transformers-flexcache bench` runs: upstream config classes, seeded random weights, no downloads.

Design decisions:
- Each `BenchModel` names an upstream model class and two configs built from upstream config classes: a
  real-sized one (t5-small, bart-base, whisper-tiny, a ~100M-parameter Llama) for the default run, and a tiny one
  for `--quick`. Weights are random and seeded, so a benchmark needs no network and every run sees the same model.
- The override class is looked up at run time through `registry.flex_model_classes()`, so a model whose override
  is not in this installation is skipped with a note instead of breaking the command.
- The output embedding is untied from the input embedding (Llama's already is), and Llama's init spread is 0.05:
  with tied embeddings these random models mostly repeat the token they just read, whatever the input, and equal
  tokens would prove little. Larger init spreads were tried and rejected: they saturate attention softmaxes, so
  that float rounding alone (eager against sdpa attention) changed the greedy tokens.
- Inputs are random token ids that avoid special tokens (so no row starts or stops early), with rows of different
  lengths padded as tokenizers pad them: right for encoder-decoder models, left for decoder-only ones. Whisper
  takes random log-mel features; its encoder only accepts `2 * max_source_positions` frames, so its encoder length
  is fixed and only its batch varies.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    AutoConfig,
    BartConfig,
    BartForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

QUICK_VOCAB = 128


@dataclass(frozen=True)
class BenchModel:
    """A model the benchmark can run.

    Args:
        name: the `--models` name, equal to the upstream `model_type`.
        upstream_class: the upstream model class; its override is looked up by it.
        build_config: the real-sized config of the default run.
        build_quick_config: a tiny config for `--quick`.
        description: what the real-sized config stands for, for the report.
        input_kind: `"tokens"` (ids and mask) or `"features"` (Whisper's log-mel features).
        default_max_batch_size: the largest batch of the default stream when it differs from the others'.
    """

    name: str
    upstream_class: type
    build_config: Callable[[], PreTrainedConfig]
    build_quick_config: Callable[[], PreTrainedConfig]
    description: str
    input_kind: str = "tokens"
    default_max_batch_size: int | None = None

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
    low = max(_special_ids(config) | {2}) + 1
    if low >= config.vocab_size:
        raise ValueError(f"vocab_size={config.vocab_size} leaves no ordinary token above the special ids < {low}")
    input_ids = torch.randint(low, config.vocab_size, (batch_size, length), generator=generator)
    row_lens = torch.randint((length + 1) // 2, length + 1, (batch_size,), generator=generator)
    row_lens[0] = length
    positions = torch.arange(length)
    if config.is_encoder_decoder:
        attention_mask = (positions[None, :] < row_lens[:, None]).long()  # right padding
    else:
        attention_mask = (positions[None, :] >= length - row_lens[:, None]).long()  # left padding
    input_ids[attention_mask == 0] = config.pad_token_id
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# --- built-in configs ------------------------------------------------------------------------------------------


def _untied_t5(config: T5Config) -> T5Config:
    # T5Config.__post_init__ (transformers 5.24) forces tie_word_embeddings=True, and reads a False passed to it as
    # "do not scale the decoder output". Set after construction, these give T5 v1.1's output layer: an lm_head of
    # its own, applied without the d_model**-0.5 scaling.
    config.tie_word_embeddings = False
    config.scale_decoder_outputs = False
    return config


def _t5_small() -> T5Config:
    # T5Config's defaults are t5-small: 6 + 6 layers, d_model 512, 8 heads, d_ff 2048, vocab 32128; untied (77M).
    return _untied_t5(T5Config(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _t5_quick() -> T5Config:
    return _untied_t5(
        T5Config(
            vocab_size=QUICK_VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def _bart_base() -> BartConfig:
    # bart-base: 6 + 6 layers, d_model 768, 12 heads, ffn 3072, vocab 50265; untied output embedding (178M).
    return BartConfig(
        vocab_size=50265,
        d_model=768,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=12,
        decoder_attention_heads=12,
        encoder_ffn_dim=3072,
        decoder_ffn_dim=3072,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


def _bart_quick() -> BartConfig:
    return BartConfig(
        vocab_size=QUICK_VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def _whisper_tiny() -> WhisperConfig:
    # WhisperConfig's defaults are whisper-tiny: 4 + 4 layers, d_model 384, 6 heads, 1500 encoder positions; untied.
    return WhisperConfig(tie_word_embeddings=False)


def _whisper_quick() -> WhisperConfig:
    return WhisperConfig(
        vocab_size=QUICK_VOCAB,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=32,
        max_target_positions=64,
        tie_word_embeddings=False,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        begin_suppress_tokens=None,
    )


def _llama_100m() -> LlamaConfig:
    # 8 layers, hidden 768, 12 heads with 4 kv heads, MLP 2048, vocab 32000, untied embeddings: 99.5M parameters.
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        initializer_range=0.05,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _llama_quick() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=QUICK_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.05,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


BENCH_MODELS = {
    model.name: model
    for model in [
        BenchModel("t5", T5ForConditionalGeneration, _t5_small, _t5_quick, "t5-small-sized T5 with untied embeddings"),
        BenchModel(
            "bart",
            BartForConditionalGeneration,
            _bart_base,
            _bart_quick,
            "bart-base-sized BART with untied embeddings",
        ),
        BenchModel(
            "whisper",
            WhisperForConditionalGeneration,
            _whisper_tiny,
            _whisper_quick,
            "whisper-tiny-sized Whisper with untied embeddings",
            input_kind="features",
            # Each row runs the 1500-position encoder (about a second on one core): batches up to 8 would take most
            # of the run's time.
            default_max_batch_size=2,
        ),
        BenchModel("llama", LlamaForCausalLM, _llama_100m, _llama_quick, "~100M-parameter Llama"),
    ]
}
DEFAULT_MODELS = tuple(BENCH_MODELS)


def find_override_class(upstream_class: type) -> tuple[type | None, str | None]:
    """The override class of `upstream_class` in this installation, or `(None, why not)`."""
    from . import registry

    try:
        classes = registry.flex_model_classes()
    except Exception as error:  # an override module that fails to import must not hide the others' results
        return None, f"the overrides could not be imported ({type(error).__name__}: {error})"
    for flex_class in classes:
        if flex_class.flex_upstream_class() is upstream_class:
            return flex_class, None
    return None, f"no override of {upstream_class.__name__} in this installation yet"


def build_models(
    model: BenchModel, *, quick: bool, checkpoint: str | None = None, seed: int = 0, with_override: bool = True
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(upstream model, override model or None) with identical weights, in eval mode, fp32.

    The override is a deep copy of the upstream model converted in place, so both hold the same weights without
    initializing twice.
    """
    from .registry import convert

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
