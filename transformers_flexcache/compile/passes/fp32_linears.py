"""Which CPU kernels run the frozen fp32 linear layers of a compiled step: MKL's (inductor's choice), oneDNN's, or
dot products that inductor generates for a step of one row.

Design decisions (the measurements behind each: docs/compile.md, "Compiling `generate`" and "Why the compile wing
chooses as it does"):
- With `freezing=True`, inductor prepacks each fp32 linear for MKL (`mkl._mkl_linear`) on x86, and for oneDNN
  (`mkldnn._linear_pointwise`) only for bf16/fp16 weights (torch==2.13.0, `fx_passes/mkldnn_fusion.py`). MKL runs its
  fast paths on Intel CPUs only; on other CPUs oneDNN's linears read the weights at the memory's bandwidth where
  MKL's do not. CTranslate2 makes the same choice (MKL only on GenuineIntel CPUs, oneDNN elsewhere: `mayiuse_mkl` in
  its `src/cpu/backend.cc`), and so does `"auto"` here.
- The change is an inductor pass (`OneDNNLinears`), handed to the compile through `compile_config_for_cpu`'s options:
  nothing global is patched, and inductor's on-disk cache keys on the pass (`uuid`). It runs before freezing, which
  folds oneDNN's packed copy of each weight into the graph, one copy for all the graphs compiled on that weight
  (`SharedOneDNNWeights`); the graph then calls oneDNN's linear, as inductor itself does for bf16 weights. Linears on
  anything but a parameter are left alone.
- At one row (a decode step of one sequence) a linear is a matrix-vector product bound by reading the weight; there
  both libraries read it more slowly than a plain vectorized dot product does. `OneRowLinears` makes that rewrite,
  before freezing (so that neither library packs those weights); at two rows or more it would read the weight once
  per row, so it is for one row only. `"auto"` applies it where the CPU is not Intel's; on Intel CPUs (MKL) it is
  not measured yet.
- Under `"auto"` the rule by vendor is only the default: where this CPU's kernel table (`compile.kernel_choice`)
  holds a measured choice for a linear's (rows, in, out), that kernel runs it (`LinearPlan`): both passes are then
  installed, each taking the linears whose choice is its own, and those measured as MKL's are left to inductor,
  which packs them for MKL under freezing. Linears of symbolic rows (the compiled encoder) keep the rule.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.virtualized import V
from torch._prims_common import make_contiguous_strides_for

from .. import kernel_choice
from ..cpu import cpu_facts
from .nodes import LIBRARY, call_node, name_new_nodes, pass_uuid, replace_node

LINEAR_KERNELS = ("auto", "onednn", "mkl")
ONE_ROW_LINEARS = ("auto", "inductor", "library")


def resolve_linear_kernels(linear_kernels: str) -> str:
    """`"onednn"` or `"mkl"` for `linear_kernels`: `"auto"` is MKL on Intel CPUs, oneDNN on the others.

    Raises:
        ValueError: `linear_kernels` is not one of `LINEAR_KERNELS`.
    """
    return _resolve("linear_kernels", linear_kernels, LINEAR_KERNELS, on_intel="mkl", elsewhere="onednn")


def resolve_one_row_linears(one_row_linears: str) -> str:
    """`"inductor"` or `"library"` for `one_row_linears`: `"auto"` is inductor's dot products where the CPU is not
    Intel's (faster there: docs/compile.md) and the library's kernel (MKL) on Intel CPUs (not measured yet).

    Raises:
        ValueError: `one_row_linears` is not one of `ONE_ROW_LINEARS`.
    """
    return _resolve("one_row_linears", one_row_linears, ONE_ROW_LINEARS, on_intel="library", elsewhere="inductor")


def _resolve(name: str, value: str, choices: tuple[str, ...], *, on_intel: str, elsewhere: str) -> str:
    """`value`, with `"auto"` resolved by the CPU's vendor; refuses a value outside `choices`."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")
    if value == "auto":
        return on_intel if cpu_facts().is_intel else elsewhere
    return value


