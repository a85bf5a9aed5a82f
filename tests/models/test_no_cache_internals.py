"""No file under model_overrides/ reads cache internals: only `update`, `get_kv` and other public cache methods.

The checker is `transformers_flexcache.models.source_check.cache_internal_reads` (its docstring states the rules); the
generic route for decoder-only models runs the same checker on upstream's model code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from transformers_flexcache.models.source_check import cache_internal_reads

OVERRIDES = Path(__file__).resolve().parents[2] / "model_overrides"


@pytest.mark.parametrize("path", sorted(OVERRIDES.glob("*.py")), ids=lambda path: path.name)
def test_model_override_reads_no_cache_internals(path):
    found = cache_internal_reads(path.read_text())
    assert not found, f"{path.name} reads cache internals; use get_kv/update or a public cache method:\n" + "\n".join(
        found
    )


VIOLATIONS = {
    "layer keys": "k = cache.cross_attention_cache.layers[self.layer_idx].keys",
    "layer values": "v = past_key_values.layers[0].values",
    "layers of a cache": "layer = cache.self_attention_cache.layers[i]",
    "is_updated": "if cache.is_updated[self.layer_idx]:\n    pass",
    "is_updated set": "cache.is_updated[self.layer_idx] = True",
    "key_cache": "k = cache.key_cache[0]",
    "conv_states": "state = cache.conv_states[self.layer_idx]",
    "ssm_states": "cache.ssm_states[i].zero_()",
    "recurrent_states": "s = cache.recurrent_states[i]",
    "private storage": "k = cache._key_storage[:, :, :4]",
    "keys with an argument": "k = layer.keys(0)",
    "private attribute of a cache": "n = cache.self_attention_cache._seen_tokens",
    "private attribute of past_key_values": "past_key_values._layers.clear()",
    "getattr": 'k = getattr(layer, "keys")',
    "getattr layers": 'layers = getattr(cache, "layers")',
}
ALLOWED = {
    "docstring and comment": '"""Upstream reads cache.layers[i].keys and is_updated."""\n# cache.is_updated[i]\n',
    "dict calls": "names = list(config.keys())\nvalues = sorted(mapping.values())",
    "model layers": "for layer in self.layers[: self.config.num_hidden_layers]:\n    pass",
    "public accessors": "k, v = cache.cross_attention_cache.get_kv(self.layer_idx, batch_size, length)\n"
    "k, v = cache.cross_attention_cache.update(k, v, self.layer_idx)\nn = cache.get_seq_length()",
    "string mentioning a name": 'message = "cache.key_cache is not read here"',
    "private methods of the model": "cache = self._prepare_cache_for_generation(config)\nself._reorder_cache(c, i)",
    "cache_position": "start = cache_position[0]\nn = cache_position.shape[0]",
    "values of a torch reduction": "top = scores.max(dim=-1).values\nfirst = torch.cummax(x, dim=1).values",
}


@pytest.mark.parametrize("snippet", list(VIOLATIONS.values()), ids=list(VIOLATIONS))
def test_the_checker_catches_a_read_of_cache_internals(snippet):
    assert cache_internal_reads(snippet), snippet


@pytest.mark.parametrize("snippet", list(ALLOWED.values()), ids=list(ALLOWED))
def test_the_checker_allows_docstrings_dict_calls_model_layers_and_public_accessors(snippet):
    assert cache_internal_reads(snippet) == []
