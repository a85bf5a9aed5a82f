"""`CapacityError`: the engine's refusal of a request that can never fit says, by capacity, what the request needs
and what the engine has, so that a caller (the HTTP server) can name its own setting in the fix."""

from __future__ import annotations

import pytest
import torch

from tests.model_cases import MODEL_CASES
from transformers_flexcache.serving import CapacityError, Engine


def test_the_engine_refusal_carries_what_the_request_needs_and_the_limits():
    case = next(case for case in MODEL_CASES if case.name == "t5")
    _, flex = case.build("sdpa")
    inputs = case.make_inputs(1, 20, torch.Generator().manual_seed(0))
    with Engine(flex, cache_config={"max_batch_size": 2, "max_cache_len": 8, "max_encoder_len": 16}) as engine:
        with pytest.raises(CapacityError, match="encoder_len=20 exceeds max_encoder_len=16") as raised:
            engine.submit(**inputs, max_new_tokens=10, num_beams=3)
    assert raised.value.needed == {"max_batch_size": 3, "max_cache_len": 10, "max_encoder_len": 20}
    assert raised.value.limits == {"max_batch_size": 2, "max_cache_len": 8, "max_encoder_len": 16}
    assert isinstance(raised.value, ValueError)
