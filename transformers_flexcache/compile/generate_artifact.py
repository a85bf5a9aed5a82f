"""Compiled artifacts of `generate`'s fixed-shape calls: `warmup(..., artifact=DIR)` and `bench --artifact DIR`.

The serving engine's artifact (`serving/exported_step.py`) exports a step it builds itself; a `generate` call's decode
step is upstream's loop calling the compiled forward (`PreTrainedModel.get_compiled_call`) with whatever
`prepare_inputs_for_generation` made. So the generate path's graphs are captured where that forward is called
(`compile.hooks.CompileHooks.compiled_call`), under `warmup()`:

- **Building** (`Recorder`): each call of the compiled forward is run eagerly instead, and its arguments are
  described (`describe`): the pytree of its kwargs, each tensor's shape, dtype and strides, every other value, and
  the cache's state, i.e. the tensors of the cache's objects (`tensor_slots`: its storages and 0-d lengths, written
  in place) and the plain values of those objects (`window_len`, `batch_size`, ...; not the pool's leases). A
  description not seen yet is exported there and then, while the cache is in that call's state (`CapturedStep`: the
  tensors in, the cache's tensors swapped in, its plain state set back after the trace); after the warm-up each
  export is compiled with AOTInductor (`artifact.write_artifact`), keyed by the description's SHA-256, with the plain
  state the eager step left and the structure of the model's output.
- **Loading** (`Replayer`): a call whose description is one of the artifact's runs its graph (the cache's tensors
  passed in, so the graph writes the live cache), and the plain values the eager step left behind are set as it left
  them; any other call runs the compiled forward (dynamo traces it), with a warning the first time. Every plain value
  that could change the graph is in the description, so a graph runs only on a call that it was traced for. Within
  one generate call, a later step with the same arguments' shapes and values skips the description (`Replayer.wrap`).

The warm-up's own facts (the model, its weights, the capacities, the calls `warmup()` runs, the generate kwargs) are
the artifact's key (`artifact.artifact_facts`), checked before anything loads.
"""

from __future__ import annotations

import hashlib
import json

import torch
from torch.utils import _pytree as pytree
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import ModelOutput

from ..cache import NOT_READ_BY_A_STEP, state_objects, tensor_slots
from ..log import get_logger
from .config import compile_settings

logger = get_logger(__name__)

PACKAGE_PREFIX = "transformers_flexcache"
# What a call's description holds (`describe`), in the artifact's key: a folder written with other descriptions would
# load and then miss every call. 2: the lender's bookkeeping left out (`cache.NOT_READ_BY_A_STEP`), the encoder's
# outputs as upstream passes them.
DESCRIPTION_VERSION = 2
ARTIFACT_ATTRIBUTE = "_flex_generate_artifact"  # on the model: its Recorder or Replayer
_PLAIN = (bool, int, float, str, type(None))


def _plain(value) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, _PLAIN) and _plain(item) for key, item in value.items())
    return False


def plain_state(cache) -> list:
    """`[[object index, attribute, value], ...]`: every plain value (numbers, strings, None, and lists or dicts of
    them) of the cache's objects (`state_objects`) but those no step reads (`NOT_READ_BY_A_STEP`); JSON-able."""
    state = []
    for index, obj in enumerate(state_objects(cache)):
        for name, value in sorted(vars(obj).items()):
            if name in NOT_READ_BY_A_STEP:  # the lender's bookkeeping between calls: no step reads it
                continue
            if isinstance(value, _PLAIN):
                state.append([index, name, value])
            elif _plain(value):  # lists and dicts as JSON holds them
                state.append([index, name, json.loads(json.dumps(value, default=str))])
    return state


