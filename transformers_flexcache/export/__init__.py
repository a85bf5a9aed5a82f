"""Export a model with the flexible cache as registered buffers: one program for every batch and length that fits.

Shape legend:
    B        batch of the call, at most `max_batch_size` (B_max)
    S        new tokens of the call
    L_enc    encoder length of the call, at most `max_encoder_len` (L_enc_max)
    L_max    `max_cache_len`: decoder positions held per row
    H, D     key/value heads and head dim of a decoder layer
    V        vocabulary

Methods (torch `ExportedProgram`s, or the methods of one ExecuTorch `.pte`); every tensor is int64 except the float
encoder inputs and the logits:
    encoder-decoder  ExecuTorch's names (its Whisper export and ASR runner):
                     `encoder(encoder_input [, attention_mask [B, L_enc]]) -> encoder_hidden_states [B, L_enc, d]`
                     starts a sequence for rows [:B]: it runs the encoder and writes every decoder layer's
                     cross-attention keys/values of those rows, and zeroes their self-attention rows.
                     `text_decoder(decoder_input_ids [B, 1], encoder_hidden_states [B, L_enc, d], cache_position [1]
                     [, encoder_attention_mask [B, L_enc]]) -> logits [B, 1, V]` runs one decoder token per row,
                     reading the cross-attention keys/values that `encoder` wrote (only the shape of
                     `encoder_hidden_states` is read: they are never projected again). The encoder input
                     (`encoder_input=` at export) is `input_ids [B, L_enc]` (T5, BART), `input_features
                     [B, num_mel_bins, 2 * L_enc]` (Whisper; `L_enc` fixed at `max_source_positions`, and then
                     neither method takes a mask: ExecuTorch's ASR runner calls them so), `flattened_patches
                     [B, L_enc, 2 + patch]` (Pix2Struct) or `encoder_hidden_states [B, L_enc, d]` (any model).
    decoder-only     `forward(tokens [B, S], cache_position [S]) -> logits [B, S, V]` is ExecuTorch's LLM-runner
                     method (`TextLLMRunner`), on rows [:B]: it runs S tokens per row at positions `cache_position`
                     under each row's mask over the cache positions (the buffer `sequence_mask [B_max, L_max]`),
                     with position ids counted from that mask as `generate` counts them. `start(attention_mask
                     [B, L_max]) -> [B]` starts sequences on rows [:B]: it zeroes their cache rows and sets their
                     masks (a left-padded prompt's zeros). The `.pte` holds the mask as all ones, so that the LLM
                     runner, which never calls `start`, finds row 0 unpadded; a `forward` at position 0 zeroes row 0.
                     The runners' `prefill` and `decode` are `start` then `forward`, and `forward` again.

Design decisions:
- The wrapper module owns the cache as registered buffers, allocated once at the maximum shape; ExecuTorch plans
  them once and shares them between the methods (`share_mutable_buffers=True`): what one method writes, the others
  read, and everything persists between calls. Layout in `cache/buffer_views.py`: packed 2-d buffers written in place.
- Each call builds a `FlexibleEncoderDecoderCache` (or `FlexibleStaticCache`) over views of those buffers and runs
  the model's own forward, so the override's `update` / `get_kv` path writes and reads the cache and logits come
  from the model's own head (T5's `d_model**-0.5` output scaling is kept).
- Batch, encoder length and prompt tokens are dynamic dimensions (`torch.export.Dim` bounded by the capacities);
  `text_decoder` takes one token (a static dimension). One decoder-only method of the model, `forward`, serves the
  prompt, every step and ExecuTorch's LLM runner: lowering time goes per method (a third of that of three).
- Self-attention positions are an input tensor, `cache_position`, as in upstream's `StaticCache`: new keys/values
  are written at those positions, and attention reads the whole row `[:B, :, :L_max]` under the causal mask that the
  model builds from `cache_position[0]` (`get_seq_length()`). A sequence starts by `encoder` / `start` (or
  `forward` at position 0, for row 0), which zero the rows first: ExecuTorch does not initialize mutable buffers,
  and a masked slot must still hold a finite value (a NaN there would survive the mask).
- While the model is traced, `rewrites.export_friendly` gives it an eager attention and norms in ops that XNNPACK
  delegates (same math, float sums in another order).
- Capacities and inputs are checked in Python by the runners (`ExportedPrograms`, `ExecuTorchPrograms`) before a
  program runs: a `ValueError` names the value, the limit and the fix.

Layout: `../cache/buffer_views.py` (the cache objects of one call, in the cache package: they subclass its layers), `rewrites.py` (export-time attention and norms, an edge
pass), `modules.py` (the traced wrappers), `api.py` (export functions), `runners.py` (checks, torch and ExecuTorch
execution), `lowering.py` (the `.pte`), `quantize.py` (torchao), `decoding.py` (greedy and sampling: `generate`), `cli.py`
(`python -m transformers_flexcache export`), `measure.py` (timings against eager and transformers' exporter).
"""

# Loaded on first use (PEP 562), so that `python -m transformers_flexcache export --help` imports no model code.
_LAZY = {
    "ENCODER_INPUTS": "modules",
    "ExecuTorchPrograms": "runners",
    "ExportableDecoderOnly": "modules",
    "ExportableEncoderDecoder": "modules",
    "ExportedPrograms": "runners",
    "ProgramRunner": "runners",
    "export_decoder_only": "api",
    "export_encoder_decoder": "api",
    "export_model": "api",
    "export_programs": "modules",
    "generate": "decoding",
    "greedy_generate": "decoding",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
