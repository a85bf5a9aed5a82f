"""`generate.signatures.signature_of`: `inspect.signature`, held per function."""

from __future__ import annotations

import inspect

from torch import nn

from transformers_flexcache.generate.signatures import signature_of


class _Model(nn.Module):
    def forward(self, input_ids, attention_mask=None, **kwargs):
        return input_ids


def test_a_signature_is_inspects_and_is_read_once_per_function():
    model = _Model()
    assert signature_of(model.forward) == inspect.signature(model.forward)
    assert list(signature_of(model.forward).parameters) == ["input_ids", "attention_mask", "kwargs"]
    assert signature_of(_Model().forward) is signature_of(model.forward)  # one function, one reading
    # the function itself (unbound) keeps its first parameter
    assert list(signature_of(_Model.forward).parameters) == ["self", "input_ids", "attention_mask", "kwargs"]
    assert list(signature_of(model.forward).parameters)[0] == "input_ids"


def test_a_replaced_forward_is_read_anew():
    model = _Model()
    before = signature_of(model.forward)

    def forward(input_features, decoder_input_ids=None):
        return input_features

    model.forward = forward
    assert list(signature_of(model.forward).parameters) == ["input_features", "decoder_input_ids"]
    assert signature_of(_Model().forward) is before
