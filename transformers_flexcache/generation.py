"""`generate(cache_implementation="flexible_static")`: one flexible cache per model, reused across calls.

Design decisions:
- The cache lives on the model instance (`model._flex_cache`) and is reset, not rebuilt, at the start of each
  `generate` call. Calls of any batch, prompt length and encoder length that fit its capacities run on the same
  storage; a call that does not fit grows it once (or raises, with `on_overflow="error"`).
- Capacities come from `cache_config` (in the call or in a saved `GenerationConfig`); any capacity not given is
  taken from the first call that needs the cache. The batch that counts is `batch x max(num_beams,
  num_return_sequences)`, the decoder length `max_length - 1` (as for upstream's static cache), the encoder length
  that of `encoder_outputs`.
- Every check happens before the cache is touched, so a refused call leaves the cache usable for the next one.
- The cache returned by `generate(..., return_dict_in_generate=True)` is that shared cache: the next call reuses
  (and overwrites) it.
- `cache_config={"shape_policy": "padded"}` is the fixed-shape mode for `torch.compile`: `generate` pads the batch to
  `max_batch_size`, decoder-only prompts to `max_prompt_len` and encoder outputs to `max_encoder_len` (see
  `padding.py`), and the cache attends over its whole capacity (see `FlexiblePaddedLayer`). Capacities not given are
  taken from the first call, as in the exact mode; the prompt length padded to is held on the model
  (`_flex_max_prompt_len`) and grows like a capacity. A model whose own `generate` calls upstream's on batches of
  its own (Whisper: one call per segment and per fallback) has each of those calls padded instead
  (`FlexCacheInnerGenerateMixin`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from transformers import masking_utils
from transformers.generation import configuration_utils as generation_configuration
from transformers.generation.utils import GenerationMixin

from .cache import (
    ON_OVERFLOW_CHOICES,
    SHAPE_POLICIES,
    FlexibleEncoderDecoderCache,
    FlexibleStaticCache,
    Overflow,
    overflow_message,
)
from .padding import (
    PaddedCall,
    left_pad_prompt,
    lengths_as_new_tokens,
    pad_encoder_outputs,
    pad_rows,
    pad_token_id,
)

logger = logging.getLogger(__name__)

FLEXIBLE_STATIC = "flexible_static"
CAPACITY_KEYS = ("max_batch_size", "max_cache_len", "max_encoder_len")
# `max_prompt_len` is a shape, not a storage size: padded mode left-pads decoder-only prompts to it.
CACHE_CONFIG_KEYS = CAPACITY_KEYS + ("on_overflow", "shape_policy", "max_prompt_len")
_CACHE_ATTR = "_flex_cache"
_PROMPT_LEN_ATTR = "_flex_max_prompt_len"


_upstream_prepare_cache = GenerationMixin._prepare_cache_for_generation


def _refuse_flexible_static(self, generation_config, *args, **kwargs):
    # Installed on GenerationMixin while the name is accepted: an upstream model would otherwise fall through to a
    # DynamicCache and silently ignore the request. Flex models override this method and never reach it for the name.
    if generation_config.cache_implementation == FLEXIBLE_STATIC:
        raise ValueError(
            f"{type(self).__name__} does not support cache_implementation={FLEXIBLE_STATIC!r}; load it after "
            "transformers_flexcache.register(), or convert it in place with transformers_flexcache.convert(model)"
        )
    return _upstream_prepare_cache(self, generation_config, *args, **kwargs)


def accept_cache_implementation_name() -> None:
    """Make `GenerationConfig` accept `cache_implementation="flexible_static"` (idempotent).

    `GenerationConfig.validate` checks names against a module-level tuple; this appends one string to it. So that
    an upstream model asked for the name fails loudly instead of silently using a DynamicCache, upstream's
    `GenerationMixin._prepare_cache_for_generation` is wrapped to refuse it. `forget_cache_implementation_name()`
    undoes both.
    """
    names = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    if FLEXIBLE_STATIC not in names:
        generation_configuration.ALL_CACHE_IMPLEMENTATIONS = names + (FLEXIBLE_STATIC,)
    GenerationMixin._prepare_cache_for_generation = _refuse_flexible_static


def forget_cache_implementation_name() -> None:
    """Undo `accept_cache_implementation_name()`."""
    names = generation_configuration.ALL_CACHE_IMPLEMENTATIONS
    generation_configuration.ALL_CACHE_IMPLEMENTATIONS = tuple(name for name in names if name != FLEXIBLE_STATIC)
    GenerationMixin._prepare_cache_for_generation = _upstream_prepare_cache


def parse_cache_config(cache_config: dict[str, Any] | None) -> dict[str, Any]:
    """Check a `cache_config` for `flexible_static` and return it with only our keys.

    Raises:
        ValueError: an unknown key, a capacity that is not a positive int, or an unknown `on_overflow`.
    """
    settings = dict(cache_config or {})
    unknown = sorted(set(settings) - set(CACHE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"cache_config keys {unknown} are not understood by cache_implementation={FLEXIBLE_STATIC!r}; "
            f"valid keys are {list(CACHE_CONFIG_KEYS)}"
        )
    for key in CAPACITY_KEYS + ("max_prompt_len",):
        value = settings.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f'cache_config["{key}"]={value!r} must be a positive int')
    on_overflow = settings.setdefault("on_overflow", "grow")
    if on_overflow not in ON_OVERFLOW_CHOICES:
        raise ValueError(f'cache_config["on_overflow"]={on_overflow!r} is not one of {ON_OVERFLOW_CHOICES}')
    shape_policy = settings.setdefault("shape_policy", "exact")
    if shape_policy not in SHAPE_POLICIES:
        raise ValueError(f'cache_config["shape_policy"]={shape_policy!r} is not one of {SHAPE_POLICIES}')
    return settings


def plan_capacities(
    need: dict[str, int], settings: dict[str, Any], existing: dict[str, int] | None
) -> tuple[dict[str, int], list[Overflow]]:
    """Capacities for a call that needs `need`, and the capacities (configured or held) that it exceeds.

    A capacity is the configured one, else the one the existing cache holds, else the call's need; the result is
    grow-only: never below what the existing cache holds, and at least what the call needs.
    """
    capacities, exceeded = {}, []
    for key, value in need.items():
        held = (existing or {}).get(key)
        limit = max(settings.get(key) or 0, held or 0) or value
        if value > limit:
            exceeded.append(Overflow(key, value, limit))
        capacities[key] = max(limit, value)
    return capacities, exceeded


def _capacities_of(cache) -> dict[str, int]:
    capacities = {"max_batch_size": cache.max_batch_size, "max_cache_len": cache.max_cache_len}
    if isinstance(cache, FlexibleEncoderDecoderCache):
        capacities["max_encoder_len"] = cache.max_encoder_len
    return capacities


def _build_cache(model, capacities: dict[str, int], on_overflow: str, shape_policy: str = "exact"):
    common = {
        "config": model.config,
        "dtype": model.dtype,
        "device": model.device,
        "on_overflow": on_overflow,
        "shape_policy": shape_policy,
        "max_batch_size": capacities["max_batch_size"],
        "max_cache_len": capacities["max_cache_len"],
    }
    if "max_encoder_len" in capacities:
        return FlexibleEncoderDecoderCache(max_encoder_len=capacities["max_encoder_len"], **common)
    return FlexibleStaticCache(**common)


def _grow(cache, capacities: dict[str, int]) -> None:
    if isinstance(cache, FlexibleEncoderDecoderCache):
        cache.self_attention_cache.grow(
            max_batch_size=capacities["max_batch_size"], max_cache_len=capacities["max_cache_len"]
        )
        cache.cross_attention_cache.grow(
            max_batch_size=capacities["max_batch_size"], max_cache_len=capacities["max_encoder_len"]
        )
    else:
        cache.grow(max_batch_size=capacities["max_batch_size"], max_cache_len=capacities["max_cache_len"])


def reusable_cache(model, *, encoder_decoder: bool, shape_policy: str):
    """The model's flexible cache if a call with these settings would reuse it, else None (it would be rebuilt)."""
    cache = getattr(model, _CACHE_ATTR, None)
    if cache is None or cache.dtype != model.dtype or cache.device != model.device:
        return None
    if isinstance(cache, FlexibleEncoderDecoderCache) != encoder_decoder:
        return None
    # The two shape policies differ in layer classes (padded storage has static addresses): rebuilt, not converted.
    if cache.shape_policy != shape_policy:
        return None
    return cache


