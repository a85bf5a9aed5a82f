"""Seeded random models from upstream config classes, for tests and the benchmark: no downloads.

Two sizes per model type:
- `tiny_config(model_type)`: 2 layers, hidden 32, vocab 99: the test models (and `bench --quick`). Sliding-window
  models get a window of `TINY_SLIDING_WINDOW` positions, shorter than the tests' prompts.
- `real_config(model_type)`: t5-small, bart-base, whisper-tiny, opus-mt-en-de-sized Marian, a ~100M-parameter Llama
  and a ~100M-parameter Qwen2: the benchmark's.

Design decisions:
- Random models must give outputs that vary, or token equality proves nothing. So output embeddings are untied from
  the input ones (tied, the tiny models echo the token they just read), in one way for every T5 (`untie_t5`), and
  some init spreads are wider than upstream's defaults (each says why).
- Special token ids are small (0 pad, 1 bos, 2 eos, as most checkpoints), so that inputs can avoid them; Marian's pad
  token is the last id, as in opus-mt checkpoints (CTranslate2's converter relies on it).
"""

from __future__ import annotations

import itertools

from transformers import (
    BartConfig,
    Gemma3TextConfig,
    GPT2Config,
    JambaConfig,
    LlamaConfig,
    M2M100Config,
    MarianConfig,
    MBartConfig,
    MistralConfig,
    PegasusConfig,
    Phi3Config,
    Pix2StructConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
    T5Config,
    WhisperConfig,
)

TINY_VOCAB = 99
WHISPER_TINY_MAX_SOURCE_POSITIONS = 12  # the encoder length that log-mel features give (2 frames per position)
WHISPER_TINY_NUM_MEL_BINS = 8
WHISPER_TINY_D_MODEL = 32
PIX2STRUCT_PATCH_DIM = 12  # pixels per flattened patch (tiny: upstream's is 16 x 16 x 3)


def untie_t5(config: T5Config) -> T5Config:
    """`config` with T5 v1.1's output layer (flan-t5's too): an `lm_head` of its own, applied without the
    `d_model**-0.5` scaling that tied T5 checkpoints (t5-small) apply.

    `T5Config.__post_init__` (transformers==5.24.0) forces `tie_word_embeddings=True`, and reads a `False` passed to it
    as "do not scale the decoder output": hence the assignments after construction. CTranslate2's converter scales
    exactly when the embeddings are tied, so both runtimes agree on this model.
    """
    config.tie_word_embeddings = False
    config.scale_decoder_outputs = False
    return config


# --- tiny ---------------------------------------------------------------------------------------------------------
def _llama_tiny() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


# Sliding window of the tiny sliding-window models: shorter than the prompts and generations of the tests, so that
# every call attends past it and drops positions.
TINY_SLIDING_WINDOW = 4


def _decoder_only_tiny(config_class: type, **kwargs) -> PreTrainedConfig:
    # Llama's tiny shape (see `_llama_tiny`) for the decoder-only models that need no module change.
    defaults = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 32,
        "intermediate_size": 37,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    return config_class(**{**defaults, **kwargs})


def _qwen2_tiny() -> Qwen2Config:
    # Hybrid, as Qwen2 checkpoints with `use_sliding_window`: layer 0 full attention, layer 1 a sliding window.
    return _decoder_only_tiny(
        Qwen2Config, use_sliding_window=True, sliding_window=TINY_SLIDING_WINDOW, max_window_layers=1
    )


def _qwen3_tiny() -> Qwen3Config:
    return _decoder_only_tiny(Qwen3Config, head_dim=8)


def _mistral_tiny() -> MistralConfig:
    # Every layer a sliding window, as Mistral-7B v0.1.
    return _decoder_only_tiny(MistralConfig, sliding_window=TINY_SLIDING_WINDOW)


def _phi3_tiny() -> Phi3Config:
    return _decoder_only_tiny(Phi3Config)


def _gemma3_text_tiny() -> Gemma3TextConfig:
    # Hybrid as Gemma 3 (5 sliding layers per full one there): layer 0 a sliding window, layer 1 full attention.
    return _decoder_only_tiny(
        Gemma3TextConfig,
        head_dim=8,
        sliding_window=TINY_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )


