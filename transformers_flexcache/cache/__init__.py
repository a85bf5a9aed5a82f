"""The flexible static cache: storage allocated once at a maximum shape, serving any smaller batch and length.

Layout (one job per file):
- `config.py`: `CacheConfig`, the settings of `cache_implementation="flexible_static"`, parsed and checked once; the
  overflow message.
- `layers.py`: attention storage of one layer, exact and padded (`LayerSpec`: what a layer holds, and where).
- `sliding.py`: sliding-window attention storage of one layer (the last positions of each row), exact and padded.
- `linear_attention.py`: Mamba conv/recurrent storage of one layer, and its shapes.
- `specs.py`: a decoder's layer specs from its config; `placement.py`: refined from the loaded model (devices,
  tensor-parallel heads, dtypes).
- `containers.py`: the self-attention, cross-attention and encoder-decoder caches, which alone decide capacity and
  growth.
- `seats.py`: the serving engine's seat caches, each row ("seat") with a length of its own.
- `buffer_views.py`: caches over an export wrapper's buffers, built for one call of an exported program (used by
  `transformers_flexcache.export` only).
"""

from .config import CacheConfig, Overflow, overflow_message
from .containers import (
    FlexibleCrossAttentionCache,
    FlexibleEncoderDecoderCache,
    FlexibleStaticCache,
    is_flexible_cache,
    plan_capacities,
)
from .layers import FlexiblePaddedLayer, FlexibleStaticLayer, LayerSpec
from .linear_attention import FlexibleLinearAttentionLayer, FlexiblePaddedLinearAttentionLayer
from .placement import layer_specs_for_model
from .seats import FlexibleSeatCache, FlexibleSeatEncoderDecoderCache
from .sliding import FlexiblePaddedSlidingWindowLayer, FlexibleSlidingWindowLayer
from .specs import layer_specs_from_config

__all__ = [
    "CacheConfig",
    "FlexibleCrossAttentionCache",
    "FlexibleEncoderDecoderCache",
    "FlexibleLinearAttentionLayer",
    "FlexiblePaddedLayer",
    "FlexiblePaddedLinearAttentionLayer",
    "FlexiblePaddedSlidingWindowLayer",
    "FlexibleSeatCache",
    "FlexibleSeatEncoderDecoderCache",
    "FlexibleSlidingWindowLayer",
    "FlexibleStaticCache",
    "FlexibleStaticLayer",
    "LayerSpec",
    "Overflow",
    "has_cross_attention_kv",
    "is_flexible_cache",
    "layer_specs_for_model",
    "layer_specs_from_config",
    "overflow_message",
    "plan_capacities",
]


def has_cross_attention_kv(cache) -> bool:
    """Whether `cache` answers `cross_attention_kv` (the encoder-decoder caches of this package): the overrides then
    read cross-attention keys and values through it instead of upstream's `is_updated` flags."""
    return isinstance(cache, (FlexibleEncoderDecoderCache, FlexibleSeatEncoderDecoderCache))
