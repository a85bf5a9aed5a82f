"""Every encoder-decoder model of transformers, with a static cache reused across calls, against DynamicCache.

Run against transformers 5.25.0 (unpatched, or with `upstream/series` applied), with transformers-flexcache NOT
importable (this script refuses to run if it is).

The family is enumerated from the tree's own auto mappings, not from a list kept here: every (model type, class) of
`MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`, `MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES` and
`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES` (where 5.x keeps the former vision-to-sequence models) whose default
config says `is_encoder_decoder`. Each member gets a tiny seeded model built from its config class (sizes from the
model's `ModelTester` in transformers' tests, weights rescaled so that greedy decoding does not settle on one token, word
embeddings untied) and, for eager and sdpa attention:

(a) *static twice*: `generate(cache_implementation="static")` on a batch of 4 inputs of length 24, then on a batch of 2
    of length 9, with nothing else passed (what a user of 5.25.0 writes): a new cache per call;
(b) *one user cache*: `EncoderDecoderCache(StaticCache(config, max_cache_len=L, max_batch_size=4),
    StaticCache(config, max_cache_len=E, max_batch_size=4))`, E the encoder output length of the longest input,
    `reset()` and passed to calls of batch 4, 2, 1, 3 with encoder inputs of length 24, 9, 5, 17 (rows after the first
    padded, so the masks are not all ones).

Each call's tokens must equal DynamicCache's (plain `generate` on the same model and inputs) and its logits agree within
1e-4 (relative to the largest logit). Members that have no static cache in 5.25.0 (their decoder keeps its own cache
format) are listed with the reason instead of being run; members this script cannot build are listed as not checked.
Prints a table (model type x attention x check), writes the results as JSON, exits 1 if any check fails or any member
is not checked.

Usage: python upstream/check_family.py [--models t5,bart,...] [--attn eager,sdpa] [--checks static,user]
                                       [--json PATH] [--list]
"""

import argparse
import json
import sys
import time
import warnings

import upstream_only  # upstream/upstream_only.py, beside this script

upstream_only.refuse_flexcache()

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import EncoderDecoderCache, StaticCache  # noqa: E402
from transformers.models.auto import configuration_auto, modeling_auto  # noqa: E402

MAPPINGS = (
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
)
STATIC_CALLS = [(4, 24), (2, 9)]  # (batch size, encoder input length) of check (a)
USER_CALLS = [(4, 24), (2, 9), (1, 5), (3, 17)]  # of check (b): the first one at the cache's capacity
MAX_BATCH_SIZE, MAX_CACHE_LEN = 4, 32
NEW_TOKENS = 5
VOCAB = 99
PAD, BOS, EOS, START = 1, 0, 2, 2  # first ids of the vocabulary
TEXT_VOCAB = VOCAB - 4  # inputs are drawn from [3, TEXT_VOCAB): the last ids are image tokens where a model has them

# Sizes shared by most members, applied to the fields a config class has (from the ModelTesters of transformers'
# tests: 2 layers, 4 heads, a small vocabulary)
SMALL = dict(
    vocab_size=VOCAB,
    d_model=32,
    hidden_size=32,
    d_kv=8,
    head_dim=8,
    d_ff=64,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    intermediate_size=64,
    num_layers=2,
    num_decoder_layers=2,
    num_hidden_layers=2,
    encoder_layers=2,
    decoder_layers=2,
    num_heads=4,
    num_attention_heads=4,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    decoder_start_token_id=START,
    forced_bos_token_id=None,
    forced_eos_token_id=None,
    tie_word_embeddings=False,
    use_cache=True,
)


def _fields(config_cls) -> set:
    return set(config_cls().to_dict())


def small_config(config_cls, **overrides):
    """`config_cls` with SMALL's values for the fields it has, then `overrides`."""
    names = _fields(config_cls)
    return config_cls(**{**{key: value for key, value in SMALL.items() if key in names}, **overrides})


# ---------------------------------------------------------------------------------------------------------------------
# Members: how to build each one and its inputs. Keys are (model type, class name) of the mappings.


