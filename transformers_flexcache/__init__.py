"""transformers-flexcache: a static KV cache allocated once at a maximum shape, serving any smaller one.

Importing this package changes nothing in transformers; call `register()` (or `convert(model)`) to opt in.
"""

from .cache import FlexibleCrossAttentionCache, FlexibleEncoderDecoderCache, FlexibleStaticCache
from .generation import FLEXIBLE_STATIC, get_flexible_cache
from .registry import convert, register, unregister

__all__ = [
    "FLEXIBLE_STATIC",
    "FlexibleCrossAttentionCache",
    "FlexibleEncoderDecoderCache",
    "FlexibleStaticCache",
    "convert",
    "get_flexible_cache",
    "register",
    "unregister",
]

__version__ = "0.1.0"
