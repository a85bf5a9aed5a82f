"""transformers-flexcache: a static KV cache allocated once at a maximum shape, serving any smaller one.

Importing this package changes nothing in transformers, and imports neither model code nor executorch; call
`register()` (or `convert(model)`) to opt in.

Package map (details in docs/design.md):
- `cache/`: the caches (config, layers, containers, placement); they alone decide capacity and growth.
- `request.py`: how a generate call asks for the flexible cache; `generation.py`: what a call needs, and taking a
  cache for it; `ownership.py`: the pool of caches a model holds, leases, `release`.
- `padding.py`: the shape policies (what the fixed-shape modes add around `generate`); `compilation.py`: the
  compiled path (`compile_config_for_cpu()`, `warmup()`); `quantization.py`: `quantize(model, "int8")`, CTranslate2's
  int8 scheme for a compiled step on CPU.
- `registry.py`, `modeling.py`, `auto_classes.py`, `saved.py`: registration, override models, saved folders.
- `export/`: torch.export and ExecuTorch programs; `bench/`: the benchmark (nothing else imports it).
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