class LinearPlan:
    """Which kernel runs each frozen fp32 linear of a graph: `base` (`"onednn"` or `"mkl"`) at any rows, `one_row`
    (`"inductor"` or `"library"`: the base) at one row, and, where `measured`, this CPU's measured choice of the
    shape instead wherever the table has one (`compile.kernel_choice.choice`).

    Equal plans compare equal (the table may grow between two configs; their graphs are keyed apart by `key()`);
    the cache identity of a measured plan holds the table's CPU key and choices (`kernel_choice.table_digest`)."""

    __slots__ = ("base", "one_row", "measured")

    def __init__(self, base: str = "onednn", one_row: str = "library", *, measured: bool = False):
        if base not in ("onednn", "mkl") or one_row not in ("inductor", "library"):
            raise ValueError(
                f"LinearPlan(base={base!r}, one_row={one_row!r}): base is onednn or mkl, one_row inductor or library"
            )
        self.base, self.one_row, self.measured = base, one_row, measured

    def kernel(self, rows, in_features: int, out_features: int) -> str:
        """`"onednn"`, `"mkl"` or `"inductor"` for a linear of `rows` (an int, or symbolic) x `in_features` ->
        `out_features`."""
        if self.measured:
            chosen = kernel_choice.choice(rows, in_features, out_features)
            if chosen is not None and (chosen != "inductor" or rows == 1):
                return chosen
        return self._rule(rows)

    def _rule(self, rows) -> str:
        return "inductor" if rows == 1 and self.one_row == "inductor" else self.base

    def key(self) -> str:
        """The plan's cache identity: its settings and, where measured, the table's CPU key and the shapes on which
        the table's choice differs from the plan's rule (the only ones where the table changes a kernel)."""
        if not self.measured:
            return f"{self.base}-{self.one_row}-rule"
        overruled = {}
        for rows, k, n in kernel_choice.measured_shapes():
            kernel = self.kernel(rows, k, n)
            if kernel != self._rule(rows):
                overruled[kernel_choice.shape_key(rows, k, n)] = kernel
        return f"{self.base}-{self.one_row}-measured:{kernel_choice.table_digest(overruled)}"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and (other.base, other.one_row, other.measured) == (
            self.base,
            self.one_row,
            self.measured,
        )

    def __hash__(self) -> int:
        return hash((type(self), self.base, self.one_row, self.measured))

    def __repr__(self) -> str:
        return f"LinearPlan({self.base!r}, {self.one_row!r}, measured={self.measured})"


def measured_linear_plan(linear_kernels: str, one_row_linears: str) -> LinearPlan | None:
    """The plan of `compile_config_for_cpu`'s fp32 linears: measured choices over the rule by vendor where both
    settings are `"auto"`; None where either is set (the passes then run as set, measuring nothing)."""
    if linear_kernels != "auto" or one_row_linears != "auto":
        return None
    base = resolve_linear_kernels("auto")
    one_row = resolve_one_row_linears("auto")
    return LinearPlan(base, one_row, measured=True)


class SharedOneDNNWeights:
    """oneDNN's packed copies of frozen weights, one per weight for all the graphs compiled on it.

    Every graph that freezing compiles holds its own constants: a model compiled at several shapes (a bucketed policy's
    decode graphs, a padded policy's, a server's twelve) held one packed copy of its linears' weights per graph, as
    much memory as the weights each time. `packed(weight, batch_size)` returns the copy packed for an earlier graph
    where that copy still lives (held by a graph, weakly here) and holds the same values (checked exactly, on its
    unpacked values: a weight changed in place, or a new tensor at a freed address, is packed anew), and packs a new
    one otherwise.

    One copy serves every number of rows but one: oneDNN packs a weight for one row (`batch_size == 1`) in another
    layout, slower at several rows, and for any other row count in a layout that runs any number of rows from 2 at the
    same speed with the same outputs, bit for bit (measured, with the memory this saves: docs/compile.md).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._copies: dict[tuple, weakref.ReferenceType] = {}
        self.packs = 0  # copies packed so far

    def packed(self, weight: torch.Tensor, batch_size) -> torch.Tensor:
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device, batch_size == 1)
        with self._lock:
            reference = self._copies.get(key)
            copy_ = reference() if reference is not None else None
            if copy_ is not None and torch.equal(copy_.to_dense(), weight):
                return copy_
            copy_ = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)
            self.packs += 1
            self._copies = {k: r for k, r in self._copies.items() if r() is not None}
            self._copies[key] = weakref.ref(copy_)
            return copy_

    def __len__(self) -> int:
        """The packed copies alive."""
        with self._lock:
            return sum(reference() is not None for reference in self._copies.values())


ONEDNN_WEIGHTS = SharedOneDNNWeights()


def _onednn_packed_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`transformers_flexcache::onednn_packed_weight`: oneDNN's packed copy of a linear's `weight` ([N, K]) for
    `rows` rows (0: any number), the one copy shared by every graph (`SharedOneDNNWeights`). Freezing folds it into a
    constant of the graph (`OneDNNLinears`)."""
    return ONEDNN_WEIGHTS.packed(weight, rows or None)


