"""Registration of the override models with transformers' AutoModel classes, and in-place conversion.

Design decisions:
- Nothing happens at import, and nothing of upstream is captured then. `register()` maps each supported upstream
  config class to its override in every AutoModel mapping where upstream maps it to the class we override (e.g.
  `T5Config` in `AutoModelForSeq2SeqLM`), and makes `cache_implementation="flexible_static"` a valid name for any
  `GenerationConfig`. So that an upstream model asked for that name fails loudly instead of silently using a
  DynamicCache, `GenerationMixin._prepare_cache_for_generation` is wrapped to refuse it, with a hint.
- `register()` is idempotent; `unregister()` puts back exactly what `register()` found, the moment it ran. Nothing
  else ever patches upstream: our model classes accept the name on their own (see `generate/mixin.py`), so neither their
  construction nor their `generate` touches upstream.
- `convert(model)` turns a loaded upstream model into its override in place (class swaps, no weight copies).
- The override classes are listed in `models/catalogue.py`: a module of `model_overrides/` per type in
  `SUPPORTED_MODEL_TYPES`, written by hand, and the generated classes of `generic.py` for decoder-only models that
  need no module change (judged from their source). `register()` maps the hand-written ones and those of
  `GENERIC_MODEL_TYPES` (the types the tests cover); `convert` also takes any other model that the generic route
  accepts, and says why when it does not.
"""

from __future__ import annotations

from transformers.generation import configuration_utils as generation_configuration
from transformers.generation.utils import GenerationMixin

from ..generate.request import FLEXIBLE_STATIC
from .auto_classes import auto_mappings, maps_to
from .catalogue import GENERIC_MODEL_TYPES, SUPPORTED_MODEL_TYPES, flex_model_classes
from .generic import GenericFlexModelMixin, config_reasons_against, flex_class_for, reasons_against, refusal
from .modeling import FlexModelMixin, swap_module_classes

_MISSING = object()
# What register() replaced, to restore it exactly: (mapping id, config class) -> the previous entry, and the
# previous names tuple and `_prepare_cache_for_generation`.
_saved: dict[tuple[int, type], object] = {}
_saved_upstream: dict[str, object] = {}

__all__ = [
    "GENERIC_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "convert",
    "flex_model_classes",
    "is_registered",
    "register",
    "unregister",
]


def _generic_refusal(upstream_class: type, config) -> str | None:
    """Why the generic route cannot serve `upstream_class` with `config`, as an error text; None when it can."""
    reasons = config_reasons_against(upstream_class, config)
    if not getattr(config, "is_encoder_decoder", False):
        reasons = reasons_against(upstream_class) + reasons
    return refusal(upstream_class, reasons) if reasons else None


def _refusing(previous):
    def _prepare_cache_for_generation(self, generation_config, *args, **kwargs):
        # Installed on GenerationMixin by register(): an upstream model asked for our name would otherwise fall
        # through to a DynamicCache and silently ignore the request. Our models override this method.
        if generation_config.cache_implementation == FLEXIBLE_STATIC:
            message = (
                f"{type(self).__name__} does not support cache_implementation={FLEXIBLE_STATIC!r}: it is upstream's "
                "class. Load it after transformers_flexcache.register() (AutoModel classes then return the "
                "override), or convert it in place with transformers_flexcache.convert(model)"
            )
            if type(self) not in {flex_class.flex_upstream_class() for flex_class in flex_model_classes()}:
                why = _generic_refusal(type(self), self.config)
                message += f". It has no written override, and convert(model) would refuse it: {why}" if why else ""
            raise ValueError(message)
        return previous(self, generation_config, *args, **kwargs)

    _prepare_cache_for_generation._flexcache_refuses = True
    _prepare_cache_for_generation.__wrapped_upstream__ = previous
    return _prepare_cache_for_generation


def _accept_name() -> None:
    if "names" in _saved_upstream:
        return
    names = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    _saved_upstream["names"] = names
    _saved_upstream["prepare"] = GenerationMixin.__dict__["_prepare_cache_for_generation"]
    if FLEXIBLE_STATIC not in names:
        generation_configuration.ALL_CACHE_IMPLEMENTATIONS = names + (FLEXIBLE_STATIC,)
    GenerationMixin._prepare_cache_for_generation = _refusing(_saved_upstream["prepare"])


def _forget_name() -> None:
    if "names" not in _saved_upstream:
        return
    names = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    if FLEXIBLE_STATIC in names and FLEXIBLE_STATIC not in _saved_upstream["names"]:
        generation_configuration.ALL_CACHE_IMPLEMENTATIONS = tuple(name for name in names if name != FLEXIBLE_STATIC)
    current = GenerationMixin.__dict__.get("_prepare_cache_for_generation")
    if getattr(current, "_flexcache_refuses", False):
        GenerationMixin._prepare_cache_for_generation = _saved_upstream["prepare"]
    _saved_upstream.clear()


def register() -> None:
    """Return the override classes from AutoModel classes, and accept `cache_implementation="flexible_static"`.

    After it, e.g. `AutoModelForSeq2SeqLM.from_config(T5Config(...))` and `.from_pretrained(dir)` build
    `FlexT5ForConditionalGeneration`, and an upstream model asked for the name raises with a hint. Idempotent;
    undone by `unregister()`.
    """
    _accept_name()
    for flex_class in flex_model_classes():
        upstream = flex_class.flex_upstream_class()
        config_class = upstream.config_class
        for mapping in auto_mappings():
            if not maps_to(mapping, upstream):
                continue
            key = (id(mapping), config_class)
            if key not in _saved:
                _saved[key] = mapping._extra_content.get(config_class, _MISSING)
            mapping._extra_content[config_class] = flex_class


def unregister() -> None:
    """Undo `register()`: AutoModel classes return upstream's classes again, and upstream's `GenerationConfig`
    refuses the name again (our model classes still accept it on their own)."""
    mappings = {id(mapping): mapping for mapping in auto_mappings()}
    for (mapping_id, config_class), previous in _saved.items():
        mapping = mappings[mapping_id]
        if previous is _MISSING:
            mapping._extra_content.pop(config_class, None)
        else:
            mapping._extra_content[config_class] = previous
    _saved.clear()
    _forget_name()


def is_registered() -> bool:
    return "names" in _saved_upstream


def convert(model):
    """Turn a loaded upstream model into its override, in place (no weight copies), and return it.

    A class without a written override is converted through the generic route (`generic.py`) when its source and its
    config allow it: a decoder-only model whose code reaches the cache only through public methods.

    Raises:
        TypeError: the model's class has no written override and the generic route refuses it (its source, or this
            model's config); the message says why (which function reads which cache internal, which layer type the
            cache does not hold) and lists the classes that have an override.
    """
    if isinstance(model, FlexModelMixin):
        return model
    by_upstream = {flex_class.flex_upstream_class(): flex_class for flex_class in flex_model_classes()}
    flex_class = by_upstream.get(type(model))
    if flex_class is None or issubclass(flex_class, GenericFlexModelMixin):
        why = _generic_refusal(type(model), model.config)
        if why is not None and flex_class is not None:
            raise TypeError(f"{type(model).__name__} with this config cannot be converted: {why}")
        if why is not None:
            supported = sorted(upstream.__name__ for upstream in by_upstream)
            raise TypeError(
                f"{type(model).__name__} has no flexcache override; supported classes are {supported}, and the "
                f"generic route for decoder-only models refuses it: {why}"
            )
        flex_class = flex_class or flex_class_for(type(model))
    model.__class__ = flex_class
    swap_module_classes(model, flex_class._flex_module_classes)
    return model
