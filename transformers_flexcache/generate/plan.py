"""One generate call, one object: the call plan.

A `CallPlan` is built once, at the door of `generate` (`FlexCacheGenerationMixin.generate`), and lives as long as
the call. It resolves the request once (the call's kwargs, then its `generation_config`, then the model's: does it ask
for `flexible_static`, with which `cache_config`), keeps the parsed `CacheConfig`, names the kind of cache the call
needs (`cache.CacheKind`), asks the model's pool the call's one capacity question (`CachePool.decide`: it raises
before anything is padded or allocated), and carries what follows from the answer: the padding record of a
fixed-shape policy (`generate.padded_call.PaddedCall`), the lease and the cache.

The plans of the calls running in this context (this thread) are one context variable, innermost last: a generate
call made inside another (Whisper's segment and fallback calls, an assistant model's rounds) finds the enclosing plan
there, and parks its leases in it when it ends (see `generate/pool.py`).

When the question is asked:
- a fixed-shape policy (`"padded"`, `"bucketed"`) asks at the door, before it pads the inputs: the call's need is
  stated from its inputs and resolved generation config (`CallPlan.state_need`, which mirrors how upstream's generate
  sizes its cache), and the answer gives the padded shapes;
- the exact policy asks when upstream's generate prepares the cache (`_prepare_cache_for_generation`), where the need
  is upstream's own numbers: nothing is padded before, and a need stated earlier would cost a second resolution of the
  generation config.
Either way it is asked once. When upstream's numbers exceed what the door stated (they never do in the test matrix,
which checks it), the plan asks again with them rather than run out of room.

`CallPlan.resolve(model, kwargs)` states the need of one request without running it (the serving engine sizes its
seats with it).

Shape legend: `B` the call's batch, `P` its prompt length (decoder-only), `L_enc` its encoder length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from ..cache import CacheConfig, CacheKind, Need, Reservation, is_flexible_cache
from ..log import get_logger
from .policies import POLICIES
from .pool import Lease, pool_of
from .request import Request, resolve_request

logger = get_logger(__name__)

# The plans of the generate calls running in this context, innermost last.
_RUNNING: ContextVar[tuple[CallPlan, ...]] = ContextVar("transformers_flexcache_running_calls", default=())


def running_plans() -> tuple[CallPlan, ...]:
    """The plans of the generate calls running in this context (this thread), innermost last."""
    return _RUNNING.get()


def current_plan(model) -> CallPlan | None:
    """The plan of `model`'s innermost running generate call in this context, or None (not inside one, or inside a
    call of another model, such as an assistant's)."""
    plans = _RUNNING.get()
    return plans[-1] if plans and plans[-1].model is model else None


def given_cache(kwargs: Mapping):
    """The cache a generate call was given (`cache`, or its deprecated name `past_key_values`), or None."""
    given = kwargs.get("cache")
    return given if given is not None else kwargs.get("past_key_values")


def rows_per_input(model, generation_config: GenerationConfig) -> int:
    """Cache rows per input of a call to upstream's generate: `max(num_beams, num_return_sequences)`, as upstream
    expands its inputs. (Whisper's own generate repeats each input `num_return_sequences` times before; see
    `CallPlan.resolve`.)"""
    return max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)


