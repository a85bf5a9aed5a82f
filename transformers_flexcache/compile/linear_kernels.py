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
  weight for oneDNN at compile time, one copy for all the graphs compiled on it (`SharedOneDNNWeights`), and drops
  the MKL copy; the graph then calls oneDNN's linear, as inductor itself does for bf16 weights. Linears that
  freezing did not pack (no frozen weight) are left alone.
- At one row (a decode step of one sequence: freezing packs it with `batch_size == 1`) a linear is a matrix-vector
  product bound by reading the weight. There, on a 2-vCPU AMD EPYC Zen 3 (AVX2, one thread), both libraries read
  T5's decoder weights and output layer (154 MB) more slowly than a plain vectorized dot product: one forward of
  those linears alone 28-29 ms with oneDNN (MKL's the same), 21-23 ms as multiply-and-sum that inductor generates;
  T5's whole bucketed step at batch 1 30.3 ms against 22.1 (CTranslate2's 21.3: its DNNL `sgemm`), measured side
  by side. `OneRowLinears` makes that rewrite, before `OneDNNLinears`. At 2-4 rows the same rewrite reads the
  weight once per row and loses (4 rows: 53 against 47 ms), so it is for one row only. `"auto"` applies it where
  the CPU is not Intel's; on Intel CPUs (MKL) it is not measured yet.
