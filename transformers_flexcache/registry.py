"""Registration of the override models with transformers' AutoModel classes, and in-place conversion.

Design decisions:
- Nothing happens at import. `register()` maps each supported upstream config class to its override in every
  AutoModel mapping where upstream maps it to the class we override (e.g. `T5Config` in `AutoModelForSeq2SeqLM`),
  and makes `cache_implementation="flexible_static"` a valid name. It is idempotent; `unregister()` restores the
  mappings exactly as they were.
- `convert(model)` turns a loaded upstream model into its override in place (class swaps, no weight copies).
"""

from __future__ import annotations

import importlib

from .auto_classes import auto_mappings, maps_to
from .generation import accept_cache_implementation_name, forget_cache_implementation_name
from .modeling import FlexModelMixin, swap_module_classes

# model_type -> module under model_overrides/ that defines its override classes (`FLEX_MODEL_CLASSES`).
SUPPORTED_MODEL_TYPES = ("llama", "t5", "bart", "whisper", "jamba", "pix2struct")

_MISSING = object()
# (mapping, config class) -> what mapping._extra_content held before register(), to restore it exactly.
_saved: dict[tuple[int, type], object] = {}


def flex_model_classes() -> list[type[FlexModelMixin]]:
    """Every override model class, from the modules in `model_overrides/`."""
    classes = []
    for model_type in SUPPORTED_MODEL_TYPES:
        module = importlib.import_module(f"model_overrides.{model_type}")
        classes.extend(module.FLEX_MODEL_CLASSES)
    return classes


def register() -> None:
    """Return the override classes from AutoModel classes, and accept `cache_implementation="flexible_static"`.

    After it, e.g. `AutoModelForSeq2SeqLM.from_config(T5Config(...))` and `.from_pretrained(dir)` build
    `FlexT5ForConditionalGeneration`. Idempotent; undone by `unregister()`.
    """
    accept_cache_implementation_name()
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
    """Undo `register()`: AutoModel classes return upstream's classes again, and the cache name is refused."""
    mappings = {id(mapping): mapping for mapping in auto_mappings()}
    for (mapping_id, config_class), previous in _saved.items():
        mapping = mappings[mapping_id]
        if previous is _MISSING:
            mapping._extra_content.pop(config_class, None)
        else:
            mapping._extra_content[config_class] = previous
    _saved.clear()
    forget_cache_implementation_name()


def convert(model):
    """Turn a loaded upstream model into its override, in place (no weight copies), and return it.

    Raises:
        TypeError: the model's class has no override; the message lists those that do.
    """
    if isinstance(model, FlexModelMixin):
        return model
    by_upstream = {flex_class.flex_upstream_class(): flex_class for flex_class in flex_model_classes()}
    flex_class = by_upstream.get(type(model))
    if flex_class is None:
        supported = sorted(upstream.__name__ for upstream in by_upstream)
        raise TypeError(f"{type(model).__name__} has no flexcache override; supported classes are {supported}")
    accept_cache_implementation_name()
    model.__class__ = flex_class
    swap_module_classes(model, flex_class._flex_module_classes)
    return model
