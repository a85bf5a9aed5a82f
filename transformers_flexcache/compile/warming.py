"""`warmup()`: every graph that calls under a fixed-shape `cache_config` can need, compiled before serving any of them.

`warmup()` runs one short call per shape of `PaddedPolicy.call_shapes`, so that every graph the shape policy can
need is compiled (and, under `mode="reduce-overhead"`, recorded as a CUDA graph) before the first request (padded:
one shape; bucketed: one per combination of buckets), and then the encoder graphs those calls leave out
(`encoder.encoder_warmup_calls`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import CompileConfig
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from ..cache import CacheConfig
from ..cache.placement import attention_modules, cross_attention_projections
from ..generate.policies import POLICIES
from ..generate.request import FLEXIBLE_STATIC
from ..log import get_logger
from . import kernel_choice
from .artifact import MANIFEST, ArtifactRefused, artifact_facts, load_artifact, write_artifact
from .caching import compile_cache, model_facts
from .encoder import encoder_graph, encoder_warmup_calls, has_int8_variants
from .encoder_artifact import encoder_artifact_graphs, encoder_graph_names, loaded_encoder_side
from .generate_artifact import DESCRIPTION_VERSION, Recorder, Replayer, set_artifact

# Forwards of each warm-up call: the first, one decode step that compiles, one that records CUDA graphs.
WARMUP_FORWARDS = 3

__all__ = ["warmup"]

logger = get_logger(__name__)


class StopAfterSteps(StoppingCriteria):
    """Stops every row after `num_steps` decoding steps: a warm-up call needs the graphs, not the tokens."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        # input_ids: [rows, T] -> [rows]
        self.steps += 1
        return torch.full(
            (input_ids.shape[0],), self.steps >= self.num_steps, dtype=torch.bool, device=input_ids.device
        )


def warmup(
    model,
    make_inputs,
    *,
    max_new_tokens: int,
    cache_config,
    compile_config: CompileConfig | None = None,
    cache_dir: str | os.PathLike | None = None,
    artifact: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
    **generate_kwargs,
) -> list:
    """Compile every graph that calls under a fixed-shape `cache_config` can need, before serving any of them.

    Runs one `generate` call per shape of the shape policy (`PaddedPolicy.call_shapes`: every rows bucket, prompt or
    encoder length bucket and decoder length bucket that calls of up to `max_new_tokens` new tokens reach), each
    stopped after three forwards: the first (eager, or a compiled prefill) and two decode steps, the first of which
    compiles the shape's graph and the second of which records its CUDA graph (`mode="reduce-overhead"` runs a new
    graph once before recording it). Afterwards no call within the capacities compiles or records anything.

    Args:
        model: a model with `flexible_static` in its generate (an override model).
        make_inputs (`Callable[[int, int], dict]`): `make_inputs(batch_size, length)` returns generate inputs of
            `batch_size` rows whose prompt (decoder-only) or encoder input (encoder-decoder) is `length` positions
            long, e.g. `lambda b, n: {"input_ids": torch.full((b, n), 5)}`. For Whisper `length` can be ignored.
        max_new_tokens (`int`): the most new tokens a served call will ask for.
        cache_config (`dict` or `CacheConfig`): the `cache_config` of the served calls: a fixed-shape policy with
            its capacities set.
        compile_config (`CompileConfig`, *optional*): what the served calls pass; None when `model.forward` is
            compiled already.
        cache_dir (`str | os.PathLike`, *optional*): a compile cache folder (`compile/caching.py`, whose
            `default_cache_dir()` is the user's): the graphs that an earlier process compiled for this model, shapes,
            settings, versions and CPU are loaded instead of compiled, and this warm-up's are written back. None:
            inductor's own cache only.
        artifact (`str | os.PathLike`, *optional*): a compiled artifact folder (`generate_artifact.py`): the decode
            steps' graphs of these calls (this model and weights, capacities, buckets, `max_new_tokens`, generate
            kwargs, versions and CPU) are loaded from it, and nothing is traced: the calls' first and later decode
            steps then run the loaded graphs, and so do their encoders where `compile_config` compiles the encoder
            (the token encoder with dynamic rows and positions, as `serve --compiled` runs it). Where it holds none
            for these (missing, another key, damaged: a warning says which, unless it is missing), the graphs are
            built into it first (`torch.export` and AOTInductor, once) and then loaded. `cache_dir` is then not
            used. The model keeps the artifact for its later calls (`transformers_flexcache.compile.set_artifact(model,
            None)` takes it away).
        progress (`Callable[[int, int], None]`, *optional*): called with (calls done, calls in all) before the first
            warm-up call and after each.
        **generate_kwargs: other arguments the served calls pass (`num_beams` changes the rows per input).

    Run it as the served calls run: dynamo guards on the grad mode, so served calls under `torch.inference_mode()`
    need a warmup under it too (else they compile again).

    Returns:
        `list[CallShape]`: the shapes run (`transformers_flexcache.padded_call.CallShape`). Generate's `compile_config`
        compiles one decode graph per distinct `(batch_size, cache_len)` (decoder-only) or `(batch_size, length,
        cache_len)` (encoder-decoder); a compiled `model.forward` also one prefill graph per shape.

    Raises:
        ValueError: the policy is `"exact"`, a capacity is not set, `max_new_tokens` does not fit, or there are more
            shapes than dynamo keeps graphs of one function (`torch._dynamo.config.recompile_limit`): the others would
            run eagerly, without a word.
    """
    config = CacheConfig.parse(cache_config)
    policy = POLICIES[config.shape_policy]
    if not policy.fixed_shapes:
        raise ValueError(
            f'warmup needs a fixed-shape policy, not shape_policy={config.shape_policy!r}: pass cache_config={{"shape_'
            'policy": "bucketed", ...}} (or "padded"); the exact policy compiles a new graph for every shape'
        )
    generation_config = model.generation_config
    expand = max(
        generate_kwargs.get("num_beams", generation_config.num_beams) or 1,
        generate_kwargs.get("num_return_sequences", generation_config.num_return_sequences) or 1,
    )
    shapes = policy.call_shapes(model, config, max_new_tokens=max_new_tokens, expand=expand)
    limit = torch._dynamo.config.recompile_limit
    if len(shapes) > limit:
        raise ValueError(
            f"{len(shapes)} shapes to compile exceed torch._dynamo.config.recompile_limit={limit}: dynamo would run "
            f"the calls of the others eagerly; set torch._dynamo.config.recompile_limit = {len(shapes)} (or more) "
            'first, or list fewer sizes in cache_config["buckets"]'
        )
    if artifact is not None:
        _warmup_artifact(model, make_inputs, shapes, config, compile_config, generate_kwargs, artifact, progress)
        return shapes
    calls = shapes + _encoder_shapes(model, shapes, compile_config)
    # this CPU's fp32 linear kernels measured for every decode graph's rows, before any compiles (and before the
    # compile cache's key: the passes' identity names the table)
    kernel_choice.prepare(model, compile_config, [shape.batch_size * expand for shape in shapes])
    cache = contextlib.nullcontext()
    if cache_dir is not None:
        facts = {
            "model": model_facts(model, compile_config),
            "warmup": {
                "calls": [dataclasses.asdict(call) for call in calls],
                "cache_config": config.to_dict(),
                "generate_kwargs": _settings_of(generate_kwargs),
            },
        }
        cache = compile_cache(cache_dir, facts)
    with explained_recompile_limit(len(shapes)), cache:
        _run_shapes(model, make_inputs, calls, config, compile_config, generate_kwargs, progress)
    return shapes


