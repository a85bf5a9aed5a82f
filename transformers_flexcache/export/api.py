"""The export entry points: an override model in, `ExportedPrograms` (runnable, lowerable) out."""

from __future__ import annotations

from torch import nn

from .modules import ExportableDecoderOnly, ExportableEncoderDecoder, export_programs
from .runners import ExportedPrograms


def export_encoder_decoder(
    model: nn.Module,
    *,
    max_batch_size: int,
    max_cache_len: int,
    max_encoder_len: int,
    encoder_input: str | None = None,
) -> ExportedPrograms:
    """Export an encoder-decoder override model: `encoder` and `text_decoder`, for every batch and encoder length
    that fits.

    Args:
        model: an override model (e.g. `FlexT5ForConditionalGeneration`), in eval mode.
        max_batch_size (`int`), max_cache_len (`int`), max_encoder_len (`int`): the capacities.
        encoder_input (`str`, *optional*): what `encoder` takes, as in `ExportableEncoderDecoder`: `"input_ids"`,
            `"input_features"` (Whisper; fixed encoder length), `"flattened_patches"` (Pix2Struct) or
            `"encoder_hidden_states"` (any model). Defaults to `model.main_input_name`.

    Returns:
        `ExportedPrograms`: runs the exported methods, and lowers them with `to_executorch`.

    Example:

    ```python
    >>> programs = export_encoder_decoder(model, max_batch_size=4, max_cache_len=32, max_encoder_len=64)
    >>> tokens = generate(programs, input_ids, attention_mask, max_new_tokens=16, decoder_start_token_id=0)
    >>> programs.to_executorch("t5.pte")
    ```
    """
    wrapper = ExportableEncoderDecoder(
        model,
        max_batch_size=max_batch_size,
        max_cache_len=max_cache_len,
        max_encoder_len=max_encoder_len,
        encoder_input=encoder_input,
    )
    return ExportedPrograms(wrapper, export_programs(wrapper))


def export_decoder_only(model: nn.Module, *, max_batch_size: int, max_cache_len: int) -> ExportedPrograms:
    """Export a decoder-only override model: `prefill`, `decode` and the LLM runner's `forward`.

    Args:
        model: an override model (e.g. `FlexLlamaForCausalLM`), in eval mode.
        max_batch_size (`int`), max_cache_len (`int`): the capacities.

    Returns:
        `ExportedPrograms`: runs the exported methods, and lowers them with `to_executorch`.
    """
    wrapper = ExportableDecoderOnly(model, max_batch_size=max_batch_size, max_cache_len=max_cache_len)
    return ExportedPrograms(wrapper, export_programs(wrapper))


def export_model(
    model: nn.Module,
    *,
    max_batch_size: int,
    max_cache_len: int,
    max_encoder_len: int | None = None,
    encoder_input: str | None = None,
) -> ExportedPrograms:
    """`export_encoder_decoder` or `export_decoder_only`, whichever `model` is.

    Raises:
        ValueError: `max_encoder_len` missing for an encoder-decoder model, or given for a decoder-only one.
    """
    if model.config.is_encoder_decoder:
        if max_encoder_len is None:
            raise ValueError(f"{type(model).__name__} is an encoder-decoder model; pass max_encoder_len")
        return export_encoder_decoder(
            model,
            max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
            max_encoder_len=max_encoder_len,
            encoder_input=encoder_input,
        )
    if max_encoder_len is not None or encoder_input is not None:
        raise ValueError(
            f"{type(model).__name__} is a decoder-only model: it takes no max_encoder_len or encoder_input"
        )
    return export_decoder_only(model, max_batch_size=max_batch_size, max_cache_len=max_cache_len)
