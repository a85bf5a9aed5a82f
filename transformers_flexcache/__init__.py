"""transformers-flexcache: a static KV cache allocated once at a maximum shape, serving any smaller one.

Importing this package changes nothing in transformers, and imports neither model code nor executorch; call
`register()` (or `convert(model)`) to opt in.

The package is four wings, imports going one way (docs/design.md opens with the map; `tests/test_layout.py` checks it):
- `cache/`: the caches (config, capacity, layers, lifecycle, containers, kind, placement, seats);
  `cache.capacity.decide` is the one capacity decision of a call.
- `generate/`: the flexible_static generate path (request, plan, mixin, pool, policies, padded calls) and
  `generate/hooks.py`, the one seam through which a call asks its plug-ins.
- `compile/`: the CPU compile stack behind one face (`compile/__init__.py`'s `__all__`, the only door the other wings
  use), every private torch name of the package (`compile_config_for_cpu()`, `warmup()`, `quantize(model, "int8")`, the
  graph passes, the compiled encoder, the CPU's facts), and its answers to generate's hooks; `models/`: override
  classes and registration (`model_overrides/` beside the package).
- `serving/` (the in-flight engine, whose request seats answer generate's hooks) and `export/` (torch.export and
  ExecuTorch programs); `server/` (its OpenAI-compatible HTTP server) and `bench/` (the benchmark: nothing but the
  command line imports it).
"""

from ._version import __version__ as __version__
from .cache import CacheConfig, FlexibleCrossAttentionCache, FlexibleEncoderDecoderCache, FlexibleStaticCache
from .generate.pool import held_nbytes, release
from .generate.request import FLEXIBLE_STATIC

# Loaded on first use (PEP 562), so that importing the package imports no model code.
_LAZY = {
    "register": "models.registry",
    "unregister": "models.registry",
    "convert": "models.registry",
    "compile_config_for_cpu": "compile",
    "warmup": "compile",
    "quantize": "compile",
}

__all__ = [
    "FLEXIBLE_STATIC",
    "CacheConfig",
    "FlexibleCrossAttentionCache",
    "FlexibleEncoderDecoderCache",
    "FlexibleStaticCache",
    "compile_config_for_cpu",
    "convert",
    "held_nbytes",
    "quantize",
    "register",
    "release",
    "unregister",
    "warmup",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
