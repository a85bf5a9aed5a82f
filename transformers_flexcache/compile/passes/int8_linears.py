"""The int8 matrix multiplies of a compiled step of a model quantized with `quantize(model, "int8")`: FBGEMM's int8
GEMMs, exact int8 dot products that inductor generates, or exact float32 GEMMs of the integers, in place of the
oneDNN int8 linears that freezing would make of them.

Design decisions (the measurements behind each: docs/compile.md, "int8 on CPU" and "Why the compile wing chooses as
it does"):
- On CPUs without VNNI oneDNN's int8 linears are slower than float32's at a few rows, and with VNNI slower than
  FBGEMM's. `Int8FbgemmMatmuls` runs the int8 products on FBGEMM's int8 GEMMs instead, exact on 7-bit weights (8-bit
  with VNNI), and `Int8DotProducts` with `Int8DotExpansion` those of decode steps of 1-2 rows as exact dot products
  that inductor generates (`"fbgemm"`, which `"auto"` picks wherever torch has FBGEMM and the CPU has no AMX).
- `"inductor"` runs the dot products up to `INT8_DOT_MAX_ROWS` rows, and the products of graphs of dynamic rows (the
  compiled encoder and cross-attention projections) as exact float32 GEMMs of float copies of the weights, made once
  when the graph is frozen (`Int8FloatGemms`).
- Every rewrite gives `_int_mm`'s integers bit for bit: products are summed in chunks that float32 holds exactly,
  and the chunks in int32.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import threading
import warnings

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from ...log import get_logger
from ..cpu import cpu_facts
from .nodes import LIBRARY, call_node, pass_uuid, replace_node, same_type, type_hash

logger = get_logger(__name__)

INT8_LINEARS = ("auto", "fbgemm", "inductor", "library")
INT8_DOT_MAX_ROWS = 8  # int8 products of static rows up to this run as dot products (decode steps)
# FBGEMM's int8 products are exact for weights in [-limit, limit): 64 (7 bits) without VNNI, 128 (8 bits) with it
# (`fbgemm_weight_limit`, see `Int8FbgemmMatmuls`)
FBGEMM_WEIGHT_LIMIT = 64
FBGEMM_MIN_ROWS = 3  # under int8_linears="fbgemm", int8 products of fewer static rows run as dot products
# ... unless their weight has at least this many outputs (a vocabulary's output layer): see `Int8FbgemmMatmuls`
FBGEMM_MIN_OUTPUTS = 8192


def resolve_int8_linears(int8_linears: str) -> str:
    """`"fbgemm"`, `"inductor"` or `"library"` for `int8_linears`. `"auto"`: on CPUs with AMX the library's (oneDNN's
    AMX int8 kernels; not measured here); elsewhere FBGEMM's int8 GEMMs (`Int8FbgemmMatmuls`) where torch has FBGEMM
    (x86 builds): exact at 7 bits without VNNI and at 8 bits with it, and faster than oneDNN's int8 kernels on both
    (docs/compile.md, "Routes per CPU"); without FBGEMM, oneDNN's where the CPU has VNNI, else inductor's dot
    products.

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
    full-width vector loads; int32 loads of inductor's CPU vectors go through a buffer copy in torch==2.13.0, several
    times slower), each word bitcast to int32 in registers, where a shift left then an arithmetic shift right gives
    each weight as a sign-extended int32, then a float. The activations are realized once as floats, grouped by byte
    position ([4, M, K/4]), and each row is a reduction of its own: inductor fuses them into one loop over the weights,
    which unpacks each word once for all rows.

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
            replace_node(graph, node, graph.call_function, int8_dot_products._opoverload, matched)

    uuid = pass_uuid
    __eq__ = same_type
    __hash__ = type_hash


