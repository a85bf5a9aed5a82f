"""`generate(cache_implementation="flexible_static")`: a call states what it needs and takes a cache for its duration.

Design decisions:
- A call asks for the flexible cache with `cache_implementation="flexible_static"` (in its kwargs or its
  `generation_config`), or through the model's own generation config (the saved form, `flexible_static={...}`: a
  custom entry that upstream neither validates nor reads, so the folder loads in plain transformers). Our name never
  reaches upstream's validation, which knows only its own names: `register()` is needed only for upstream classes.
- A call's needs are stated once, before it starts (`call_need`): rows (`batch x max(num_beams,
  num_return_sequences)`), decoder positions (`max_length - 1`, at least `max_cache_len`, plus prompt-lookup
  candidates, which may run past `max_length`), encoder positions. The cache decides whether they fit, grows or
  refuses (`FlexibleStaticCache.reserve`), before anything is written.
- The cache comes from the model's pool (`ownership.py`): a lease for the call, a new cache object over reused
  storage. A cache passed back as `past_key_values` is leased as it is (a continuation).
- What a shape policy adds around a call (padding) lives in `padding.py`; this module only asks the policy.
"""

from __future__ import annotations

import inspect
import threading
import weakref

from transformers.generation.utils import GenerationMixin

from .cache import CacheConfig, FlexibleEncoderDecoderCache, FlexibleStaticCache, is_flexible_cache
from .cache.placement import layer_specs_for_model
from .ownership import call_scope, hold_for_call, note_returned, pool_of
from .padding import FixedShapeMasksMixin, policy_for
from .request import (
    FLEXIBLE_STATIC,
    SAVED_REQUEST_KEY,
    STAND_IN,
    asks_for_flexible,
    cache_config_of,
    normalize_saved_form,
    requested_cache_config,
    without_request,
)
from .serving import context as serving_context

_last_cache = threading.local()


def _last_caches() -> weakref.WeakKeyDictionary:
    """This thread's last flexible cache per model (weakly keyed: a model's entry goes with the model)."""
    if not hasattr(_last_cache, "by_model"):
        _last_cache.by_model = weakref.WeakKeyDictionary()
    return _last_cache.by_model


