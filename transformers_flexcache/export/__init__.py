"""Export a model with the flexible cache as registered buffers: one program for every batch and length that fits.

Shape legend:
    B        batch of the call, at most `max_batch_size` (B_max)
    S        new decoder tokens of the call (a prefill of several tokens, or one step)
    L_enc    encoder length of the call, at most `max_encoder_len` (L_enc_max)
    L_max    `max_cache_len`: decoder positions held per row
    H, D     key/value heads and head dim of a decoder layer
    V        vocabulary

Programs, `prefill` and `decode` (two `torch.export.ExportedProgram`s, or two methods of one ExecuTorch `.pte`):
    encoder-decoder  `prefill(encoder input, attention_mask [B, L_enc], decoder_input_ids [B, S],
                     cache_position [S]) -> logits [B, S, V]` runs the encoder, writes its output and the
                     cross-attention keys/values of rows [:B], then the first decoder tokens. The encoder input
                     (`encoder_input=` at export) is `input_ids [B, L_enc]` (T5, BART), `input_features
                     [B, num_mel_bins, 2 * L_enc]` (Whisper; `L_enc` fixed at `max_source_positions`) or
                     `encoder_hidden_states [B, L_enc, d_model]` (any model: the encoder is not in the program).
                     `decode(decoder_input_ids [B, S], cache_position [S], encoder_attention_mask [B, L_enc])
                     -> logits [B, S, V]` runs the next decoder tokens, reading the cross-attention keys/values that
                     `prefill` wrote (they are never recomputed).
    decoder-only     `prefill` and `decode`, both `(input_ids [B, S], attention_mask [B, L_max], position_ids [B, S],
                     cache_position [S]) -> logits [B, S, V]`; `attention_mask` covers every cache position.

Design decisions:
- The wrapper module owns the cache as registered buffers, allocated once at the maximum shape: per decoder layer,
  self-attention keys/values `[B_max, H, L_max, D]`, and for encoder-decoder models cross-attention keys/values
  `[B_max, H, L_enc_max + 1, D]` and the encoder output `[B_max, L_enc_max + 1, d_model]`. ExecuTorch plans them
  once and shares them between the two methods (`share_mutable_buffers=True`): what `prefill` writes, `decode`
  reads, and everything persists between calls.
- Each call builds a `FlexibleEncoderDecoderCache` (or `FlexibleStaticCache`) over views of those buffers and runs
  the model's own forward. So the model's own code (our override's `update` / `get_kv` path) writes and reads the
  cache, and logits come from the model's own head: T5's `d_model**-0.5` output scaling is kept.
- Batch, encoder length and new decoder tokens are dynamic dimensions (`torch.export.Dim` bounded by the
  capacities). Cross-attention views are exact, `[:B, :, :L_enc]`, `L_enc` being read from the shape of the encoder
  attention mask, so the cross-attention mask covers exactly the call's encoder positions. The one spare encoder
  position is never used: it makes such a view non-contiguous for every `L_enc`, which keeps `torch.export` from
  specializing the program on `L_enc == max_encoder_len` when it traces a matmul on it.
- Self-attention positions are an input tensor, `cache_position`, as in upstream's `StaticCache`: new keys/values
  are written with `index_copy_` at those positions, and attention reads the whole row `[:B, :, :L_max]` under the
  causal mask that the model builds from `cache_position[0]` (`get_seq_length()`). A sequence restarts by calling
  `prefill` again from position 0: there is no reset program. `prefill` zeroes the call's rows of the
  self-attention buffers first, because ExecuTorch does not initialize mutable buffers and a masked slot must still
  hold a finite value (a NaN there would survive the mask).
- What differs between encoder-decoder models is confined to the wrapper's encoder entry: which keyword feeds the
  encoder, and which one masks cross-attention (`attention_mask` for T5 and BART; `encoder_attention_mask` for
  Whisper, whose encoder takes no mask and whose override adds the decoder's cross mask). Everything else (buffers,
  cache views, decode) is shared.
- Capacities and inputs are checked in Python by the runners (`ExportedPrograms`, `ExecuTorchPrograms`) before a
  program runs: a `ValueError` names the value, the limit and the fix, instead of a kernel error or an
  out-of-bounds write.

Layout: `cache_views.py` (the cache objects of one call), `modules.py` (the traced wrappers and the export
functions), `runners.py` (checks, torch and ExecuTorch execution, `greedy_generate`).
"""

from .cache_views import (
    BufferViewCrossAttentionCache,
    BufferViewEncoderDecoderCache,
    BufferViewLayer,
    PositionedCache,
    PositionedLayer,
)
from .modules import (
    ExportableDecoderOnly,
    ExportableEncoderDecoder,
    export_decoder_only,
    export_encoder_decoder,
    export_programs,
)
from .runners import ExecuTorchPrograms, ExportedPrograms, ProgramRunner, greedy_generate

__all__ = [
    "BufferViewCrossAttentionCache",
    "BufferViewEncoderDecoderCache",
    "BufferViewLayer",
    "ExecuTorchPrograms",
    "ExportableDecoderOnly",
    "ExportableEncoderDecoder",
    "ExportedPrograms",
    "PositionedCache",
    "PositionedLayer",
    "ProgramRunner",
    "export_decoder_only",
    "export_encoder_decoder",
    "export_programs",
    "greedy_generate",
]
