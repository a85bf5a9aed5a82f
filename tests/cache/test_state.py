"""The cache wing's `state_objects` and `tensor_slots`: the one walk of a cache's objects and tensors that both
compiled artifacts (the serving engine's and `generate`'s) hand to their graphs, in one fixed order."""

from __future__ import annotations

import pytest
import torch

from tests.model_cases import MODEL_CASES
from tests.serving.test_engine import capacities
from transformers_flexcache.cache import state_objects, tensor_slots
from transformers_flexcache.serving import Engine


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_tensor_slots_hold_every_storage_once_in_a_fixed_order(name):
    case = next(case for case in MODEL_CASES if case.name == name)
    _, flex = case.build("sdpa")
    with Engine(flex, cache_config={**capacities(flex), "shape_policy": "padded"}) as engine:
        cache = engine.cache
        slots = tensor_slots(cache)
        tensors = [getattr(owner, attribute) for owner, attribute in slots]
        assert len({id(t) for t in tensors}) == len(tensors)  # each tensor once
        # every layer's storages are slots: a graph handed these writes the live cache
        layers = [obj for obj in state_objects(cache) if type(obj).__name__.endswith("Layer")]
        assert layers
        for layer in layers:
            for attribute, value in vars(layer).items():
                if isinstance(value, torch.Tensor):
                    assert any(t is value for t in tensors), f"{type(layer).__name__}.{attribute} is not a slot"
        assert [(id(o), a) for o, a in tensor_slots(cache)] == [(id(o), a) for o, a in slots]  # the same order again
        objects = state_objects(cache)
        assert objects[0] is cache and len({id(o) for o in objects}) == len(objects)
        order = {id(obj): index for index, obj in enumerate(objects)}
        assert [order[id(owner)] for owner, _ in slots] == sorted(order[id(owner)] for owner, _ in slots)


def test_objects_that_lend_a_cache_are_not_its_state():
    """An object outside the cache wing (a pool's lease, say) held by a cache is not walked, nor its tensors."""

    class Lease:  # defined in a test module: not of the cache wing
        def __init__(self):
            self.counter = torch.zeros(1)

    case = next(case for case in MODEL_CASES if case.name == "llama")
    _, flex = case.build("sdpa")
    with Engine(flex, cache_config={**capacities(flex), "shape_policy": "padded"}) as engine:
        cache = engine.cache
        before = tensor_slots(cache)
        cache.lease = Lease()
        try:
            after = tensor_slots(cache)
            assert all(not isinstance(owner, Lease) for owner in state_objects(cache))
            assert [(id(o), a) for o, a in after] == [(id(o), a) for o, a in before]
        finally:
            del cache.lease