class Int8FloatGemms(CustomGraphPass):
    """Inductor joint-graph pass (before freezing): an int8 matrix multiply of dynamic rows (`aten._int_mm(a [M, K],
    w.T)` with `M` symbolic: the compiled encoder and cross-attention projections, `compile/encoder.py`) becomes
    float32 GEMMs of the same integers, `_int_mm`'s result bit for bit, where the CPU's int8 GEMMs are slow (no
    VNNI: oneDNN's int8 linears are slower than float32's there).

    The weight's conversion to float32 reads only the weight, a constant once frozen: freezing folds it into a float
    copy, which the fp32 linear kernels then prepack as they do a float model's (`OneDNNLinears`). That copy is the
    cost: a graph of dynamic rows holds its weights as a float32 graph does (4x their int8 bytes). At many rows
    oneDNN's int8 linears are faster again (docs/compile.md), so the compiled encoder side keeps a compile without
    this pass for calls of more than 128 positions (`compile.encoder.encoder_graph`).

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
            replace_node(graph, node, _int8_float_gemms, graph, fake_mode, *matched)

    uuid = pass_uuid
    __eq__ = same_type
    __hash__ = type_hash


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
        # off it does not look (what that saves a call: docs/compile.md).
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


# Registered as a plain library op (a CPU kernel and a fake): a `torch.library.custom_op`'s dispatch costs more a call
# than FBGEMM's own kernel at one row (docs/compile.md).
LIBRARY.define("int8_fbgemm_mm(Tensor inputs, Tensor weight, int zero_point, ScalarType out_dtype) -> Tensor")
LIBRARY.impl("int8_fbgemm_mm", _int8_fbgemm_mm, "CPU")


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
    `transformers_flexcache::int8_fbgemm_mm` (`_int8_fbgemm_nodes`), FBGEMM's int8 GEMM, which freezing leaves alone
    (else it would become oneDNN's int8 linear, slow on CPUs without VNNI: `Int8DotProducts`). Fewer rows (decode steps
    of one or two sequences) are left to `Int8DotProducts` where it takes them: there FBGEMM's fixed cost a call loses
    to the dot products that inductor fuses into the graph. Not so for an output layer (`FBGEMM_MIN_OUTPUTS` outputs or
    more): there reading the weight is most of the product, and FBGEMM's kernels (`vpmaddubsw` on uint8 x int8 pairs)
    read it faster than the dot products, which unpack four int8 weights from each float32 word; the results equal bit
    for bit (measured: docs/compile.md). So no int8 product is left to the library.

    Why it is exact: `a` is given to FBGEMM as floats quantized at scale 1 (zero point 128 for int8, 0 for uint8:
    the integers themselves, shifted to 0..255), `w` as a qint8 tensor of scale 1, so FBGEMM computes the integers'
    products, takes the zero point's share out in int32, and writes the result times 1.0 as float32. Both
    conversions are graph nodes that inductor fuses into the kernels beside the op (float32 activations in; the
    float32 result read as it is where no sum can pass 2**24). Without VNNI
    its kernels add pairs of uint8 x int8 products in saturating int16 (`vpmaddubsw`): exact where each weight lies
    in [-64, 63] (255 x 64 x 2 < 2**15), as `quantize`'s 7-bit weights do on such a CPU; a weight beyond that is
    multiplied in float64 instead, with a warning. `K` is cut into chunks whose sums stay within 2**24 (exact as
    float32), added in int32: `_int_mm`'s result bit for bit.

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
            replace_node(graph, node, _int8_fbgemm_nodes, graph, fake_mode, *matched)

    uuid = pass_uuid
    __eq__ = same_type
    __hash__ = type_hash


def _int8_fbgemm_nodes(graph, fake_mode, inputs, weight) -> torch.fx.Node:
    """Nodes computing `_int_mm(inputs [M, K], weight.T)` as int32 [M, N] with `int8_fbgemm_mm`, its conversions in
    the graph, where inductor fuses them into the kernels around it: the activations given as float32, and the result
    taken as float32 where no sum can pass 2**24 in magnitude (even with weights beyond 7 bits, which the op
    multiplies in float64), converted to int32 in the kernel that reads it."""
    convert = torch.ops.prims.convert_element_type.default
    dtype, features = inputs.meta["val"].dtype, inputs.meta["val"].shape[1]
    zero_point, largest = (128, 128 * 128) if dtype == torch.int8 else (0, 255 * 128)
    out_dtype = torch.float32 if features * largest <= 2**24 else torch.int32
    floats = call_node(graph, fake_mode, convert, inputs, torch.float32)
    out = call_node(graph, fake_mode, int8_fbgemm_mm, floats, weight, zero_point, out_dtype)
    return out if out_dtype == torch.int32 else call_node(graph, fake_mode, convert, out, torch.int32)


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
        return call_node(graph, fake_mode, target, *args, **kwargs)

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

    uuid = pass_uuid
    __eq__ = same_type
    __hash__ = type_hash


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
        return call_node(graph, fake_mode, target, *args, **kwargs)

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
