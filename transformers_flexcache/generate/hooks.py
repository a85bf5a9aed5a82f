"""The one seam through which a flexible generate call asks its plug-ins.

The generate path (`mixin.py`, `policies.py`) decides what a call needs and which cache it leases; what compiling
or serving changes about a call is asked of a `GenerateHooks` object, never tested for by type. Its defaults are
upstream's behaviour (and the generate path's own): a model without plug-ins runs as if the seam were not there.

Who answers (`hooks_of`):
- a serving engine's request: its worker thread plugs the request's hooks for the duration of its `generate`
  (`plugged`; `serving/request_seats.py`): the request's cache is its seats of the engine's cache, its encoder and
  model calls run in the engine's batched steps;
- otherwise the model class's `_flex_hooks`: an override model's are the compile wing's (`compile/hooks.py`, set on
  `models.modeling.FlexModelMixin`): inductor settings around a compiled call, the compiled encoder, the first
  decoder step in the decode graph, guards checked at a call's first step, static addresses;
- otherwise `GenerateHooks()` itself.

The arrows point down: `compile/` and `serving/` import this module, this package imports neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from transformers.cache_utils import Cache


class GenerateHooks:
    """What a flexible generate call asks its plug-ins; every default is upstream's behaviour."""

    def plans_calls(self, model) -> bool:
        """Whether `model.generate` runs as a flexible call (a plan, a lease of the model's pool, the shape policy).
        False: upstream's generate runs as it is, and the plug-in answers for its cache and model calls."""
        return True

    def call_context(self, model, generation_config) -> contextlib.AbstractContextManager:
        """A context around a fixed-shape call's run of upstream's generate (its encoder included), entered once the
        call's generation config is resolved. It may refuse the call (raise) before anything is padded."""
        return contextlib.nullcontext()

    def take_cache(self, model, generation_config, model_kwargs: dict, batch_size: int, max_cache_length: int):
        """A cache for the call when upstream's generate prepares one, instead of a lease of the model's pool
        (`GenerationMixin._prepare_cache_for_generation`'s arguments); None: the generate path decides."""
        return None

    def cache_leased(self, model, cache) -> None:
        """Called with each cache a flexible call leases, before the call uses it."""
        return None

    def encodes(self, model) -> bool:
        """Whether the plug-in runs the encoder of a call that upstream's generate encodes itself
        (`_prepare_text_encoder_decoder_kwargs_for_generation`; `encode`). False: upstream's encoder runs."""
        return False

    def encode(self, model, encoder_kwargs: dict):
        """The encoder outputs of `encoder_kwargs` (upstream's, for the model's encoder), where `encodes`."""
        raise NotImplementedError

    def call_padded(self, model, plan, generation_config) -> None:
        """A fixed-shape call's padded shapes are known (`plan.padding`), before anything of it runs or compiles."""

    def encode_padded_call(self, model, generation_config, input_name: str, model_inputs: dict, *, candidates: bool):
        """The model kwargs of a fixed-shape encoder-decoder call encoded at its own rows (its encoder outputs in
        place of `model_inputs[input_name]`), or None: the call is encoded as the policy would otherwise."""
        return None

    def first_step(self, model, plan, input_ids, generation_config, model_kwargs: dict):
        """The outputs of a flexible call's first forward (`GenerationMixin._prefill`), or None: upstream's."""
        return None

    def compiled_call(self, model, plan, compile_config, compiled):
        """The compiled forward a flexible call runs, given upstream's (`PreTrainedModel.get_compiled_call`)."""
        return compiled


class ForwardingCache(Cache):
    """A cache whose model calls a plug-in runs elsewhere (a serving engine's seats: the call runs in the engine's
    next batched step). `models.modeling.FlexModelMixin.__call__` hands a model call given one to its `forward`."""

    def forward(self, model_inputs: dict):
        """Run `model(**model_inputs)` for this cache's rows; returns the model's outputs."""
        raise NotImplementedError


DEFAULT_HOOKS = GenerateHooks()
# The hooks plugged in for this context (a serving engine's worker thread, for its request's generate).
_PLUGGED: ContextVar[GenerateHooks | None] = ContextVar("transformers_flexcache_plugged_hooks", default=None)


def hooks_of(model) -> GenerateHooks:
    """The hooks that answer for `model`'s generate in this context (module docstring)."""
    plugged = _PLUGGED.get()
    if plugged is not None:
        return plugged
    return getattr(model, "_flex_hooks", None) or DEFAULT_HOOKS


@contextlib.contextmanager
def plugged(hooks: GenerateHooks) -> Iterator[GenerateHooks]:
    """Within this context (this thread), every flexible generate call asks `hooks`."""
    token = _PLUGGED.set(hooks)
    try:
        yield hooks
    finally:
        _PLUGGED.reset(token)


def plugged_hooks() -> GenerateHooks | None:
    """The hooks plugged in for this context, or None."""
    return _PLUGGED.get()