- int8 (`quantize(model, "int8")`): on CPUs without VNNI oneDNN's int8 linears are 5-6x slower than float32's at a
  few rows, and with VNNI slower than FBGEMM's. `Int8FbgemmMatmuls` runs the int8 products on FBGEMM's int8 GEMMs
  instead, exact on 7-bit weights (8-bit with VNNI), and `Int8DotProducts` with `Int8DotExpansion` those of decode
  steps of 1-2 rows as exact dot products that inductor generates (`"fbgemm"`, which `"auto"` picks wherever torch
  has FBGEMM and the CPU has no AMX). `"inductor"` runs the dot products up to 8
  rows and those of graphs of dynamic rows (the compiled encoder and cross-attention projections) as exact float32
  GEMMs of float copies of the weights, made once when the graph is frozen (`Int8FloatGemms`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import threading
import warnings
import weakref

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._prims_common import make_contiguous_strides_for

from ..log import get_logger
from .cpu import cpu_facts

logger = get_logger(__name__)

LINEAR_KERNELS = ("auto", "onednn", "mkl")
ONE_ROW_LINEARS = ("auto", "inductor", "library")
INT8_LINEARS = ("auto", "fbgemm", "inductor", "library")
INT8_DOT_MAX_ROWS = 8  # int8 products of static rows up to this run as dot products (decode steps)
# FBGEMM's int8 products are exact for weights in [-limit, limit): 64 (7 bits) without VNNI, 128 (8 bits) with it
# (`fbgemm_weight_limit`, see `Int8FbgemmMatmuls`)
FBGEMM_WEIGHT_LIMIT = 64
FBGEMM_MIN_ROWS = 3  # under int8_linears="fbgemm", int8 products of fewer static rows run as dot products
# ... unless their weight has at least this many outputs (a vocabulary's output layer): see `Int8FbgemmMatmuls`
FBGEMM_MIN_OUTPUTS = 8192


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


def resolve_int8_linears(int8_linears: str) -> str:
    """`"fbgemm"`, `"inductor"` or `"library"` for `int8_linears`. `"auto"`: on CPUs with AMX the library's (oneDNN's
    AMX int8 kernels; not measured here); elsewhere FBGEMM's int8 GEMMs (`Int8FbgemmMatmuls`) where torch has FBGEMM
    (x86 builds): exact at 7 bits without VNNI and at 8 bits with it, and faster than oneDNN's int8 kernels on both
    (AMD EPYC Zen 3 without VNNI: oneDNN's 5-6x float32's at a few rows; Zen 4 with VNNI: a T5 call at 8 rows 281
    against 348 ms, at one row 156 against 162); without FBGEMM, oneDNN's where the CPU has VNNI, else inductor's
    dot products.

    Raises:
        ValueError: `int8_linears` is not one of `INT8_LINEARS`.
    """
    if int8_linears not in INT8_LINEARS:
        raise ValueError(f"int8_linears={int8_linears!r} is not one of {INT8_LINEARS}")
    if int8_linears == "auto":
        facts = cpu_facts()
        if facts.amx:
            return "library"
        if has_fbgemm():
            return "fbgemm"
        return "library" if facts.vnni else "inductor"
    return int8_linears


def fbgemm_weight_limit() -> int:
    """FBGEMM's int8 products are exact for weights in `[-limit, limit)`: 128 (8 bits) on a CPU with VNNI, whose
    kernels sum u8 x s8 products in 32 bits (`vpdpbusd`), else 64 (7 bits), where they sum pairs in saturating 16 bits
    (`vpmaddubsw`: 255 x 64 x 2 < 2**15)."""
    return 128 if cpu_facts().vnni else FBGEMM_WEIGHT_LIMIT


def has_fbgemm() -> bool:
    """Whether this torch has FBGEMM's quantized kernels (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def _resolve(name: str, value: str, choices: tuple[str, ...], *, on_intel: str, elsewhere: str) -> str:
    """`value`, with `"auto"` resolved by the CPU's vendor; refuses a value outside `choices`."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")
    if value == "auto":
        return on_intel if cpu_facts().is_intel else elsewhere
    return value


def _uuid(self) -> str:
    """The hash of the file that defines the pass's class, and its name: inductor's cache keys on it."""
    return get_hash_for_files((sys.modules[type(self).__module__].__file__,), type(self).__name__).hex()


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


class SharedOneDNNWeights:
    """oneDNN's packed copies of frozen weights, one per weight for all the graphs compiled on it.

    Every graph that freezing compiles holds its own constants: a model compiled at several shapes (a bucketed policy's
    decode graphs, a padded policy's, a server's twelve) held one packed copy of its linears' weights per graph, as
    much memory as the weights each time. `packed(weight, batch_size)` returns the copy packed for an earlier graph
    where that copy still lives (held by a graph, weakly here) and holds the same values (checked exactly, on its
    unpacked values: a weight changed in place, or a new tensor at a freed address, is packed anew), and packs a new
    one otherwise.

    One copy serves every number of rows but one: oneDNN packs a weight for one row (`batch_size == 1`) in another
    layout, slower at several rows, and for any other row count in a layout that runs 2 to 320 rows at the same speed
    with the same outputs, bit for bit (measured on an AMD EPYC Zen 3, one thread, t5-small's 512x2048, 2048x512 and
    32128x512 weights: `mkldnn._linear_pointwise` at 2, 4, 8, 64 and 320 rows on weights packed for 2, 4, 8, 16, 64,
    320 rows and for none, within the timing's noise). The bench's bucketed warm-up (rows 1, 2, 4, 6, 8) grew the
    process by 724 MB against 1155 MB on the t5-small-sized T5, 718 against 1341 MB on opus-mt-sized Marian
    (docs/compile.md).
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


# The package's ops that are plain library ops (a CPU kernel and a fake), not `torch.library.custom_op`s.
_LIBRARY = torch.library.Library("transformers_flexcache", "FRAGMENT")


def _onednn_packed_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`transformers_flexcache::onednn_packed_weight`: oneDNN's packed copy of a linear's `weight` ([N, K]) for
    `rows` rows (0: any number), the one copy shared by every graph (`SharedOneDNNWeights`). Freezing folds it into a
    constant of the graph (`OneDNNLinears`)."""
    return ONEDNN_WEIGHTS.packed(weight, rows or None)


_LIBRARY.define("onednn_packed_weight(Tensor weight, int rows) -> Tensor")
_LIBRARY.impl("onednn_packed_weight", _onednn_packed_weight, "CPU")


@torch.library.register_fake("transformers_flexcache::onednn_packed_weight")
def _(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.empty_like(weight)  # oneDNN's copy has the weight's sizes (its layout is its own)


onednn_packed_weight = torch.ops.transformers_flexcache.onednn_packed_weight.default


class OneDNNLinears(CustomGraphPass):
    """Inductor joint-graph pass (before freezing): every fp32 linear on a parameter (`aten.mm(x [M, K], permute(w
    [N, K], [1, 0]))`, `aten.addmm(b, x, permute(w, [1, 0]))`) becomes oneDNN's (`mkldnn._linear_pointwise`) on
    `onednn_packed_weight(w, M)`, which freezing folds into a constant: oneDNN's packed copy, one per weight for all
    graphs (`SharedOneDNNWeights`). Linears of one static row are left to `OneRowLinears` where `one_row` says it
    takes them (inductor packs those for MKL, as it packs every linear it is given).

    Before freezing, not after (torch==2.13.0: inductor's own packing, `mkldnn_fusion.py`, would pack them for MKL
    first): so the frozen graph that inductor's FX graph cache keys on already holds the packed copies as frozen
    constants, which the cache keys by their sizes and takes from the graph at a hit (`compile.fx_cache`); a pass
    after freezing adds constants that a hit never makes.

    Instances with the same `one_row` are equal, so that two `compile_config_for_cpu()` configs compare equal
    (upstream's generate keeps its compiled call while the config does not change).
    """

    def __init__(self, *, one_row: bool = True):
        self.one_row = one_row

    def __call__(self, graph: torch.fx.Graph) -> None:
        weights = _parameter_placeholders(graph)
        for node in list(graph.nodes):
            matched = _fp32_linear(node, weights)
            if matched is None:
                continue
            inputs, weight, bias = matched
            rows = inputs.meta["val"].shape[0]
            if rows == 1 and not self.one_row:
                continue
            fake_mode = torch._guards.detect_fake_mode([inputs.meta["val"]])
            packed_rows = rows if isinstance(rows, int) else 0
            with graph.inserting_before(node):
                packed = _call(graph, fake_mode, onednn_packed_weight, weight, packed_rows)
            linear = torch.ops.mkldnn._linear_pointwise.default
            _replace(graph, node, _call, graph, fake_mode, linear, inputs, packed, bias, "none", [], "")

    def uuid(self) -> str:
        return f"{_uuid(self)}-{self.one_row}"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.one_row == self.one_row

    def __hash__(self) -> int:
        return hash((type(self), self.one_row))


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
    """Inductor post-grad pass: a frozen fp32 linear of one row (`mkl._mkl_linear` with `batch_size == 1`: a decode
    step of one sequence) becomes a multiply and a sum over the input features, which inductor generates as one
    vectorized dot product per output, reading the weight ([N, K], contiguous) once, row by row.

    The input is stored in a buffer of its own first (`prims.inductor_force_stride_order`, which inductor realizes).
    Left to itself, inductor fuses the pointwise work that makes the input (a norm, the residual sums) into the dot
    products and recomputes it for every output: the inner loop of T5's output layer loaded six vectors and ran a
    dozen vector operations per eight weights, where it now loads the weights and the stored input, multiplies and
    adds. The same operations on the same values: the outputs are unchanged, bit for bit. Measured on an AMD EPYC
    Zen 3, one thread, the bench's models bucketed compiled, a call of one row and 12 new tokens, both variants in one
    process, alternating (15 rounds, medians): a decode step 11.1 against 13.4 ms (t5-small-sized T5), 15.0 against
    17.4 (opus-mt-sized Marian), scores equal bit for bit.

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
                # The input stored once (see the docstring), contiguous
                strides = make_contiguous_strides_for(inputs.meta["val"].shape)
                stored = _call(graph, fake_mode, torch.ops.prims.inductor_force_stride_order.default, inputs, strides)
                # [..., K] -> [..., 1, K] * [N, K] -> [..., N, K] -> sum over K -> [..., N]
                row = _call(graph, fake_mode, torch.ops.aten.unsqueeze.default, stored, -2)
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


@torch.library.custom_op("transformers_flexcache::int8_dot_products", mutates_args=())
def int8_dot_products(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`torch._int_mm(inputs, weight.T)` of a few rows, marked by `Int8DotProducts` for `Int8DotExpansion`, which
    writes it as inductor's dot products. Eagerly (unexpanded) it is `_int_mm` itself."""
    return torch._int_mm(inputs, weight.t())


@int8_dot_products.register_fake
def _(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return inputs.new_empty((inputs.shape[0], weight.shape[0]), dtype=torch.int32)


class Int8DotProducts(CustomGraphPass):
    """Inductor joint-graph pass (before freezing): an int8 matrix multiply of at most `INT8_DOT_MAX_ROWS` static rows
    (`aten._int_mm(a [M, K], w.T)`, what torchao's int8 linears trace to in a decode step; `w` [N, K] int8, `a` int8
    or uint8) becomes `transformers_flexcache::int8_dot_products(a, w)`, which `Int8DotExpansion` (a post-grad pass)
    writes as dot products that inductor generates, equal to `_int_mm`'s integers.

    Why two passes: freezing turns `_int_mm` with a constant weight into oneDNN's int8 linear
    (`onednn.qlinear_pointwise`) and folds the pointwise work on constants into new constants (here: unpacked
    copies of the weights). The custom op is neither matched nor folded (its activations are not constant), and
    once frozen the expansion is left as it is written.

    Why it is exact: the products are integers of at most 128 * 128 in magnitude (128 * 255 for uint8 activations),
    so float32 sums of up to 1024 (514) of them, in any order, are exact integers. `K` is cut into chunks that size
    or below, each summed in float32 and converted to int32, and the chunks summed in int32: `_int_mm`'s result, bit
    for bit.

    How the dot products read the weights: as float32 words of four int8 weights each (a view of the storage:
    full-width vector loads; int32 loads of inductor's CPU vectors go through a buffer copy in torch==2.13.0, 5x
    slower), each word bitcast to int32 in registers, where a shift left then an arithmetic shift right gives each
    weight as a sign-extended int32, then a float. The activations are realized once as floats, grouped by byte
    position ([4, M, K/4]), and each row is a reduction of its own: inductor fuses them into one loop over the
    weights, which unpacks each word once for all rows.

    Skipped: dynamic rows (the compiled encoder and cross-attention projections: `Int8FloatGemms`'s), more than 8
    static rows (the library's), a `K` that cannot be cut into chunks of a multiple of 4, a weight that is not the
    transposed view of a contiguous [N, K] int8 tensor at a 4-byte offset, a big-endian machine (the bytes of a word
    are read little-endian).

    Every instance is equal, as for `OneDNNLinears`.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            matched = _int_mm_operands(node)
            if matched is None:
                continue
            _replace(graph, node, graph.call_function, int8_dot_products._opoverload, matched)

    uuid = _uuid
    __eq__ = _same_type
    __hash__ = _type_hash


class Int8FloatGemms(CustomGraphPass):
    """Inductor joint-graph pass (before freezing): an int8 matrix multiply of dynamic rows (`aten._int_mm(a [M, K],
    w.T)` with `M` symbolic: the compiled encoder and cross-attention projections, `compile/encoder.py`) becomes
    float32 GEMMs of the same integers, `_int_mm`'s result bit for bit, where the CPU's int8 GEMMs are slow (no
    VNNI: oneDNN's int8 linears took 1.6x float32's at 40 rows on an AMD EPYC Zen 3).

    The weight's conversion to float32 reads only the weight, a constant once frozen: freezing folds it into a float
    copy, which the fp32 linear kernels then prepack as they do a float model's (`OneDNNLinears`). That copy is the
    cost: a graph of dynamic rows holds its weights as a float32 graph does (4x their int8 bytes). Measured on that
    AMD EPYC, one thread, t5-small-sized T5 quantized: encoder and projections at 1 x 40 tokens 31 against 57 ms,
    an int8 call's first token 45.6 against 68.9 ms (float32's: 49). At many rows oneDNN's int8 linears are faster
    again (8 x 40 tokens: 117 against 166 ms), so the compiled encoder side keeps a compile without this pass for
    calls of more than 128 positions (`compile.encoder.encoder_graph`).

    Why it is exact: as in `Int8DotProducts`, `K` is cut into chunks whose products sum below 2**24 in magnitude
    (each chunk one GEMM), so every partial sum a GEMM forms, in any order, is an exact float32 integer; the chunks
    are converted to int32 and added in int32. It needs float32 GEMMs at full precision: under a lower
    `torch.get_float32_matmul_precision()` or `torch.backends.mkldnn.matmul.fp32_precision` (bf16 or tf32
    arithmetic) when the graph compiles, the pass leaves `_int_mm` to the library. Static rows are left alone
    (decode steps: up to 8 rows `Int8DotProducts`'s, more the library's, whose graphs would otherwise each hold
    float copies).

    Every instance is equal, as for `OneDNNLinears`.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        if not _float32_gemms_exact():
            return
        for node in list(graph.nodes):
            matched = _int_mm_operands(node, dynamic_rows=True)
            if matched is None:
                continue
            fake_mode = torch._guards.detect_fake_mode([matched[0].meta["val"]])
            _replace(graph, node, _int8_float_gemms, graph, fake_mode, *matched)

    uuid = _uuid
    __eq__ = _same_type
    __hash__ = _type_hash


def _int8_fbgemm_mm(
    inputs: torch.Tensor, weight: torch.Tensor, zero_point: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """`transformers_flexcache::int8_fbgemm_mm`: `torch._int_mm(a, weight.t())` on FBGEMM's int8 GEMMs, where
    `inputs` (float32 [M, K]) holds the integers of `a` (int8 [M, K] for `zero_point` 128, uint8 for 0) and `weight`
    is int8 [N, K] (see `Int8FbgemmMatmuls`). In `out_dtype`: int32 bit for bit, or float32, which holds the sums
    exactly where they lie within 2**24 in magnitude (the pass asks for it only where they must). A weight beyond 7
    bits, on which FBGEMM's products could saturate, is multiplied in float64 instead (exact, slower), with a
    warning."""
    parts = _fbgemm_parts(weight, torch.int8 if zero_point == 128 else torch.uint8)
    if parts is None or inputs.shape[0] == 0:
        return (inputs.double() @ weight.double().t()).to(out_dtype)
    total = None
    for start, stop, packed in parts:
        part_inputs = inputs if stop - start == inputs.shape[1] else inputs[:, start:stop].contiguous()
        # Called from Python, an op given a TorchScript object (`packed`) looks for `__torch_function__` on it, which
        # raises and catches a C++ exception and formats its message at every call; with subclasses' torch functions
        # off it does not look. Measured on an AMD EPYC Zen 3, one thread: 27 against 50-60 us for one row of 512 x
        # 512 alone; a quantized t5-small-sized T5's decode step (49 such products from 3 rows on) 1.1-3.6 ms less.
        with torch._C.DisableTorchFunctionSubclass():
            part = _fbgemm_linear()(part_inputs, 1.0, zero_point, packed)
        if len(parts) == 1:
            return part if out_dtype == torch.float32 else part.to(out_dtype)
        part = part.to(torch.int32)
        total = part if total is None else total.add_(part)
    return total.to(out_dtype)


@functools.cache
def _fbgemm_linear():
    """FBGEMM's linear (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32.default`) called past the Python
    check that its `__call__` makes for fake TorchScript objects (a pytree walk of the arguments, for tracing; this
    kernel only ever gets real ones): the overload's `_op`, where torch has one."""
    overload = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default
    return getattr(overload, "_op", overload)


# Registered as a plain library op (a CPU kernel and a fake): a `torch.library.custom_op` took 40 us more a call
# (98 against 58 us for one row of 512 x 512, FBGEMM's own 34), 2 ms of a decode step's 49 int8 linears.
_LIBRARY.define("int8_fbgemm_mm(Tensor inputs, Tensor weight, int zero_point, ScalarType out_dtype) -> Tensor")
_LIBRARY.impl("int8_fbgemm_mm", _int8_fbgemm_mm, "CPU")


@torch.library.register_fake("transformers_flexcache::int8_fbgemm_mm")
def _(inputs: torch.Tensor, weight: torch.Tensor, zero_point: int, out_dtype: torch.dtype) -> torch.Tensor:
    return inputs.new_empty((inputs.shape[0], weight.shape[0]), dtype=out_dtype)


int8_fbgemm_mm = torch.ops.transformers_flexcache.int8_fbgemm_mm.default


_PACKING = threading.Lock()


def _fbgemm_parts(weight: torch.Tensor, dtype: torch.dtype) -> list | None:
    """`[(start, stop, packed)]`: FBGEMM's packed weights of `weight[:, start:stop]`, chunks of the input features
    whose products sum to at most 2**24 in magnitude for inputs of `dtype`; None for a weight beyond 7 bits. Packed
    once per weight (held on the tensor, repacked if it is written in place)."""
    limit = fbgemm_weight_limit()
    key = (weight._version, dtype, limit)
    held = getattr(weight, "_flex_fbgemm_parts", None)
    if held is not None and held[0] == key:
        return held[1]
    parts = None
    if weight.numel() == 0 or (int(weight.min()) >= -limit and int(weight.max()) < limit):  # ints: 128 fits no int8
        step = 2**24 // ((255 if dtype == torch.uint8 else 128) * limit)
        parts = [(start, min(start + step, weight.shape[1])) for start in range(0, weight.shape[1], step)]
        with _PACKING, _fbgemm_engine(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            parts = [
                (start, stop, torch.ops.quantized.linear_prepack(_per_tensor(weight[:, start:stop]), None))
                for start, stop in parts
            ]
    else:
        logger.warning(
            "int8_linears='fbgemm': a weight of shape %s holds values beyond 7 bits (%d..%d), whose products "
            "FBGEMM's kernels may saturate on this CPU, which has no VNNI; it is multiplied in float64 instead "
            "(exact, slower). quantize(model, 'int8') makes 7-bit weights on such a CPU; or pass "
            "int8_linears='inductor'.",
            tuple(weight.shape),
            int(weight.min()),
            int(weight.max()),
        )
    weight._flex_fbgemm_parts = (key, parts)
    return parts


def _per_tensor(values: torch.Tensor) -> torch.Tensor:
    """`values` (int8) as a qint8 tensor of scale 1 and zero point 0: FBGEMM's products are then the integers'."""
    return torch._make_per_tensor_quantized_tensor(values.contiguous(), 1.0, 0)


@contextlib.contextmanager
def _fbgemm_engine():
    """Pack for FBGEMM (torch's default `"x86"` engine may choose oneDNN); the engine is restored after."""
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        yield
    finally:
        torch.backends.quantized.engine = engine


class Int8FbgemmMatmuls(CustomGraphPass):
    """Inductor joint-graph pass (before freezing): an int8 matrix multiply (`aten._int_mm(a [M, K], w.T)`, what
    torchao's int8 linears trace to) of dynamic rows or of at least `FBGEMM_MIN_ROWS` static rows becomes
    `transformers_flexcache::int8_fbgemm_mm` (`_int8_fbgemm_nodes`), FBGEMM's int8 GEMM, which freezing leaves
    alone (else it would become oneDNN's int8 linear, slow on CPUs without VNNI: `Int8DotProducts`). Fewer rows
    (decode steps of one or two sequences) are left to `Int8DotProducts` where it takes them: there FBGEMM's fixed
    cost a call (about 35 us, 55 when the op also made its conversions) loses to the dot products that inductor
    fuses into the graph. Not so for an output layer (`FBGEMM_MIN_OUTPUTS` outputs or more): there reading the
    weight is most of the product, and FBGEMM's kernels (`vpmaddubsw` on uint8 x int8 pairs) read it faster than the
    dot products, which unpack four int8 weights from each float32 word. Measured on an AMD EPYC Zen 3, one thread,
    compiled and frozen, the t5-small-sized T5's quantized output layer (512 x 32128) with one feed-forward linear
    (512 x 2048), side by side: 2.05 and 2.38 ms at one row as dot products against 1.51 and 1.71 on FBGEMM, 2.36 and
    3.01 against 0.99 and 1.77 at two rows (the feed-forward linear alone: 0.19 and 0.25 ms against 0.22 and 0.28 at
    one row: the dot products keep it); the results equal bit for bit. The whole step, two such models side by side
    (bucketed, tokens equal): 9.25 against 9.54 ms at one row, 9.43 against 11.09 at two. So no int8 product is left
    to the library.

    Why it is exact: `a` is given to FBGEMM as floats quantized at scale 1 (zero point 128 for int8, 0 for uint8:
    the integers themselves, shifted to 0..255), `w` as a qint8 tensor of scale 1, so FBGEMM computes the integers'
    products, takes the zero point's share out in int32, and writes the result times 1.0 as float32. Both
    conversions are graph nodes that inductor fuses into the kernels beside the op (float32 activations in; the
    float32 result read as it is where no sum can pass 2**24). Without VNNI
    its kernels add pairs of uint8 x int8 products in saturating int16 (`vpmaddubsw`): exact where each weight lies
    in [-64, 63] (255 x 64 x 2 < 2**15), as `quantize`'s 7-bit weights do on such a CPU; a weight beyond that is
    multiplied in float64 instead, with a warning. `K` is cut into chunks whose sums stay within 2**24 (exact as
    float32), added in int32: `_int_mm`'s result bit for bit.

    Measured on an AMD EPYC Zen 3 (AVX2, no VNNI), one thread, per product: 512 x 2048 at 1 / 8 / 40 rows 0.06 /
    0.13 / 0.53 ms (float32's linear 0.16 / 0.54 / 1.47); the 512 x 32128 output layer 0.57 / 1.68 / 8.5 ms (float32
    12.4 / 18.4 / 32.6). t5-small-sized T5 quantized, side by side against `int8_linears="inductor"`: decode step
    at 2 / 4 / 8 rows, all FBGEMM's, 10.6 / 13.2 / 15.1 ms against 9.6 / 12.7 / 23.3; first token (encoder and
    first step) at 1 / 2 / 8 rows of 40 tokens 47 / 61 / 165 ms against 56 / 86 / 186.

    Every instance is equal, as for `OneDNNLinears`.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            matched = _int_mm_pair(node)
            if matched is None:
                continue
            rows, outputs = matched[0].meta["val"].shape[0], matched[1].meta["val"].shape[0]
            few_rows = isinstance(rows, int) and rows < FBGEMM_MIN_ROWS
            if few_rows and outputs < FBGEMM_MIN_OUTPUTS and _int_mm_operands(node) is not None:
                continue  # the dot products take it
            fake_mode = torch._guards.detect_fake_mode([matched[0].meta["val"]])
            _replace(graph, node, _int8_fbgemm_nodes, graph, fake_mode, *matched)

    uuid = _uuid
    __eq__ = _same_type
    __hash__ = _type_hash


def _int8_fbgemm_nodes(graph, fake_mode, inputs, weight) -> torch.fx.Node:
    """Nodes computing `_int_mm(inputs [M, K], weight.T)` as int32 [M, N] with `int8_fbgemm_mm`, its conversions in
    the graph, where inductor fuses them into the kernels around it: the activations given as float32, and the result
    taken as float32 where no sum can pass 2**24 in magnitude (even with weights beyond 7 bits, which the op
    multiplies in float64), converted to int32 in the kernel that reads it."""
    convert = torch.ops.prims.convert_element_type.default
    dtype, features = inputs.meta["val"].dtype, inputs.meta["val"].shape[1]
    zero_point, largest = (128, 128 * 128) if dtype == torch.int8 else (0, 255 * 128)
    out_dtype = torch.float32 if features * largest <= 2**24 else torch.int32
    floats = _call(graph, fake_mode, convert, inputs, torch.float32)
    out = _call(graph, fake_mode, int8_fbgemm_mm, floats, weight, zero_point, out_dtype)
    return out if out_dtype == torch.int32 else _call(graph, fake_mode, convert, out, torch.int32)


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, build, *args) -> None:
    """Replace `node` by the node `build(*args)` adds before it, which keeps `node`'s metadata beside its own."""
    with graph.inserting_before(node):
        out = build(*args)
    out.meta = {**node.meta, **out.meta}
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def without_int8_float_gemms(compile_config):
    """A copy of `compile_config` whose inductor passes leave out `Int8FloatGemms` (its int8 matrix multiplies of
    dynamic rows then run the library's int8 kernels), or None where it has no such pass."""
    options = getattr(compile_config, "options", None) or {}
    passes = options.get("joint_custom_post_pass")
    passes = tuple(passes) if isinstance(passes, (tuple, list)) else () if passes is None else (passes,)
    if Int8FloatGemms() not in passes:
        return None
    kept = tuple(graph_pass for graph_pass in passes if graph_pass != Int8FloatGemms())
    other = copy.copy(compile_config)
    other.options = {**options, "joint_custom_post_pass": kept}
    return other


def _float32_gemms_exact() -> bool:
    """Whether float32 matrix multiplies run in float32 arithmetic (not bf16 or tf32)."""
    mkldnn_precision = getattr(torch.backends.mkldnn.matmul, "fp32_precision", "none")
    return torch.get_float32_matmul_precision() == "highest" and mkldnn_precision in ("none", "ieee")


def _int8_float_gemms(graph, fake_mode, inputs, weight) -> torch.fx.Node:
    """Nodes computing `_int_mm(inputs [M, K], weight.T)` as int32 [M, N] with float32 GEMMs (see
    `Int8FloatGemms`)."""
    ops, convert = torch.ops.aten, torch.ops.prims.convert_element_type.default
    features = inputs.meta["val"].shape[1]
    chunk = _chunk(features, inputs.meta["val"].dtype, multiple=1)

    def call(target, *args, **kwargs):
        return _call(graph, fake_mode, target, *args, **kwargs)

    floats, weights = call(convert, inputs, torch.float32), call(convert, weight, torch.float32)
    total = None
    for start in range(0, features, chunk):  # [M, chunk] @ [chunk, N], exact, then int32
        part_inputs, part_weights = floats, weights
        if chunk < features:
            part_inputs = call(ops.slice.Tensor, floats, 1, start, start + chunk)
            part_weights = call(ops.slice.Tensor, weights, 1, start, start + chunk)
        part = call(
            convert, call(ops.mm.default, part_inputs, call(ops.permute.default, part_weights, [1, 0])), torch.int32
        )
        total = part if total is None else call(ops.add.Tensor, total, part)
    return total


class Int8DotExpansion(CustomGraphPass):
    """Inductor post-grad pass: each `int8_dot_products(a, w)` that `Int8DotProducts` marked becomes the dot products
    of its docstring. Every instance is equal, as for `OneDNNLinears`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.find_nodes(op="call_function", target=int8_dot_products._opoverload)):
            inputs, weight = node.args
            fake_mode = torch._guards.detect_fake_mode([inputs.meta["val"]])
            with graph.inserting_before(node):
                out = _int8_dot_products(graph, fake_mode, inputs, weight)
            node.replace_all_uses_with(out)
            graph.erase_node(node)

    uuid = _uuid
    __eq__ = _same_type
    __hash__ = _type_hash


def _int_mm_pair(node: torch.fx.Node):
    """`(a, w)` where `node` is `aten._int_mm(a [M, K], permute(w [N, K], [1, 0]))` with `a` int8 or uint8 and `w`
    int8, `K` static; None otherwise."""
    if node.target is not torch.ops.aten._int_mm.default:
        return None
    inputs, transposed = node.args
    if transposed.target is not torch.ops.aten.permute.default or list(transposed.args[1]) != [1, 0]:
        return None
    weight = transposed.args[0]
    value, weight_value = inputs.meta["val"], weight.meta.get("val")
    if not isinstance(value.shape[1], int) or value.dtype not in (torch.int8, torch.uint8):
        return None
    if weight_value is None or weight_value.dtype != torch.int8:
        return None
    return inputs, weight


def _int_mm_operands(node: torch.fx.Node, *, dynamic_rows: bool = False):
    """`(a, w)` where `node` is an `_int_mm` of `_int_mm_pair` that `Int8DotProducts` takes (see its docstring), or
    with `dynamic_rows` that `Int8FloatGemms` takes (`M` symbolic, any weight layout); None otherwise."""
    matched = _int_mm_pair(node)
    if matched is None:
        return None
    inputs, weight = matched
    value, weight_value = inputs.meta["val"], weight.meta["val"]
    rows, features = value.shape
    if (
        isinstance(rows, int) == dynamic_rows
        or _chunk(features, value.dtype, multiple=1 if dynamic_rows else 4) is None
    ):
        return None
    if dynamic_rows:
        return inputs, weight
    if rows > INT8_DOT_MAX_ROWS:
        return None
    if not weight_value.is_contiguous() or weight_value.storage_offset() % 4 or sys.byteorder != "little":
        return None
    return inputs, weight


def _chunk(features: int, dtype: torch.dtype, multiple: int = 4) -> int | None:
    """The length of the chunks of `features` that float32 sums exactly (see `Int8DotProducts`): the fewest equal
    chunks of at most 2**24 / (largest |product|) features, each a multiple of `multiple` (4 for the dot products,
    which read words of 4 weights); None if there are none."""
    largest = 128 * (255 if dtype == torch.uint8 else 128)
    chunks = -(-features // (2**24 // largest))
    chunk = features // chunks
    return chunk if chunk * chunks == features and chunk % multiple == 0 else None


def _int8_dot_products(graph, fake_mode, inputs, weight) -> torch.fx.Node:
    """Nodes computing `_int_mm(inputs [M, K], weight.T)` as int32 [M, N] (see `Int8DotProducts`)."""
    ops = torch.ops.aten
    rows, features = inputs.meta["val"].shape
    chunk = _chunk(features, inputs.meta["val"].dtype)
    words, chunks = chunk // 4, features // chunk

    def call(target, *args, **kwargs):
        return _call(graph, fake_mode, target, *args, **kwargs)

    # activations: [M, K] -> floats [M, C, W, 4] -> [4, M, C, W], realized once (else recomputed per output)
    floats = call(torch.ops.prims.convert_element_type.default, inputs, torch.float32)
    grouped = call(ops.permute.default, call(ops.reshape.default, floats, [rows, chunks, words, 4]), [3, 0, 1, 2])
    grouped = call(
        torch.ops.prims.inductor_force_stride_order.default, grouped, [rows * features // 4, features // 4, words, 1]
    )
    # weights: [N, K] int8 -> float32 words [N, K/4] -> int32 in registers -> [N, C, W], one float tensor per byte
    packed = call(ops.view.dtype, call(ops.view.dtype, weight, torch.float32), torch.int32)
    packed = call(ops.reshape.default, packed, [-1, chunks, words])
    unpacked = []
    for byte in range(4):  # little-endian: byte b of a word is feature 4 * w + b
        shifted = call(ops.__lshift__.Scalar, packed, 24 - 8 * byte) if byte < 3 else packed
        unpacked.append(
            call(torch.ops.prims.convert_element_type.default, call(ops.__rshift__.Scalar, shifted, 24), torch.float32)
        )
    # One reduction per row: inductor fuses them into one loop over the weights, unpacking each word once for all rows.
    results = []
    for row in range(rows):
        total = None
        for byte, weights in enumerate(unpacked):
            product = call(
                ops.mul.Tensor, weights, call(ops.select.int, call(ops.select.int, grouped, 0, byte), 0, row)
            )
            total = product if total is None else call(ops.add.Tensor, total, product)  # [N, C, W]
        sums = call(torch.ops.prims.convert_element_type.default, call(ops.sum.dim_IntList, total, [-1]), torch.int32)
        sums = call(ops.sum.dim_IntList, sums, [-1], dtype=torch.int32)  # [N, C] -> [N], in int32
        results.append(call(ops.unsqueeze.default, sums, 0))
    return results[0] if rows == 1 else call(ops.cat.default, results)  # [M, N]


def _call(graph: torch.fx.Graph, fake_mode, target, *args, **kwargs) -> torch.fx.Node:
    """A `call_function` node of `target(*args, **kwargs)` with its fake value in `meta["val"]`, as inductor's
    lowering reads."""
    node = graph.call_function(target, args, kwargs)
    values = torch.fx.node.map_arg(args, lambda arg: _value(arg, fake_mode))  # nested too (a list of tensors)
    node.meta["val"] = target(*values, **kwargs)
    return node


def _value(node: torch.fx.Node, fake_mode):
    """The fake value of `node`: its `meta["val"]`, or for a constant (`get_attr`) one made from the tensor."""
    if "val" not in node.meta:
        node.meta["val"] = fake_mode.from_tensor(getattr(node.graph.owning_module, node.target), static_shapes=True)
    return node.meta["val"]
