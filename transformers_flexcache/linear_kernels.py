"""Which CPU kernels run the frozen fp32 linear layers of a compiled step: MKL's (inductor's choice) or oneDNN's.

Design decisions:
- With `freezing=True`, inductor prepacks each fp32 linear for MKL (`mkl._mkl_linear`) on x86, and for oneDNN
  (`mkldnn._linear_pointwise`) only for bf16/fp16 weights (torch==2.13.0, `fx_passes/mkldnn_fusion.py`). MKL runs its
  fast paths on Intel CPUs only. Measured on an AMD EPYC (AVX-512, one thread), t5-small-sized linears at 4 rows:
  MKL 0.21 ms for 512x2048, 6.1 ms for the 512x32128 output layer; oneDNN 0.063 ms and 2.1 ms, at the memory's
  bandwidth (at one row both are within 10% of each other). CTranslate2 makes the same choice (MKL only on
  GenuineIntel CPUs, oneDNN elsewhere: `mayiuse_mkl` in its `src/cpu/backend.cc`), and so does `"auto"` here.
- The change is an inductor post-grad pass (`OneDNNLinears`), handed to the compile through
  `options["post_grad_custom_post_pass"]` (`compile_config_for_cpu(linear_kernels=...)`): nothing global is
  patched, and inductor's on-disk cache keys on the pass (`uuid`). It runs after freezing, so it repacks each frozen
  weight for oneDNN once, at compile time, and drops the MKL copy; the graph then calls oneDNN's linear, as inductor
  itself does for bf16 weights. Linears that freezing did not pack (no frozen weight) are left alone.
- At one row (a decode step of one sequence: freezing packs it with `batch_size == 1`) a linear is a matrix-vector
  product bound by reading the weight. There, on a 2-vCPU AMD EPYC Zen 3 (AVX2, one thread), both libraries read
  T5's decoder weights and output layer (154 MB) more slowly than a plain vectorized dot product: one forward of
  those linears alone 28-29 ms with oneDNN (MKL's the same), 21-23 ms as multiply-and-sum that inductor generates;
  T5's whole bucketed step at batch 1 30.3 ms against 22.1 (CTranslate2's 21.3: its DNNL `sgemm`), measured side
  by side. `OneRowLinears` makes that rewrite, before `OneDNNLinears`. At 2-4 rows the same rewrite reads the
  weight once per row and loses (4 rows: 53 against 47 ms), so it is for one row only. `"auto"` applies it where
  the CPU is not Intel's; on Intel CPUs (MKL) it is not measured yet.
"""

from __future__ import annotations

import functools

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

LINEAR_KERNELS = ("auto", "onednn", "mkl")
ONE_ROW_LINEARS = ("auto", "inductor", "library")


@functools.cache
def cpu_vendor() -> str | None:
    """The `vendor_id` of /proc/cpuinfo (`"GenuineIntel"`, `"AuthenticAMD"`), or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), None)
    except OSError:
        return None


def resolve_linear_kernels(linear_kernels: str) -> str:
    """`"onednn"` or `"mkl"` for `linear_kernels`: `"auto"` is MKL on Intel CPUs, oneDNN on the others.

    Raises:
        ValueError: `linear_kernels` is not one of `LINEAR_KERNELS`.
    """
    return _resolve("linear_kernels", linear_kernels, LINEAR_KERNELS, on_intel="mkl", elsewhere="onednn")


def resolve_one_row_linears(one_row_linears: str) -> str:
    """`"inductor"` or `"library"` for `one_row_linears`: `"auto"` is inductor's dot products where the CPU is not
    Intel's (measured faster there) and the library's kernel (MKL) on Intel CPUs (not measured yet).

    Raises:
        ValueError: `one_row_linears` is not one of `ONE_ROW_LINEARS`.
    """
    return _resolve("one_row_linears", one_row_linears, ONE_ROW_LINEARS, on_intel="library", elsewhere="inductor")


def _resolve(name: str, value: str, choices: tuple[str, ...], *, on_intel: str, elsewhere: str) -> str:
    """`value`, with `"auto"` resolved by the CPU's vendor; refuses a value outside `choices`."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")
    if value == "auto":
        return on_intel if cpu_vendor() == "GenuineIntel" else elsewhere
    return value


def _uuid(self) -> str:
    return get_hash_for_files((__file__,), type(self).__name__).hex()  # inductor's cache keys on it


def _same_type(self, other) -> bool:
    return type(other) is type(self)


def _type_hash(self) -> int:
    return hash(type(self))


