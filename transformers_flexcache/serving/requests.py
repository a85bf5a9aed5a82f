"""What a request of the serving engine may be: `submit`'s checks, before anything is queued.

A request is what `model.generate` takes for one input (batch 1) and its generation arguments. `check_request`
resolves its generation config as `generate` will, and refuses, with the value, the limit and the fix, a request
that can never fit the engine's capacities or that one request among others cannot have (its own cache, a streamer,
assisted decoding, attention weights, a model input the batched steps would drop). Nothing here runs the model.
"""

from __future__ import annotations

import os

import torch
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import ModelOutput

from ..cache import CacheConfig
from ..cache.capacity import exceeding
from ..cache.config import overflow_message
from ..generate.plan import CallPlan
from .handle import CapacityError, RequestHandle
from .worker import RequestSpec

# Decoding methods the engine runs: those whose loop makes one model call per step for every row.
SERVED_MODES = (
    GenerationMode.GREEDY_SEARCH,
    GenerationMode.SAMPLE,
    GenerationMode.BEAM_SEARCH,
    GenerationMode.BEAM_SAMPLE,
)
# `generate` arguments the engine decides itself, or cannot honour for one request among others.
REFUSED_KWARGS = {
    "cache": "the engine owns the cache",
    "past_key_values": "the engine owns the cache",
    "cache_implementation": "the engine owns the cache",
    "cache_config": "capacities are the engine's (Engine(model, cache_config=...))",
    "compile_config": "compiling is the engine's (Engine(model, compile_config=...))",
    "streamer": "iterate the handle for the new tokens",
    "assistant_model": "assisted decoding is not served (its candidate steps are not one token per row)",
    "prompt_lookup_num_tokens": "prompt-lookup decoding is not served (its candidate steps are not one token per row)",
    "output_attentions": "attention weights of a batched step are not one request's",
    "output_hidden_states": "hidden states of a batched step are not one request's",
    "synced_gpus": "the engine steps on one process",
}
# Model inputs a request may pass; any other tensor is refused rather than dropped.
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "decoder_input_ids",
    "decoder_attention_mask",
    "input_features",
    "flattened_patches",
    "encoder_outputs",
)
# Tensors that `generate` takes for the request as a whole, not as batched model inputs (Whisper's `prompt_ids`, one
# prompt of shape [P]): passed to the request's generate as given.
GENERATE_TENSORS = ("prompt_ids",)
ENGINE_CONFIG_KEYS = ("max_batch_size", "max_cache_len", "max_encoder_len", "shape_policy", "buckets")