def text_inputs(batch_size: int, length: int, gen) -> dict:
    """input_ids and attention_mask; rows after the first are right-padded to shorter lengths."""
    mask = padding_mask(batch_size, length)
    ids = torch.randint(3, TEXT_VOCAB, (batch_size, length), generator=gen) * mask + PAD * (1 - mask)
    return {"input_ids": ids, "attention_mask": mask}


def padding_mask(batch_size: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch_size, length, dtype=torch.long)
    for row in range(1, batch_size):
        mask[row, length - (row * length) // (2 * batch_size) :] = 0
    return mask


def features_inputs(feature_size: int, frames_per_position: int, channels_first: bool = False, name="input_features"):
    """Inputs of speech models that take (batch, frames, features) (or (batch, features, frames)) with a mask."""

    def make(batch_size, length, gen):
        frames = length * frames_per_position
        features = torch.randn(batch_size, frames, feature_size, generator=gen)
        mask = padding_mask(batch_size, frames)
        features = features * mask[..., None]
        if channels_first:
            features = features.transpose(1, 2).contiguous()
        return {name: features, "attention_mask": mask}

    return make


class Member:
    """How to build one (model type, class) of the family and its inputs."""

    def __init__(self, build, inputs=text_inputs, generation=None, no_static=None):
        self.build = build  # () -> model, on the default seed
        self.inputs = inputs  # (batch_size, length, generator) -> dict of generate's inputs
        self.generation = generation or {}  # generation config entries the model's own generate needs
        # Why the member cannot use a static cache in 5.25.0, or None: its checks still run and are shown, but do not
        # fail the script (a series that fixes such a member shows it as passing)
        self.no_static = no_static


def _plain(class_name, **overrides):
    """A member whose config class takes SMALL plus `overrides`."""

    def build():
        cls = getattr(transformers, class_name)
        return cls(small_config(cls.config_class, **overrides))

    return build


def _composite(class_name, encoder, decoder, **overrides):
    """EncoderDecoderModel and its speech and vision siblings: an encoder config and a decoder config."""

    def build():
        cls = getattr(transformers, class_name)
        encoder_config = encoder()
        decoder_config = decoder()
        config = cls.config_class(encoder=encoder_config.to_dict(), decoder=decoder_config.to_dict(), **overrides)
        config.decoder_start_token_id, config.pad_token_id = START, PAD
        config.bos_token_id, config.eos_token_id = BOS, EOS
        config.tie_word_embeddings = False
        return cls(config=config)

    return build


def _bert_decoder():
    return small_config(transformers.BertConfig, is_decoder=True, add_cross_attention=True)


MOONSHINE_DOWNSAMPLING = 64 * 3 * 2  # conv1 stride 64, conv2 stride 3, conv3 stride 2


def _moonshine_inputs(batch_size, length, gen):
    samples = (length + 1) * MOONSHINE_DOWNSAMPLING
    mask = padding_mask(batch_size, samples)
    return {"input_values": torch.randn(batch_size, samples, generator=gen) * mask, "attention_mask": mask}


def _whisper_inputs(batch_size, length, gen):
    # Whisper's input features have one length: 2 * max_source_positions frames (16 here)
    return {"input_features": torch.randn(batch_size, 8, 32, generator=gen)}


def _pix2struct_inputs(batch_size, length, gen):
    mask = padding_mask(batch_size, length)
    patches = torch.randn(batch_size, length, 2 + 4 * 4 * 3, generator=gen)
    patches[:, :, 0] = torch.arange(length) // 8 + 1  # row ids
    patches[:, :, 1] = torch.arange(length) % 8 + 1  # column ids
    return {"flattened_patches": patches * mask[..., None], "attention_mask": mask}


def _pix2struct():
    text = dict(
        vocab_size=VOCAB, hidden_size=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=PAD,
        eos_token_id=EOS, bos_token_id=BOS, decoder_start_token_id=START, tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, patch_embed_hidden_size=4 * 4 * 3, d_kv=8, d_ff=64, num_hidden_layers=2,
        num_attention_heads=4, seq_len=4096,
    )  # fmt: skip
    config = transformers.Pix2StructConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return transformers.Pix2StructForConditionalGeneration(config)


def _image_inputs(channels: int, size: int, image_tokens: int = 0):
    """Inputs of vision encoders: pixel values (one encoder length); with `image_tokens`, a text prompt of `length`
    after that many image placeholders (Florence-2 merges the image features into its encoder's input there)."""

    def make(batch_size, length, gen):
        pixels = {"pixel_values": torch.randn(batch_size, channels, size, size, generator=gen)}
        if not image_tokens:
            return pixels
        text = text_inputs(batch_size, length, gen)
        placeholders = torch.full((batch_size, image_tokens), VOCAB - 1)
        text["input_ids"] = torch.cat([placeholders, text["input_ids"]], dim=1)
        text["attention_mask"] = torch.cat([torch.ones_like(placeholders), text["attention_mask"]], dim=1)
        return {**text, **pixels}

    return make


def _t5gemma():
    module = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )  # fmt: skip
    config = transformers.T5GemmaConfig(
        encoder=module, decoder={**module, "cross_attention_hidden_size": 32}, vocab_size=VOCAB,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=START, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.T5GemmaForConditionalGeneration(config)


def _t5gemma2():
    text = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=64,
        layer_types=["full_attention", "sliding_attention"], pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=20, patch_size=5
    )
    encoder = dict(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=VOCAB - 3,
                   eoi_token_index=VOCAB - 2, image_token_index=VOCAB - 1)  # fmt: skip
    config = transformers.T5Gemma2Config(
        encoder=encoder, decoder=text, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
        decoder_start_token_id=START, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.T5Gemma2ForConditionalGeneration(config)


def _udop_inputs(batch_size, length, gen):
    inputs = text_inputs(batch_size, length, gen)
    corners = torch.rand(batch_size, length, 2, generator=gen) * 0.5
    inputs["bbox"] = torch.cat([corners, corners + 0.25], dim=-1)
    return inputs


def _seamless(class_name):
    def build():
        cls = getattr(transformers, class_name)
        config = small_config(
            cls.config_class, t2u_vocab_size=VOCAB, speech_encoder_layers=2, speech_encoder_attention_heads=4,
            speech_encoder_intermediate_size=64, feature_projection_input_dim=16, num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=4, adaptor_kernel_size=2, adaptor_stride=2, num_adapter_layers=1,
            max_source_positions=256,
        )  # fmt: skip
        return cls(config)

    return build


def _seamless_speech_inputs(batch_size, length, gen):
    return features_inputs(16, 2)(batch_size, length, gen)


def _speecht5():
    config = small_config(
        transformers.SpeechT5Config, conv_dim=(32, 32, 32), conv_stride=(4, 4, 4), conv_kernel=(8, 8, 8),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, max_text_positions=128, max_speech_positions=4096,
    )  # fmt: skip
    return transformers.SpeechT5ForSpeechToText(config)


def _raw_audio_inputs(samples_per_position: int):
    def make(batch_size, length, gen):
        samples = length * samples_per_position
        mask = padding_mask(batch_size, samples)
        return {"input_values": torch.randn(batch_size, samples, generator=gen) * mask, "attention_mask": mask}

    return make


def _wav2vec2_encoder():
    return small_config(
        transformers.Wav2Vec2Config, conv_dim=(32, 32, 32), conv_stride=(4, 4, 4), conv_kernel=(8, 8, 8),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, feat_extract_norm="layer",
    )  # fmt: skip


def _vit_encoder():
    return small_config(transformers.ViTConfig, image_size=16, patch_size=4)


def _florence2():
    text = dict(
        vocab_size=VOCAB, max_position_embeddings=128, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4, d_model=32, pad_token_id=PAD,
        bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=START, forced_eos_token_id=None,
    )  # fmt: skip
    vision = dict(
        in_channels=3, depths=[1], patch_size=[7], patch_stride=[4], patch_padding=[3], patch_prenorm=[False],
        embed_dim=[32], num_heads=[4], num_groups=[4], window_size=12, projection_dim=32,
    )  # fmt: skip
    config = transformers.Florence2Config(
        text_config=text, vision_config=vision, image_token_id=VOCAB - 1, tie_word_embeddings=False
    )
    return transformers.Florence2ForConditionalGeneration(config)


def _pp_formulanet():
    vision = dict(
        image_size=64, patch_size=16, hidden_size=32, window_size=2, num_hidden_layers=1, output_channels=16,
        num_attention_heads=4, global_attn_indexes=[0], mlp_dim=32, post_conv_in_channels=16,
        post_conv_mid_channels=16, post_conv_out_channels=16, decoder_hidden_size=32,
    )  # fmt: skip
    text = dict(
        vocab_size=VOCAB, max_position_embeddings=128, decoder_layers=2, decoder_ffn_dim=64, decoder_attention_heads=4,
        d_model=32, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=START,
        forced_eos_token_id=None,
    )  # fmt: skip
    config = transformers.PPFormulaNetConfig(text_config=text, vision_config=vision)
    return transformers.PPFormulaNetForConditionalGeneration(config)


def _asr_encoder(**overrides):
    return dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
        conv_kernel_size=9, subsampling_factor=4, subsampling_conv_channels=8, num_mel_bins=8,
        subsampling_conv_kernel_size=3, subsampling_conv_stride=2, scale_input=False, layerdrop=0.0, **overrides,
    )  # fmt: skip


