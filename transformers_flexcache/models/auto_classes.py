"""Where transformers' AutoModel classes meet the override classes: the mappings and the saved `auto_map`.

Design decisions:
- "The auto classes of an override" are found, never listed: every AutoModel mapping in
  `transformers.models.auto.modeling_auto` whose entry for the upstream `model_type` names the upstream class we
  override (T5: `AutoModelForSeq2SeqLM` and `AutoModelForPreTraining`). `register()` edits those mappings, and
  `save_pretrained` writes those auto classes into `config.json`'s `auto_map`, so a new override needs no list here.
- The folder saved by an override model holds a small `modeling_flexcache.py` that *takes* the override class from
  the installed package by its name, through one public, versioned entry point (`transformers_flexcache.saved`), so
  that no later move of our modules breaks a saved folder; instead of upstream's mechanism (`register_for_auto_class` + `custom_object_save`), which
  copies the file that defines the class. A copy would be a second, stale class outside the package; the import
  gives the package's own class at the installed version, so `from_pretrained(dir, trust_remote_code=True)` in a
  process that never called `register()` builds exactly the class `register()` would have given.
- The checkpoint itself stays upstream's: the weights, and the config apart from `auto_map`, which transformers
  reads only when `trust_remote_code=True`. Without it, AutoModel classes load the folder into upstream's class.
"""

from __future__ import annotations

import os

from transformers.models.auto import modeling_auto
from transformers.models.auto.auto_factory import _BaseAutoModelClass, _LazyAutoMapping

# The module that `save_pretrained` writes beside `config.json`; `auto_map` entries point into it.
REMOTE_CODE_MODULE = "modeling_flexcache"
# The format of the `REMOTE_CODE_MODULE` this package writes; `saved.READABLE_FORMAT_VERSIONS` are those it reads.
FORMAT_VERSION = 1

_MODULE_TEMPLATE = '''"""Written by transformers-flexcache's `save_pretrained`: the model classes of this folder.

It holds no model code. `AutoModel*.from_pretrained(<this folder>, trust_remote_code=True)` takes the override class
from the installed transformers-flexcache package (`pip install transformers-flexcache`), through its stable entry
point `transformers_flexcache.saved.override_class`, so the model runs the package's code at the installed version.
Without `trust_remote_code`, transformers loads this folder into its own class ({upstream_name}).
"""

from transformers_flexcache.saved import override_class

{name} = override_class("{name}", format_version={format_version})

__all__ = ["{name}"]
'''


def auto_mappings() -> list[_LazyAutoMapping]:
    """Every model mapping of `transformers.models.auto.modeling_auto`, including those no auto class uses."""
    return [value for value in vars(modeling_auto).values() if isinstance(value, _LazyAutoMapping)]


def mapped_class_names(mapping: _LazyAutoMapping, model_type: str) -> tuple[str, ...]:
    """The class names that upstream's `mapping` gives for `model_type` (not counting registrations)."""
    names = mapping._model_mapping.get(model_type, ())
    return (names,) if isinstance(names, str) else tuple(names)


def maps_to(mapping: _LazyAutoMapping, upstream_class: type) -> bool:
    """Whether upstream's `mapping` gives `upstream_class` for its config's `model_type`."""
    return upstream_class.__name__ in mapped_class_names(mapping, upstream_class.config_class.model_type)


def auto_classes_for(upstream_class: type) -> list[type[_BaseAutoModelClass]]:
    """The AutoModel classes that upstream maps to `upstream_class` (e.g. T5ForConditionalGeneration ->
    [AutoModelForPreTraining, AutoModelForSeq2SeqLM]), in the order `modeling_auto` defines them."""
    classes = []
    for value in vars(modeling_auto).values():
        is_auto_class = isinstance(value, type) and issubclass(value, _BaseAutoModelClass)
        mapping = getattr(value, "_model_mapping", None) if is_auto_class else None
        if mapping is not None and value not in classes and maps_to(mapping, upstream_class):
            classes.append(value)
    return classes


def auto_map_for(flex_class: type, *, extra_auto_classes: tuple[str, ...] = ()) -> dict[str, str]:
    """The `auto_map` entries of `config.json` that point every auto class of the override (and the named
    `extra_auto_classes`) at the class in `REMOTE_CODE_MODULE`."""
    names = [auto_class.__name__ for auto_class in auto_classes_for(flex_class.flex_upstream_class())]
    reference = f"{REMOTE_CODE_MODULE}.{flex_class.__name__}"
    return {name: reference for name in [*names, *extra_auto_classes]}


def write_remote_code_module(flex_class: type, save_directory: str | os.PathLike) -> str:
    """Write `REMOTE_CODE_MODULE`.py into `save_directory`, importing `flex_class` from its installed module.

    Returns:
        `str`: the path of the written file.
    """
    path = os.path.join(save_directory, f"{REMOTE_CODE_MODULE}.py")
    source = _MODULE_TEMPLATE.format(
        name=flex_class.__name__,
        upstream_name=flex_class.flex_upstream_class().__name__,
        format_version=FORMAT_VERSION,
    )
    with open(path, "w", encoding="utf-8") as file:
        file.write(source)
    return path
