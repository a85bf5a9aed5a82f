"""How a `generate` call asks for the flexible cache: the name, the saved form, and the resolved request.

A call asks with `cache_implementation="flexible_static"` (in its kwargs or its `generation_config`) and a
`cache_config`. A saved generation config holds the request as a custom entry, `flexible_static={...}` (its value
is the `cache_config`), which upstream neither validates nor reads: a folder saved that way loads in plain
transformers, which then uses its default cache.

`resolve_request` is the one place that answers "does this call ask for the flexible cache, and with which
`cache_config`", with upstream's precedence: the call's kwargs, then its `generation_config`, then the model's. It
parses the `cache_config` once; the call's plan (`generate.plan.CallPlan`) keeps the result.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

from ..cache import CacheConfig

FLEXIBLE_STATIC = "flexible_static"
# The GenerationConfig entry that holds a saved request: its value is the `cache_config` (a dict, maybe empty).
SAVED_REQUEST_KEY = "flexible_static"
# A valid upstream name that stands in for ours while upstream merges and validates generation configs.
STAND_IN = "static"


@dataclass(frozen=True)
class Request:
    """What a generate call asks of this package.

    Attributes:
        flexible (`bool | None`): True: it asks for `flexible_static`; False: it names another cache; None: nothing.
        cache_config (`CacheConfig | None`): its `cache_config`, parsed, when it asks for `flexible_static`.
    """

    flexible: bool | None = None
    cache_config: CacheConfig | None = None


def resolve_request(model, generation_config, kwargs: Mapping) -> Request:
    """What a call of `model.generate(generation_config=generation_config, **kwargs)` asks for: the first of its
    kwargs (`cache_implementation`, `cache_config`), its `generation_config` and the model's own generation config that
    says anything, as upstream's precedence goes.

    Raises:
        TypeError, ValueError: the `cache_config` of a call that asks for `flexible_static` is not a dict, or has an
            unknown key or value.
    """
    named = kwargs.get("cache_implementation")
    flexible = (named == FLEXIBLE_STATIC) if named is not None else None
    for source in (generation_config, model.generation_config):
        flexible = asks_for_flexible(source) if flexible is None else flexible
    if not flexible:
        return Request(flexible=flexible)
    cache_config = kwargs.get("cache_config")
    for source in (generation_config, model.generation_config):
        cache_config = cache_config_of(source) if cache_config is None else cache_config
    return Request(flexible=True, cache_config=CacheConfig.parse(cache_config))


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
