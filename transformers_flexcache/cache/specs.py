"""The `LayerSpec`s of a model's decoder, read from its config: layer types, kv heads and head dims, as upstream's
`StaticCache` sees them. `placement.py` refines them from the loaded model (devices, dtypes, tensor-parallel heads).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.configuration_utils import PreTrainedConfig, get_head_shapes

from .layers import LayerSpec
from .linear_attention import linear_attention_shapes, recurrent_dtype

# Layer types that FlexibleStaticCache holds: attention keys/values (of every position, or of a sliding window), or
# linear-attention (Mamba) conv/recurrent states.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_specs_from_config(
    config: PreTrainedConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> list[LayerSpec]:
    """One `LayerSpec` per decoder layer of `config`, every layer on `device` in `dtype`.

    Raises:
        ValueError: the decoder has layer types other than `SUPPORTED_LAYER_TYPES`, or no attention layer (upstream
            takes positions and masks from one), or linear-attention sizes the cache cannot read.
    """
    text_config = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    num_heads, head_dim = get_head_shapes(text_config)
    num_layers = len(layer_types)
    num_heads = num_heads if isinstance(num_heads, list) else [num_heads] * num_layers
    head_dim = head_dim if isinstance(head_dim, list) else [head_dim] * num_layers
    unsupported = sorted({layer_type for layer_type in layer_types if layer_type not in SUPPORTED_LAYER_TYPES})
    if unsupported:
        raise ValueError(
            f"layer types {unsupported} of {type(config).__name__} are not supported by FlexibleStaticCache, which "
            f"holds {list(SUPPORTED_LAYER_TYPES)} layers only"
        )
    if not set(ATTENTION_LAYER_TYPES) & set(layer_types):
        raise ValueError(
            f"{type(config).__name__} has no full-attention layer, nor a sliding-window one (layer types "
            f"{sorted(set(layer_types))}); FlexibleStaticCache needs at least one attention layer"
        )
    device = torch.device(device)
    specs = []
    for layer_type, kwargs, heads, dim in zip(layer_types, layer_kwargs, num_heads, head_dim, strict=True):
        if layer_type == "linear_attention":
            conv_shape, recurrent_shape = linear_attention_shapes(config)
            specs.append(
                LayerSpec(
                    layer_type=layer_type,
                    device=device,
                    dtype=dtype,
                    conv_shape=conv_shape,
                    recurrent_shape=recurrent_shape,
                    recurrent_dtype=recurrent_dtype(dtype),
                )
            )
        else:
            specs.append(
                LayerSpec(
                    layer_type=layer_type,
                    device=device,
                    dtype=dtype,
                    num_heads=heads,
                    k_head_dim=dim,
                    v_head_dim=dim,
                    sliding_window=kwargs.get("sliding_window") if layer_type == "sliding_attention" else None,
                )
            )
    return specs