def _gpt2_tiny() -> GPT2Config:
    return GPT2Config(
        vocab_size=TINY_VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=37,
        n_positions=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def _t5_tiny() -> T5Config:
    config = T5Config(
        vocab_size=TINY_VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=2,
    )
    return untie_t5(config)


def _jamba_tiny() -> JambaConfig:
    # Layer 0 is Mamba (linear attention), layer 1 attention with a 2-expert MoE feed-forward. The expert width is a
    # multiple of 4 because the grouped matmul of the experts needs 16-byte strides in fp32.
    return JambaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=4,
        mamba_d_conv=3,
        mamba_expand=2,
        mamba_dt_rank=4,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _whisper_tiny() -> WhisperConfig:
    return WhisperConfig(
        vocab_size=TINY_VOCAB,
        num_mel_bins=WHISPER_TINY_NUM_MEL_BINS,
        d_model=WHISPER_TINY_D_MODEL,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_source_positions=WHISPER_TINY_MAX_SOURCE_POSITIONS,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        # upstream's defaults suppress ids of the real 51865-token vocabulary
        suppress_tokens=None,
        begin_suppress_tokens=None,
        # at the default 0.02 a random tiny Whisper emits one token over and over; 0.5 gives varied sequences
        init_std=0.5,
    )


def _bart_tiny() -> BartConfig:
    return BartConfig(
        vocab_size=TINY_VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
        # Untied and wider than upstream's 0.02: with tied embeddings the tiny model copies the decoder start (its
        # EOS) at once, and with small weights every row decodes the same tokens whatever its encoder input.
        tie_word_embeddings=False,
        init_std=0.2,
    )


def _bart_family_tiny(config_class: type, **kwargs) -> PreTrainedConfig:
    # BART's tiny shape and init (see `_bart_tiny`) for the models whose attention upstream copies from BART's.
    # The decoder starts from EOS unless the model type's own convention is kept in `kwargs` (Marian and Pegasus
    # start from the pad token).
    defaults = {
        "vocab_size": TINY_VOCAB,
        "d_model": 32,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 37,
        "decoder_ffn_dim": 37,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "decoder_start_token_id": 2,
        "forced_eos_token_id": 2,
        "tie_word_embeddings": False,
        "init_std": 0.2,
    }
    return config_class(**{**defaults, **kwargs})


def _marian_tiny() -> MarianConfig:
    # As opus-mt checkpoints: the pad token is the last id and starts decoding (CTranslate2's converter drops that
    # last id and starts from a zero embedding), and embeddings are scaled. At BART's init spread (0.2) every row
    # decodes the same token over and over whatever its input; 0.5 gives rows of their own.
    pad_token_id = TINY_VOCAB - 1
    return _bart_family_tiny(
        MarianConfig,
        pad_token_id=pad_token_id,
        decoder_start_token_id=pad_token_id,
        forced_eos_token_id=None,
        scale_embedding=True,
        init_std=0.5,
    )


def _m2m_100_tiny() -> M2M100Config:
    return _bart_family_tiny(M2M100Config)


def _mbart_tiny() -> MBartConfig:
    return _bart_family_tiny(MBartConfig)


def _pegasus_tiny() -> PegasusConfig:
    # Pegasus starts decoding from the pad token and scales its embeddings, as its checkpoints do.
    return _bart_family_tiny(PegasusConfig, decoder_start_token_id=0, scale_embedding=True)


def _pix2struct_tiny() -> Pix2StructConfig:
    text_config = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 32,
        "d_kv": 8,
        "d_ff": 37,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": 2,
    }
    vision_config = {
        "hidden_size": 32,
        "patch_embed_hidden_size": PIX2STRUCT_PATCH_DIM,
        "d_ff": 37,
        "d_kv": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "seq_len": 16,  # row/column ids below 16: up to 60 patches in rows of 4
    }
    return Pix2StructConfig(text_config=text_config, vision_config=vision_config)