def set_plain_state(cache, state: list) -> None:
    """Set the plain values `plain_state` gave (JSON's lists back to tuples, its string keys back to the keys)."""
    objects = state_objects(cache)
    for index, name, value in state:
        attributes = vars(objects[index])  # as `plain_state` read them (a property of the class may shadow one)
        current = attributes.get(name)
        if isinstance(current, dict) and isinstance(value, dict):
            keys = {str(key): key for key in current}
            value = {keys.get(text, text): item for text, item in value.items()}
        elif isinstance(current, tuple) and isinstance(value, list):
            value = tuple(value)
        if current != value:
            attributes[name] = value


class Unsupported(Exception):
    """A forward call whose arguments a graph cannot stand for (an object that is not a cache or a plain value)."""


def describe(kwargs: dict) -> tuple[str, dict]:
    """`(digest, parts)` of a call of the compiled forward: what its graph depends on (module docstring).

    Raises:
        Unsupported: an argument that is neither a tensor, a plain value, a dtype or device, nor a cache.
    """
    leaves, spec = pytree.tree_flatten(kwargs)
    described, caches = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(["tensor", list(leaf.shape), str(leaf.dtype), list(leaf.stride())])
        elif isinstance(leaf, Cache) or type(leaf).__module__.startswith(PACKAGE_PREFIX) and tensor_slots(leaf):
            described.append(["cache", len(caches)])
            caches.append(leaf)
        elif isinstance(leaf, torch.dtype | torch.device) or _plain(leaf):
            described.append(["value", str(leaf) if isinstance(leaf, torch.dtype | torch.device) else leaf])
        else:
            raise Unsupported(f"an argument of type {type(leaf).__name__}")
    cache_parts = []
    for cache in caches:
        slots = [
            [type(owner).__name__, name, list(getattr(owner, name).shape), str(getattr(owner, name).dtype)]
            for owner, name in tensor_slots(cache)
        ]
        cache_parts.append({"class": type(cache).__name__, "slots": slots, "state": plain_state(cache)})
    parts = {"spec": str(spec), "leaves": described, "caches": cache_parts}
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32], parts


def encoder_outputs_as_upstream_passes_them(kwargs: dict) -> dict:
    """`kwargs` with `encoder_outputs` as a `BaseModelOutput` of the same tensors where it is another output class
    with no other field set (the eager encoder's `BaseModelOutputWithPastAndCrossAttentions`, which upstream's
    encoder-decoder forwards turn into a `BaseModelOutput` themselves): the class is part of a call's description, and
    an artifact's encoder (`encoder_artifact.LoadedEncoderSide`) returns a `BaseModelOutput` where the eager encoder
    that ran while the artifact was built returned another class, for the same graph."""
    outputs = kwargs.get("encoder_outputs")
    if not isinstance(outputs, ModelOutput) or type(outputs) is BaseModelOutput:
        return kwargs
    fields = dict(outputs.items())
    if not set(fields) <= {"last_hidden_state", "hidden_states", "attentions"}:
        return kwargs
    return {**kwargs, "encoder_outputs": BaseModelOutput(**fields)}


def _quick(leaf):
    """What the quick check of a step compares of one argument: a tensor's shape, dtype and strides, an object's
    identity (a cache), a value itself."""
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape, leaf.dtype, leaf.stride())
    if isinstance(leaf, _PLAIN):
        return (type(leaf), leaf)
    return ("id", id(leaf))


def _split(kwargs: dict) -> tuple[list, list, object, list]:
    """(tensor leaves, caches, spec, leaves) of the kwargs of a forward call."""
    leaves, spec = pytree.tree_flatten(kwargs)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    caches = [
        leaf
        for leaf in leaves
        if isinstance(leaf, Cache) or (type(leaf).__module__.startswith(PACKAGE_PREFIX) and tensor_slots(leaf))
    ]
    return tensors, caches, spec, leaves


