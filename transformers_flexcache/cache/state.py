"""What a cache's state is, for code that must hand it to a graph as tensors: the objects a cache is made of, and the
tensors they hold, each once, in a fixed order.

Two users outside this wing need it and must agree on it: the serving engine's compiled artifact
(`serving/exported_step.py`: a decode step takes the seat cache's tensors as inputs) and `generate`'s artifact
(`compile/generate_artifact.py`: a compiled forward's call is described and replayed with the cache's tensors and
plain values). The order is part of an exported program's signature, so it is defined here, once: the objects in
pre-order (the cache, then each cache object it holds, depth first, in attribute order), then each object's tensors
in attribute order.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

_WING = __name__.rsplit(".", 1)[0]  # transformers_flexcache.cache
# Plain attributes of cache objects that are the lender's bookkeeping between calls, which no step reads (a model's
# forward, the cache's `update`, `get_kv`...): a description of a step's state leaves them out, and a replayed step
# leaves them as the call set them. `num_prompt_pad`: the left padding of the prompt of the call that filled the cache
# (set by `generate/plan.py`, read by the policies before a continuation), which differs from call to call.
NOT_READ_BY_A_STEP = frozenset({"num_prompt_pad"})


def _is_cache_object(value) -> bool:
    """A cache object: of this wing (layers, seat state, containers) or transformers' caches and cache layers. Not
    the objects that lend a cache (a pool's leases: their counters change from call to call and no graph reads them)."""
    return hasattr(value, "__dict__") and (
        type(value).__module__.startswith(_WING) or isinstance(value, Cache | CacheLayerMixin)
    )


def state_objects(cache) -> list:
    """`cache` and every cache object it holds (directly, or in a list or tuple attribute), each once, in pre-order."""
    found, seen = [], set()

    def walk(obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        found.append(obj)
        for value in list(vars(obj).values()):
            if isinstance(value, list | tuple):
                for item in value:
                    if _is_cache_object(item):
                        walk(item)
            elif _is_cache_object(value):
                walk(value)

    walk(cache)
    return found


def tensor_slots(cache) -> list[tuple[object, str]]:
    """`(owner, attribute)` of every tensor held by an object of `state_objects(cache)`, once per tensor (the first
    owner in that order), in that order, then by attribute order. Tensors in dicts (per-device index views a step
    makes from these) are not slots."""
    slots, seen = [], set()
    for obj in state_objects(cache):
        for name, value in list(vars(obj).items()):
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                slots.append((obj, name))
    return slots
