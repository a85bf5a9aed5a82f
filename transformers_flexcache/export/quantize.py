"""Weight quantization before export, with torchao, in the forms that ExecuTorch's XNNPACK backend runs.

Design decisions:
- Modes follow ExecuTorch's LLM export (`--qlinear`): `8da4w` is int8 dynamic activations with int4 weights in
  groups of 32 along the input dim (`Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
  PerGroup(32))`); `int8` is int8 dynamic activations with int8 weights per output channel (`8da8w`:
  `Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, PerAxis(0))`). XNNPACK runs both as dynamically
  quantized linears (`qd8-f32-qb4w` / `qd8-f32-qc8w` kernels); activations stay fp32 between linears.
- Only `nn.Linear` layers are quantized (embeddings and norms stay as they are), in place, before `torch.export`.
  A linear whose input width is not a multiple of the group size stays fp32 (torchao would refuse it), and so does
  an output layer tied to the input embeddings (the embedding lookup would read the quantized tensor).
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZE_MODES = ("none", "8da4w", "int8")
GROUP_SIZE = 32  # 8da4w: weights per scale, as ExecuTorch's default


def check_quantize(mode: str, backend: str) -> None:
    """Raise `ValueError` for an unknown mode, or a quantized mode without XNNPACK (no portable kernels for it)."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize={mode!r} is not one of {QUANTIZE_MODES}")
    if mode != "none" and backend != "xnnpack":
        raise ValueError(
            f"quantize={mode!r} needs backend='xnnpack': ExecuTorch's portable kernels have no dynamically quantized "
            "linear; pass --backend xnnpack, or --quantize none"
        )


def _config(mode: str):
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig

    if mode == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP_SIZE))
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))


def quantize_model_(model: nn.Module, mode: str) -> int:
    """Quantize the linear layers of `model` in place for `mode` (`"none"`, `"8da4w"`, `"int8"`).

    Returns:
        `int`: how many linear layers were quantized.

    Raises:
        ValueError: an unknown `mode`.
        ImportError: torchao is not installed.
    """
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize={mode!r} is not one of {QUANTIZE_MODES}")
    if mode == "none":
        return 0
    try:
        from torchao.quantization.quant_api import quantize_
    except ImportError as error:
        raise ImportError(f"quantize={mode!r} needs torchao: pip install torchao") from error

    quantized = []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def fits(module: nn.Module, name: str) -> bool:
        ok = (
            isinstance(module, nn.Linear)
            and id(module.weight) not in embeddings
            and (mode != "8da4w" or module.in_features % GROUP_SIZE == 0)
        )
        if ok:
            quantized.append(name)
        return ok

    quantize_(model, _config(mode), filter_fn=fits)
    return len(quantized)