def _cohere_asr():
    config = small_config(
        transformers.CohereAsrConfig, encoder_config=_asr_encoder(), num_key_value_heads=4, max_position_embeddings=256
    )
    return transformers.CohereAsrForConditionalGeneration(config)


def _canary():
    decoder = small_config(transformers.CanaryDecoderConfig, max_position_embeddings=256)
    config = transformers.CanaryConfig(
        encoder_config=_asr_encoder(), decoder_config=decoder.to_dict(), vocab_size=VOCAB, pad_token_id=PAD,
        bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=START, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.CanaryForConditionalGeneration(config)


def _moonshine_streaming():
    encoder = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, sliding_windows=[[16, 4], [16, 4]],
    )  # fmt: skip
    config = small_config(
        transformers.MoonshineStreamingConfig,
        encoder_config=encoder,
        max_position_embeddings=256,
        num_key_value_heads=4,
    )
    return transformers.MoonshineStreamingForConditionalGeneration(config)


def _dia():
    encoder = dict(
        max_position_embeddings=128, num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, intermediate_size=64, vocab_size=VOCAB,
    )  # fmt: skip
    decoder = dict(
        max_position_embeddings=128, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, cross_num_attention_heads=4, cross_head_dim=16,
        cross_num_key_value_heads=4, cross_hidden_size=32, vocab_size=VOCAB + 3, num_channels=3,
        pad_token_id=VOCAB + 1, eos_token_id=VOCAB, bos_token_id=VOCAB + 2,
    )  # fmt: skip
    config = transformers.DiaConfig(encoder_config=encoder, decoder_config=decoder, delay_pattern=[0, 1, 2])
    return transformers.DiaForConditionalGeneration(config)


