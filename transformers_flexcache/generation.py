"""`generate(cache_implementation="flexible_static")`: one flexible cache per model, reused across calls.

Design decisions:
- The cache lives on the model instance (`model._flex_cache`) and is reset, not rebuilt, at the start of each
  `generate` call. Calls of any batch, prompt length and encoder length that fit its capacities run on the same
  storage; a call that does not fit grows it once (or raises, with `on_overflow="error"`).
- Capacities come from `cache_config` (in the call or in a saved `GenerationConfig`); any capacity not given is
  taken from the first call that needs the cache. The batch that counts is `batch x max(num_beams,
  num_return_sequences)`, the decoder length `max_length - 1` (as for upstream's static cache), the encoder length
  that of `encoder_outputs`.
- Every check happens before the cache is touched, so a refused call leaves the cache usable for the next one.
- The cache returned by `generate(..., return_dict_in_generate=True)` is that shared cache: the next call reuses
  (and overwrites) it.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers.generation import configuration_utils as generation_configuration
from transformers.generation.utils import GenerationMixin

from .cache import (
    ON_OVERFLOW_CHOICES,
    FlexibleEncoderDecoderCache,
    FlexibleStaticCache,
    Overflow,
    overflow_message,
)

logger = logging.getLogger(__name__)

FLEXIBLE_STATIC = "flexible_static"
CAPACITY_KEYS = ("max_batch_size", "max_cache_len", "max_encoder_len")
CACHE_CONFIG_KEYS = CAPACITY_KEYS + ("on_overflow",)
_CACHE_ATTR = "_flex_cache"


_upstream_prepare_cache = GenerationMixin._prepare_cache_for_generation


def _refuse_flexible_static(self, generation_config, *args, **kwargs):
    # Installed on GenerationMixin while the name is accepted: an upstream model would otherwise fall through to a
    # DynamicCache and silently ignore the request. Flex models override this method and never reach it for the name.
    if generation_config.cache_implementation == FLEXIBLE_STATIC:
        raise ValueError(
            f"{type(self).__name__} does not support cache_implementation={FLEXIBLE_STATIC!r}; load it after "
            "transformers_flexcache.register(), or convert it in place with transformers_flexcache.convert(model)"
        )
    return _upstream_prepare_cache(self, generation_config, *args, **kwargs)


def accept_cache_implementation_name() -> None:
    """Make `GenerationConfig` accept `cache_implementation="flexible_static"` (idempotent).

    `GenerationConfig.validate` checks names against a module-level tuple; this appends one string to it. So that
    an upstream model asked for the name fails loudly instead of silently using a DynamicCache, upstream's
    `GenerationMixin._prepare_cache_for_generation` is wrapped to refuse it. `forget_cache_implementation_name()`
    undoes both.
    """
    names = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    if FLEXIBLE_STATIC not in names:
        generation_configuration.ALL_CACHE_IMPLEMENTATIONS = names + (FLEXIBLE_STATIC,)
    GenerationMixin._prepare_cache_for_generation = _refuse_flexible_static


def forget_cache_implementation_name() -> None:
    """Undo `accept_cache_implementation_name()`."""
    names = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    generation_configuration.ALL_CACHE_IMPLEMENTATIONS = tuple(name for name in names if name != FLEXIBLE_STATIC)
    GenerationMixin._prepare_cache_for_generation = _upstream_prepare_cache


def parse_cache_config(cache_config: dict[str, Any] | None) -> dict[str, Any]:
    """Check a `cache_config` for `flexible_static` and return it with only our keys.

    Raises:
        ValueError: an unknown key, a capacity that is not a positive int, or an unknown `on_overflow`.
    """
    settings = dict(cache_config or {})
    unknown = sorted(set(settings) - set(CACHE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"cache_config keys {unknown} are not understood by cache_implementation={FLEXIBLE_STATIC!r}; "
            f"valid keys are {list(CACHE_CONFIG_KEYS)}"
        )
    for key in CAPACITY_KEYS:
        value = settings.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f'cache_config["{key}"]={value!r} must be a positive int')
    on_overflow = settings.setdefault("on_overflow", "grow")
    if on_overflow not in ON_OVERFLOW_CHOICES:
        raise ValueError(f'cache_config["on_overflow"]={on_overflow!r} is not one of {ON_OVERFLOW_CHOICES}')
    return settings


def plan_capacities(
    need: dict[str, int], settings: dict[str, Any], existing: dict[str, int] | None
) -> tuple[dict[str, int], list[Overflow]]:
    """Capacities for a call that needs `need`, and the capacities (configured or held) that it exceeds.

    A capacity is the configured one, else the one the existing cache holds, else the call's need; the result is
    grow-only: never below what the existing cache holds, and at least what the call needs.
    """
    capacities, exceeded = {}, []
    for key, value in need.items():
        held = (existing or {}).get(key)
        limit = max(settings.get(key) or 0, held or 0) or value
        if value > limit:
            exceeded.append(Overflow(key, value, limit))
        capacities[key] = max(limit, value)
    return capacities, exceeded


def _capacities_of(cache) -> dict[str, int]:
    capacities = {"max_batch_size": cache.max_batch_size, "max_cache_len": cache.max_cache_len}
    if isinstance(cache, FlexibleEncoderDecoderCache):
        capacities["max_encoder_len"] = cache.max_encoder_len
    return capacities


def _build_cache(model, capacities: dict[str, int], on_overflow: str):
    common = {
        "config": model.config,
        "dtype": model.dtype,
        "device": model.device,
        "on_overflow": on_overflow,
        "max_batch_size": capacities["max_batch_size"],
        "max_cache_len": capacities["max_cache_len"],
    }
    if "max_encoder_len" in capacities:
        return FlexibleEncoderDecoderCache(max_encoder_len=capacities["max_encoder_len"], **common)
    return FlexibleStaticCache(**common)


def _grow(cache, capacities: dict[str, int]) -> None:
    if isinstance(cache, FlexibleEncoderDecoderCache):
        cache.self_attention_cache.grow(
            max_batch_size=capacities["max_batch_size"], max_cache_len=capacities["max_cache_len"]
        )
        cache.cross_attention_cache.grow(
            max_batch_size=capacities["max_batch_size"], max_cache_len=capacities["max_encoder_len"]
        )
    else:
        cache.grow(max_batch_size=capacities["max_batch_size"], max_cache_len=capacities["max_cache_len"])


def get_flexible_cache(model, *, need: dict[str, int], cache_config: dict[str, Any] | None):
    """The model's flexible cache, reset and big enough for a call that needs `need`.

    Args:
        model: a model whose generate supports `flexible_static`.
        need: `max_batch_size`, `max_cache_len` and, for encoder-decoder models, `max_encoder_len` of the call.
        cache_config: the `cache_config` of the call (capacities and `on_overflow`).

    Returns:
        The cache held by `model`, created on first use, grown when needed, and reset.

    Raises:
        ValueError: the call exceeds a capacity and `on_overflow="error"`; the cache is left as it was.
    """
    settings = parse_cache_config(cache_config)
    cache = getattr(model, _CACHE_ATTR, None)
    if cache is not None and (cache.dtype != model.dtype or cache.device != model.device):
        logger.warning(
            "The model moved to dtype=%s device=%s; the flexible cache (%s on %s) is rebuilt",
            model.dtype,
            model.device,
            cache.dtype,
            cache.device,
        )
        cache = None
    if cache is not None and isinstance(cache, FlexibleEncoderDecoderCache) != ("max_encoder_len" in need):
        cache = None

    existing = _capacities_of(cache) if cache is not None else None
    capacities, exceeded = plan_capacities(need, settings, existing)
    # Over a limit that the user configured, or that an earlier call set: refuse or warn, before any change.
    if exceeded:
        message = overflow_message(exceeded)
        if settings["on_overflow"] == "error":
            raise ValueError(message)
        logger.warning("The flexible cache grows (one reallocation): %s", message)

    if cache is None:
        cache = _build_cache(model, capacities, settings["on_overflow"])
        setattr(model, _CACHE_ATTR, cache)
    else:
        if capacities != existing:
            _grow(cache, capacities)
        cache.on_overflow = settings["on_overflow"]
    cache.reset()
    return cache


class FlexCacheGenerationMixin:
    """Adds `cache_implementation="flexible_static"` to a model's `generate`.

    Put it before the upstream model class: `class FlexT5ForConditionalGeneration(FlexCacheGenerationMixin,
    T5ForConditionalGeneration)`. Other cache implementations go to upstream unchanged.
    """

    def __init__(self, *args, **kwargs):
        accept_cache_implementation_name()
        super().__init__(*args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # A saved generation_config.json may name `flexible_static`; it is validated while loading.
        accept_cache_implementation_name()
        return super().from_pretrained(*args, **kwargs)

    def generate(self, *args, **kwargs):
        accept_cache_implementation_name()
        return super().generate(*args, **kwargs)

    @property
    def flexible_cache(self):
        """The cache that `generate(cache_implementation="flexible_static")` reuses, or None before its first call."""
        return getattr(self, _CACHE_ATTR, None)

    def _flexible_cache_need(self, generation_config, model_kwargs: dict, batch_size: int, max_cache_length: int):
        """Batch, decoder length and (encoder-decoder) encoder length that this generate call needs."""
        expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        need = {"max_batch_size": batch_size * expand, "max_cache_len": max_cache_length}
        if self.config.is_encoder_decoder:
            need["max_encoder_len"] = model_kwargs["encoder_outputs"][0].shape[1]
        return need

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        """Overrides `GenerationMixin._prepare_cache_for_generation` (transformers==5.24.0) for one new name.

        Differences: `cache_implementation="flexible_static"` takes the model's flexible cache (see
        `get_flexible_cache`) instead of building a new cache; every other value goes to upstream unchanged.
        """
        if generation_config.cache_implementation != FLEXIBLE_STATIC:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        if model_kwargs.get("cache") is not None:
            raise ValueError(
                "Passing both `cache_implementation` (used to initialize certain caches) and `cache` (a Cache "
                "object) is unsupported. Please use only one of the two."
            )
        if generation_config.use_cache is False:
            return
        if generation_config.max_cache_len is not None:
            # Upstream's `max_cache_len` generation option is honoured as a floor, as for its static cache.
            max_cache_length = max(max_cache_length, generation_config.max_cache_len)
        need = self._flexible_cache_need(generation_config, model_kwargs, batch_size, max_cache_length)
        model_kwargs["cache"] = get_flexible_cache(self, need=need, cache_config=generation_config.cache_config)
        if generation_config.is_assistant:
            model_kwargs["cache"].activate_past_recording()


def is_flexible_cache(cache) -> bool:
    """Whether `cache` is one of this package's caches."""
    return isinstance(cache, (FlexibleStaticCache, FlexibleEncoderDecoderCache))
