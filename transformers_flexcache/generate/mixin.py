"""`generate(cache_implementation="flexible_static")`: one plan per call, a cache leased for its duration.

Design decisions:
- A call asks for the flexible cache with `cache_implementation="flexible_static"` (in its kwargs or its
  `generation_config`), or through the model's own generation config (the saved form, `flexible_static={...}`: a
  custom entry that upstream neither validates nor reads, so the folder loads in plain transformers). Our name never
  reaches upstream's validation, which knows only its own names: `register()` is needed only for upstream classes.
- Each call gets a `CallPlan` at the door (`generate/plan.py`): the request resolved and its `cache_config` parsed once, the
  shape policy that runs it, the one capacity question to the model's pool, the padding record, the lease and the
  cache. The overrides below read the running call's plan; none of them resolves the request again.
- A call's needs are upstream's own numbers: rows (`batch x max(num_beams, num_return_sequences)`), decoder positions
  (`max_length - 1`, at least `max_cache_len`, plus prompt-lookup candidates, which may run past `max_length`),
  encoder positions. The pool decides whether they fit, grow or are refused before anything is written.
- The cache comes from the model's pool (`generate/pool.py`): a lease for the call, a new cache object over reused
  storage. A cache passed back as `past_key_values` is leased as it is (a continuation).
- What a shape policy adds around a call (padding) lives in `generate/policies.py`.
"""

from __future__ import annotations

from transformers.generation.utils import GenerationMixin

from ..cache import is_flexible_cache
from .hooks import hooks_of
from .plan import CallPlan, current_plan
from .policies import FixedShapeMasksMixin
from .pool import pool_of
from .request import (
    FLEXIBLE_STATIC,
    SAVED_REQUEST_KEY,
    STAND_IN,
    Request,
    asks_for_flexible,
    normalize_saved_form,
    resolve_request,
    without_request,
)
from .signatures import signature_of


