"""`CacheConfig`: the settings of `cache_implementation="flexible_static"`, parsed and checked once.

A `cache_config` (a dict in `generate(...)` or in a saved `GenerationConfig`) becomes one `CacheConfig` at the door;
no other code reads the dict or checks its keys. Capacities start with `max_`; a capacity left unset is taken from
the first call that needs it (see `FlexibleStaticCache.reserve`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

ON_OVERFLOW_CHOICES = ("grow", "error")
SHAPE_POLICIES = ("exact", "padded", "bucketed")
ON_BUSY_CHOICES = ("wait", "error")
# The capacities that size storage; `max_prompt_len` is a shape (padded prompts), held by the cache all the same.
CAPACITY_NAMES = ("max_batch_size", "max_cache_len", "max_encoder_len")
# The shapes that `shape_policy="bucketed"` rounds up to a bucket, and the smallest default bucket of each: powers of
# two from there up to the capacity, which is always the last bucket. Lengths start at 16: below that, attention costs
# next to nothing and each bucket is one more graph to compile.
BUCKETED_NAMES = ("max_batch_size", "max_cache_len", "max_encoder_len", "max_prompt_len")
DEFAULT_SMALLEST_BUCKET = {"max_batch_size": 1, "max_cache_len": 16, "max_encoder_len": 16, "max_prompt_len": 16}


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
        max_prompt_len (`int`, *optional*): fixed-shape policies only: decoder-only prompts are left-padded to it
            (`"padded"`) or to a bucket up to it (`"bucketed"`).
        on_overflow (`str`, *optional*, defaults to `"grow"`): a call over a capacity grows the storage once, with a
            warning naming the capacity to preset (`"grow"`), or raises a `ValueError` before anything is written
            (`"error"`). With `"error"`, a capacity given here is a limit even when the storage is larger.
        shape_policy (`str`, *optional*, defaults to `"exact"`): `"exact"` runs each call at its own shapes (eager,
            `torch.export`); `"padded"` pads every call to the capacities, for `torch.compile` and CUDA graphs (one
            graph); `"bucketed"` pads each shape only up to the next of a few buckets, and attention spans the decoder
            length bucket of the call (a known, bounded number of graphs; see `buckets`).
        buckets (`dict[str, list[int]]`, *optional*): `shape_policy="bucketed"` only: for any of `max_batch_size`,
            `max_cache_len`, `max_encoder_len` and `max_prompt_len`, the sizes a call's rows, decoder length, encoder
            length and prompt length are rounded up to, e.g. `{"max_batch_size": [1, 4, 8]}`. The capacity is always
            the last bucket (larger entries are not used). A shape left out gets powers of two up to its capacity,
            from 1 for the batch and from 16 for lengths.
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
    buckets: Mapping[str, Sequence[int]] | None = None

    def __post_init__(self):
        for name in (*CAPACITY_NAMES, "max_prompt_len", "max_concurrent_calls"):
            value = getattr(self, name)
            if value is not None:
                check_positive_int(f'cache_config["{name}"]', value)
        check_choice('cache_config["on_overflow"]', self.on_overflow, ON_OVERFLOW_CHOICES)
        check_choice('cache_config["shape_policy"]', self.shape_policy, SHAPE_POLICIES)
        check_choice('cache_config["on_busy"]', self.on_busy, ON_BUSY_CHOICES)
        if self.buckets is not None:
            # Kept as sorted pairs of tuples: a frozen config stays hashable and compares by value.
            object.__setattr__(self, "buckets", _checked_buckets(self.buckets, self.shape_policy))

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
        config = {key: value for key, value in asdict(self).items() if value != getattr(defaults, key)}
        if self.buckets is not None:
            config["buckets"] = {name: list(sizes) for name, sizes in self.buckets}
        return config

    def buckets_of(self, name: str, capacity: int) -> tuple[int, ...]:
        """The buckets of shape `name` (one of `BUCKETED_NAMES`) under a capacity of `capacity`, smallest first.

        The configured ones below the capacity (powers of two from `DEFAULT_SMALLEST_BUCKET[name]` when none are
        configured), then the capacity itself.
        """
        configured = dict(self.buckets or ()).get(name)
        if configured is None:
            configured, size = [], DEFAULT_SMALLEST_BUCKET[name]
            while size < capacity:
                configured.append(size)
                size *= 2
        return (*(size for size in configured if size < capacity), capacity)

    def bucket_for(self, name: str, value: int, *, capacity: int) -> int:
        """The smallest bucket of shape `name` that holds `value`, under a capacity of `capacity` (see
        `buckets_of`); `value` itself when it exceeds the capacity (the caller refuses or grows first)."""
        return next((size for size in self.buckets_of(name, capacity) if size >= value), value)

    def limit(self, name: str) -> int | None:
        """The configured value of capacity `name`, or None when it was left to the first call."""
        return getattr(self, name)


def _checked_buckets(buckets, shape_policy: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """`cache_config["buckets"]` as sorted `(name, sizes)` pairs, checked: known names, increasing positive ints."""
    example = '{"max_batch_size": [1, 2, 4, 8]}'
    if shape_policy != "bucketed":
        raise ValueError(
            f'cache_config["buckets"] only applies to shape_policy="bucketed", not {shape_policy!r}; pass '
            'cache_config={"shape_policy": "bucketed", ...} or leave "buckets" out'
        )
    if not isinstance(buckets, Mapping):
        raise ValueError(f'cache_config["buckets"]={buckets!r} must be a dict such as {example}')
    unknown = sorted(set(buckets) - set(BUCKETED_NAMES), key=str)
    if unknown:
        raise ValueError(
            f'cache_config["buckets"] keys {unknown} are not bucketed shapes; valid keys are {list(BUCKETED_NAMES)}'
        )
    checked = []
    for name, sizes in buckets.items():
        where = f'cache_config["buckets"]["{name}"]'
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
            raise ValueError(f"{where}={sizes!r} must be a non-empty list of sizes such as [1, 2, 4, 8]")
        for size in sizes:
            check_positive_int(where, size)
        if any(later <= earlier for earlier, later in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"{where}={list(sizes)} must be increasing, e.g. {sorted(set(sizes))}")
        checked.append((name, tuple(sizes)))
    return tuple(sorted(checked))
