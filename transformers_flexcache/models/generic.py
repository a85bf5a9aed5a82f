"""Decoder-only models that need no module change: their override classes, built from the upstream class.

Most decoder-only models of transformers 5.24 and 5.25 (Qwen2, Qwen3, Mistral, Phi3, Gemma2/3, SmolLM3, ...) reach their
cache only through its public methods (`update`, `get_seq_length`, `get_mask_sizes`, `is_sliding`), which
`FlexibleStaticCache` answers for the live batch and length. Their override is then the upstream class with
`FlexModelMixin` in front and nothing else, as `model_overrides/llama.py` writes by hand: here it is built on the fly,
`Flex<UpstreamName>`, once the upstream code has been checked.

How a model is judged eligible (`reasons_against`, `config_reasons_against`):
- Source: every function of `transformers.models` that the class runs (its methods, its submodules', their helpers:
  `models.source_check.model_code`) is read for cache internals (`models.source_check.cache_internal_reads`: `is_updated`,
  `.layers[i]`, `.keys`/`.values`, `key_cache`, private storage). Any read refuses the model, naming the function,
  the line and the expression, unless it is one of `REVIEWED_READS`: reads checked by hand not to run with a
  flexible decoder-only cache under a stated config condition (GPT2's cross-attention branch), matched exactly, so
  that a change upstream is read again instead of trusted.
- Config (checked when `flexible_static` is asked for, and by `convert`): the model is decoder-only, every decoder
  layer type is one the cache holds (`full_attention`, `sliding_attention`, `linear_attention` with Jamba's Mamba
  sizes), and the conditions of the reviewed reads hold.

Design decisions:
- Classes are built once per upstream class and kept in this module, which is their `__module__`: it is imported
  whenever one exists (it builds them), so `sys.modules[cls.__module__]` and `inspect.getfile(cls)` answer as for a
  written class (upstream's tests ask both), and any `Flex<UpstreamName>` resolves by name with a module
  `__getattr__`, so that pickling, `saved.override_class` and a saved folder's `modeling_flexcache.py` find a
  generated class like a written one. `transformers_flexcache.generic` resolves the same names under the path that
  pickles made before this code moved to `models/` name.
- Nothing is registered here: `models/registry.py` registers the generated classes of `models.catalogue.GENERIC_MODEL_TYPES` (the
  types the test matrix covers) and converts any other eligible model on request.
- A class with a written override (`model_overrides/<model_type>.py`, one module per type) is never generated: that
  module is looked up by the class's `model_type`, so this module needs no list of the written ones.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable
from dataclasses import dataclass

import transformers
from transformers import GenerationMixin
from transformers.configuration_utils import PreTrainedConfig

from ..cache import is_flexible_cache, layer_specs_from_config
from ..generate.plan import current_plan
from ..generate.request import FLEXIBLE_STATIC
from .modeling import FlexModelMixin
from .source_check import CacheRead, upstream_cache_reads

# What a model whose code reads cache internals would need instead.
OVERRIDE_HINT = (
    "an override in model_overrides/{model_type}.py of those methods that reaches the cache only through its public "
    "methods (get_kv/update/cross_attention_kv; model_overrides/bart.py does this for BartAttention.forward)"
)


@dataclass(frozen=True)
class ReviewedReads:
    """Cache-internal reads of one upstream function that cannot run with a flexible decoder-only cache, checked by
    hand: they apply as long as `holds(config)`, and only while upstream's function reads exactly `codes`."""

    function: str
    codes: frozenset[str]
    why: str
    holds: Callable[[PreTrainedConfig], bool]
    condition: str  # `holds` in words, for the refusal


REVIEWED_READS = (
    ReviewedReads(
        function="transformers.models.gpt2.modeling_gpt2.GPT2Attention.forward",
        codes=frozenset(
            {
                "cache.is_updated",
                "curr_cache.layers",
                "curr_cache.layers[self.layer_idx].keys",
                "curr_cache.layers[self.layer_idx].values",
            }
        ),
        why=(
            "`is_updated` is read inside `isinstance(cache, EncoderDecoderCache)` and written, and "
            "`.layers[i].keys/.values` read, only in the cross-attention branch (`encoder_hidden_states` given); "
            "GPT2Block calls attention with encoder states only through its `crossattention` module, which exists "
            "only with `config.add_cross_attention`, and a FlexibleStaticCache is no EncoderDecoderCache"
        ),
        holds=lambda config: not getattr(config, "add_cross_attention", False),
        condition="add_cross_attention=False",
    ),
)