class FlexCacheGenerationMixin(FixedShapeMasksMixin):
    """Adds `cache_implementation="flexible_static"` to a model's `generate`.

    It reaches override models through `FlexModelMixin`, before the upstream class: `class
    FlexT5ForConditionalGeneration(FlexModelMixin, T5ForConditionalGeneration, GenerationMixin)`. Other cache
    implementations go to upstream unchanged.
    """

    # The model input that masks encoder positions in cross-attention (padded with the encoder outputs).
    _flex_encoder_mask_key = "attention_mask"
    # Whether the model's own generate repeats each input per returned sequence before upstream's (Whisper's does).
    _flex_repeats_inputs_per_sequence = False

    def generate(self, *args, **kwargs):
        if not hooks_of(self).plans_calls(self):
            # A plug-in answers for this call's cache and model calls (a serving engine's request): upstream's generate.
            return super().generate(*args, **kwargs)
        plan = CallPlan.at_door(self, args, kwargs)
        with plan.running():
            if isinstance(self, FlexCacheInnerGenerateMixin):
                # The model's own generate (Whisper's) runs at the call's batch; each call it makes to upstream's
                # `GenerationMixin.generate` is a call of its own (see FlexCacheInnerGenerateMixin).
                output = super().generate(*args, **kwargs)
            else:
                output = plan.run(super().generate, args, kwargs)
            # Inside the call, while the lease is held: once given back, another call may take the storage.
            plan.note_returned(output)
        return output

    def get_compiled_call(self, compile_config):
        """Stands for `PreTrainedModel.get_compiled_call` (transformers==5.24.0): its compiled call, which inside a
        flexible call the plug-ins may wrap (`hooks.GenerateHooks.compiled_call`: the compile wing checks dynamo's
        guards in full at the call's first step only)."""
        compiled = super().get_compiled_call(compile_config)
        plan = current_plan(self)
        if plan is None or not plan.flexible:
            return compiled
        return hooks_of(self).compiled_call(self, plan, compile_config, compiled)

    def _flex_request(self, generation_config, kwargs: dict) -> Request:
        """What the running call asks for (its plan's request), or, outside a call, what these arguments ask for."""
        plan = current_plan(self)
        return plan.request if plan is not None else resolve_request(self, generation_config, kwargs)

    def _prepare_generation_config(self, generation_config, **kwargs):
        """Wraps `GenerationMixin._prepare_generation_config` (transformers==5.24.0).

        Differences: a request for `flexible_static` (in `kwargs`, in `generation_config`, or in the model's own
        generation config, as `cache_implementation` or in the saved form; resolved once per call, see `generate/plan.py`) is
        taken out before upstream merges and validates the configs (upstream's validation knows only its own names; a
        valid one stands in), and set on the merged copy afterwards with its `cache_config`. Upstream's precedence is
        kept: the call's kwargs, then its `generation_config`, then the model's. The model's own config is rewritten
        into the saved form, in place. Upstream's generate takes the config that a fixed-shape policy resolved at
        the door of the same call, when its arguments are the same (`CallPlan.take_resolved`).
        """
        plan = current_plan(self)
        if plan is not None:
            taken = plan.take_resolved(generation_config, kwargs)
            if taken is not None:  # resolved at the door of this call, with these arguments
                return taken
            if plan.keep_resolved:  # the door's resolution: kept for upstream's generate to take
                plan.keep_resolved, asked = False, (generation_config, dict(kwargs))
                resolved, model_kwargs = self._flex_resolve_generation_config(generation_config, kwargs)
                plan.hold_resolved(*asked, resolved)
                return resolved, model_kwargs
        return self._flex_resolve_generation_config(generation_config, kwargs)

    def _flex_resolve_generation_config(self, generation_config, kwargs: dict):
        """`_prepare_generation_config`'s resolution (its docstring): the request taken out, upstream's, the request
        set on the merged copy."""
        request = self._flex_request(generation_config, kwargs)
        normalize_saved_form(self.generation_config)
        if not request.flexible:
            if asks_for_flexible(generation_config) is not None:
                generation_config = without_request(generation_config)
            resolved, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
            vars(resolved).pop(SAVED_REQUEST_KEY, None)
            return resolved, model_kwargs

        kwargs.pop("cache_config", None)
        kwargs.pop("cache_implementation", None)
        if generation_config is not None:
            generation_config = without_request(generation_config)
            generation_config.cache_implementation = STAND_IN
        else:
            kwargs["cache_implementation"] = STAND_IN
        resolved, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        resolved.cache_implementation = FLEXIBLE_STATIC
        resolved.cache_config = request.cache_config.to_dict()
        vars(resolved).pop(SAVED_REQUEST_KEY, None)
        return resolved, model_kwargs

    @property
    def flexible_cache(self):
        """The cache object that this thread's last flexible `generate` call on this model used, or None.

        Its storage may since have been reused by a later call (in this or another thread): it is then stale, and
        raises on use. `transformers_flexcache.held_nbytes(model)` tells what the model holds.
        """
        pool = pool_of(self, create=False)
        return pool.last_cache() if pool is not None else None

    def _flex_encoder_len(self, inputs_tensor, model_input_name: str, model_kwargs: dict) -> int:
        """Encoder positions of a call, before its encoder runs: those of `encoder_outputs` when given, else one per
        position of the main input (tokens, embeddings, image patches). Models whose encoder changes the length
        override it (Whisper's convolutions halve its frames)."""
        # inputs_tensor: [B, L_in, ...] -> L_enc
        encoder_outputs = model_kwargs.get("encoder_outputs")
        if encoder_outputs is not None:
            return encoder_outputs[0].shape[1]
        return inputs_tensor.shape[1]

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        """Overrides `GenerationMixin._prepare_cache_for_generation` (transformers==5.25.0) for one new name.

        Differences: `cache_implementation="flexible_static"` leases a cache of the model's pool, reserved for what
        the call needs, instead of building a new cache; a flexible cache passed as `past_key_values` is leased as it
        is (a continuation) and reserved for the call; a plug-in's cache where one answers (`hooks.GenerateHooks.
        take_cache`: a serving engine's request runs on its seats of the engine's cache). Every other case goes to
        upstream unchanged. An assistant's cache is put to record its past without upstream's
        `recurrent_states_to_keep` (transformers 5.25; 5.24 takes no argument): only linear-attention layers read it,
        and ours refuse past recording.
        """
        hooks = hooks_of(self)
        taken = hooks.take_cache(self, generation_config, model_kwargs, batch_size, max_cache_length)
        if taken is not None:
            model_kwargs["cache"] = taken  # flexcache: a plug-in's cache
            return
        plan = current_plan(self)
        if plan is None:  # upstream's generate called without ours: the resolved config tells the request
            plan = CallPlan.at_door(self, (), {"generation_config": generation_config, **model_kwargs})
        given = model_kwargs.get("cache")
        if not plan.flexible and not is_flexible_cache(given):
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
        cache = plan.take_cache(generation_config, model_kwargs, batch_size, max_cache_length)
        hooks.cache_leased(self, cache)
        if given is not None:
            given._is_user_defined = True
        model_kwargs["cache"] = cache
        if generation_config.is_assistant:
            cache.activate_past_recording()

    def _prefill(self, input_ids, generation_config, model_kwargs: dict, is_first_iteration: bool = True):
        """Wraps `GenerationMixin._prefill` (transformers==5.25.0).

        Differences: a plug-in may run a flexible call's first forward (`hooks.GenerateHooks.first_step`: the compile
        wing runs the first decoder step of a compiled fixed-shape encoder-decoder call in the compiled decode graph,
        its cross-attention keys and values projected beforehand); upstream runs it eagerly. Every other call is
        upstream's.
        """
        plan = current_plan(self)
        if is_first_iteration and plan is not None:
            outputs = hooks_of(self).first_step(self, plan, input_ids, generation_config, model_kwargs)
            if outputs is not None:
                return outputs
        return super()._prefill(input_ids, generation_config, model_kwargs, is_first_iteration)

    def _prepare_text_encoder_decoder_kwargs_for_generation(
        self, inputs_tensor, model_kwargs: dict, model_input_name, generation_config
    ) -> dict:
        """Derived from `GenerationMixin._prepare_text_encoder_decoder_kwargs_for_generation` (transformers==5.24.0).

        Differences: a plug-in may run the encoder on upstream's kwargs (`hooks.GenerateHooks.encode`: a serving
        engine's request is encoded in the engine's next batched encoder call, with the other requests admitted at
        that step) instead of here. Otherwise the method is upstream's.
        """
        hooks = hooks_of(self)
        if not hooks.encodes(self):
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
        encoder_signature = set(signature_of(encoder.forward).parameters)
        if "kwargs" not in encoder_signature and "model_kwargs" not in encoder_signature:
            encoder_kwargs = {
                argument: value for argument, value in encoder_kwargs.items() if argument in encoder_signature
            }
        encoder_kwargs["output_attentions"] = generation_config.output_attentions
        encoder_kwargs["output_hidden_states"] = generation_config.output_hidden_states
        encoder_kwargs["return_dict"] = True
        encoder_kwargs[model_input_name if model_input_name is not None else self.main_input_name] = inputs_tensor
        model_kwargs["encoder_outputs"] = hooks.encode(self, encoder_kwargs)  # flexcache: the plug-in's encoder call
        return model_kwargs


class FlexCacheInnerGenerateMixin(GenerationMixin):
    """For models whose own `generate` calls upstream's `GenerationMixin.generate` on batches of its own (Whisper's
    runs one call per 30-second segment and per temperature fallback, on the rows still running).

    Each of those calls is a call of its own: it has a plan, leases a cache (and gives it back when it returns), and
    a shape policy pads it, not the model's whole call (padding around the model's own generate would pad the wrong
    batch: its inner calls see the batch shrink as rows finish). Put this class right before `GenerationMixin`, which
    comes last among the override's bases: `class FlexWhisperForConditionalGeneration(FlexModelMixin,
    WhisperForConditionalGeneration, FlexCacheInnerGenerateMixin, GenerationMixin)`. Python's method resolution order
    then places it right before `GenerationMixin`, so the model's `super().generate(...)` reaches this `generate`.
    """

    def generate(self, *args, **kwargs):
        if not hooks_of(self).plans_calls(self):
            return super().generate(*args, **kwargs)
        plan = CallPlan.at_door(self, args, kwargs)
        with plan.running():
            output = plan.run(super().generate, args, kwargs)
            # The model's generate usually returns this cache (Whisper's does when its rows are the call's rows).
            plan.note_returned(output)
            return output
