"""The base of every override model: flexible-cache generate plus in-place module class swaps.

An override model is the upstream model class with `FlexModelMixin` in front, and a map from upstream submodule
classes to their `Flex` subclasses (`_flex_module_classes`). Building the model builds upstream's modules, then
changes the class of each mapped submodule in place: no weights are copied and state dicts stay upstream's. The
same swap turns an already-loaded upstream model into its override (`transformers_flexcache.convert`). A `Flex`
submodule class may therefore override methods only, never add state in `__init__`.

`save_pretrained` also writes an `auto_map` and a small `modeling_flexcache.py` that imports the override class, so
that `AutoModel*.from_pretrained(dir, trust_remote_code=True)` builds it without `register()` (see `models/auto_classes.py`).
"""

from __future__ import annotations

import os

import transformers.models.auto as transformers_auto
from torch import nn
from transformers.modeling_utils import PreTrainedModel
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from ..compile import COMPILE_HOOKS
from ..generate.hooks import ForwardingCache
from ..generate.mixin import FlexCacheGenerationMixin
from ..generate.request import normalize_saved_form
from .auto_classes import auto_map_for, write_remote_code_module


def swap_module_classes(model: nn.Module, module_classes: dict[type, type]) -> int:
    """Change the class of every submodule of `model` whose exact type is a key of `module_classes`.

    Returns:
        `int`: how many submodules were changed.
    """
    changed = 0
    for module in model.modules():
        flex_class = module_classes.get(type(module))
        if flex_class is not None:
            module.__class__ = flex_class
            if isinstance(module, PreTrainedModel):
                # Upstream registers `_can_record_outputs` (what `output_attentions`/`output_hidden_states` record) by
                # class name in `PreTrainedModel.__init__`, which a swapped class never runs.
                _CAN_RECORD_REGISTRY[module] = module._can_record_outputs
            changed += 1
    return changed