_lock = threading.Lock()
_built: dict[type, type] = {}


def _model_type(upstream_class: type) -> str:
    return getattr(getattr(upstream_class, "config_class", None), "model_type", "") or upstream_class.__name__.lower()


def written_override_of(upstream_class: type) -> type | None:
    """The written override class of `upstream_class` in `model_overrides/<model_type>.py`, or None."""
    name = f"model_overrides.{_model_type(upstream_class)}"
    if importlib.util.find_spec("model_overrides") is None or importlib.util.find_spec(name) is None:
        return None
    classes = getattr(importlib.import_module(name), "FLEX_MODEL_CLASSES", ())
    return next((flex_class for flex_class in classes if flex_class.flex_upstream_class() is upstream_class), None)


def _unreviewed(upstream_class: type) -> tuple[list[CacheRead], list[tuple[ReviewedReads, list[CacheRead]]]]:
    """(reads no review covers, [(review, the reads it covers)]) of `upstream_class`'s code."""
    by_function: dict[str, list[CacheRead]] = {}
    for read in _cache_reads(upstream_class):
        by_function.setdefault(read.function, []).append(read)
    reviews = {review.function: review for review in REVIEWED_READS}
    blocking, reviewed = [], []
    for function, reads in by_function.items():
        review = reviews.get(function)
        if review is not None and {read.code for read in reads} == review.codes:
            reviewed.append((review, reads))
        else:
            blocking.extend(reads)
    return blocking, reviewed


@functools.cache
def _cache_reads(upstream_class: type) -> tuple[CacheRead, ...]:
    # Reading the source costs 0.2-0.7 s per class: once per process (the installed source does not change).
    return tuple(upstream_cache_reads(upstream_class))


def reasons_against(upstream_class: type) -> list[str]:
    """Why `upstream_class` cannot run on the flexible cache without an override, judged from its source: one line per
    cache-internal read that no review covers (empty: it can).

    An encoder-decoder class is judged by its config (`config_reasons_against`): its cross-attention always needs an
    override.
    """
    blocking, _ = _unreviewed(upstream_class)
    by_function: dict[str, list[CacheRead]] = {}
    for read in blocking:
        by_function.setdefault(read.function, []).append(read)
    return [_describe(reads) for reads in by_function.values()]


def _describe(reads: list[CacheRead]) -> str:
    """`XGLMAttention.forward (transformers/models/xglm/modeling_xglm.py) reads `a` (line 1), `b` (lines 2, 3)`: the
    outermost expressions only (`c.layers[i].keys`, not also `c.layers`)."""
    lines: dict[str, list[int]] = {}
    for read in reads:
        same_line = [other.code for other in reads if other.line == read.line and other.code != read.code]
        if not any(read.code in code for code in same_line):
            lines.setdefault(read.code, []).append(read.line)
    spelled = ", ".join(
        f"`{code}` (line{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))})"
        for code, numbers in lines.items()
    )
    return f"{reads[0].short_name} ({reads[0].path}) reads {spelled}"


def config_reasons_against(upstream_class: type, config: PreTrainedConfig) -> list[str]:
    """Why a model of `upstream_class` built from `config` cannot run on the flexible cache (empty: it can)."""
    if getattr(config, "is_encoder_decoder", False):
        return [
            f"{type(config).__name__} is an encoder-decoder config: cross-attention needs an override of its own "
            "(model_overrides/bart.py is one); the generic route serves decoder-only models"
        ]
    reasons = []
    try:
        layer_specs_from_config(config)
    except ValueError as error:  # a layer type the cache does not hold, or no attention layer
        reasons.append(f"{error}; needed: a layer class for them in transformers_flexcache/cache/")
    except AttributeError as error:  # no attention sizes to read (e.g. a model without attention)
        reasons.append(
            f"FlexibleStaticCache cannot read the attention layers of {type(config).__name__} ({error}); needed: a "
            "layer class for its states in transformers_flexcache/cache/"
        )
    _, reviewed = _unreviewed(upstream_class)
    for review, reads in reviewed:
        if not review.holds(config):
            codes = ", ".join(f"`{code}`" for code in sorted(review.codes))
            reasons.append(
                f"{reads[0].short_name} ({reads[0].path}) reads {codes}, which is safe only with "
                f"{review.condition} ({review.why}); needed: "
                f"{OVERRIDE_HINT.format(model_type=_model_type(upstream_class))}"
            )
    return reasons


