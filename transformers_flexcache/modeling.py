"""The base of every override model: flexible-cache generate plus in-place module class swaps.

An override model is the upstream model class with `FlexModelMixin` in front, and a map from upstream submodule
classes to their `Flex` subclasses (`_flex_module_classes`). Building the model builds upstream's modules, then
changes the class of each mapped submodule in place: no weights are copied and state dicts stay upstream's. The
same swap turns an already-loaded upstream model into its override (`transformers_flexcache.convert`). A `Flex`
submodule class may therefore override methods only, never add state in `__init__`.
"""

from __future__ import annotations

from torch import nn
from transformers.modeling_utils import PreTrainedModel
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from .generation import FlexCacheGenerationMixin


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

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        swap_module_classes(self, self._flex_module_classes)

    @classmethod
    def flex_upstream_class(cls) -> type:
        """The upstream model class this override stands for (the first base after the mixins)."""
        return next(base for base in cls.__mro__[1:] if not issubclass(base, FlexCacheGenerationMixin))