class FlexModelMixin(FlexCacheGenerationMixin):
    """Put it before the upstream model class; set `_flex_module_classes` to the submodules that change."""

    _flex_module_classes: dict[type, type] = {}
    # What its generate asks the plug-ins (`generate.hooks`): the compile wing answers for compiled calls.
    _flex_hooks = COMPILE_HOOKS

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        swap_module_classes(self, self._flex_module_classes)

    def __call__(self, *args, **kwargs):
        """`nn.Module.__call__`, except for a model call given a cache whose calls run elsewhere
        (`generate.hooks.ForwardingCache`: a serving engine's request's seats, whose call runs in the engine's next
        batched step, which returns this request's outputs).

        Intercepting the call, not `forward`, leaves `forward`'s signature to upstream, which `generate` inspects.
        """
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, ForwardingCache):
            return cache.forward(kwargs)
        return super().__call__(*args, **kwargs)

    @classmethod
    def flex_upstream_class(cls) -> type:
        """The upstream model class this override stands for (the first base after the mixins)."""
        return next(
            base
            for base in cls.__mro__[1:]
            if issubclass(base, PreTrainedModel) and not issubclass(base, FlexCacheGenerationMixin)
        )

    @classmethod
    def is_custom_code(cls) -> bool:
        """Overrides `PreTrainedModel.is_custom_code` (transformers==5.24.0): the upstream class answers.

        Differences: upstream counts every class whose module is outside `transformers.` as custom code, and treats
        custom code differently when loading: `_init_weights` is skipped for every module whose own parameters were
        all loaded, which a module without parameters of its own always is, so weights that T5 and Pix2Struct
        initialize from a parent module (attention projections, embeddings) and Whisper's sinusoidal
        `embed_positions` (set from `WhisperEncoder`) are left at generic defaults when missing from a checkpoint; and
        the checkpoint conversion mapping of the model type is skipped. An override runs upstream's modules,
        `_init_weights` and state dict, so it answers as its upstream class; it is custom code only when
        transformers loaded it as remote code (`is_remote_code`).
        """
        return cls.is_remote_code() or cls.flex_upstream_class().is_custom_code()

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """Overrides `PreTrainedModel._can_set_experts_implementation` (transformers==5.24.0): the upstream class
        answers.

        Differences: upstream reads the source of the module that defines the class, looking for
        `@use_experts_implementation`. An override's module (`model_overrides/<model_type>.py`) defines no experts,
        so upstream's answer would be False: the default `grouped_mm` would silently fall back to the eager experts
        loop, asking for `grouped_mm` would raise, and `set_experts_implementation` would do nothing. The experts
        modules are upstream's, so the upstream class's module decides.
        """
        return cls.flex_upstream_class()._can_set_experts_implementation()

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """Overrides `PreTrainedModel._can_set_attn_implementation` (transformers==5.24.0): the upstream class answers.

        Differences: upstream reads the source of the class's module (an `*Attention*(nn.Module)` class that does not
        call `ALL_ATTENTION_FUNCTIONS.get_interface` cannot switch). Our attention classes subclass upstream's and
        dispatch through the same interface, so the upstream class's module decides, whatever an override's module
        defines.
        """
        return cls.flex_upstream_class()._can_set_attn_implementation()

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """Overrides `PreTrainedModel.register_for_auto_class` (transformers==5.24.0): records `auto_class` for the
        `auto_map` that `save_pretrained` writes.

        Differences: upstream sets `cls._auto_class`, which makes `save_pretrained` copy the file defining the class
        (`model_overrides/<model_type>.py`) into the folder and point `auto_map` at that copy. `save_pretrained`
        already maps every auto class that upstream uses for this model to `modeling_flexcache.py`, which imports
        the installed class; this only adds `auto_class` to them. transformers calls this method on the class it
        loads through `trust_remote_code`, so a model loaded that way saves the same folder again.

        Raises:
            ValueError: `auto_class` is not an auto class of `transformers.models.auto`.
        """
        name = auto_class if isinstance(auto_class, str) else auto_class.__name__
        if not hasattr(transformers_auto, name):
            raise ValueError(f"{name} is not a valid auto class.")
        if name not in cls.__dict__.get("_flex_extra_auto_classes", ()):
            cls._flex_extra_auto_classes = (*cls.__dict__.get("_flex_extra_auto_classes", ()), name)

    def save_pretrained(
        self, save_directory, is_main_process: bool = True, state_dict=None, push_to_hub: bool = False, **kwargs
    ):
        """`PreTrainedModel.save_pretrained`, plus what a process without `register()` needs to build this class.

        Adds to `config.json` an `auto_map` from every auto class upstream uses for this model (and any given to
        `register_for_auto_class`) to `modeling_flexcache.<class name>`, and writes `modeling_flexcache.py`, which
        imports the class from the installed package. The weights and the rest of the config are upstream's.

        Raises:
            ValueError: `push_to_hub=True`: upstream uploads inside its `save_pretrained`, before the module file
                exists; `model.push_to_hub(repo_id)` saves through this method and uploads the whole folder.
        """
        if push_to_hub:
            raise ValueError(
                f"{type(self).__name__}.save_pretrained(push_to_hub=True) would upload the folder before "
                "modeling_flexcache.py is written; save with push_to_hub=False, or call model.push_to_hub(repo_id), "
                "which saves through save_pretrained and uploads the whole folder"
            )
        # A request for flexible_static is saved where upstream does not validate it: the folder loads without us.
        normalize_saved_form(self.generation_config)
        save_on_this_rank = self.should_save_on_this_rank(is_main_process)
        had_auto_map = "auto_map" in vars(self.config)
        previous = self.config.auto_map if had_auto_map else None
        # Set only while upstream writes config.json: the model's config is left as it was.
        self.config.auto_map = {
            **(previous or {}),
            **auto_map_for(type(self), extra_auto_classes=getattr(type(self), "_flex_extra_auto_classes", ())),
        }
        try:
            super().save_pretrained(save_directory, is_main_process=is_main_process, state_dict=state_dict, **kwargs)
        finally:
            if had_auto_map:
                self.config.auto_map = previous
            else:
                del self.config.auto_map
        if save_on_this_rank and os.path.isdir(save_directory):
            write_remote_code_module(type(self), save_directory)