LIBRARY.define("onednn_packed_weight(Tensor weight, int rows) -> Tensor")
LIBRARY.impl("onednn_packed_weight", _onednn_packed_weight, "CPU")


@torch.library.register_fake("transformers_flexcache::onednn_packed_weight")
def _(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.empty_like(weight)  # oneDNN's copy has the weight's sizes (its layout is its own)


onednn_packed_weight = torch.ops.transformers_flexcache.onednn_packed_weight.default


class OneDNNLinears(CustomGraphPass):
    """Inductor joint-graph pass (before freezing): every fp32 linear on a parameter (`aten.mm(x [M, K], permute(w
    [N, K], [1, 0]))`, `aten.addmm(b, x, permute(w, [1, 0]))`) becomes oneDNN's (`mkldnn._linear_pointwise`) on
    `onednn_packed_weight(w, M)`, which freezing folds into a constant: oneDNN's packed copy, one per weight for all
    graphs (`SharedOneDNNWeights`). Linears of one static row are left to `OneRowLinears` where `one_row` says it
    takes them (it rewrites them before freezing, so that inductor packs none of them).

    Before freezing, not after (torch==2.13.0: inductor's own packing, `mkldnn_fusion.py`, would pack them for MKL
    first): so the frozen graph that inductor's FX graph cache keys on already holds the packed copies as frozen
    constants, which the cache keys by their sizes and takes from the graph at a hit (`compile.fx_cache`); a pass
    after freezing adds constants that a hit never makes.

    Instances with the same `one_row` are equal, so that two `compile_config_for_cpu()` configs compare equal
    (upstream's generate keeps its compiled call while the config does not change).
    """

    def __init__(self, *, one_row: bool = True, plan: LinearPlan | None = None):
        self.one_row = one_row
        # without a plan: every linear (those of one row too where `one_row`) on oneDNN
        self.plan = plan if plan is not None else LinearPlan("onednn", "library" if one_row else "inductor")

    def __call__(self, graph: torch.fx.Graph) -> None:
        weights = _parameter_placeholders(graph)
        for node in list(graph.nodes):
            matched = _fp32_linear(node, weights)
            if matched is None:
                continue
            inputs, weight, bias = matched
            rows = inputs.meta["val"].shape[0]
            out_features, in_features = weight.meta["val"].shape
            if self.plan.kernel(rows if isinstance(rows, int) else None, in_features, out_features) != "onednn":
                continue
            fake_mode = torch._guards.detect_fake_mode([inputs.meta["val"]])
            packed_rows = rows if isinstance(rows, int) else 0
            with graph.inserting_before(node):
                packed = call_node(graph, fake_mode, onednn_packed_weight, weight, packed_rows)
            linear = torch.ops.mkldnn._linear_pointwise.default
            replace_node(graph, node, call_node, graph, fake_mode, linear, inputs, packed, bias, "none", [], "")

    def uuid(self) -> str:
        return f"{pass_uuid(self)}-{self.plan.key()}"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.plan == self.plan

    def __hash__(self) -> int:
        return hash((type(self), self.plan))


def _parameter_placeholders(graph: torch.fx.Graph) -> set:
    """The placeholders of `graph` that freezing makes constants: the parameters and buffers that AOT autograd lifted
    (the first inputs, `TracingContext.params_flat`), not mutated; empty outside a compile."""
    context = torch._guards.TracingContext.try_get()
    params = getattr(context, "params_flat", None) if context is not None else None
    if not params:
        return set()
    placeholders = graph.find_nodes(op="placeholder")[: len(params)]
    metadata = getattr(context, "fw_metadata", None)
    mutated = set(getattr(metadata, "mutated_inp_runtime_indices", None) or ())
    return {node for index, node in enumerate(placeholders) if index not in mutated}


def _frozen_weights(graph: torch.fx.Graph) -> set:
    """The nodes of `graph` that stand for weights freezing makes constants: under `torch.compile` the parameters that
    AOT autograd lifted (`_parameter_placeholders`); under AOTInductor (`V.aot_compilation`: a `torch.export`ed
    program, whose parameters and buffers reach the joint graph as `get_attr` constants and whose mutated buffers as
    inputs) its `get_attr` nodes."""
    if V.aot_compilation:
        return set(graph.find_nodes(op="get_attr"))
    return _parameter_placeholders(graph)


def _fp32_linear(node: torch.fx.Node, weights: set):
    """`(x, w, b or None)` where `node` is `aten.mm(x [M, K], permute(w, [1, 0]))` or `aten.addmm(b [N], x,
    permute(w, [1, 0]))` (no scaling) on float32 tensors with `w` [N, K] among `weights`; None otherwise."""
    if node.target is torch.ops.aten.mm.default and not node.kwargs:
        bias, (inputs, transposed) = None, node.args
    elif node.target is torch.ops.aten.addmm.default and not node.kwargs:
        bias, inputs, transposed = node.args
        if not isinstance(bias, torch.fx.Node) or bias.meta["val"].dim() != 1:
            return None
    else:
        return None
    if transposed.target is not torch.ops.aten.permute.default or list(transposed.args[1]) != [1, 0]:
        return None
    weight = transposed.args[0]
    if weight not in weights or inputs.meta["val"].dtype != torch.float32:
        return None
    if weight.meta["val"].dtype != torch.float32 or weight.meta["val"].dim() != 2:
        return None
    return inputs, weight, bias


class OneRowLinears(CustomGraphPass):
    """Inductor joint-graph pass (before freezing, as `OneDNNLinears`): an fp32 linear of one row on a parameter (a
    decode step of one sequence) becomes a multiply and a sum over the input features, which inductor generates as
    one vectorized dot product per output, reading the weight ([N, K], contiguous) once, row by row.

    Before freezing, so that inductor never packs these weights: under `torch.compile` it would pack them for MKL,
    under AOTInductor (`V.aot_compilation`, the compiled artifacts) for oneDNN, and a pass after freezing that matched
    MKL's packed linear left every one-row linear of an AOTInductor graph on oneDNN (the artifact's one-row step ran
    slower than the frozen graph's: docs/performance.md). Freezing then folds the weight into a constant that the
    dot products read.

    The input is stored in a buffer of its own first (`prims.inductor_force_stride_order`, which inductor realizes).
    Left to itself, inductor fuses the pointwise work that makes the input (a norm, the residual sums) into the dot
    products and recomputes it for every output: the inner loop of T5's output layer loaded six vectors and ran a
    dozen vector operations per eight weights, where it now loads the weights and the stored input, multiplies and
    adds. The same operations on the same values: the outputs are unchanged, bit for bit (what storing the input
    saves a step: docs/compile.md).

    With a `plan` (`LinearPlan`), only the linears that it gives to `"inductor"` (measured or by rule); without
    one, every fp32 linear of one row on a parameter. Instances with equal plans are equal, as for `OneDNNLinears`.
    """

    def __init__(self, plan: LinearPlan | None = None):
        self.plan = plan

    def __call__(self, graph: torch.fx.Graph) -> None:
        weights = _frozen_weights(graph)
        before = set(graph.nodes)
        for node in list(graph.nodes):
            matched = _fp32_linear(node, weights)
            if matched is None:
                continue
            inputs, weight, bias = matched
            out_features, in_features = weight.meta["val"].shape
            if inputs.meta["val"].shape[0] != 1 or not weight.meta["val"].is_contiguous():
                continue  # several rows (or symbolic ones): the libraries' kernels
            if self.plan is not None and self.plan.kernel(1, in_features, out_features) != "inductor":
                continue
            fake_mode = torch._guards.detect_fake_mode([inputs.meta["val"]])
            with graph.inserting_before(node):
                # The input stored once (see the docstring), contiguous
                strides = make_contiguous_strides_for(inputs.meta["val"].shape)
                stored = call_node(
                    graph, fake_mode, torch.ops.prims.inductor_force_stride_order.default, inputs, strides
                )
                # [1, K] -> [1, 1, K] * [N, K] -> [1, N, K] -> sum over K -> [1, N]
                row = call_node(graph, fake_mode, torch.ops.aten.unsqueeze.default, stored, -2)
                products = call_node(graph, fake_mode, torch.ops.aten.mul.Tensor, row, weight)
                out = call_node(graph, fake_mode, torch.ops.aten.sum.dim_IntList, products, [-1])
                if bias is not None:
                    out = call_node(graph, fake_mode, torch.ops.aten.add.Tensor, out, bias)
            transposed = node.args[-1]  # `permute(weight)`, the linear's last argument
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            if not transposed.users:
                graph.erase_node(transposed)
        name_new_nodes(graph, before, torch.ops.aten.mm.default)  # kernels named `..._mm_...`

    def uuid(self) -> str:
        return pass_uuid(self) if self.plan is None else f"{pass_uuid(self)}-{self.plan.key()}"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.plan == self.plan

    def __hash__(self) -> int:
        return hash((type(self), self.plan))