def engine_config(model, cache_config) -> CacheConfig:
    """The engine's capacities and shape policy, checked: every capacity set (Whisper's encoder length defaults to
    its `max_source_positions`), no key of `generate`'s that the engine does not take.

    Raises:
        TypeError: `cache_config` is not a dict.
        ValueError: an unknown key, a capacity missing or not a positive int.
    """
    if not isinstance(cache_config, dict):
        raise TypeError("cache_config must be a dict such as {'max_batch_size': 8, 'max_cache_len': 64}")
    unknown = sorted(set(cache_config) - set(ENGINE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"cache_config keys {unknown} do not apply to the serving engine; it takes {list(ENGINE_CONFIG_KEYS)}"
        )
    cache_config = dict(cache_config)
    if model.config.is_encoder_decoder and "max_encoder_len" not in cache_config:
        default = getattr(model.config, "max_source_positions", None)  # Whisper: its fixed encoder length
        if default is not None:
            cache_config["max_encoder_len"] = default
    config = CacheConfig.parse(cache_config)
    needed = ["max_batch_size", "max_cache_len"] + (["max_encoder_len"] if model.config.is_encoder_decoder else [])
    missing = [name for name in needed if getattr(config, name) is None]
    if missing:
        raise ValueError(
            f"the engine allocates its seats up front: cache_config needs {missing} (e.g. "
            '{"max_batch_size": 8, "max_cache_len": 128, "max_encoder_len": 128})'
        )
    return config


def check_request(engine, seed: int | None, kwargs: dict, *, on_cancel) -> RequestSpec:
    """The `RequestSpec` of one `submit`: its inputs, the generate arguments its worker passes, its seats.

    Raises:
        CapacityError: a request that can never fit (a `ValueError`).
        ValueError: see `Engine.submit`.
    """
    for name, reason in REFUSED_KWARGS.items():
        if kwargs.get(name) not in (None, False):
            raise ValueError(f"Engine.submit does not take {name}: {reason}")
    if kwargs.get("use_cache") is False:
        raise ValueError("Engine.submit does not take use_cache=False: the engine serves from its cache")
    for name, value in kwargs.items():
        if name in GENERATE_TENSORS:
            continue
        if isinstance(value, (torch.Tensor, ModelOutput)) and name not in MODEL_INPUTS:
            raise ValueError(
                f"Engine.submit does not take the model input {name!r}: the engine's batched steps would drop it; "
                f"it takes {list(MODEL_INPUTS)}"
            )
        batch = _batch_of(value)
        if batch is not None and batch != 1:
            raise ValueError(
                f"Engine.submit takes one request: {name} has batch {batch}; submit each row on its own (the "
                "engine batches requests itself)"
            )
    model = engine.model
    # What generate would resolve and need for this request alone, resolved once (the call plan of `generate/plan.py`).
    plan = CallPlan.resolve(model, kwargs)
    generation_config = plan.generation_config
    mode = generation_config.get_generation_mode()
    if mode not in SERVED_MODES:
        raise ValueError(
            f"Engine.submit serves greedy search, sampling and beam search (with sampling), not {mode.value}"
        )
    # As many seats as generate uses rows for it alone (Whisper's repeats its input per returned sequence first).
    num_seats = plan.need.rows
    inputs = {name: kwargs[name] for name in MODEL_INPUTS if name in kwargs}
    _check_fits(engine, plan.need)
    forwarded = {k: v for k, v in kwargs.items() if k not in inputs}
    forwarded["use_cache"] = True
    if engine.tokenizer is not None and generation_config.stop_strings and "tokenizer" not in forwarded:
        forwarded["tokenizer"] = engine.tokenizer
    return RequestSpec(
        inputs=inputs,
        generation_kwargs=forwarded,
        num_seats=num_seats,
        seed=seed if seed is not None else int.from_bytes(os.urandom(7), "little"),
        stream=generation_config.num_beams == 1 and not is_whisper_like(model),
        handle=RequestHandle(request_id=-1, num_seats=num_seats, on_cancel=on_cancel),
        prompt_len=_prompt_len(engine, inputs),
    )


def _prompt_len(engine, inputs: dict) -> int:
    """Columns of `generate`'s result that come before the new tokens (known ahead for most models)."""
    if is_whisper_like(engine.model):
        return 0  # Whisper's generate returns the new tokens alone, without its decoder prompt
    if engine.is_encoder_decoder:
        decoder_ids = inputs.get("decoder_input_ids")
        return decoder_ids.shape[1] if decoder_ids is not None else 1
    return inputs["input_ids"].shape[1] if "input_ids" in inputs else 0


def _check_fits(engine, need) -> None:
    """Refuse a request whose `Need` exceeds a capacity of the engine (Whisper's decoder positions are a lower bound
    here, see `CallPlan.resolve`: its worker checks them again when its generate prepares the cache)."""
    stated = {"max_batch_size": need.rows, "max_cache_len": need.decoder_positions}
    if need.encoder_positions is not None:
        stated["max_encoder_len"] = need.encoder_positions
    limits = {
        "max_batch_size": engine.max_batch_size,
        "max_cache_len": engine.max_cache_len,
        "max_encoder_len": engine.max_encoder_len,
    }
    exceeded = exceeding(stated, limits)
    if exceeded:
        raise CapacityError(
            f"this request can never fit the engine: {overflow_message(exceeded)}",
            needed={overflow.name: overflow.value for overflow in exceeded},
            limits={overflow.name: overflow.limit for overflow in exceeded},
        )


def pad_token_id_of(model) -> int:
    for config in (model.generation_config, model.config):
        value = getattr(config, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


def is_whisper_like(model) -> bool:
    """Whether the model's own generate calls upstream's on batches of its own (Whisper)."""
    from ..generate.mixin import FlexCacheInnerGenerateMixin

    return isinstance(model, FlexCacheInnerGenerateMixin)


def _batch_of(value) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() > 0 else None
    if isinstance(value, ModelOutput):
        return _batch_of(value[0])
    return None