class FlexCacheGenerationMixin(FixedShapeMasksMixin):
    """Adds `cache_implementation="flexible_static"` to a model's `generate`.

    It reaches override models through `FlexModelMixin`, before the upstream class: `class
    FlexT5ForConditionalGeneration(FlexModelMixin, T5ForConditionalGeneration, GenerationMixin)`. Other cache
    implementations go to upstream unchanged.
    """

    # The model input that masks encoder positions in cross-attention (padded with the encoder outputs).
    _flex_encoder_mask_key = "attention_mask"

    def generate(self, *args, **kwargs):
        if serving_context.current_request() is not None:
            # A request of the serving engine: its cache and model calls go to the engine, at the request's own shapes.
            return super().generate(*args, **kwargs)
        with call_scope():
            if isinstance(self, FlexCacheInnerGenerateMixin):
                # The model's own generate (Whisper's) runs at the call's batch; each call it makes to upstream's
                # `GenerationMixin.generate` is a call of its own (see FlexCacheInnerGenerateMixin).
                output = super().generate(*args, **kwargs)
            else:
                output = policy_for(self, args, kwargs).generate(self, super().generate, args, kwargs)
            # Inside the scope, while the lease is held: once given back, another call may take the storage.
            note_returned(output)
        return output

    def _prepare_generation_config(self, generation_config, **kwargs):
        """Wraps `GenerationMixin._prepare_generation_config` (transformers==5.24.0).

        Differences: a request for `flexible_static` (in `kwargs`, in `generation_config`, or in the model's own
        generation config, as `cache_implementation` or in the saved form) is taken out before upstream merges and
        validates the configs (upstream's validation knows only its own names; a valid one stands in), and set on the
        merged copy afterwards with its `cache_config`. Upstream's precedence is kept: the call's kwargs, then its
        `generation_config`, then the model's. The model's own config is rewritten into the saved form, in place.
        """
        normalize_saved_form(self.generation_config)
        named = kwargs.get("cache_implementation")
        asks = (named == FLEXIBLE_STATIC) if named is not None else None
        for source in (generation_config, self.generation_config):
            asks = asks_for_flexible(source) if asks is None else asks
        if not asks:
            if asks_for_flexible(generation_config) is not None:
                generation_config = without_request(generation_config)
            resolved, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
            vars(resolved).pop(SAVED_REQUEST_KEY, None)
            return resolved, model_kwargs

        cache_config = kwargs.pop("cache_config", None)
        for source in (generation_config, self.generation_config):
            cache_config = cache_config_of(source) if cache_config is None else cache_config
        kwargs.pop("cache_implementation", None)
        if generation_config is not None:
            generation_config = without_request(generation_config)
            generation_config.cache_implementation = STAND_IN
        else:
            kwargs["cache_implementation"] = STAND_IN
        resolved, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        resolved.cache_implementation = FLEXIBLE_STATIC
        resolved.cache_config = CacheConfig.parse(cache_config).to_dict()
        vars(resolved).pop(SAVED_REQUEST_KEY, None)
        return resolved, model_kwargs

    @property
    def flexible_cache(self):
        """The cache object that this thread's last flexible `generate` call on this model used, or None.

        Its storage may since have been reused by a later call (in this or another thread): it is then stale, and
        raises on use. `transformers_flexcache.held_nbytes(model)` tells what the model holds.
        """
        return _last_caches().get(self)

    def _flexible_cache_need(self, generation_config, model_kwargs: dict, batch_size: int, max_cache_length: int):
        """Rows, decoder positions and (encoder-decoder) encoder positions that this generate call needs."""
        expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        length = max_cache_length
        if generation_config.max_cache_len is not None:
            # Upstream's `max_cache_len` generation option is honoured as a floor, as for its static cache.
            length = max(length, generation_config.max_cache_len)
        if generation_config.prompt_lookup_num_tokens:
            # Prompt-lookup candidates are copied from the prompt and are not capped at `max_length`: the last forward
            # of a call can write that many positions past `max_length - 1`.
            length += generation_config.prompt_lookup_num_tokens
        if self.device.type == "mps":
            length += 1  # upstream defers its stop check on MPS: one more forward than `max_length` allows
        need = {"max_batch_size": batch_size * expand, "max_cache_len": length}
        if self.config.is_encoder_decoder:
            need["max_encoder_len"] = model_kwargs["encoder_outputs"][0].shape[1]
        return need

    def _flexible_cache_kind(self, config: CacheConfig) -> tuple:
        self_specs, cross_specs = layer_specs_for_model(self)
        return (self.config.is_encoder_decoder, config.shape_policy, tuple(self_specs), tuple(cross_specs or ()))

    def _build_flexible_cache(self, kind: tuple, config: CacheConfig, capacities: dict):
        encoder_decoder, shape_policy, self_specs, cross_specs = kind
        common = {
            "config": self.config,
            "max_batch_size": capacities["max_batch_size"],
            "max_cache_len": capacities["max_cache_len"],
            "on_overflow": config.on_overflow,
            "shape_policy": shape_policy,
            "layer_specs": list(self_specs),
        }
        if encoder_decoder:
            return FlexibleEncoderDecoderCache(
                max_encoder_len=capacities["max_encoder_len"], cross_layer_specs=list(cross_specs), **common
            )
        return FlexibleStaticCache(**common)

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        """Overrides `GenerationMixin._prepare_cache_for_generation` (transformers==5.24.0) for one new name.

        Differences: `cache_implementation="flexible_static"` leases a cache of the model's pool, reserved for what
        the call needs, instead of building a new cache; a flexible cache passed as `past_key_values` is leased as it
        is (a continuation) and reserved for the call; a request of the serving engine gets its seats of the engine's
        cache (`RequestSeats`). Every other case goes to upstream unchanged.
        """
        request = serving_context.current_request()
        if request is not None:
            # flexcache: a request of the serving engine runs on its seats of the engine's cache.
            model_kwargs["cache"] = request.open_session(generation_config, model_kwargs, batch_size, max_cache_length)
            return
        config = requested_cache_config(generation_config)
        given = model_kwargs.get("cache")
        if config is None and not is_flexible_cache(given):
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        if given is not None and not is_flexible_cache(given):
            raise ValueError(
                "Passing both `cache_implementation` (used to initialize certain caches) and `cache` (a Cache "
                "object) is unsupported. Please use only one of the two."
            )
        if generation_config.use_cache is False and given is None:
            return
        # A continuation without a cache_config of its own runs as its cache was filled.
        config = config or CacheConfig(on_overflow=given.on_overflow, shape_policy=given.shape_policy)
        policy = policy_for(self, (), {}, config=config)
        extra_need = policy.prepare_model_kwargs(self, generation_config, model_kwargs, config)
        need = {
            **self._flexible_cache_need(generation_config, model_kwargs, batch_size, max_cache_length),
            **extra_need,
        }
        pool = pool_of(self)
        if given is not None:
            lease = pool.lease_given(given, need=need, config=config)
            given._is_user_defined = True
        else:
            kind = self._flexible_cache_kind(config)
            lease = pool.lease(
                kind=kind,
                need=need,
                config=config,
                build=lambda capacities: self._build_flexible_cache(kind, config, capacities),
            )
        hold_for_call(lease)
        model_kwargs["cache"] = lease.cache
        _last_caches()[self] = lease.cache
        if generation_config.is_assistant:
            lease.cache.activate_past_recording()

    def _prepare_text_encoder_decoder_kwargs_for_generation(
        self, inputs_tensor, model_kwargs: dict, model_input_name, generation_config
    ) -> dict:
        """Derived from `GenerationMixin._prepare_text_encoder_decoder_kwargs_for_generation` (transformers==5.24.0).

        Differences: in a request of the serving engine, the encoder runs in the engine's next batched encoder call
        (with the other requests admitted at that step) instead of here; its kwargs are upstream's. Otherwise the
        method is upstream's.
        """
        request = serving_context.current_request()
        if request is None:
            return super()._prepare_text_encoder_decoder_kwargs_for_generation(
                inputs_tensor, model_kwargs, model_input_name, generation_config
            )
        encoder = self.get_encoder()
        irrelevant_prefix = ["decoder_", "cross_attn", "use_cache", "cache"]
        encoder_kwargs = {
            argument: value
            for argument, value in model_kwargs.items()
            if not any(argument.startswith(prefix) for prefix in irrelevant_prefix)
        }
        encoder_signature = set(inspect.signature(encoder.forward).parameters)
        if "kwargs" not in encoder_signature and "model_kwargs" not in encoder_signature:
            encoder_kwargs = {
                argument: value for argument, value in encoder_kwargs.items() if argument in encoder_signature
            }
        encoder_kwargs["output_attentions"] = generation_config.output_attentions
        encoder_kwargs["output_hidden_states"] = generation_config.output_hidden_states
        encoder_kwargs["return_dict"] = True
        encoder_kwargs[model_input_name if model_input_name is not None else self.main_input_name] = inputs_tensor
        model_kwargs["encoder_outputs"] = request.encode(encoder_kwargs)  # flexcache: batched by the engine
        return model_kwargs


class FlexCacheInnerGenerateMixin(GenerationMixin):
    """For models whose own `generate` calls upstream's `GenerationMixin.generate` on batches of its own (Whisper's
    runs one call per 30-second segment and per temperature fallback, on the rows still running).

    Each of those calls is a call of its own: it leases a cache (and gives it back when it returns), and a shape
    policy pads it, not the model's whole call (padding around the model's own generate would pad the wrong batch:
    its inner calls see the batch shrink as rows finish). Put this class right before `GenerationMixin`, which comes
    last among the override's bases: `class FlexWhisperForConditionalGeneration(FlexModelMixin,
    WhisperForConditionalGeneration, FlexCacheInnerGenerateMixin, GenerationMixin)`. Python's method resolution order
    then places it right before `GenerationMixin`, so the model's `super().generate(...)` reaches this `generate`.
    """

    def generate(self, *args, **kwargs):
        if serving_context.current_request() is not None:
            return super().generate(*args, **kwargs)
        with call_scope():
            output = policy_for(self, args, kwargs).generate(self, super().generate, args, kwargs)
            # The model's generate usually returns this cache (Whisper's does when its rows are the call's rows).
            note_returned(output)
            return output
