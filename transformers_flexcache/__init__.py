"""transformers-flexcache: a static KV cache allocated once at a maximum shape, serving any smaller one.

Importing this package changes nothing in transformers, and imports neither model code nor executorch; call
`register()` (or `convert(model)`) to opt in.

Package map, in the order modules import each other (details in docs/design.md):
- `cache/`: the caches (config, capacity, layers, lifecycle, containers, kind, placement); `cache.capacity.decide`
  is the one capacity decision of a call.
- generate: `request.py` (how a call asks for the flexible cache), `ownership.py` (the pool of caches a model holds,
  its capacity question, leases, `release`), `padding.py` (the shape policies), `plan.py` (`CallPlan`: one generate
  call, one object), `generation.py` (the generate door and upstream's hooks), `compilation.py` (the compiled path:
  `compile_config_for_cpu()`, `warmup()`), `quantization.py` (`quantize(model, "int8")`, CTranslate2's int8
  scheme for a compiled step on CPU).
- models: `modeling.py`, `generic.py` (override classes), `catalogue.py` (which ones exist), `registry.py`,
  `auto_classes.py`, `saved.py` (registration and saved folders); `model_overrides/` beside this package.
- `export/`: torch.export and ExecuTorch programs; `bench/`: the benchmark (nothing but the command line imports it).
- `serving/`: the in-flight engine; `server/`: its OpenAI-compatible HTTP server.
"""

from .cache import CacheConfig, FlexibleCrossAttentionCache, FlexibleEncoderDecoderCache, FlexibleStaticCache
from .ownership import held_nbytes, release
from .request import FLEXIBLE_STATIC

__version__ = "0.2.0"

# Loaded on first use (PEP 562), so that importing the package imports no model code.
_LAZY = {
    "register": "registry",
    "unregister": "registry",
    "convert": "registry",
    "compile_config_for_cpu": "compilation",
    "warmup": "compilation",
    "quantize": "quantization",
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