MEMBERS = {
    # BART and the models derived from it
    ("bart", "BartForConditionalGeneration"): Member(_plain("BartForConditionalGeneration")),
    ("mbart", "MBartForConditionalGeneration"): Member(_plain("MBartForConditionalGeneration")),
    ("plbart", "PLBartForConditionalGeneration"): Member(_plain("PLBartForConditionalGeneration")),
    ("mvp", "MvpForConditionalGeneration"): Member(_plain("MvpForConditionalGeneration")),
    ("marian", "MarianMTModel"): Member(_plain("MarianMTModel", decoder_vocab_size=VOCAB)),
    ("pegasus", "PegasusForConditionalGeneration"): Member(_plain("PegasusForConditionalGeneration")),
    ("pegasus_x", "PegasusXForConditionalGeneration"): Member(
        _plain("PegasusXForConditionalGeneration", num_global_tokens=4, block_size=8)
    ),
    ("blenderbot", "BlenderbotForConditionalGeneration"): Member(_plain("BlenderbotForConditionalGeneration")),
    ("blenderbot-small", "BlenderbotSmallForConditionalGeneration"): Member(
        _plain("BlenderbotSmallForConditionalGeneration")
    ),
    ("m2m_100", "M2M100ForConditionalGeneration"): Member(_plain("M2M100ForConditionalGeneration")),
    ("nllb-moe", "NllbMoeForConditionalGeneration"): Member(
        _plain("NllbMoeForConditionalGeneration", num_experts=4, expert_capacity=100)
    ),
    ("bigbird_pegasus", "BigBirdPegasusForConditionalGeneration"): Member(
        _plain("BigBirdPegasusForConditionalGeneration", attention_type="original_full")
    ),
    ("led", "LEDForConditionalGeneration"): Member(
        _plain(
            "LEDForConditionalGeneration",
            max_encoder_position_embeddings=128,
            max_decoder_position_embeddings=128,
            attention_window=4,
        ),
        no_static="LEDDecoder builds no self-attention mask for one new token, so a decode step attends every slot "
        "of a static cache, the empty ones included",
    ),
    ("fsmt", "FSMTForConditionalGeneration"): Member(
        _plain("FSMTForConditionalGeneration", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, langs=["ru", "en"]),
        no_static="FSMT's decoder masks only the current decoder_input_ids (its own causal mask, no cache "
        "length), so a decode step attends every slot of a static cache, the empty ones included",
    ),
    # T5 and its relatives
    ("t5", "T5ForConditionalGeneration"): Member(_plain("T5ForConditionalGeneration")),
    ("mt5", "MT5ForConditionalGeneration"): Member(_plain("MT5ForConditionalGeneration")),
    ("umt5", "UMT5ForConditionalGeneration"): Member(_plain("UMT5ForConditionalGeneration")),
    ("longt5", "LongT5ForConditionalGeneration"): Member(
        _plain("LongT5ForConditionalGeneration", local_radius=5, global_block_size=3)
    ),
    ("switch_transformers", "SwitchTransformersForConditionalGeneration"): Member(
        _plain(
            "SwitchTransformersForConditionalGeneration",
            num_experts=4,
            expert_capacity=64,
            num_sparse_encoder_layers=1,
            num_sparse_decoder_layers=1,
        )
    ),
    # Speech
    ("whisper", "WhisperForConditionalGeneration"): Member(
        _plain(
            "WhisperForConditionalGeneration",
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=128,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        ),
        inputs=_whisper_inputs,
    ),
    ("speech_to_text", "Speech2TextForConditionalGeneration"): Member(
        _plain(
            "Speech2TextForConditionalGeneration",
            input_feat_per_channel=8,
            conv_channels=16,
            max_source_positions=128,
            max_target_positions=128,
        ),
        inputs=features_inputs(8, 4),
    ),
    ("moonshine", "MoonshineForConditionalGeneration"): Member(
        _plain(
            "MoonshineForConditionalGeneration",
            encoder_num_hidden_layers=2,
            decoder_num_hidden_layers=2,
            encoder_num_attention_heads=4,
            decoder_num_attention_heads=4,
            encoder_num_key_value_heads=4,
            decoder_num_key_value_heads=4,
        ),
        inputs=_moonshine_inputs,
    ),
    # Vision
    ("pix2struct", "Pix2StructForConditionalGeneration"): Member(_pix2struct, inputs=_pix2struct_inputs),
    # Composite models: an encoder and a decoder from two other model types
    ("encoder-decoder", "EncoderDecoderModel"): Member(
        _composite("EncoderDecoderModel", lambda: small_config(transformers.BertConfig), _bert_decoder)
    ),
    ("t5gemma", "T5GemmaForConditionalGeneration"): Member(_t5gemma),
    ("t5gemma2", "T5Gemma2ForConditionalGeneration"): Member(_t5gemma2),
    ("udop", "UdopForConditionalGeneration"): Member(_plain("UdopForConditionalGeneration"), inputs=_udop_inputs),
    ("pop2piano", "Pop2PianoForConditionalGeneration"): Member(
        _plain("Pop2PianoForConditionalGeneration", composer_vocab_size=1),
        inputs=features_inputs(32, 1),
        generation={"composer_to_feature_token": {"composer1": TEXT_VOCAB}},
    ),
    ("prophetnet", "ProphetNetForConditionalGeneration"): Member(
        _plain(
            "ProphetNetForConditionalGeneration",
            num_encoder_layers=2,
            num_decoder_layers=2,
            num_encoder_attention_heads=4,
            num_decoder_attention_heads=4,
            ngram=2,
            pad_token_id=0,  # its positions count from the padding id, which must be the start id
        ),  # fmt: skip
        generation={"pad_token_id": 0, "decoder_start_token_id": 0},
        no_static="ProphetNet's n-gram self-attention builds its masks for a cache that grows: "
        "generate(cache_implementation='static') fails in its first decode step (an expand of the n-gram mask)",
    ),
    ("seamless_m4t", "SeamlessM4TForTextToText"): Member(_seamless("SeamlessM4TForTextToText")),
    ("seamless_m4t", "SeamlessM4TForSpeechToText"): Member(
        _seamless("SeamlessM4TForSpeechToText"), inputs=_seamless_speech_inputs
    ),
    ("seamless_m4t_v2", "SeamlessM4Tv2ForTextToText"): Member(_seamless("SeamlessM4Tv2ForTextToText")),
    ("seamless_m4t_v2", "SeamlessM4Tv2ForSpeechToText"): Member(
        _seamless("SeamlessM4Tv2ForSpeechToText"), inputs=_seamless_speech_inputs
    ),
    ("speecht5", "SpeechT5ForSpeechToText"): Member(_speecht5, inputs=_raw_audio_inputs(64)),
    ("canary", "CanaryForConditionalGeneration"): Member(_canary, inputs=features_inputs(8, 4)),
    ("cohere_asr", "CohereAsrForConditionalGeneration"): Member(_cohere_asr, inputs=features_inputs(8, 4)),
    ("moonshine_streaming", "MoonshineStreamingForConditionalGeneration"): Member(
        _moonshine_streaming, inputs=_raw_audio_inputs(80)
    ),
    ("dia", "DiaForConditionalGeneration"): Member(_dia),
    ("florence2", "Florence2ForConditionalGeneration"): Member(
        _florence2,
        inputs=_image_inputs(3, 32, image_tokens=65),  # 1 + (32 / 4) ** 2 image features
    ),
    ("pp_formulanet", "PPFormulaNetForConditionalGeneration"): Member(
        _pp_formulanet,
        inputs=_image_inputs(3, 64),
        no_static="generate sizes the cross cache from encoder_outputs[0].shape[1], here the channels of the vision "
        "feature map (16), while the decoder attends 1 cross state: the other 15 zero slots are attended",
    ),
    ("speech-encoder-decoder", "SpeechEncoderDecoderModel"): Member(
        _composite("SpeechEncoderDecoderModel", _wav2vec2_encoder, _bert_decoder), inputs=_raw_audio_inputs(64)
    ),
    ("vision-encoder-decoder", "VisionEncoderDecoderModel"): Member(
        _composite("VisionEncoderDecoderModel", _vit_encoder, _bert_decoder),
        inputs=_image_inputs(3, 16),
    ),
}


