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
import importlib.abc
import json
import os
import sys
import time
import warnings


class _RefuseFlexcache(importlib.abc.MetaPathFinder):
    """The check is about upstream alone: importing this package's code would invalidate it."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers_flexcache", "model_overrides"):
            raise ImportError(f"{name} imported during the upstream check; run it without transformers-flexcache")
        return None


# Off the path too: an editable install puts this repository's root on it
sys.path[:] = [entry for entry in sys.path if not os.path.isdir(os.path.join(entry or ".", "transformers_flexcache"))]
sys.meta_path.insert(0, _RefuseFlexcache())

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
PAD, BOS, EOS, START = 1, 0, 2, 2  # first ids of the vocabulary; inputs are drawn from [3, VOCAB)

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
    return config_cls(**{key: value for key, value in SMALL.items() if key in names}, **overrides)


# ---------------------------------------------------------------------------------------------------------------------
# Members: how to build each one and its inputs. Keys are (model type, class name) of the mappings.


def text_inputs(batch_size: int, length: int, gen) -> dict:
    """input_ids and attention_mask; rows after the first are right-padded to shorter lengths."""
    mask = padding_mask(batch_size, length)
    ids = torch.randint(3, VOCAB, (batch_size, length), generator=gen) * mask + PAD * (1 - mask)
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

    def __init__(self, build, inputs=text_inputs, fixed_encoder_len=False, no_static=None):
        self.build = build  # () -> model, on the default seed
        self.inputs = inputs  # (batch_size, length, generator) -> dict of generate's inputs
        self.fixed_encoder_len = fixed_encoder_len  # the encoder output has one length whatever the input
        self.no_static = no_static  # why the member has no static cache in 5.25.0, or None


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
        )
    ),
    ("fsmt", "FSMTForConditionalGeneration"): Member(
        _plain("FSMTForConditionalGeneration", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, langs=["ru", "en"])
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
        fixed_encoder_len=True,
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
}


def family() -> list[tuple[str, str, list[str]]]:
    """(model type, class name, mappings) of every encoder-decoder generative class of the tree's auto mappings."""
    members = {}
    for mapping_name in MAPPINGS:
        for model_type, class_name in getattr(modeling_auto, mapping_name).items():
            if isinstance(class_name, (list, tuple)):
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
    return out.sequences, torch.stack(out.logits, dim=1).float()


def compare(reference, result) -> str | None:
    (ref_tokens, ref_logits), (tokens, logits) = reference, result
    if ref_tokens.shape != tokens.shape or not torch.equal(ref_tokens, tokens):
        rows = [row for row in range(min(len(ref_tokens), len(tokens))) if not torch.equal(ref_tokens[row], tokens[row])]
        return f"tokens differ (rows {rows}): {ref_tokens[rows[:1]].tolist()} vs {tokens[rows[:1]].tolist()}"
    scale = max(1.0, ref_logits.abs().max().item())
    diff = (ref_logits - logits).abs().max().item()
    return None if diff <= 1e-4 * scale else f"logits differ by {diff:.2e} (largest {scale:.1f})"


def _error(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:200]}"


def encoder_len(model, call_inputs) -> int:
    encoder_inputs = {key: value for key, value in call_inputs.items() if key != "attention_mask"}
    if "attention_mask" in call_inputs and "input_features" not in call_inputs:
        encoder_inputs["attention_mask"] = call_inputs["attention_mask"]
    with torch.no_grad():
        return model.get_encoder()(**encoder_inputs)[0].shape[1]


def run_check(model, member: Member, check: str) -> tuple[int, int, str]:
    """(calls equal to DynamicCache, calls, notes) of one check on one built model."""
    calls = STATIC_CALLS if check == "static" else USER_CALLS
    cache = None
    passed, notes = 0, []
    for seed, (batch_size, length) in enumerate(calls):
        call_inputs = member.inputs(batch_size, length, torch.Generator().manual_seed(seed))
        try:
            reference = generate(model, call_inputs)
        except Exception as error:
            return passed, len(calls), f"DynamicCache reference failed: {_error(error)}"
        try:
            if check == "static":
                result = generate(model, call_inputs, cache_implementation="static")
            else:
                if cache is None:  # sized by the first call, the longest encoder input
                    config = model.config
                    cache = EncoderDecoderCache(
                        StaticCache(config, max_cache_len=MAX_CACHE_LEN, max_batch_size=MAX_BATCH_SIZE),
                        StaticCache(
                            config, max_cache_len=encoder_len(model, call_inputs), max_batch_size=MAX_BATCH_SIZE
                        ),
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated model types (default: the whole family)")
    parser.add_argument("--attn", default="eager,sdpa")
    parser.add_argument("--checks", default="static,user", help="static: check (a); user: check (b)")
    parser.add_argument("--json", default="check_family.json", help="where to write the results")
    parser.add_argument("--list", action="store_true", help="print the family and exit")
    args = parser.parse_args(argv)
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
        if member is None or member.no_static:
            status = "not checked" if member is None else "no static cache"
            reason = "check_family.py has no tiny config for it" if member is None else member.no_static
            failed += member is None
            results.append({**row, "status": status, "reason": reason})
            print(f"{model_type:<22} {class_name:<44} {'-':<6} {'-':<7} {status.upper()}: {reason}")
            continue
        for attn in args.attn.split(","):
            try:
                model = build(member, attn)
            except Exception as error:
                failed += 1
                results.append({**row, "attn": attn, "status": "not checked", "reason": f"build: {_error(error)}"})
                print(f"{model_type:<22} {class_name:<44} {attn:<6} {'-':<7} NOT CHECKED: build: {_error(error)}")
                continue
            for check in checks:
                tic = time.time()
                passed, total, notes = run_check(model, member, check)
                ok = passed == total
                failed += not ok
                results.append(
                    {**row, "attn": attn, "check": check, "passed": passed, "calls": total,
                     "status": "ok" if ok else "FAIL", "notes": notes, "seconds": round(time.time() - tic, 2)}
                )  # fmt: skip
                print(f"{model_type:<22} {class_name:<44} {attn:<6} {check:<7} {passed}/{total} {'ok' if ok else 'FAIL'}"
                      f"  {notes}", flush=True)  # fmt: skip
    with open(args.json, "w") as handle:
        json.dump(
            {"transformers": transformers.__version__, "path": transformers.__file__, "torch": torch.__version__,
             "seconds": round(time.time() - start, 1), "results": results},
            handle, indent=1,
        )  # fmt: skip
    print(f"{len(members)} members; {time.time() - start:.0f} s; results in {args.json}")
    print("all checks passed" if not failed else f"{failed} check(s) failed or not run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
