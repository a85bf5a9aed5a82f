"""The compile cache's old import path (`transformers_flexcache.compile.warm_start`), kept so that code written
against it keeps working: the compile cache is `compile/caching.py`, and its public names come from the wing's face,
`from transformers_flexcache.compile import compile_cache, default_cache_dir, WarmStart`."""

from .caching import WarmStart, compile_cache, default_cache_dir, model_facts

__all__ = ["WarmStart", "compile_cache", "default_cache_dir", "model_facts"]