def family() -> list[tuple[str, str, list[str]]]:
    """(model type, class name, mappings) of every encoder-decoder generative class of the tree's auto mappings."""
    members = {}
    for mapping_name in MAPPINGS:
        for model_type, class_name in getattr(modeling_auto, mapping_name).items():
            if isinstance(class_name, list | tuple):
                class_name = class_name[0]
            members.setdefault((model_type, class_name), []).append(mapping_name.removeprefix("MODEL_FOR_"))
    result = []
    for (model_type, class_name), mappings in sorted(members.items()):
        try:
            is_encoder_decoder = configuration_auto.CONFIG_MAPPING[model_type]().is_encoder_decoder
        except Exception:  # a config without defaults: decided by the class below
            is_encoder_decoder = None
        if is_encoder_decoder is None:
            cls = getattr(transformers, class_name, None)
            is_encoder_decoder = cls is not None and "EncoderDecoder" in class_name
        if is_encoder_decoder:
            result.append((model_type, class_name, mappings))
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The checks


def build(member: Member, attn: str):
    torch.manual_seed(0)
    model = member.build()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and "norm" not in name:
                param.normal_(0.0, 0.3)
    model.set_attn_implementation(attn)
    config = model.generation_config
    config.pad_token_id, config.bos_token_id, config.eos_token_id = PAD, BOS, EOS
    config.decoder_start_token_id = START
    # Settings some configs carry for their checkpoints, which would make the reference differ by more than the cache
    for name, value in dict(
        num_beams=1, do_sample=False, no_repeat_ngram_size=None, encoder_no_repeat_ngram_size=None,
        forced_bos_token_id=None, forced_eos_token_id=None, suppress_tokens=None, begin_suppress_tokens=None,
        bad_words_ids=None, max_length=None, min_length=None, cache_implementation=None,
    ).items():  # fmt: skip
        setattr(config, name, value)
    for name, value in member.generation.items():
        setattr(config, name, value)
    return model.eval()