def get_flexible_cache(model, *, need: dict[str, int], cache_config: dict[str, Any] | None):
    """The model's flexible cache, reset and big enough for a call that needs `need`.

    Args:
        model: a model whose generate supports `flexible_static`.
        need: `max_batch_size`, `max_cache_len` and, for encoder-decoder models, `max_encoder_len` of the call.
        cache_config: the `cache_config` of the call (capacities and `on_overflow`).

    Returns:
        The cache held by `model`, created on first use, grown when needed, and reset.

    Raises:
        ValueError: the call exceeds a capacity and `on_overflow="error"`; the cache is left as it was.
    """
    settings = parse_cache_config(cache_config)
    cache = getattr(model, _CACHE_ATTR, None)
    if cache is not None and (cache.dtype != model.dtype or cache.device != model.device):
        logger.warning(
            "The model moved to dtype=%s device=%s; the flexible cache (%s on %s) is rebuilt",
            model.dtype,
            model.device,
            cache.dtype,
            cache.device,
        )
    cache = reusable_cache(model, encoder_decoder="max_encoder_len" in need, shape_policy=settings["shape_policy"])

    existing = _capacities_of(cache) if cache is not None else None
    capacities, exceeded = plan_capacities(need, settings, existing)
    # Over a limit that the user configured, or that an earlier call set: refuse or warn, before any change.
    if exceeded:
        message = overflow_message(exceeded)
        if settings["on_overflow"] == "error":
            raise ValueError(message)
        logger.warning("The flexible cache grows (one reallocation): %s", message)

    if cache is None:
        cache = _build_cache(model, capacities, settings["on_overflow"], settings["shape_policy"])
        setattr(model, _CACHE_ATTR, cache)
    else:
        if capacities != existing:
            _grow(cache, capacities)
        cache.on_overflow = settings["on_overflow"]
    cache.reset()
    return cache


