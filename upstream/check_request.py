"""The original request (one static cache allocated at a maximum shape serves smaller calls), run on transformers itself.

Run against transformers 5.25.0 with `upstream/series` applied, with transformers-flexcache NOT importable (this script
refuses to run if it is). For T5, BART, Whisper, Pix2Struct, Llama and Jamba, tiny seeded models (no download), eager
and sdpa:

1. *user cache*: the request's script ported to 5.25's constructors: one
   `EncoderDecoderCache(StaticCache(config, max_cache_len=200, max_batch_size=4), StaticCache(config, max_cache_len=170,
   max_batch_size=4))` (a single `StaticCache` for decoder-only models), `reset()` and passed as `past_key_values` to
   calls of batch 2, 4, 1, 3, 2 and encoder (or prompt) lengths 19, 170, 5, 64, 7;
2. *generate(cache_implementation="static")*: the same calls with `max_cache_len=200, max_encoder_len=170,
   max_batch_size=4` (PRs 6 and 8), a new cache per call, all of one shape;
3. *compiled decode step* (eager attention only): the user cache's calls again with the model's forward compiled
   (`torch._dynamo.testing.CompileCounter`, dynamic shapes) after the prefill: the number of graphs over the five
   calls of different batch and encoder length.

Each call's tokens must equal DynamicCache's (plain `generate`) and its logits agree within 1e-4. Every call passes
`use_cache=True`: Pix2Struct's configs default to False (PR 10 makes a passed cache count anyway). Whisper's encoder
output has one length (its input features are fixed), so only its batch varies. Prints one line per model, mode and
attention, and exits 1 if any check fails.

Usage: python upstream/check_request.py [--models t5,bart,...] [--attn eager,sdpa] [--no-compile]
"""

import argparse
import sys
import warnings

import upstream_only  # upstream/upstream_only.py, beside this script

upstream_only.refuse_flexcache()

import torch  # noqa: E402
import torch._dynamo.testing  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    BartConfig,
    BartForConditionalGeneration,
    EncoderDecoderCache,
    JambaConfig,
    JambaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Pix2StructConfig,
    Pix2StructForConditionalGeneration,
    StaticCache,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

CALLS = [(2, 19), (4, 170), (1, 5), (3, 64), (2, 7)]  # (batch size, encoder or prompt length)
MAX_BATCH_SIZE, MAX_CACHE_LEN, MAX_ENCODER_LEN = 4, 200, 170
NEW_TOKENS = 6
VOCAB = 100
PATCH_DIM = 2 + 4 * 4 * 3  # Pix2Struct: row and column ids, then a 4x4 RGB patch
MEL_BINS, MEL_FRAMES = 8, 32  # Whisper: input features (batch, mel bins, 2 * max_source_positions)


def _t5():
    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
            tie_word_embeddings=False,
        )
    )


def _bart():
    return BartForConditionalGeneration(
        BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=256,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_bos_token_id=None,
            forced_eos_token_id=None,
            tie_word_embeddings=False,
        )
    )


def _whisper():
    return WhisperForConditionalGeneration(
        WhisperConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_mel_bins=MEL_BINS,
            max_source_positions=MEL_FRAMES // 2,
            max_target_positions=256,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=3,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            tie_word_embeddings=False,
        )
    )


def _pix2struct():
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=32,
        patch_embed_hidden_size=PATCH_DIM - 2,
        d_kv=8,
        d_ff=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        seq_len=4096,
    )
    return Pix2StructForConditionalGeneration(
        Pix2StructConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    )


def _llama():
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
    )


def _jamba():
    return JambaForCausalLM(
        JambaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
    )


MODELS = {"t5": _t5, "bart": _bart, "whisper": _whisper, "pix2struct": _pix2struct, "llama": _llama, "jamba": _jamba}


def build(model_type: str, attn: str):
    """A tiny model whose weights are scaled up so that greedy decoding does not settle on one token."""
    torch.manual_seed(0)
    model = MODELS[model_type]()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and "norm" not in name:
                param.normal_(0.0, 0.3)
    model.set_attn_implementation(attn)
    model.generation_config.pad_token_id = model.config.get_text_config(decoder=True).pad_token_id
    return model.eval()


def inputs(model_type: str, batch_size: int, length: int, seed: int) -> dict:
    """Encoder (or prompt) inputs of one call; rows after the first are shorter (padded) where the model allows it."""
    gen = torch.Generator().manual_seed(seed)
    if model_type == "whisper":
        return {"input_features": torch.randn(batch_size, MEL_BINS, MEL_FRAMES, generator=gen)}
    mask = torch.ones(batch_size, length, dtype=torch.long)
    for row in range(1, batch_size):
        pad = (row * length) // (2 * batch_size)
        if model_type in ("llama", "jamba"):
            mask[row, :pad] = 0  # decoder-only: left padding
        else:
            mask[row, length - pad :] = 0
    if model_type == "pix2struct":
        patches = torch.randn(batch_size, length, PATCH_DIM, generator=gen)
        patches[:, :, 0] = torch.arange(length) // 8 + 1  # row ids
        patches[:, :, 1] = torch.arange(length) % 8 + 1  # column ids
        return {"flattened_patches": patches * mask[..., None], "attention_mask": mask}
    ids = torch.randint(3, VOCAB, (batch_size, length), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask}