class CapturedStep(torch.nn.Module):
    """A recorded call of the compiled forward as a module of tensors (`torch.export` takes it): `forward(*inputs,
    *cache_tensors)` returns the tensors of the model's output. The cache's plain state is set as it was before the
    recorded call; its tensors are swapped for those passed in, then put back."""

    def __init__(self, model, kwargs: dict, state_before: list):
        super().__init__()
        self.model = model
        tensors, caches, self.spec, self.leaves = _split(kwargs)
        self.num_inputs = len(tensors)
        self.caches = caches
        self.slots = [slot for cache in caches for slot in tensor_slots(cache)]
        self.state_before = state_before

    def cache_tensors(self) -> list[torch.Tensor]:
        return [getattr(owner, name) for owner, name in self.slots]

    def forward(self, *tensors: torch.Tensor):
        inputs, storages = iter(tensors[: self.num_inputs]), tensors[self.num_inputs :]
        saved = self.cache_tensors()
        leaves = [next(inputs) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        try:
            for (owner, name), tensor in zip(self.slots, storages, strict=True):
                setattr(owner, name, tensor)
            for cache, state in zip(self.caches, self.state_before, strict=True):
                set_plain_state(cache, state)
            outputs = self.model(**pytree.tree_unflatten(leaves, self.spec))
            return [leaf for leaf in pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]
        finally:
            for (owner, name), tensor in zip(self.slots, saved, strict=True):
                setattr(owner, name, tensor)


def _rebuild(outputs_template, tensors: list):
    """The model's output with its tensors taken from `tensors`, in the order `CapturedStep` returns them."""
    leaves, spec = pytree.tree_flatten(outputs_template)
    given = iter(tensors)
    return pytree.tree_unflatten([next(given) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


class Recorder:
    """Building an artifact (module docstring): the compiled forward's calls run eagerly and are recorded.

    Args:
        model: the model whose forward is recorded.
        limit: the most distinct calls kept (a warm-up's calls times their steps' kinds); past it, `Unsupported`.
    """

    def __init__(self, model, compile_config, limit: int = 256):
        self.model = model
        self.compile_config = compile_config
        self.limit = limit
        self.graphs: dict = {}  # (digest,) -> (ExportedProgram, example inputs, extra)

    def wrap(self, compiled):
        def forward(**kwargs):
            kwargs = encoder_outputs_as_upstream_passes_them(kwargs)
            try:
                digest, parts = describe(kwargs)
            except Unsupported as error:
                raise Unsupported(
                    f"generate's compiled forward got {error}: it cannot be an artifact's graph"
                ) from None
            if (digest,) in self.graphs:
                return self.model(**kwargs)
            if len(self.graphs) >= self.limit:
                raise Unsupported(f"more than {self.limit} distinct decode steps in one warm-up")
            states = [cache_part["state"] for cache_part in parts["caches"]]
            module = CapturedStep(self.model, kwargs, states)
            tensors, caches, _, _ = _split(kwargs)
            inputs = [*tensors, *module.cache_tensors()]
            # Exported here, while the cache is in this call's state (its layers leased, its views made); the
            # export runs the step's Python on fake tensors, and what it leaves in the cache is put back.
            with compile_settings(self.compile_config):
                program = torch.export.export(module, tuple(inputs), strict=False)
            for cache, state in zip(caches, states, strict=True):
                set_plain_state(cache, state)
            outputs = self.model(**kwargs)
            extra = {
                "state_after": [plain_state(cache) for cache in caches],
                "outputs": output_template(outputs),
                "call": parts,
            }
            self.graphs[(digest,)] = (program, inputs, extra)
            return outputs

        return forward


class Replayer:
    """Loading an artifact: calls the artifact has a graph for run it; others run `compiled` (module docstring).
    `encoder_side` (`encoder_artifact.LoadedEncoderSide`, or None where the artifact holds none) runs the encoder
    and the first step's cross-attention projections of the calls whose compile would have compiled them."""

    def __init__(self, model, loaded, encoder_side=None):
        self.model = model
        self.loaded = loaded  # `artifact.LoadedArtifact`: graphs and extras by (digest,)
        self.encoder_side = encoder_side
        self.missed: set = set()

    def wrap(self, compiled):
        # Within one generate call (upstream's generate asks for the compiled forward once per call), a step whose
        # arguments have the shapes, values and cache of the step before, after a graph that leaves the cache's plain
        # state as it found it, has that step's description: it is not computed again (a full description costs
        # milliseconds on a t5-small-sized model). The same reasoning as `hooks.GuardsOfFirstStep`: between the
        # steps of one call nothing but the step itself changes the cache.
        last = {}
        converted = {}  # the encoder outputs of the call's steps (one object), and what they were taken as

        def forward(**kwargs):
            outputs = kwargs.get("encoder_outputs")
            if outputs is not None:
                if converted.get("from") is not outputs:  # once per call, not at every step
                    taken = encoder_outputs_as_upstream_passes_them({"encoder_outputs": outputs})
                    converted.update({"from": outputs, "to": taken["encoder_outputs"]})
                kwargs = {**kwargs, "encoder_outputs": converted["to"]}
            leaves, spec = pytree.tree_flatten(kwargs)
            quick = (spec, tuple(_quick(leaf) for leaf in leaves))
            if last.get("quick") == quick:  # a steady step like the one before (see above)
                tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
                storages = [getattr(owner, name) for owner, name in last["slots"]]
                results = last["graph"]([*tensors, *storages])
                return _rebuild(last["template"], results)
            last.clear()
            try:
                digest, _ = describe(kwargs)
            except Unsupported:
                digest = None
            graph = self.loaded.graphs.get((digest,))
            if graph is None:
                if digest not in self.missed:
                    self.missed.add(digest)
                    logger.warning(
                        "compiled artifact %s holds no graph for this step: compiling it (a call outside the "
                        "shapes warmup() ran, or other generate arguments)",
                        self.loaded.directory,
                    )
                return compiled(**kwargs)
            tensors, caches, _, _ = _split(kwargs)
            slots = [slot for cache in caches for slot in tensor_slots(cache)]
            results = graph([*tensors, *(getattr(owner, name) for owner, name in slots)])
            extra = self.loaded.extras[(digest,)]
            for cache, state in zip(caches, extra["state_after"], strict=True):
                set_plain_state(cache, state)
            template = _output_of(extra["outputs"], caches)
            if extra["state_after"] == [part["state"] for part in extra["call"]["caches"]]:
                last.update(quick=quick, graph=graph, slots=slots, template=template)
            return _rebuild(template, results)

        return forward


def output_template(outputs) -> dict:
    """What `_output_of` needs to rebuild an output like `outputs`: its class, its fields and which are tensors or the
    cache (JSON-able)."""
    fields = {}
    for name, value in outputs.items():
        if isinstance(value, torch.Tensor):
            fields[name] = "tensor"
        elif isinstance(value, Cache) or type(value).__module__.startswith(PACKAGE_PREFIX):
            fields[name] = "cache"
        elif value is None:
            continue
        else:
            raise Unsupported(f"the model's output {name} ({type(value).__name__})")
    return {"module": type(outputs).__module__, "class": type(outputs).__qualname__, "fields": fields}


def _output_of(template: dict, caches: list):
    import importlib

    cls = getattr(importlib.import_module(template["module"]), template["class"])
    fields = {}
    for name, kind in template["fields"].items():
        fields[name] = torch.empty(0) if kind == "tensor" else (caches[0] if caches else None)
    return cls(**fields)


def artifact_of(model):
    """The `Recorder` or `Replayer` that `warmup(..., artifact=DIR)` set on `model`, or None."""
    return getattr(model, ARTIFACT_ATTRIBUTE, None)


def set_artifact(model, artifact) -> None:
    """Set (or with None, take away) the compiled forward's artifact of `model`'s generate calls."""
    if artifact is None:
        model.__dict__.pop(ARTIFACT_ATTRIBUTE, None)
    else:
        model.__dict__[ARTIFACT_ATTRIBUTE] = artifact