@dataclass
class CallPlan:
    """One generate call of a model with `FlexCacheGenerationMixin` (module docstring).

    Attributes:
        model: the model.
        request: what the call asks for (`generate.request.Request`).
        config: the call's `CacheConfig`: its `cache_config`, parsed once; for a continuation without one, the given
            cache's `on_overflow` and `shape_policy`; None when the call uses no flexible cache.
        policy: the shape policy that runs the call (`generate.policies.POLICIES`).
        given: a cache passed to the call (`cache=` / `past_key_values=`), or None.
        generation_config: the call's resolved generation config, once resolved.
        kind: the kind of cache the call leases (`CacheKind`), once known.
        need: what the call needs (`Need`), once stated.
        reservation: the pool's answer (`Reservation`).
        padding: what a fixed-shape policy did to the call (`generate.padded_call.PaddedCall`), or None.
        leases: the leases this call holds (its own, and those of calls it made that ended).
        cache: the flexible cache the call runs on, once leased.
        num_questions: how many times the pool was asked (1; 2 only if upstream needed more than stated).
        keep_resolved: whether the next resolution of the generation config (`_prepare_generation_config`) is the
            door's, to be held (`hold_resolved`).
        resolved: what the door resolved, held for upstream's generate to take instead of resolving it again
            (`take_resolved`), or None.
    """

    model: object
    request: Request
    config: CacheConfig | None
    policy: object
    given: object = None
    generation_config: GenerationConfig | None = None
    kind: CacheKind | None = None
    need: Need | None = None
    reservation: Reservation | None = None
    padding: object = None
    leases: list[Lease] = field(default_factory=list)
    cache: object = None
    num_questions: int = 0
    keep_resolved: bool = False
    resolved: tuple | None = None

    # --- the door -------------------------------------------------------------------------------------------------
    @classmethod
    def at_door(cls, model, args: tuple, kwargs: Mapping) -> CallPlan:
        """The plan of `model.generate(*args, **kwargs)`: its request resolved, its `cache_config` parsed, its policy.

        Raises:
            TypeError, ValueError: the `cache_config` is not a dict, or has an unknown key or value.
        """
        generation_config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
        request = resolve_request(model, generation_config, kwargs)
        given = given_cache(kwargs)
        config = request.cache_config
        policy = POLICIES[config.shape_policy] if config is not None else POLICIES["exact"]
        if is_flexible_cache(given):
            # A continuation runs as its cache was filled, and takes the cache's settings without a cache_config.
            policy = POLICIES[given.shape_policy]
            config = config or CacheConfig(on_overflow=given.on_overflow, shape_policy=given.shape_policy)
        return cls(model=model, request=request, config=config, policy=policy, given=given)

    @property
    def flexible(self) -> bool:
        """Whether the call runs on a flexible cache (asked for, or given to continue)."""
        return self.config is not None

    def run(self, upstream_generate, args: tuple, kwargs: dict):
        """`upstream_generate(*args, **kwargs)` as this call's shape policy runs it."""
        return self.policy.generate(self, upstream_generate, args, kwargs)

    @contextlib.contextmanager
    def running(self):
        """Within this context, this plan is the innermost running call. When it closes, the leases the call holds
        are given back, or parked in the enclosing call of this context when there is one (`generate/pool.py`)."""
        token = _RUNNING.set((*_RUNNING.get(), self))
        try:
            yield self
        finally:
            _RUNNING.reset(token)
            enclosing = _RUNNING.get()
            if enclosing:
                for lease in self.leases:
                    lease.park()
                enclosing[-1].leases.extend(self.leases)
            else:
                for lease in reversed(self.leases):
                    lease.give_back()

    def hold(self, lease: Lease) -> None:
        """Keep `lease` until this call ends (give it back at once when this plan is not running: upstream's generate
        called without ours)."""
        if self in _RUNNING.get():
            self.leases.append(lease)
        else:
            lease.give_back()

    def lease_of(self, cache) -> Lease | None:
        """This call's lease of `cache` (its own, or a parked one of a call it made), or None."""
        return next((lease for lease in reversed(self.leases) if lease.cache is cache), None)

    def note_returned(self, output) -> None:
        """Tell the pool of a cache found in `generate`'s output that it went back to the caller."""
        cache = getattr(output, "cache", None) if not isinstance(output, dict) else output.get("cache")
        if is_flexible_cache(cache) and cache._owner is not None:
            cache._owner.mark_returned(cache)

    # --- the resolved generation config, once -----------------------------------------------------------------------
    def hold_resolved(self, given: GenerationConfig | None, kwargs: Mapping, resolved: GenerationConfig) -> None:
        """Hold what `_prepare_generation_config(given, **kwargs)` resolved at the door (`keep_resolved`: a fixed-shape
        policy resolves the config before it pads the call), for upstream's generate to take once instead of
        resolving it again (`take_resolved`). The kwargs that were generation options (attributes of `resolved`,
        which upstream's `GenerationConfig.update` takes) are held with their values."""
        options = {name: value for name, value in kwargs.items() if hasattr(resolved, name)}
        self.resolved = (given, options, resolved)

    def take_resolved(self, given: GenerationConfig | None, kwargs: Mapping) -> tuple | None:
        """`(resolved, model_kwargs)` of `_prepare_generation_config(given, **kwargs)` (transformers==5.24.0) from
        what the door held (`hold_resolved`), once: for the same `given` object and the same generation options (the
        same objects), no other kwarg being a generation option. Else None, and the caller resolves the config.

        Why: upstream's generate resolves its config again after the door did (a deep copy, two merges and a
        validation: 0.5-0.6 ms on one core of an AMD EPYC Zen 3 for the t5-small-sized T5, 2% of a first token of
        2 rows of 8 tokens). What the door resolved is a copy made for this call alone, so upstream's generate may
        take that very object: the plan then holds the config that upstream runs with (`generation_config`).
        """
        held, self.resolved = self.resolved, None
        if held is None:
            return None
        held_given, options, resolved = held
        if held_given is not given or any(
            name not in kwargs or kwargs[name] is not value for name, value in options.items()
        ):
            return None
        model_kwargs = {name: value for name, value in kwargs.items() if name not in options}
        if any(hasattr(resolved, name) for name in model_kwargs):
            return None
        # As upstream: the output_xxx options stay in the model kwargs, for `forward`.
        for name in ("output_attentions", "output_hidden_states"):
            if getattr(resolved, name):
                model_kwargs[name] = getattr(resolved, name)
        return resolved, model_kwargs

    # --- the need, and the one question ---------------------------------------------------------------------------
    def need_of(
        self,
        generation_config: GenerationConfig,
        *,
        rows: int,
        decoder_positions: int,
        encoder_positions: int | None = None,
        prompt_len: int | None = None,
    ) -> Need:
        """The `Need` of a call of `rows` cache rows writing `decoder_positions` positions (upstream's
        `max_length - 1`): that, at least upstream's `max_cache_len` generation option, plus what candidate decoding
        and MPS write past `max_length`."""
        length = decoder_positions
        if generation_config.max_cache_len is not None:
            # Upstream's `max_cache_len` generation option is honoured as a floor, as for its static cache.
            length = max(length, generation_config.max_cache_len)
        if generation_config.prompt_lookup_num_tokens:
            # Prompt-lookup candidates are copied from the prompt and are not capped at `max_length`: the last forward
            # of a call can write that many positions past `max_length - 1`.
            length += generation_config.prompt_lookup_num_tokens
        if self.model.device.type == "mps":
            length += 1  # upstream defers its stop check on MPS: one more forward than `max_length` allows
        return Need(rows=rows, decoder_positions=length, encoder_positions=encoder_positions, prompt_len=prompt_len)

    def state_need(
        self,
        generation_config: GenerationConfig,
        inputs_tensor: torch.Tensor,
        model_input_name: str,
        model_kwargs: Mapping,
        *,
        has_default_max_length: bool,
        prompt_pad: int = 0,
        padded_prompt: bool = False,
    ) -> Need:
        """What a call with these inputs will need, stated before upstream's generate runs.

        Args:
            generation_config: the call's resolved generation config.
            inputs_tensor, model_input_name, model_kwargs: what upstream's `_prepare_model_inputs` returns for it.
            has_default_max_length: whether no length was set by the call (upstream's flag of that name).
            prompt_pad: columns of left padding the call's prompt is known to get (a continuation of a padded cache).
            padded_prompt: a decoder-only prompt that a fixed-shape policy pads: it is stated as `prompt_len`.
        """
        model = self.model
        encoder_positions = None
        if model.config.is_encoder_decoder:
            input_ids_length = _decoder_input_length(model, generation_config, model_input_name, model_kwargs)
            encoder_positions = model._flex_encoder_len(inputs_tensor, model_input_name, model_kwargs)
        elif model_input_name == "input_ids":
            input_ids_length = inputs_tensor.shape[1] + prompt_pad
        else:  # inputs_embeds: upstream's `input_ids` are those given with them (none: an empty [B, 0])
            input_ids = model_kwargs.get("input_ids")
            input_ids_length = input_ids.shape[1] if input_ids is not None else 0
        positions = _decoder_positions(
            model,
            generation_config,
            input_ids_length=input_ids_length,
            inputs_len=inputs_tensor.shape[1] + prompt_pad,
            model_input_name=model_input_name,
            has_default_max_length=has_default_max_length,
        )
        return self.need_of(
            generation_config,
            rows=inputs_tensor.shape[0] * rows_per_input(model, generation_config),
            decoder_positions=positions,
            encoder_positions=encoder_positions,
            prompt_len=inputs_tensor.shape[1] if padded_prompt else None,
        )

    def ask(self, need: Need, *, padded_size=None) -> Reservation:
        """Ask the model's pool the call's capacity question (`CachePool.decide`) and keep the answer.

        Raises:
            ValueError: the call exceeds a capacity with `on_overflow="error"`; nothing is padded or allocated.
        """
        if self.kind is None and self.given is None:
            self.kind = CacheKind.for_model(self.model, shape_policy=self.config.shape_policy)
        self.need = need
        self.reservation = pool_of(self.model).decide(
            need, self.config, kind=self.kind, given=self.given, padded_size=padded_size
        )
        self.num_questions += 1
        return self.reservation

    # --- the cache --------------------------------------------------------------------------------------------------
    def take_cache(self, generation_config, model_kwargs: dict, batch_size: int, max_cache_length: int):
        """Lease the call's cache, when upstream's generate prepares it: upstream's numbers (`batch_size` inputs,
        `max_cache_length` decoder positions, the encoder outputs) are the call's need; the fixed-shape policy pads
        the encoder outputs to its shape first. Returns the cache.

        Raises:
            ValueError: the call exceeds a capacity with `on_overflow="error"`, or the given cache is stale.
            RuntimeError: the pool is busy (`on_busy="error"`), or the given cache serves another call.
        """
        self.generation_config = generation_config
        encoder_len = None
        if self.model.config.is_encoder_decoder and model_kwargs.get("encoder_outputs") is not None:
            encoder_len = model_kwargs["encoder_outputs"][0].shape[1]
        actual = self.need_of(
            generation_config,
            rows=batch_size * rows_per_input(self.model, generation_config),
            decoder_positions=max_cache_length,
            encoder_positions=encoder_len,
        )
        if self.reservation is None or (
            encoder_len is not None and self.need is not None and encoder_len != self.need.encoder_positions
        ):
            if self.reservation is not None:
                logger.debug("%s: upstream's encoder length differs from the one stated: asking again", self.model)
            self.ask(actual, padded_size=self.policy.encoder_size(self))
        encoder_len = self.policy.pad_encoder(self, model_kwargs)
        need = actual.capacities()
        if encoder_len is not None:
            need["max_encoder_len"] = encoder_len
        if self.padding is not None and not self.padding.continuation and not self.model.config.is_encoder_decoder:
            need["max_prompt_len"] = self.padding.padded_prompt_len  # a shape the cache holds for later calls
        if not self.reservation.covers(need):
            logger.debug("%s needs %s, beyond what was stated: asking again", type(self.model).__name__, need)
            self.ask(_need_from_capacities(need))
        pool = pool_of(self.model)
        if self.given is not None:
            lease = pool.lease_given(self.given, reservation=self.reservation)
        else:
            lease = pool.lease(kind=self.kind, reservation=self.reservation, need=need)
            if self.padding is not None:  # what the rows of this cache hold: a continuation pads alike
                lease.cache.num_prompt_pad = self.padding.num_prompt_pad
        self.hold(lease)
        self.cache = lease.cache
        return lease.cache

    # --- for the serving engine ---------------------------------------------------------------------------------------
    @classmethod
    def resolve(cls, model, kwargs: Mapping) -> CallPlan:
        """The plan of `model.generate(**kwargs)`, resolved without running it: its `generation_config` (resolved as
        upstream's generate resolves it), its `config` (`CacheConfig`, or None when the request asks for no flexible
        cache) and its `need` (`Need`: rows, decoder positions, encoder positions), at the call's own shapes.

        Whisper's own generate repeats each input `num_return_sequences` times before upstream's generate expands
        beams: its rows are `batch x num_return_sequences x num_beams`. It also starts each row with its initial
        tokens (start, and language, task and timestamp tokens where the checkpoint uses them) and adds them to
        `max_length` when no `max_new_tokens` is given: the decoder positions stated here count the start token alone,
        so for Whisper they are a lower bound, short by the other initial tokens. Nothing is leased or allocated.

        Args:
            model: a model with `FlexCacheGenerationMixin` (an override model).
            kwargs: the keyword arguments of the generate call (model inputs and generation settings).

        Raises:
            TypeError, ValueError: as `generate` raises for the same request.
        """
        plan = cls.at_door(model, (), kwargs)
        kwargs = dict(kwargs)
        generation_config = kwargs.pop("generation_config", None)
        has_default_max_length = _has_default_max_length(model, generation_config, kwargs)
        with plan.running():
            resolved, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
            inputs_tensor, model_input_name, model_kwargs = model._prepare_model_inputs(
                None, resolved.bos_token_id, dict(model_kwargs)
            )
        plan.generation_config = resolved
        plan.need = plan.state_need(
            resolved, inputs_tensor, model_input_name, model_kwargs, has_default_max_length=has_default_max_length
        )
        if model._flex_repeats_inputs_per_sequence:
            plan.need = Need(
                rows=plan.need.rows
                // rows_per_input(model, resolved)
                * (resolved.num_beams or 1)
                * (resolved.num_return_sequences or 1),
                decoder_positions=plan.need.decoder_positions,
                encoder_positions=plan.need.encoder_positions,
            )
        return plan