def refusal(upstream_class: type, reasons: list[str]) -> str:
    """The error text for a model refused by the generic route: every reason, then what would be needed."""
    text = f"{upstream_class.__name__} cannot use cache_implementation='flexible_static' without an override: "
    text += "; ".join(reasons)
    if not any("needed:" in reason for reason in reasons):
        text += f"; needed: {OVERRIDE_HINT.format(model_type=_model_type(upstream_class))}"
    return text


class GenericFlexModelMixin(FlexModelMixin):
    """The base of generated override classes: `FlexModelMixin` with no module change, and a config check.

    A model whose config the route cannot serve (`config_reasons_against`) is refused when a `generate` call asks for
    `flexible_static`, with the reasons: building or loading it stays possible (e.g. GPT2 as the decoder of an
    `EncoderDecoderModel`, built through `AutoModelForCausalLM` with `add_cross_attention=True`).
    """

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """Extends `FlexCacheGenerationMixin._prepare_cache_for_generation`: refuses a config the route cannot serve.

        Raises:
            ValueError: the call asks for the flexible cache and `config_reasons_against` gives reasons.
        """
        plan = current_plan(self)
        asks = plan.flexible if plan is not None else generation_config.cache_implementation == FLEXIBLE_STATIC
        if asks or is_flexible_cache(model_kwargs.get("cache")):
            upstream_class = type(self).flex_upstream_class()
            reasons = config_reasons_against(upstream_class, self.config)
            if reasons:
                raise ValueError(refusal(upstream_class, reasons))
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)


def flex_class_for(upstream_class: type) -> type[GenericFlexModelMixin]:
    """`Flex<UpstreamName>`: the override class of a decoder-only `upstream_class` that needs no module change.

    Built once per class, after its source was judged (`reasons_against`).

    Raises:
        TypeError: the class has a written override in `model_overrides/` (one class per upstream class), or its code
            reads cache internals (each read named, with what would be needed instead).
    """
    with _lock:
        if upstream_class in _built:
            return _built[upstream_class]
        written = written_override_of(upstream_class)
        if written is not None:
            raise TypeError(
                f"{upstream_class.__name__} has a written override, {written.__module__}.{written.__name__}; use it "
                "(transformers_flexcache.convert(model) does)"
            )
        reasons = reasons_against(upstream_class)
        if reasons:
            raise TypeError(refusal(upstream_class, reasons))
        name = f"Flex{upstream_class.__name__}"
        flex_class = type(
            name,
            (GenericFlexModelMixin, upstream_class, GenerationMixin),
            {
                "__module__": __name__,  # imported wherever the class exists, unlike a module nobody imports
                "__qualname__": name,
                "__doc__": (
                    f'`{upstream_class.__name__}` whose generate accepts `cache_implementation="flexible_static"`: '
                    "no module change (built by transformers_flexcache.models.generic)."
                ),
            },
        )
        _built[upstream_class] = flex_class
        globals()[name] = flex_class  # held by its module, as a written class is
        return flex_class


def upstream_class_named(name: str) -> type | None:
    """The transformers model class that `Flex<name>` stands for, or None."""
    if not name.startswith("Flex"):
        return None
    upstream_class = getattr(transformers, name.removeprefix("Flex"), None)
    return upstream_class if isinstance(upstream_class, type) else None


def __getattr__(name: str):
    # `Flex<UpstreamName>` resolves to its generated class (pickling, saved folders): module-level lookup by name.
    upstream_class = upstream_class_named(name)
    if upstream_class is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return flex_class_for(upstream_class)