class FlexCacheGenerationMixin:
    """Adds `cache_implementation="flexible_static"` to a model's `generate`.

    Put it before the upstream model class: `class FlexT5ForConditionalGeneration(FlexCacheGenerationMixin,
    T5ForConditionalGeneration)`. Other cache implementations go to upstream unchanged. With
    `cache_config={"shape_policy": "padded"}`, `generate` pads the call to fixed shapes around upstream's `generate`
    and cuts the outputs back (see `padding.py`).
    """

    # The model input that masks encoder positions in cross-attention, padded with the encoder outputs.
    _flex_encoder_mask_key = "attention_mask"

    def __init__(self, *args, **kwargs):
        accept_cache_implementation_name()
        super().__init__(*args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # A saved generation_config.json may name `flexible_static`; it is validated while loading.
        accept_cache_implementation_name()
        return super().from_pretrained(*args, **kwargs)

    def generate(self, *args, **kwargs):
        accept_cache_implementation_name()
        if isinstance(self, FlexCacheInnerGenerateMixin):
            # The model's own generate (Whisper's) runs at the call's batch; the calls it makes to upstream's
            # `GenerationMixin.generate` are padded one by one (see FlexCacheInnerGenerateMixin).
            return super().generate(*args, **kwargs)
        return self._flex_generate(super().generate, args, kwargs)

    def _flex_generate(self, upstream_generate, args: tuple, kwargs: dict):
        """`upstream_generate(*args, **kwargs)`, padded to fixed shapes and cut back when `shape_policy="padded"`."""
        signature = inspect.signature(upstream_generate)
        arguments = signature.bind(*args, **kwargs).arguments
        var_keyword = next(p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD)
        extra = dict(arguments.pop(var_keyword, {}))
        if not self._may_request_padded(arguments.get("generation_config"), extra):
            return upstream_generate(*args, **kwargs)
        resolved, model_kwargs = self._prepare_generation_config(arguments.get("generation_config"), **extra)
        if resolved.cache_implementation != FLEXIBLE_STATIC:
            return upstream_generate(*args, **kwargs)
        main_param = next(iter(signature.parameters))  # `inputs` (GenerationMixin) or e.g. `input_features`
        call = self._pad_generate_call(resolved, arguments, extra, model_kwargs, main_param=main_param)
        if "stopping_criteria" in signature.parameters:
            arguments["stopping_criteria"] = call.stopping_criteria(arguments.get("stopping_criteria"))
        output = upstream_generate(**arguments, **extra)
        if not self.config.is_encoder_decoder:
            setattr(self, _PROMPT_LEN_ATTR, call.padded_prompt_len)  # grow-only: at least the held length
        return call.cut(output)

    def _may_request_padded(self, generation_config, kwargs: dict) -> bool:
        """A cheap look at whether any `cache_config` in reach asks for `shape_policy="padded"`."""
        configs = (kwargs.get("cache_config"), getattr(generation_config, "cache_config", None))
        configs += (self.generation_config.cache_config,)
        return any(isinstance(config, dict) and config.get("shape_policy") == "padded" for config in configs)

    def _pad_generate_call(self, resolved, arguments: dict, extra: dict, model_kwargs: dict, *, main_param: str):
        """Pad the batch (and decoder-only prompts) of a generate call in `arguments`/`extra`, in place.

        Returns:
            `PaddedCall`: what was padded, to cut the outputs back.

        Raises:
            ValueError: the prompt exceeds `max_prompt_len` with `on_overflow="error"` (nothing is changed then).
        """
        settings = parse_cache_config(resolved.cache_config)
        inputs = arguments.pop(main_param, None)
        inputs_tensor, input_name, _ = self._prepare_model_inputs(inputs, resolved.bos_token_id, dict(model_kwargs))
        batch_size, prompt_len = inputs_tensor.shape[0], inputs_tensor.shape[1]
        num_prompt_pad = 0 if self.config.is_encoder_decoder else self._prompt_padding(settings, prompt_len)

        expand = max(resolved.num_beams or 1, resolved.num_return_sequences or 1)
        held = reusable_cache(self, encoder_decoder=self.config.is_encoder_decoder, shape_policy="padded")
        max_rows = max(settings.get("max_batch_size") or 0, held.max_batch_size if held is not None else 0)
        call = PaddedCall(
            batch_size=batch_size,
            padded_batch_size=max(batch_size, max_rows // expand),
            num_prompt_pad=num_prompt_pad,
            padded_prompt_len=prompt_len + num_prompt_pad,
        )

        model_inputs = {key: extra[key] for key in model_kwargs if key in extra}
        # Without a main input, upstream makes placeholders from `encoder_outputs` (-100s of shape [B, L_enc]) only to
        # count the batch; passed on, they would reach e.g. Whisper's generate as `input_features`.
        if inputs is not None or extra.get(input_name) is not None or "encoder_outputs" not in model_inputs:
            model_inputs[input_name] = inputs_tensor
        model_inputs = {
            key: pad_rows(value, batch_size, call.padded_batch_size) for key, value in model_inputs.items()
        }
        for name in ("negative_prompt_ids", "negative_prompt_attention_mask"):
            if arguments.get(name) is not None:
                arguments[name] = pad_rows(arguments[name], batch_size, call.padded_batch_size)
        ids = model_inputs.get("input_ids")
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == prompt_len):
            call.num_prompt_pad = 0  # `sequences` then holds only new tokens: nothing to cut from it
        if num_prompt_pad:
            model_inputs = left_pad_prompt(
                model_inputs, prompt_len=prompt_len, num_pad=num_prompt_pad, pad_token_id=pad_token_id(resolved)
            )
            given = (extra, arguments.get("generation_config"), self.generation_config)
            extra.update(lengths_as_new_tokens(resolved, given, prompt_len=prompt_len))
        extra.update(model_inputs)
        return call

    def _prompt_padding(self, settings: dict, prompt_len: int) -> int:
        """Positions to add on the left of a decoder-only prompt of `prompt_len` tokens to reach `max_prompt_len`."""
        limit = max(settings.get("max_prompt_len") or 0, getattr(self, _PROMPT_LEN_ATTR, None) or 0)
        if limit and prompt_len > limit:
            message = overflow_message([Overflow("max_prompt_len", prompt_len, limit)])
            if settings["on_overflow"] == "error":
                raise ValueError(message)
            logger.warning("The padded prompt length grows (a new prefill shape under torch.compile): %s", message)
        return max(limit, prompt_len) - prompt_len

    def create_masks_for_generate(self, **mask_kwargs):
        """The hook `GenerationMixin.prepare_inputs_for_generation` (transformers==5.24.0) calls for compileable caches.

        Differences from upstream's (the model's own, else `masking_utils.create_masks_for_generate`): with a padded
        flexible cache, a full-attention mask that SDPA would drop in favour of `is_causal` (a prompt without padding)
        is built anyway. Otherwise whether a prefill gets a mask would depend on the values of the call's attention
        mask, and a compiled prefill would compile once with a mask and once without.
        """
        upstream = getattr(super(), "create_masks_for_generate", masking_utils.create_masks_for_generate)
        masks = upstream(**mask_kwargs)
        cache = mask_kwargs.get("cache")
        if getattr(cache, "shape_policy", None) != "padded":
            return masks
        full_kwargs = {
            key: mask_kwargs.get(key) for key in ("inputs_embeds", "attention_mask", "cache", "position_ids")
        }
        full_kwargs["config"] = mask_kwargs["config"].get_text_config()
        if masks is None:
            return masking_utils.create_causal_mask(**full_kwargs, allow_is_causal_skip=False)
        if isinstance(masks, dict) and "full_attention" in masks and masks["full_attention"] is None:
            masks["full_attention"] = masking_utils.create_causal_mask(**full_kwargs, allow_is_causal_skip=False)
        return masks

    def _pad_encoder_outputs(self, generation_config, model_kwargs: dict) -> None:
        """Padded mode: right-pad encoder outputs and mask to `max_encoder_len` (configured, held, or this call's)."""
        settings = parse_cache_config(generation_config.cache_config)
        held = reusable_cache(self, encoder_decoder=True, shape_policy="padded")
        encoder_len = model_kwargs["encoder_outputs"][0].shape[1]
        max_encoder_len = max(
            settings.get("max_encoder_len") or 0, held.max_encoder_len if held is not None else 0, encoder_len
        )
        pad_encoder_outputs(model_kwargs, max_encoder_len, mask_key=self._flex_encoder_mask_key)

    @property
    def flexible_cache(self):
        """The cache that `generate(cache_implementation="flexible_static")` reuses, or None before its first call."""
        return getattr(self, _CACHE_ATTR, None)

    def _flexible_cache_need(self, generation_config, model_kwargs: dict, batch_size: int, max_cache_length: int):
        """Batch, decoder length and (encoder-decoder) encoder length that this generate call needs."""
        expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        need = {"max_batch_size": batch_size * expand, "max_cache_len": max_cache_length}
        if self.config.is_encoder_decoder:
            need["max_encoder_len"] = model_kwargs["encoder_outputs"][0].shape[1]
        return need

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        """Overrides `GenerationMixin._prepare_cache_for_generation` (transformers==5.24.0) for one new name.

        Differences: `cache_implementation="flexible_static"` takes the model's flexible cache (see
        `get_flexible_cache`) instead of building a new cache; every other value goes to upstream unchanged.
        """
        if generation_config.cache_implementation != FLEXIBLE_STATIC:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        if model_kwargs.get("cache") is not None:
            raise ValueError(
                "Passing both `cache_implementation` (used to initialize certain caches) and `cache` (a Cache "
                "object) is unsupported. Please use only one of the two."
            )
        if generation_config.use_cache is False:
            return
        if generation_config.max_cache_len is not None:
            # Upstream's `max_cache_len` generation option is honoured as a floor, as for its static cache.
            max_cache_length = max(max_cache_length, generation_config.max_cache_len)
        if self.config.is_encoder_decoder and (generation_config.cache_config or {}).get("shape_policy") == "padded":
            self._pad_encoder_outputs(generation_config, model_kwargs)
        need = self._flexible_cache_need(generation_config, model_kwargs, batch_size, max_cache_length)
        model_kwargs["cache"] = get_flexible_cache(self, need=need, cache_config=generation_config.cache_config)
        if generation_config.is_assistant:
            model_kwargs["cache"].activate_past_recording()


class FlexCacheInnerGenerateMixin(GenerationMixin):
    """For models whose own `generate` calls upstream's `GenerationMixin.generate` on batches of its own (Whisper's
    runs one call per 30-second segment and per temperature fallback, on the rows still running).

    Padding around such a `generate` would pad the wrong batch: its inner calls see the batch shrink as rows finish,
    and padding rows would stop real ones. Put this class last among the override's bases:
    `class FlexWhisperForConditionalGeneration(FlexModelMixin, WhisperForConditionalGeneration,
    FlexCacheInnerGenerateMixin)`. Python's method resolution order then places it right before `GenerationMixin`, so
    the model's `super().generate(...)` reaches this `generate`, which pads that call (as `FlexCacheGenerationMixin`
    pads a whole call) and cuts its outputs back before the model's own post-processing reads them.
    """

    def generate(self, *args, **kwargs):
        return self._flex_generate(super().generate, args, kwargs)


def is_flexible_cache(cache) -> bool:
    """Whether `cache` is one of this package's caches."""
    return isinstance(cache, (FlexibleStaticCache, FlexibleEncoderDecoderCache))
