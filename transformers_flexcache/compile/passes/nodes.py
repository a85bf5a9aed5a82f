"""What the graph passes share: building FX nodes with the fake values inductor's lowering reads, replacing a node,
the passes' cache identity, and the package's library of plain ops.

Every pass here is an inductor `CustomGraphPass`: inductor's FX graph cache keys a compile on `uuid()`
(`pass_uuid`: the hash of the file that defines the pass's class), so an edit of a pass's file is a new key. Instances
of a pass compare equal (`same_type`, `type_hash`), so that two `compile_config_for_cpu()` configs compare equal and
upstream's generate keeps its compiled call while the config does not change.
"""

from __future__ import annotations

import sys

import torch
from torch._inductor.custom_graph_pass import get_hash_for_files

# The package's ops that are plain library ops (a CPU kernel and a fake), not `torch.library.custom_op`s.
LIBRARY = torch.library.Library("transformers_flexcache", "FRAGMENT")


def pass_uuid(self) -> str:
    """The hash of the file that defines the pass's class, and its name: inductor's cache keys on it."""
    return get_hash_for_files((sys.modules[type(self).__module__].__file__,), type(self).__name__).hex()


def same_type(self, other) -> bool:
    return type(other) is type(self)


def type_hash(self) -> int:
    return hash(type(self))


def replace_node(graph: torch.fx.Graph, node: torch.fx.Node, build, *args) -> None:
    """Replace `node` by the node `build(*args)` adds before it, which keeps `node`'s metadata beside its own."""
    with graph.inserting_before(node):
        out = build(*args)
    out.meta = {**node.meta, **out.meta}
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def call_node(graph: torch.fx.Graph, fake_mode, target, *args, **kwargs) -> torch.fx.Node:
    """A `call_function` node of `target(*args, **kwargs)` with its fake value in `meta["val"]`, as inductor's
    lowering reads."""
    node = graph.call_function(target, args, kwargs)
    values = torch.fx.node.map_arg(args, lambda arg: node_value(arg, fake_mode))  # nested too (a list of tensors)
    node.meta["val"] = target(*values, **kwargs)
    return node


def node_value(node: torch.fx.Node, fake_mode):
    """The fake value of `node`: its `meta["val"]`, or for a constant (`get_attr`) one made from the tensor."""
    if "val" not in node.meta:
        node.meta["val"] = fake_mode.from_tensor(getattr(node.graph.owning_module, node.target), static_shapes=True)
    return node.meta["val"]


def name_new_nodes(graph: torch.fx.Graph, before: set, op) -> None:
    """Gives the nodes of `graph` not in `before` (those a pass added) `op` as their `meta["original_aten"]`, where
    they have none: inductor names a fused C++ kernel after its nodes' original aten ops, so a pass's loops keep
    the name of what they compute (a profile reads it: `bench/profile.py`). Names only; the code is the same."""
    for node in graph.nodes:
        if node not in before and node.op == "call_function" and node.meta.get("original_aten") is None:
            node.meta["original_aten"] = op