# --- real-sized ---------------------------------------------------------------------------------------------------
def _t5_small() -> T5Config:
    # T5Config's defaults are t5-small: 6 + 6 layers, d_model 512, 8 heads, d_ff 2048, vocab 32128; untied (77M).
    return untie_t5(T5Config(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


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


def _whisper_real() -> WhisperConfig:
    # WhisperConfig's defaults are whisper-tiny: 4 + 4 layers, d_model 384, 6 heads, 1500 encoder positions; untied.
    return WhisperConfig(tie_word_embeddings=False)


def _marian_opus_mt() -> MarianConfig:
    # opus-mt-en-de: 6 + 6 layers, d_model 512, 8 heads, ffn 2048, swish, scaled embeddings, vocab 58101 whose last id
    # is the pad token that starts decoding, EOS 0. Untied: tied (opus-mt's 74M parameters), the random model decodes
    # one token over and over; untied, transformers 5.24 also unties the encoder and decoder input embeddings (164M
    # parameters), which are only gathered from, so a decoding step computes what opus-mt's does. No EOS forced at the
    # last step.
    return MarianConfig(
        vocab_size=58101,
        d_model=512,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=2048,
        decoder_ffn_dim=2048,
        max_position_embeddings=512,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=58100,
        decoder_start_token_id=58100,
        eos_token_id=0,
        forced_eos_token_id=None,
        tie_word_embeddings=False,
    )


def _qwen2_100m() -> Qwen2Config:
    # The ~100M Llama's shape (see `_llama_100m`) as a Qwen2: 8 layers, hidden 768, 12 heads with 4 kv heads (with
    # Qwen2's q/k/v biases), MLP 2048, vocab 32000, untied embeddings, full attention in every layer (as Qwen2.5
    # checkpoints: `use_sliding_window=False`).
    return Qwen2Config(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        initializer_range=0.05,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _llama_100m() -> LlamaConfig:
    # 8 layers, hidden 768, 12 heads with 4 kv heads, MLP 2048, vocab 32000, untied embeddings: 99.5M parameters.
    # The init spread is 0.05: at upstream's 0.02 the random model repeats one token; larger spreads saturate
    # softmaxes, so that float rounding alone (eager against sdpa) changes greedy tokens.
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


TINY_CONFIGS = {
    "llama": _llama_tiny,
    "t5": _t5_tiny,
    "bart": _bart_tiny,
    "whisper": _whisper_tiny,
    "jamba": _jamba_tiny,
    "pix2struct": _pix2struct_tiny,
    "marian": _marian_tiny,
    "m2m_100": _m2m_100_tiny,
    "mbart": _mbart_tiny,
    "pegasus": _pegasus_tiny,
    "qwen2": _qwen2_tiny,
    "qwen3": _qwen3_tiny,
    "mistral": _mistral_tiny,
    "phi3": _phi3_tiny,
    "gpt2": _gpt2_tiny,
    "gemma3_text": _gemma3_text_tiny,
}
REAL_CONFIGS = {
    "t5": _t5_small,
    "bart": _bart_base,
    "marian": _marian_opus_mt,
    "whisper": _whisper_real,
    "llama": _llama_100m,
    "qwen2": _qwen2_100m,
}


def tiny_config(model_type: str) -> PreTrainedConfig:
    """A new tiny config of `model_type` (2 layers, hidden 32, vocab 99)."""
    return _lookup(TINY_CONFIGS, model_type, "tiny")()


def real_config(model_type: str) -> PreTrainedConfig:
    """A new real-sized config of `model_type` (t5-small, bart-base, opus-mt-en-de, whisper-tiny, ~100M Llama and
    Qwen2)."""
    return _lookup(REAL_CONFIGS, model_type, "real-sized")()


def _lookup(table: dict, model_type: str, size: str):
    if model_type not in table:
        raise ValueError(f"no {size} config for model_type={model_type!r}; there are {sorted(table)}")
    return table[model_type]


# --- Whisper checkpoints that transcribe: a tokenizer, a processor and a generation config --------------------------
# Long-form transcription, timestamps, languages and prompts need what a real Whisper checkpoint ships beside its
# weights: the special tokens in the real order (end of text, start of transcript, languages, tasks, start of previous
# text, no speech, no timestamps, then one token per timestamp step) and a generation config naming them. These make
# that for a random model, with no download. `tiny` fits the tests' 3 s window (12 encoder positions of 0.25 s, 13
# timestamps); `real` is whisper-tiny's layout (51865 ids, 99 languages, 1501 timestamps, 30 s windows).
WHISPER_TINY_CHUNK_S = 3  # the tiny processor's window: 3 s of 16 kHz audio make 24 frames, 12 encoder positions
WHISPER_SAMPLING_RATE = 16000
WHISPER_TINY_LANGUAGES = ("en", "de", "fr")


def _byte_level_characters() -> list[str]:
    """The 256 characters that byte-level BPE writes bytes as (GPT-2's table, which Whisper's tokenizer uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + extra)
            extra += 1
    return [characters[byte] for byte in range(256)]


def whisper_vocabulary(size: str) -> tuple[dict[str, int], list[str]]:
    """`(text vocabulary, special tokens in id order after it)` of a Whisper tokenizer of `size` (`"tiny"` or
    `"real"`, see above). Tiny text tokens are the printable ASCII bytes; real ones are the 256 bytes, then filler
    tokens of two and three letters up to Whisper's 50257 text ids (decodable, never produced by encoding)."""
    characters = _byte_level_characters()
    if size == "tiny":
        text = [characters[byte] for byte in range(ord(" "), ord("~") + 1)]
        languages, num_timestamps, step = WHISPER_TINY_LANGUAGES, 13, 3 / 12
    elif size == "real":
        letters = "abcdefghijklmnopqrstuvwxyz"
        fillers = ("".join(t) for n in (2, 3, 4) for t in itertools.product(letters, repeat=n))
        text = list(characters) + list(itertools.islice(fillers, 50257 - 256))
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        languages, num_timestamps, step = tuple(LANGUAGES)[:99], 1501, 0.02
    else:
        raise ValueError(f"size={size!r}: pass 'tiny' or 'real'")
    special = ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in languages)]
    special += ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>"]
    special += ["<|notimestamps|>", *(f"<|{i * step:.2f}|>" for i in range(num_timestamps))]
    return {token: i for i, token in enumerate(text)}, special


def whisper_checkpoint_parts(size: str, *, init_std: float | None = None):
    """`(config, generation_config, processor)` of a transcribing Whisper of `size`: the zoo's config with the
    vocabulary of `whisper_vocabulary(size)`, a generation config as real checkpoints ship it (languages, tasks,
    timestamps, alignment heads), and a `WhisperProcessor` (a tiny 3 s window for `"tiny"`, 30 s for `"real"`)."""
    from tokenizers import AddedToken
    from transformers import GenerationConfig, WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizer

    vocab, special = whisper_vocabulary(size)
    ids = {token: len(vocab) + i for i, token in enumerate(special)}
    tokenizer = WhisperTokenizer(vocab=vocab, merges=[])
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in special[:-1]])
    # Timestamps are added tokens that are not special, as in Whisper's own tokenizer.json: decoding keeps them unless
    # the caller filters them (WhisperTokenizer.decode does).
    tokenizer.add_tokens([token for token in special if token.startswith("<|") and token[2].isdigit()])
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    config = tiny_config("whisper") if size == "tiny" else real_config("whisper")
    config.vocab_size = len(vocab) + len(special)
    config.pad_token_id = config.bos_token_id = config.eos_token_id = eot
    config.decoder_start_token_id = sot
    if init_std is not None:
        config.init_std = init_std
    space = vocab[_byte_level_characters()[ord(" ")]]
    languages = [
        token for token in special if len(token) in (6, 7) and token[2:-2].isalpha() and token[2:-2].islower()
    ]
    generation_config = GenerationConfig(
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=config.max_target_positions,
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        is_multilingual=True,
        lang_to_id={token: ids[token] for token in languages},
        task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        # at most 1 s of silence before the first word, as real checkpoints (50 steps of 0.02 s)
        max_initial_timestamp_index=4 if size == "tiny" else 50,
        begin_suppress_tokens=[space, eot],
        suppress_tokens=[],
        alignment_heads=[[config.decoder_layers - 1, 0], [config.decoder_layers - 1, 1]],
    )
    config.suppress_tokens, config.begin_suppress_tokens = None, None
    chunk_s = WHISPER_TINY_CHUNK_S if size == "tiny" else 30
    extractor = WhisperFeatureExtractor(
        feature_size=config.num_mel_bins,
        sampling_rate=WHISPER_SAMPLING_RATE,
        hop_length=chunk_s * WHISPER_SAMPLING_RATE // (2 * config.max_source_positions),
        chunk_length=chunk_s,
        n_fft=400,
    )
    return config, generation_config, WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer)
