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
"""

from __future__ import annotations

import functools

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

LINEAR_KERNELS = ("auto", "onednn", "mkl")


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
    if linear_kernels not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernels={linear_kernels!r} is not one of {LINEAR_KERNELS}")
    if linear_kernels == "auto":
        return "mkl" if cpu_vendor() == "GenuineIntel" else "onednn"
    return linear_kernels


class OneDNNLinears(CustomGraphPass):
    """Inductor post-grad pass: every MKL-packed frozen linear (`mkl._mkl_linear`) becomes oneDNN's
    (`mkldnn._linear_pointwise`) on the same weight, repacked for oneDNN at compile time.

    All instances are equal, so that two `compile_config_for_cpu()` configs compare equal (upstream's generate keeps
    its compiled call while the config does not change).
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        replaced = set()
        for node in list(graph.nodes):
            if node.target not in (torch.ops.mkl._mkl_linear, torch.ops.mkl._mkl_linear.default):
                continue
            # mkl._mkl_linear(input, mkl_packed_weight, weight_t, bias, batch_size): weight_t [K, N], frozen
            inputs, packed, weight_t, bias, batch_size = node.args
            if weight_t.op != "get_attr" or packed.op != "get_attr":
                continue
            name = f"{weight_t.target}_onednn"
            if not hasattr(module, name):
                weight = getattr(module, weight_t.target)
                module.register_buffer(name, torch.ops.mkldnn._reorder_linear_weight(weight, batch_size))
            with graph.inserting_before(node):
                onednn_weight = graph.get_attr(name)
                linear = graph.call_function(
                    torch.ops.mkldnn._linear_pointwise.default, (inputs, onednn_weight, bias, "none", [], "")
                )
            linear.meta.update(node.meta)
            node.replace_all_uses_with(linear)
            graph.erase_node(node)
            replaced.update((packed.target, weight_t.target))
        if not replaced:
            return
        graph.eliminate_dead_code()
        used = {node.target for node in graph.nodes if node.op == "get_attr"}
        for target in replaced - used:  # the MKL copies: freed rather than kept beside oneDNN's
            delattr(module, target)

    def uuid(self) -> str:
        return get_hash_for_files((__file__,)).hex()

    def __eq__(self, other) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))