def _warmup_artifact(model, make_inputs, shapes, config, compile_config, generate_kwargs, directory, progress):
    """`warmup(..., artifact=directory)`: load the artifact of these calls, or build it and load it.

    The artifact holds the decode steps' graphs that the calls reached (first steps included), recorded by a
    `Recorder`, and where `compile_config` compiles the encoder, the encoder side's graphs that the serving engine's
    artifact holds too (`encoder_artifact.py`: the token encoder, an int8 model's cross-attention projections, with
    dynamic rows and positions up to the calls' largest)."""
    if compile_config is None:
        raise ValueError("warmup(artifact=...) needs the compile_config of the served calls")
    projections = _cross_attention_projections(model)
    encoder_limits = {
        "max_rows": max(shape.batch_size for shape in shapes),
        "max_positions": max(shape.length for shape in shapes),
    }
    encoder_names = encoder_graph_names(
        model, compile_config, projections, max_positions=encoder_limits["max_positions"]
    )
    caller = {
        "graph": "generate decode steps",
        "calls": [dataclasses.asdict(call) for call in shapes],
        "cache_config": config.to_dict(),
        "generate_kwargs": _settings_of(generate_kwargs),
        "encoder_graphs": encoder_names,
        "description": DESCRIPTION_VERSION,
    }
    facts = artifact_facts(model, compile_config, shapes=[dataclasses.astuple(call) for call in shapes], caller=caller)
    set_artifact(model, None)
    try:
        loaded = load_artifact(directory, facts)
    except ArtifactRefused as error:
        if (Path(directory) / MANIFEST).exists() or (Path(directory).exists() and any(Path(directory).iterdir())):
            logger.warning("compiled artifact not used, building it again: %s", error)
        recorder = Recorder(model, compile_config)
        set_artifact(model, recorder)
        try:
            with torch.no_grad():
                _run_shapes(model, make_inputs, shapes, config, compile_config, generate_kwargs, progress)
        finally:
            set_artifact(model, None)
        graphs = dict(recorder.graphs)
        if encoder_names:
            graphs.update(encoder_artifact_graphs(model, compile_config, projections, **encoder_limits))
        write_artifact(directory, facts, graphs, compile_config)
        loaded = load_artifact(directory, facts)
    encoder_side = None
    if encoder_names:
        encoder_side = loaded_encoder_side(
            model, compile_config, projections, loaded, max_positions=encoder_limits["max_positions"]
        )
    set_artifact(model, Replayer(model, loaded, encoder_side))
    # Each shape's calls once more, now on the loaded graphs: a package's first run pays what a compile's warm-up
    # call pays (its constants' pages, the libraries' kernels made for its shapes), 80-250 ms a package in the
    # bench's stream, where a call of the same bucket later took 10-30 ms to its first token
    with torch.no_grad():
        _run_shapes(model, make_inputs, shapes, config, compile_config, generate_kwargs)
    logger.info("%s", loaded.describe())
    return loaded


