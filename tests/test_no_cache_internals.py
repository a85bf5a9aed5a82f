"""No file under model_overrides/ reads cache internals: only `update`, `get_kv` and other public cache methods.

The check reads each file's syntax tree, so docstrings and comments (which quote upstream's `.layers[i].keys` to
say what changed) never count, and it decides precisely:
- `.is_updated`, `.key_cache`, `.value_cache`, `.conv_states`, `.ssm_states`, `.recurrent_states`, and any
  private `_..._storage` attribute: always internal.
- `.keys` / `.values`: internal unless called with no arguments (`mapping.keys()`, `dict.values()`), which no cache
  layer offers: a layer's keys and values are tensor attributes.
- `.layers`, and any private `._name`: internal on an expression that names a cache (`cache.layers`,
  `past_key_values.layers`, `cache.cross_attention_cache._x`); a model's own `self.layers` (its decoder layers)
  and `self._private_method` are not a cache's.
- `getattr(obj, "<any of these names>")`: the same reads, spelled as strings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

OVERRIDES = Path(__file__).resolve().parent.parent / "model_overrides"

ALWAYS_INTERNAL = {
    "is_updated",
    "key_cache",
    "value_cache",
    "conv_states",
    "ssm_states",
    "recurrent_states",
}
PRIVATE_STORAGE = re.compile(r"^_\w*storage\w*$")
CALLABLE_ON_DICTS = {"keys", "values"}
# An expression that names a cache: `cache`, `x.cross_attention_cache`, `self_attention_cache`, `past_key_values`.
CACHE_RECEIVER = re.compile(r"(?:^|[._])cache$|past_key_values?$")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _internal_attribute(node: ast.Attribute, parent: ast.AST | None) -> str | None:
    """Why reading `node` is a cache internal, or None."""
    name = node.attr
    if name in ALWAYS_INTERNAL or PRIVATE_STORAGE.match(name):
        return f".{name}"
    if name in CALLABLE_ON_DICTS:
        called_bare = isinstance(parent, ast.Call) and parent.func is node and not parent.args and not parent.keywords
        return None if called_bare else f".{name} (not a `.{name}()` dict call)"
    receiver = ast.unparse(node.value)
    if (name == "layers" or _is_private(name)) and CACHE_RECEIVER.search(receiver):
        return f".{name} of {receiver}"
    return None


def _internal_getattr(node: ast.Call) -> str | None:
    is_getattr = isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2
    name = node.args[1].value if is_getattr and isinstance(node.args[1], ast.Constant) else None
    if not isinstance(name, str):
        return None
    if name in ALWAYS_INTERNAL | CALLABLE_ON_DICTS or PRIVATE_STORAGE.match(name):
        return f'getattr(..., "{name}")'
    if (name == "layers" or _is_private(name)) and CACHE_RECEIVER.search(ast.unparse(node.args[0])):
        return f'getattr({ast.unparse(node.args[0])}, "{name}")'
    return None


def cache_internal_reads(source: str) -> list[str]:
    """Every read of a cache internal in `source`, as "line N: <code> (<why>)"."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            why = _internal_attribute(node, parents.get(node))
        elif isinstance(node, ast.Call):
            why = _internal_getattr(node)
        else:
            why = None
        if why:
            found.append(f"line {node.lineno}: {ast.unparse(node)} ({why})")
    return sorted(found, key=lambda entry: int(entry.split(":")[0].removeprefix("line ")))


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
}


@pytest.mark.parametrize("snippet", list(VIOLATIONS.values()), ids=list(VIOLATIONS))
def test_the_checker_catches_a_read_of_cache_internals(snippet):
    assert cache_internal_reads(snippet), snippet


@pytest.mark.parametrize("snippet", list(ALLOWED.values()), ids=list(ALLOWED))
def test_the_checker_allows_docstrings_dict_calls_model_layers_and_public_accessors(snippet):
    assert cache_internal_reads(snippet) == []