def generate(model, call_inputs, **kwargs):
    """Greedy tokens and logits (batch, new tokens, vocab) of one call."""
    out = model.generate(
        **call_inputs,
        use_cache=True,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits, dim=1).float(), out.past_key_values


def compare(reference, result) -> str | None:
    (ref_tokens, ref_logits, _), (tokens, logits, _) = reference, result
    if ref_tokens.shape != tokens.shape or not torch.equal(ref_tokens, tokens):
        rows = [
            row for row in range(min(len(ref_tokens), len(tokens))) if not torch.equal(ref_tokens[row], tokens[row])
        ]
        return f"tokens differ (rows {rows}): {ref_tokens[rows[:1]].tolist()} vs {tokens[rows[:1]].tolist()}"
    scale = max(1.0, ref_logits.abs().max().item())
    diff = (ref_logits - logits).abs().max().item()
    return None if diff <= 1e-4 * scale else f"logits differ by {diff:.2e} (largest {scale:.1f})"


def _error(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:200]}"


def run_check(model, reference_model, member: Member, check: str) -> tuple[int, int, str]:
    """(calls equal to DynamicCache, calls, notes) of one check. `reference_model` is the same model built again, for
    DynamicCache's calls: Pop2Piano's generate writes its arguments (cache_implementation) into generation_config."""
    calls = STATIC_CALLS if check == "static" else USER_CALLS
    cache = None
    passed, notes = 0, []
    for seed, (batch_size, length) in enumerate(calls):
        call_inputs = member.inputs(batch_size, length, torch.Generator().manual_seed(seed))
        try:
            reference = generate(reference_model, call_inputs)
        except Exception as error:
            return passed, len(calls), f"DynamicCache reference failed: {_error(error)}"
        try:
            if check == "static":
                result = generate(model, call_inputs, cache_implementation="static")
            else:
                if cache is None:  # sized by the first call: the cross-attention length its decoder sees
                    max_encoder_len = reference[2].cross_attention_cache.get_seq_length()
                    config = model.config
                    cache = EncoderDecoderCache(
                        StaticCache(config, max_cache_len=MAX_CACHE_LEN, max_batch_size=MAX_BATCH_SIZE),
                        StaticCache(config, max_cache_len=max_encoder_len, max_batch_size=MAX_BATCH_SIZE),
                    )
                cache.reset()
                result = generate(model, call_inputs, past_key_values=cache)
            problem = compare(reference, result)
        except Exception as error:  # every call is reported, not only the first failure
            problem = _error(error)
        if problem is None:
            passed += 1
        else:
            notes.append(f"call {seed + 1} (batch {batch_size}, length {length}): {problem}")
    return passed, len(calls), "; ".join(notes)


