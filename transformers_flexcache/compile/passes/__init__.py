"""Inductor graph passes of the compiled CPU step, chosen by `compile_config_for_cpu()` (`compile/config.py`):

- `fp32_linears.py`: the frozen fp32 linears on oneDNN (`OneDNNLinears`, its packed weights shared by every graph:
  `SharedOneDNNWeights`), and those of one row as dot products that inductor generates (`OneRowLinears`);
- `int8_linears.py`: the int8 matrix multiplies of a quantized model on FBGEMM's int8 GEMMs (`Int8FbgemmMatmuls`), as
  exact dot products (`Int8DotProducts`, `Int8DotExpansion`) or as exact float32 GEMMs (`Int8FloatGemms`);
- `decode_attention.py`: a decode step's attention of one query position as loops that inductor generates
  (`OneQueryAttention`);
- `nodes.py`: what they share (FX nodes with fake values, their cache identity, the package's library of ops).

Each CPU-dependent choice (`"auto"`) is resolved here from `compile.cpu.cpu_facts()`.
"""

from .decode_attention import OneQueryAttention, resolve_decode_attention
from .fp32_linears import (
    ONEDNN_WEIGHTS,
    LinearPlan,
    OneDNNLinears,
    OneRowLinears,
    measured_linear_plan,
    resolve_linear_kernels,
    resolve_one_row_linears,
)
from .int8_linears import (
    Int8DotExpansion,
    Int8DotProducts,
    Int8FbgemmMatmuls,
    Int8FloatGemms,
    resolve_int8_linears,
    without_int8_float_gemms,
)

__all__ = [
    "ONEDNN_WEIGHTS",
    "Int8DotExpansion",
    "Int8DotProducts",
    "Int8FbgemmMatmuls",
    "Int8FloatGemms",
    "LinearPlan",
    "OneDNNLinears",
    "OneQueryAttention",
    "OneRowLinears",
    "measured_linear_plan",
    "resolve_decode_attention",
    "resolve_int8_linears",
    "resolve_linear_kernels",
    "resolve_one_row_linears",
    "without_int8_float_gemms",
]