def _frozen_mkl_linears(graph: torch.fx.Graph):
    """`(node, (input, packed weight, weight, bias, batch_size))` for each MKL-packed frozen linear of `graph`:
    `mkl._mkl_linear(input [..., K], mkl_packed_weight, origin_weight [N, K], bias [N] or None, batch_size)`, whose
    packed and original weights are constants (`get_attr`)."""
    for node in list(graph.nodes):
        if node.target not in (torch.ops.mkl._mkl_linear, torch.ops.mkl._mkl_linear.default):
            continue
        inputs, packed, weight, bias, batch_size = node.args
        if weight.op == "get_attr" and packed.op == "get_attr":
            yield node, (inputs, packed, weight, bias, batch_size)


def _free_unused(graph: torch.fx.Graph, targets: set) -> None:
    """Drops the dead nodes of `graph`, then those of the constants `targets` that no node reads any more (MKL's
    packed copies): freed rather than kept beside what replaced them."""
    if not targets:
        return
    graph.eliminate_dead_code()
    used = {node.target for node in graph.nodes if node.op == "get_attr"}
    for target in targets - used:
        delattr(graph.owning_module, target)


class OneDNNLinears(CustomGraphPass):
    """Inductor post-grad pass: every MKL-packed frozen linear (`mkl._mkl_linear`) becomes oneDNN's
    (`mkldnn._linear_pointwise`) on the same weight, repacked for oneDNN at compile time.

    All instances are equal, so that two `compile_config_for_cpu()` configs compare equal (upstream's generate keeps
    its compiled call while the config does not change).
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        replaced = set()
        for node, (inputs, packed, weight, bias, batch_size) in _frozen_mkl_linears(graph):
            name = f"{weight.target}_onednn"
            if not hasattr(module, name):
                module.register_buffer(
                    name, torch.ops.mkldnn._reorder_linear_weight(getattr(module, weight.target), batch_size)
                )
            with graph.inserting_before(node):
                onednn_weight = graph.get_attr(name)
                linear = graph.call_function(
                    torch.ops.mkldnn._linear_pointwise.default, (inputs, onednn_weight, bias, "none", [], "")
                )
            linear.meta.update(node.meta)
            node.replace_all_uses_with(linear)
            graph.erase_node(node)
            replaced.update((packed.target, weight.target))
        _free_unused(graph, replaced)

    uuid = _uuid
    __eq__ = _same_type
    __hash__ = _type_hash


class OneRowLinears(CustomGraphPass):
    """Inductor post-grad pass: a frozen fp32 linear of one row (`mkl._mkl_linear` with `batch_size == 1`: a decode
    step of one sequence) becomes a multiply and a sum over the input features, which inductor generates as one
    vectorized dot product per output, reading the weight ([N, K], contiguous) once, row by row.

    Run before `OneDNNLinears` (which takes the other linears). Every instance is equal, as for `OneDNNLinears`.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        replaced = set()
        for node, (inputs, packed, weight, bias, batch_size) in _frozen_mkl_linears(graph):
            value = getattr(module, weight.target)
            if batch_size != 1 or not value.is_contiguous() or value.shape[-1] != inputs.meta["val"].shape[-1]:
                continue
            fake_mode = torch._guards.detect_fake_mode([inputs.meta["val"]])
            with graph.inserting_before(node):
                # [..., K] -> [..., 1, K] * [N, K] -> [..., N, K] -> sum over K -> [..., N]
                row = _call(graph, fake_mode, torch.ops.aten.unsqueeze.default, inputs, -2)
                products = _call(graph, fake_mode, torch.ops.aten.mul.Tensor, row, weight)
                out = _call(graph, fake_mode, torch.ops.aten.sum.dim_IntList, products, [-1])
                if bias is not None:
                    out = _call(graph, fake_mode, torch.ops.aten.add.Tensor, out, bias)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            replaced.add(packed.target)  # the weight itself stays: the products read it
        _free_unused(graph, replaced)

    uuid = _uuid
    __eq__ = _same_type
    __hash__ = _type_hash


def _call(graph: torch.fx.Graph, fake_mode, target, *args) -> torch.fx.Node:
    """A `call_function` node of `target(*args)` with its fake value in `meta["val"]`, as inductor's lowering reads."""
    node = graph.call_function(target, args)
    node.meta["val"] = target(*(_value(arg, fake_mode) if isinstance(arg, torch.fx.Node) else arg for arg in args))
    return node


def _value(node: torch.fx.Node, fake_mode):
    """The fake value of `node`: its `meta["val"]`, or for a constant (`get_attr`) one made from the tensor."""
    if "val" not in node.meta:
        node.meta["val"] = fake_mode.from_tensor(getattr(node.graph.owning_module, node.target), static_shapes=True)
    return node.meta["val"]
