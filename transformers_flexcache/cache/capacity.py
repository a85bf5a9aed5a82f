"""The one capacity decision of a call: what it needs, against what is held and configured.

A `generate` call states its `Need` (rows, decoder positions, encoder positions, a decoder-only prompt); `decide`
compares it with the capacities held (by the model's caches of its kind, or by the cache it continues) and with the
call's `CacheConfig`, and returns a `Reservation`: the capacities the call runs at, the limits of its writes, and the
shapes a fixed-shape policy pads it to. It raises before anything is padded or allocated when the call is over a limit
with `on_overflow="error"`. The pool asks it (`CachePool.decide`), a cache applies its answer (`reserve`); nothing
else plans a capacity. A need against fixed limits (the serving engine's capacities, a request's seats, a cache's
own) is compared by `exceeding`, the one such comparison.

Rules (grow-only): a capacity is at least what is held, what the config sets and what the call needs. A call exceeds
a capacity when it needs more than the configured value (`on_overflow="error"`: the configured value is a limit even
when more is held), or more than is held when none is configured; with `on_overflow="grow"` only needs beyond both
what is held and what is configured count, and they are what the growth warning names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .config import CacheConfig, Overflow, overflow_message

# (shape name, its size in the call, the capacities decided so far) -> the size the call runs it at
PaddedSize = Callable[[str, int, Mapping[str, int]], int]


@dataclass(frozen=True)
class Need:
    """What one generate call needs, stated before it starts.

    Args:
        rows (`int`): cache rows, `batch x max(num_beams, num_return_sequences)` (Whisper: `batch x
            num_return_sequences x num_beams`).
        decoder_positions (`int`): decoder positions written, at the call's own prompt length (upstream's
            `max_length - 1`, and what candidate decoding adds past it).
        encoder_positions (`int`, *optional*): encoder-decoder models: the encoder length of the call.
        prompt_len (`int`, *optional*): decoder-only calls of a fixed-shape policy: the prompt length, which the
            policy left-pads (the padding adds as many decoder positions).
    """

    rows: int
    decoder_positions: int
    encoder_positions: int | None = None
    prompt_len: int | None = None

    def capacities(self, *, num_prompt_pad: int = 0) -> dict[str, int]:
        """The need as capacities (`max_batch_size`, `max_cache_len`, ...), with `num_prompt_pad` columns of left
        padding counted in the decoder positions."""
        need = {"max_batch_size": self.rows, "max_cache_len": self.decoder_positions + num_prompt_pad}
        if self.encoder_positions is not None:
            need["max_encoder_len"] = self.encoder_positions
        if self.prompt_len is not None:
            need["max_prompt_len"] = self.prompt_len + num_prompt_pad
        return need


@dataclass(frozen=True)
class Reservation:
    """The answer to a call's `Need`: what storage serving it holds, and how the call runs (see `decide`).

    Attributes:
        capacities: what new storage for the call is built with: at least the largest held, the configured and the
            needed capacities (so that any call one storage serves, the others serve too).
        required: what any storage serving the call grows to (the needed and configured capacities; for a
            continuation, `capacities`, with their headroom).
        limits: with `on_overflow="error"`, the configured capacities: the call's writes may not go past them (nor
            past what the storage holds, where none is configured); empty with `"grow"`.
        shapes: the size each shape of the call runs at (`max_batch_size`: rows, `max_prompt_len`, `max_encoder_len`):
            its own, or a fixed-shape policy's padded size.
        need: the capacities the call needs at the sizes of `shapes` (decoder positions included).
        exceeded: the needs beyond what was held and configured: the storage grows, with a warning naming them.
        config: the call's `CacheConfig`.
    """

    capacities: Mapping[str, int]
    required: Mapping[str, int]
    limits: Mapping[str, int]
    shapes: Mapping[str, int]
    need: Mapping[str, int]
    exceeded: tuple[Overflow, ...]
    config: CacheConfig = field(compare=False)

    def covers(self, need: Mapping[str, int]) -> bool:
        """Whether a call needing `need` fits what this reservation makes storage hold."""
        return all(value <= self.required.get(name, 0) for name, value in need.items())


def exceeding(need: Mapping[str, int], limits: Mapping[str, int | None]) -> list[Overflow]:
    """The capacities of `need` (`max_batch_size`, `max_cache_len`, ...) over their limit in `limits`, in the order of
    `need`: the one comparison of a need with fixed limits (a serving engine's seats and capacities, a request's),
    whose `overflow_message` names each value, its limit and the fix. A limit that is None or missing is no limit."""
    return [
        Overflow(name, value, limits[name])
        for name, value in need.items()
        if limits.get(name) is not None and value > limits[name]
    ]


def plan_capacities(
    held: Mapping[str, int], need: Mapping[str, int], config: CacheConfig
) -> tuple[dict[str, int], list[Overflow]]:
    """The capacities to hold for a call that needs `need`, and those it exceeds (the rules of the module docstring).

    A capacity missing from `held`, or 0, is not set yet: the call sets it.
    """
    target, exceeded = {}, []
    for name, value in need.items():
        current, configured = held.get(name, 0), config.limit(name)
        if current == 0 and configured is None:
            limit = value  # nothing held or configured yet: the first call sets it
        elif config.on_overflow == "error":
            limit = configured if configured is not None else current
        else:
            limit = max(current, configured or 0)
        if value > limit:
            exceeded.append(Overflow(name, value, limit))
        target[name] = max(current, configured or 0, value)
    return target, exceeded


def decide(
    held: Mapping[str, int],
    need: Need,
    config: CacheConfig,
    *,
    padded_size: PaddedSize | None = None,
    geometric: bool = False,
) -> Reservation:
    """What a call of `need` runs at, given the capacities `held` (see the module docstring).

    Args:
        padded_size: a fixed-shape policy's size for each shape of the call (`PaddedPolicy.padded_size`); None: every
            shape runs at its own size. A padded decoder-only prompt adds its padding to the decoder positions.
        geometric: a continuation: a decoder length that must grow grows to at least twice what is held, so that a
            conversation continued turn by turn reallocates a logarithmic number of times.

    Raises:
        ValueError: with `on_overflow="error"`, a need over a limit, naming each value, its limit and the
            `cache_config` that fits. Nothing has been padded or allocated.
    """
    own = need.capacities()
    decoder = own.pop("max_cache_len")
    target, exceeded = plan_capacities(held, own, config)
    shapes = {name: padded_size(name, value, target) if padded_size else value for name, value in own.items()}
    # A left-padded prompt is written too: its padding adds as many decoder positions.
    needed = {**shapes, "max_cache_len": decoder + shapes.get("max_prompt_len", 0) - own.get("max_prompt_len", 0)}
    decoder_target, decoder_exceeded = plan_capacities(held, {"max_cache_len": needed["max_cache_len"]}, config)
    target.update(decoder_target)
    exceeded += decoder_exceeded
    if exceeded and config.on_overflow == "error":
        raise ValueError(overflow_message(exceeded))
    required = {name: max(value, config.limit(name) or 0) for name, value in needed.items()}
    if geometric:
        current = held.get("max_cache_len", 0)
        if config.on_overflow == "grow" and target["max_cache_len"] > current > 0:
            target["max_cache_len"] = max(target["max_cache_len"], 2 * current)
        required = dict(target)
    limits = {name: config.limit(name) for name in needed if config.limit(name) is not None}
    return Reservation(
        capacities=target,
        required=required,
        limits=limits if config.on_overflow == "error" else {},
        shapes=shapes,
        need=needed,
        exceeded=tuple(exceeded),
        config=config,
    )
