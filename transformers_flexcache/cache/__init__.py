"""The flexible static cache: storage allocated once at a maximum shape, serving any smaller batch and length.

Layout (one job per file):
- `config.py`: `CacheConfig`, the settings of `cache_implementation="flexible_static"`, parsed and checked once; the
  overflow message.
- `capacity.py`: a call's `Need`, and `decide`: the one capacity decision of a call (a `Reservation`).
- `layers.py`: attention storage of one layer, exact, padded and bucketed (`LayerSpec`: what a layer holds, and
  where).
- `sliding.py`: sliding-window attention storage of one layer (the last positions of each row), exact, padded and
  bucketed.
- `linear_attention.py`: Mamba conv/recurrent storage of one layer, its shapes, and the cache's state accessors.
- `specs.py`: a decoder's layer specs from its config; `placement.py`: refined from the loaded model (devices,
  tensor-parallel heads, dtypes).
- `lifecycle.py`: what every flexible cache does with its storage (reserve, renew, stale, free, detach, bytes).
- `layer_cache.py`: a cache of layers (live batch and length, growth, `get_kv`/`update`), shared by the two below.
- `containers.py`: the self-attention, cross-attention and encoder-decoder caches.
- `kind.py`: `CacheKind`, what tells caches apart in a pool, and `build()`.
- `seats.py`: the serving engine's seat caches, each row ("seat") with a length of its own.
- `state.py`: a cache's objects and tensors in one fixed order (`state_objects`, `tensor_slots`), for the compiled
  artifacts that hand a cache to a graph as tensors.
- `buffer_views.py`: caches over an export wrapper's buffers, built for one call of an exported program (used by
  `transformers_flexcache.export` only).
"""

from .capacity import Need, Reservation, decide, plan_capacities
from .config import CacheConfig, Overflow, overflow_message
from .containers import (
    FlexibleCrossAttentionCache,
    FlexibleEncoderDecoderCache,
    FlexibleStaticCache,
    is_flexible_cache,
)
from .kind import CacheKind
from .layers import FlexiblePaddedLayer, FlexibleStaticLayer, LayerSpec
from .linear_attention import FlexibleLinearAttentionLayer, FlexiblePaddedLinearAttentionLayer
from .placement import layer_specs_for_model
from .seats import FlexibleSeatCache, FlexibleSeatEncoderDecoderCache
from .sliding import FlexiblePaddedSlidingWindowLayer, FlexibleSlidingWindowLayer
from .specs import layer_specs_from_config
from .state import NOT_READ_BY_A_STEP, state_objects, tensor_slots

__all__ = [
    "CacheConfig",
    "CacheKind",
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
    "NOT_READ_BY_A_STEP",
    "Need",
    "Overflow",
    "Reservation",
    "decide",
    "has_cross_attention_kv",
    "is_flexible_cache",
    "layer_specs_for_model",
    "layer_specs_from_config",
    "overflow_message",
    "plan_capacities",
    "state_objects",
    "tensor_slots",
]


def has_cross_attention_kv(cache) -> bool:
    """Whether `cache` answers `cross_attention_kv` (the encoder-decoder caches of this package): the overrides then
    read cross-attention keys and values through it instead of upstream's `is_updated` flags."""
    return isinstance(cache, (FlexibleEncoderDecoderCache, FlexibleSeatEncoderDecoderCache))
