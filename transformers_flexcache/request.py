"""How a `generate` call asks for the flexible cache: the name, the saved form, and the resolved request.

A call asks with `cache_implementation="flexible_static"` (in its kwargs or its `generation_config`) and a
`cache_config`. A saved generation config holds the request as a custom entry, `flexible_static={...}` (its value
is the `cache_config`), which upstream neither validates nor reads: a folder saved that way loads in plain
transformers, which then uses its default cache.
"""

from __future__ import annotations

import copy

from .cache import CacheConfig

FLEXIBLE_STATIC = "flexible_static"
# The GenerationConfig entry that holds a saved request: its value is the `cache_config` (a dict, maybe empty).
SAVED_REQUEST_KEY = "flexible_static"
# A valid upstream name that stands in for ours while upstream merges and validates generation configs.
STAND_IN = "static"


def requested_cache_config(generation_config) -> CacheConfig | None:
    """The `CacheConfig` if a resolved generation config asks for `flexible_static`, else None."""
    if getattr(generation_config, "cache_implementation", None) != FLEXIBLE_STATIC:
        return None
    return CacheConfig.parse(generation_config.cache_config)


def normalize_saved_form(config) -> None:
    """Rewrite a request for `flexible_static` in `config` (in place) into its saved form.

    `cache_implementation="flexible_static"` (and its `cache_config`) becomes the custom entry `flexible_static={...}`,
    which means the same to this package, and which upstream neither validates nor reads: a folder saved with it loads
    in plain transformers (which then uses its default cache). Idempotent.
    """
    if getattr(config, "cache_implementation", None) == FLEXIBLE_STATIC:
        setattr(config, SAVED_REQUEST_KEY, CacheConfig.parse(config.cache_config).to_dict())
        config.cache_implementation = None
        config.cache_config = None
    if getattr(config, SAVED_REQUEST_KEY, None) is not None:
        # Upstream's loader drops custom entries of a config it marks as made from the model config; this one no longer
        # is only that.
        config._from_model_config = False


def asks_for_flexible(config) -> bool | None:
    """Whether a generation config asks for flexible_static (True), for another cache (False), or says nothing."""
    if config is None:
        return None
    name = getattr(config, "cache_implementation", None)
    if name is not None:
        return name == FLEXIBLE_STATIC
    return True if getattr(config, SAVED_REQUEST_KEY, None) is not None else None


def cache_config_of(config):
    if config is None:
        return None
    if getattr(config, "cache_implementation", None) == FLEXIBLE_STATIC:
        return config.cache_config
    return getattr(config, SAVED_REQUEST_KEY, None)


def without_request(config):
    """A copy of `config` in which nothing names `flexible_static`."""
    config = copy.deepcopy(config)
    normalize_saved_form(config)
    vars(config).pop(SAVED_REQUEST_KEY, None)
    return config