def user_cache(model):
    config = model.config
    self_attention = StaticCache(config, max_cache_len=MAX_CACHE_LEN, max_batch_size=MAX_BATCH_SIZE)
    if not config.is_encoder_decoder:
        return self_attention
    cross_attention = StaticCache(config, max_cache_len=MAX_ENCODER_LEN, max_batch_size=MAX_BATCH_SIZE)
    return EncoderDecoderCache(self_attention, cross_attention)


def generate(model, call_inputs, **kwargs):
    """Greedy tokens and raw logits (batch, new tokens, vocab) of one call. `use_cache=True` for all: Pix2Struct's
    configs default to False, which would make the reference uncached and ignore `cache_implementation`."""
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
    return out.sequences, torch.stack(out.logits, dim=1)


def compare(reference, result) -> str | None:
    (ref_tokens, ref_scores), (tokens, scores) = reference, result
    if not torch.equal(ref_tokens, tokens):
        return f"tokens differ: {ref_tokens.tolist()} vs {tokens.tolist()}"
    diff = (ref_scores - scores).abs().max().item()
    return None if diff < 1e-4 else f"scores differ by {diff:.2e}"


def run_mode(model_type: str, attn: str, mode: str) -> tuple[int, int, str]:
    """Returns (calls equal to DynamicCache, calls, note) for one model, attention and mode."""
    model = build(model_type, attn)
    cache = user_cache(model) if mode in ("user cache", "compiled") else None
    counter = None
    if mode == "compiled":
        counter = torch._dynamo.testing.CompileCounter()
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend=counter, dynamic=True)
    passed, notes = 0, []
    for seed, (batch_size, length) in enumerate(CALLS):
        call_inputs = inputs(model_type, batch_size, length, seed)
        reference = generate(model, call_inputs)
        try:
            if mode == "static":
                result = generate(
                    model,
                    call_inputs,
                    cache_implementation="static",
                    max_cache_len=MAX_CACHE_LEN,
                    max_encoder_len=MAX_ENCODER_LEN,
                    max_batch_size=MAX_BATCH_SIZE,
                )
            else:
                cache.reset()
                if mode == "compiled":
                    result = decode_compiled(model, compiled, call_inputs, cache, reference[0])
                else:
                    result = generate(model, call_inputs, past_key_values=cache)
            problem = compare(reference, result)
        except Exception as error:  # report every call, not only the first failure
            problem = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if problem is None:
            passed += 1
        else:
            notes.append(f"call {seed + 1} (batch {batch_size}, length {length}): {problem}")
    if counter is not None:
        notes.insert(0, f"{counter.frame_count} compiled graph(s) for {len(CALLS)} calls")
    return passed, len(CALLS), "; ".join(notes)


def decode_compiled(model, compiled_forward, call_inputs, cache, reference_tokens):
    """Decoding by hand along DynamicCache's tokens: the prefill eager, every decode step through `compiled_forward`.
    Returns DynamicCache's tokens and the logits of each step."""
    kwargs = {"cache": cache, "use_cache": True}
    if model.config.is_encoder_decoder:
        kwargs["encoder_outputs"] = model.get_encoder()(**{k: v for k, v in call_inputs.items()})
        if "attention_mask" in call_inputs:
            kwargs["attention_mask"] = call_inputs["attention_mask"]
        start = model.generation_config.decoder_start_token_id
        ids = torch.full((next(iter(call_inputs.values())).shape[0], 1), start, dtype=torch.long)
        step_inputs = {"decoder_input_ids": ids}
        positions = None
    else:
        ids, mask = call_inputs["input_ids"], call_inputs["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        kwargs["attention_mask"] = mask
        step_inputs = {"input_ids": ids, "position_ids": positions}
    scores = []
    new_tokens = reference_tokens[:, -NEW_TOKENS:]
    forward = model.forward
    with torch.no_grad():
        for step in range(NEW_TOKENS):
            logits = forward(**step_inputs, **kwargs).logits[:, -1].float()
            forward = compiled_forward
            scores.append(logits)
            next_tokens = new_tokens[:, step : step + 1]
            if model.config.is_encoder_decoder:
                step_inputs = {"decoder_input_ids": next_tokens}
            else:
                kwargs["attention_mask"] = torch.cat([kwargs["attention_mask"], torch.ones_like(next_tokens)], dim=-1)
                positions = positions[:, -1:] + 1
                step_inputs = {"input_ids": next_tokens, "position_ids": positions}
    return reference_tokens, torch.stack(scores, dim=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--attn", default="eager,sdpa")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    print(f"transformers {transformers.__version__} ({transformers.__file__}), torch {torch.__version__}")
    failed = 0
    for model_type in args.models.split(","):
        runs = [(attn, mode) for attn in args.attn.split(",") for mode in ("user cache", "static")]
        if not args.no_compile:
            runs.append(("eager", "compiled"))
        for attn, mode in runs:
            passed, total, note = run_mode(model_type, attn, mode)
            failed += passed != total
            status = "ok" if passed == total else "FAIL"
            print(f"{model_type:<11} {attn:<6} {mode:<11} {passed}/{total} calls equal DynamicCache  {status}  {note}")
    print("all checks passed" if not failed else f"{failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