def markdown_table(runs: dict[str, str]) -> str:
    """One row per (model type, class, attention), one column per run and check: `passed/calls`, `n/a` or the status."""
    loaded = {name: json.load(open(path))["results"] for name, path in runs.items()}
    keys, cells = [], {}
    for name, results in loaded.items():
        for r in results:
            key = (r["model_type"], r["class_name"], r.get("attn", "-"))
            if key not in keys:
                keys.append(key)
            if r["status"] == "n/a":
                cells[(name, key, "static")] = cells[(name, key, "user")] = "n/a"
            elif "check" in r:
                mark = (
                    ""
                    if r["status"] == "ok"
                    else " (no static cache)"
                    if r["status"] == "no static cache"
                    else " FAIL"
                )
                cells[(name, key, r["check"])] = f"{r['passed']}/{r['calls']}{mark}"
            else:
                cells[(name, key, "static")] = cells[(name, key, "user")] = r["status"]
    header = ["model type", "class", "attn"] + [f"{name} ({check})" for name in loaded for check in ("a", "b")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in sorted(keys):
        row = list(key) + [cells.get((name, key, check), "") for name in loaded for check in ("static", "user")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated model types (default: the whole family)")
    parser.add_argument("--attn", default="eager,sdpa")
    parser.add_argument("--checks", default="static,user", help="static: check (a); user: check (b)")
    parser.add_argument("--json", default="check_family.json", help="where to write the results")
    parser.add_argument("--list", action="store_true", help="print the family and exit")
    parser.add_argument(
        "--table", nargs="+", metavar="NAME=JSON", help="print earlier results side by side (markdown)"
    )
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(dict(item.split("=", 1) for item in args.table)))
        return 0
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    start = time.time()
    print(f"transformers {transformers.__version__} ({transformers.__file__}), torch {torch.__version__}")
    members = family()
    if args.list:
        for model_type, class_name, mappings in members:
            known = "" if (model_type, class_name) in MEMBERS else "  (no tiny config here)"
            print(f"{model_type:<24} {class_name:<48} {','.join(mappings)}{known}")
        return 0
    if args.models:
        wanted = set(args.models.split(","))
        members = [member for member in members if member[0] in wanted]
    checks = args.checks.split(",")
    results, failed = [], 0
    print(f"{'model type':<22} {'class':<44} {'attn':<6} {'check':<7} result")
    for model_type, class_name, mappings in members:
        member = MEMBERS.get((model_type, class_name))
        row = dict(model_type=model_type, class_name=class_name, mappings=mappings)
        if member is None:
            failed += 1
            results.append({**row, "status": "not checked", "reason": "check_family.py has no tiny config for it"})
            print(f"{model_type:<22} {class_name:<44} {'-':<6} {'-':<7} NOT CHECKED: no tiny config here")
            continue
        if member.no_static:
            print(f"{model_type:<22} {class_name:<44} {'-':<6} {'-':<7} NO STATIC CACHE in 5.25.0: {member.no_static}")
        for attn in args.attn.split(","):
            for check in checks:
                try:  # fresh models per check (see run_check)
                    model, reference_model = build(member, attn), build(member, attn)
                except Exception as error:
                    if "does not support an attention implementation" in str(error):
                        results.append({**row, "attn": attn, "status": "n/a", "reason": f"no {attn} attention"})
                        print(f"{model_type:<22} {class_name:<44} {attn:<6} {'-':<7} n/a: the model has no {attn} "
                              "attention")  # fmt: skip
                        break
                    failed += 1
                    results.append({**row, "attn": attn, "status": "not checked", "reason": f"build: {_error(error)}"})
                    print(f"{model_type:<22} {class_name:<44} {attn:<6} {'-':<7} NOT CHECKED: build: {_error(error)}")
                    break
                tic = time.time()
                passed, total, notes = run_check(model, reference_model, member, check)
                status = "ok" if passed == total else "no static cache" if member.no_static else "FAIL"
                failed += status == "FAIL"
                results.append(
                    {**row, "attn": attn, "check": check, "passed": passed, "calls": total, "status": status,
                     "notes": notes, "seconds": round(time.time() - tic, 2)}
                )  # fmt: skip
                print(f"{model_type:<22} {class_name:<44} {attn:<6} {check:<7} {passed}/{total} {status}  {notes}",
                      flush=True)  # fmt: skip
    with open(args.json, "w") as handle:
        json.dump(
            {"transformers": transformers.__version__, "path": transformers.__file__, "torch": torch.__version__,
             "seconds": round(time.time() - start, 1), "results": results},
            handle, indent=1,
        )  # fmt: skip
    for check in checks:
        runs = [r for r in results if r.get("check") == check and r["status"] in ("ok", "FAIL")]
        print(f"check {check}: {sum(r['status'] == 'ok' for r in runs)}/{len(runs)} (model, attention) pairs equal "
              "DynamicCache (members with a static cache in 5.25.0)")  # fmt: skip
    print(f"{len(members)} members; {time.time() - start:.0f} s; results in {args.json}")
    print("all checks passed" if not failed else f"{failed} check(s) failed or not run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