def _cross_attention_projections(model) -> list | None:
    """The cross-attention projections of `model`'s decoder layers (`cache.placement.cross_attention_projections`),
    None where it has none."""
    if not model.config.is_encoder_decoder:
        return None
    _, cross = attention_modules(model)
    return cross_attention_projections(model, len(cross)) if cross else None


def _settings_of(generate_kwargs: dict) -> dict:
    """The plain settings among `generate_kwargs` (a compile cache key holds them; tensors and objects are left out)."""
    return {
        key: value
        for key, value in sorted(generate_kwargs.items())
        if value is None or isinstance(value, (bool, int, float, str))
    }


def _encoder_shapes(model, shapes: list, compile_config) -> list:
    """The calls that compile the encoder graphs the shapes leave out: a compiled encoder (`encoder.py`) runs
    at the call's own rows and length with dynamic shapes: one graph for a single row (where the encoder does not
    pack: a packed one, and an int8 model's projections, run it in the graph of several), one for more, and for an
    int8 model one more for many (`encoder.encoder_graph`). Each shape's call ran at its bucket's rows and
    length (the capacities always among them); a graph none of them reached gets a call of its own."""
    if not shapes:
        return []
    calls = encoder_warmup_calls(
        model, compile_config, max(shape.batch_size for shape in shapes), max(shape.length for shape in shapes)
    )
    variants = has_int8_variants(model, compile_config)
    reached = {
        encoder_graph(shape.batch_size, shape.length, int8_variants=variants) for shape in shapes if shape.length > 1
    }
    smallest = min(shapes, key=lambda shape: (shape.batch_size, shape.length))
    return [
        dataclasses.replace(smallest, batch_size=batch, length=positions)
        for batch, positions in calls
        if encoder_graph(batch, positions, int8_variants=variants) not in reached
    ]


def _run_shapes(model, make_inputs, shapes, config, compile_config, generate_kwargs: dict, progress=None) -> None:
    if progress is not None:
        progress(0, len(shapes))
    for done, shape in enumerate(shapes, start=1):
        stopping = StoppingCriteriaList(
            [*(generate_kwargs.get("stopping_criteria") or []), StopAfterSteps(WARMUP_FORWARDS)]
        )
        model.generate(
            **make_inputs(shape.batch_size, shape.length),
            **{**generate_kwargs, "stopping_criteria": stopping},
            cache_implementation=FLEXIBLE_STATIC,
            cache_config=config.to_dict(),
            compile_config=compile_config,
            max_new_tokens=shape.max_new_tokens,
            min_new_tokens=min(WARMUP_FORWARDS, shape.max_new_tokens),
        )
        if progress is not None:
            progress(done, len(shapes))


@contextlib.contextmanager
def explained_recompile_limit(num_shapes: int):
    """Re-raise dynamo's recompile-limit failure of a warm-up with what it means here.

    Every flexible model's forward is one function to dynamo (`FlexModelMixin.__call__`, which generate's
    `compile_config` compiles), so the graphs compiled earlier in the process for other models, or for copies of this
    one, count against the same `recompile_limit`: a warm-up that fits the limit alone can still reach it.
    """
    try:
        yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        limit = torch._dynamo.config.recompile_limit
        raise RuntimeError(
            f"dynamo's recompile limit ({limit} graphs of one function) was reached while compiling {num_shapes} "
            "shapes: every flexible model's forward is one function to dynamo (FlexModelMixin.__call__), so the graphs "
            "compiled earlier in this process for other models, or for copies of this one, count too. Set "
            "torch._dynamo.config.recompile_limit and accumulated_recompile_limit to the graphs of all the models "
            "this process compiles, or call torch._dynamo.reset() before warming up another model"
        ) from error
