"""`CacheConfig`: the settings of `cache_implementation="flexible_static"`, parsed and checked once.

A `cache_config` (a dict in `generate(...)` or in a saved `GenerationConfig`) becomes one `CacheConfig` at the door;
no other code reads the dict or checks its keys. Capacities start with `max_`; a capacity left unset is taken from
the first call that needs it (see `FlexibleStaticCache.reserve`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

ON_OVERFLOW_CHOICES = ("grow", "error")
SHAPE_POLICIES = ("exact", "padded")
ON_BUSY_CHOICES = ("wait", "error")
# The capacities that size storage; `max_prompt_len` is a shape (padded prompts), held by the cache all the same.
CAPACITY_NAMES = ("max_batch_size", "max_cache_len", "max_encoder_len")


@dataclass(frozen=True)
class Overflow:
    """One capacity that a call exceeds: `value` is what the call needs, `limit` what it may use."""

    name: str
    value: int
    limit: int

    def describe(self) -> str:
        return f"{self.name.removeprefix('max_')}={self.value} exceeds {self.name}={self.limit}"


def overflow_message(overflows: list[Overflow]) -> str:
    """The error text for `overflows`: each value and limit, then the `cache_config` that would fit."""
    fix = ", ".join(f'"{o.name}": {o.value}' for o in overflows)
    return "; ".join(o.describe() for o in overflows) + f"; pass cache_config={{{fix}}} or more"


def check_positive_int(name: str, value) -> int:
    """`value` if it is a positive int (not a bool), else a `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def check_choice(name: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")
    return value


@dataclass(frozen=True)
class CacheConfig:
    """Capacities and behaviour of the flexible cache, as given in `cache_config`.

    Args:
        max_batch_size (`int`, *optional*): rows of storage (count `batch x num_beams` for beam search).
        max_cache_len (`int`, *optional*): decoder positions per row (prompt plus generated tokens).
        max_encoder_len (`int`, *optional*): encoder positions per row (encoder-decoder models).
        max_prompt_len (`int`, *optional*): `shape_policy="padded"` only: decoder-only prompts are left-padded to it.
        on_overflow (`str`, *optional*, defaults to `"grow"`): a call over a capacity grows the storage once, with a
            warning naming the capacity to preset (`"grow"`), or raises a `ValueError` before anything is written
            (`"error"`). With `"error"`, a capacity given here is a limit even when the storage is larger.
        shape_policy (`str`, *optional*, defaults to `"exact"`): `"exact"` runs each call at its own shapes (eager,
            `torch.export`); `"padded"` pads every call to the capacities, for `torch.compile` and CUDA graphs.
        max_concurrent_calls (`int`, *optional*): how many `generate` calls may run on one model at once, each on
            storage of its own (a pool of caches, each allocated once). Defaults to 1: calls from other threads wait.
        on_busy (`str`, *optional*, defaults to `"wait"`): what a call does when `max_concurrent_calls` calls are
            already running: wait for one to finish (`"wait"`), or raise a `RuntimeError` (`"error"`).

    Raises:
        TypeError: `cache_config` is not a dict (or `CacheConfig`).
        ValueError: an unknown key, a capacity that is not a positive int, or an unknown choice.
    """

    max_batch_size: int | None = None
    max_cache_len: int | None = None
    max_encoder_len: int | None = None
    max_prompt_len: int | None = None
    on_overflow: str = "grow"
    shape_policy: str = "exact"
    max_concurrent_calls: int | None = None
    on_busy: str = "wait"

    def __post_init__(self):
        for name in (*CAPACITY_NAMES, "max_prompt_len", "max_concurrent_calls"):
            value = getattr(self, name)
            if value is not None:
                check_positive_int(f'cache_config["{name}"]', value)
        check_choice('cache_config["on_overflow"]', self.on_overflow, ON_OVERFLOW_CHOICES)
        check_choice('cache_config["shape_policy"]', self.shape_policy, SHAPE_POLICIES)
        check_choice('cache_config["on_busy"]', self.on_busy, ON_BUSY_CHOICES)

    @classmethod
    def parse(cls, cache_config) -> CacheConfig:
        """The `CacheConfig` of a `cache_config` given to `generate` (a dict, a `CacheConfig`, or None)."""
        if cache_config is None:
            return cls()
        if isinstance(cache_config, cls):
            return cache_config
        if not isinstance(cache_config, Mapping):
            raise TypeError(
                f'cache_config must be a dict such as {{"max_batch_size": 8, "max_cache_len": 256}}, not '
                f"{type(cache_config).__name__} ({cache_config!r})"
            )
        valid = [field.name for field in fields(cls)]
        unknown = sorted(set(cache_config) - set(valid), key=str)
        if unknown:
            raise ValueError(
                f"cache_config keys {unknown} are not understood by cache_implementation='flexible_static'; valid "
                f"keys are {valid}"
            )
        return cls(**cache_config)

    def to_dict(self) -> dict:
        """The keys that were set (those that differ from the defaults), as a `cache_config` dict."""
        defaults = CacheConfig()
        return {key: value for key, value in asdict(self).items() if value != getattr(defaults, key)}

    def limit(self, name: str) -> int | None:
        """The configured value of capacity `name`, or None when it was left to the first call."""
        return getattr(self, name)