def _need_from_capacities(capacities: Mapping[str, int]) -> Need:
    return Need(
        rows=capacities["max_batch_size"],
        decoder_positions=capacities["max_cache_len"],
        encoder_positions=capacities.get("max_encoder_len"),
    )


def _has_default_max_length(model, generation_config, kwargs: Mapping) -> bool:
    """Whether the call sets no `max_length` (upstream's `has_default_max_length`, transformers==5.24.0)."""
    return (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )


def _decoder_input_length(model, generation_config, model_input_name: str, model_kwargs: Mapping) -> int:
    """Mirrors `GenerationMixin._prepare_decoder_input_ids_for_generation` (transformers==5.24.0) for the length of
    the decoder inputs: those given (`decoder_input_ids`, or `input_ids` when they are not the encoder's), with the
    decoder start token put before them unless every row starts with it; the start token alone when none is given."""
    decoder_input_ids = model_kwargs.get("decoder_input_ids")
    if decoder_input_ids is None and "input_ids" in model_kwargs and model_input_name != "input_ids":
        decoder_input_ids = model_kwargs["input_ids"]
    if decoder_input_ids is None:
        return 1
    start = generation_config.decoder_start_token_id
    start = generation_config.bos_token_id if start is None else start
    is_donut = "donut" in type(model).__name__.lower() or (
        model.config.model_type == "vision-encoder-decoder" and "donut" in model.config.encoder.model_type.lower()
    )
    if is_donut or model.config.model_type == "whisper" or start is None:
        return decoder_input_ids.shape[1]
    start = torch.as_tensor(start, device=decoder_input_ids.device).reshape(-1)
    starts = start if start.numel() == decoder_input_ids.shape[0] else start[:1].expand(decoder_input_ids.shape[0])
    prepended = bool((decoder_input_ids[:, 0] != starts).all())
    return decoder_input_ids.shape[1] + int(prepended)


def _decoder_positions(
    model, generation_config, *, input_ids_length: int, inputs_len: int, model_input_name: str, has_default_max_length
) -> int:
    """Mirrors `GenerationMixin._prepare_generated_length` (transformers==5.24.0) for `max_length`, and the
    `max_cache_length` that `GenerationMixin.generate` passes to `_prepare_cache_for_generation`: the decoder positions
    a call writes."""
    embeds = (
        model_input_name == "inputs_embeds" and input_ids_length != inputs_len and not model.config.is_encoder_decoder
    )
    max_length = generation_config.max_length
    if generation_config.max_new_tokens is not None:
        max_length = generation_config.max_new_tokens + input_ids_length
    elif embeds and not has_default_max_length:
        max_length -= inputs_len
    elif has_default_max_length:
        max_length = max_length + input_ids_length
        max_position_embeddings = getattr(model.config, "max_position_embeddings", None)
        if max_position_embeddings is not None:
            max_length = min(max_length, max_position_embeddings)
    return max_length - 1 + (inputs_len if embeds else 0)


__all__ = [
    "CallPlan",
    "current_plan",
    "given_cache",
    "rows_per_input",
    "running_plans",
]
