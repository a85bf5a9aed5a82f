"""`quantize(model, "int8")`: CTranslate2's int8 scheme on CPU, with torchao, for a compiled `generate`.

Design decisions:
- The scheme CPU translation services run (CTranslate2's `compute_type="int8"`): int8 weights with one scale per
  output row, activations quantized per token at run time, int8 GEMMs. In torch that is torchao's
  `Int8DynamicActivationInt8WeightConfig` (per-row weights, symmetric per-token activations), which inductor turns
  into int8 matrix multiplies (`aten._int_mm`) with the scales folded in, once the graph is frozen
  (`compile_config_for_cpu()`). int8 weight-only with fp32 activations gains nothing on CPU: inductor runs an int8
  weight-only kernel only for bf16 activations.
- One option, on the model: every `nn.Linear` is quantized in place, in the encoder, the decoder and the output
  layer, so the same model serves `generate` (with any cache and shape policy), the serving engine and the
  benchmark without either knowing about it. Embeddings, norms and convolutions (Whisper's front end) stay in
  float. An output layer tied to the input embeddings is untied: the embedding keeps its float table, the output
  layer reads int8 (the largest matrix of a decode step).
- For a compiled step only. torchao's eager int8 linear recomputes each weight's row sums at every call (many times
  the compiled linear's time: docs/compile.md, "int8 on CPU"), so an eager quantized model is a reference for
  correctness, not a way to run.
- Refused, with the reason, before anything changes: a mode other than `"int8"`, a model already quantized, a model
  off the CPU (only the CPU path was measured and tested), float16/float64 weights, a model with no `nn.Linear`,
  and a model whose large matrices are not `nn.Linear` (Jamba's experts are fused 3-D parameters, GPT-2-style
  `Conv1D` layers hold transposed weights): quantizing only the rest would leave most of a step in float without a
  word.
- On CPUs without VNNI (AVX2 only, AVX-512 without VNNI), the weights and activations are quantized to 7 bits
  (torchao's `reduce_range`, what torchao's `should_reduce_range` asks for). oneDNN's int8 GEMMs there
  (`onednn.qlinear_pointwise`, what inductor turns the frozen int8 linears into) sum pairs of u8*s8 products in
  16-bit registers (`vpmaddubsw`), which saturate at full 8-bit ranges (uxlfoundation/oneDNN#717): the compiled int8
  linears then differ from the eager ones, and so do the tokens (docs/compile.md, "int8 on CPU"). At 7 bits the
  compiled linear equals the eager one and its error against fp32 doubles: reported by `int8_bits()` and the bench's
  header. CPUs with VNNI or AMX keep 8 bits. On such a CPU oneDNN's int8 linears are also slower than float32's,
  so under `compile_config_for_cpu(int8_linears="auto")` the compiled graphs run FBGEMM's int8 GEMMs instead, exact
  on 7-bit weights (`passes.int8_linears.Int8FbgemmMatmuls`: the activations are handed over at scale 1, already
  quantized per token as torchao quantizes them), and decode steps of 1-2 rows exact int8 dot products that inductor
  generates (`passes.int8_linears.Int8DotProducts`); an eager prefill keeps oneDNN's, and `quantize` logs a warning
  saying so.
- torchao's `set_inductor_config` is turned off: it would change inductor's global settings for the whole process.
- Compiled graphs of the model from before are dropped (upstream's cached compiled call): frozen graphs hold the
  float weights as constants and would keep running them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..log import get_logger
from .cpu import cpu_facts

logger = get_logger(__name__)

QUANTIZE_MODES = ("int8",)
QUANTIZED_DTYPES = (torch.float32, torch.bfloat16)


def quantize(model: nn.Module, mode: str = "int8") -> nn.Module:
    """Quantize the linear layers of `model` in place, in CTranslate2's int8 scheme, for a compiled decode step.

    Args:
        model (`nn.Module`): a transformers model (upstream class or override) on the CPU, float32 or bfloat16.
        mode (`str`, *optional*, defaults to `"int8"`): the only mode: int8 weights per output row, activations
            quantized per token at run time, int8 GEMMs (torchao `Int8DynamicActivationInt8WeightConfig`); 7-bit
            ranges on CPUs without VNNI (`int8_bits()`).

    Returns:
        `nn.Module`: `model` itself, its `nn.Linear` weights now torchao int8 tensors.

    Raises:
        ValueError: an unknown mode, or a model this cannot quantize (see the module docstring); nothing is changed.
        ImportError: torchao is not installed.

    Example:

    ```python
    >>> from transformers_flexcache import compile_config_for_cpu, quantize
    >>> model = quantize(model, "int8")
    >>> out = model.generate(
    ...     **inputs,
    ...     cache_implementation="flexible_static",
    ...     cache_config={"shape_policy": "bucketed", "max_batch_size": 8, "max_cache_len": 64, "max_encoder_len": 64},
    ...     compile_config=compile_config_for_cpu(),
    ... )
    ```
    """
    check_quantizable(model, mode)
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError as error:
        raise ImportError(f'quantize(model, "{mode}") needs torchao: pip install torchao') from error

    bits = int8_bits()
    if bits == 7:
        logger.warning(
            "this CPU has no VNNI: int8 is quantized to 7 bits (8 would saturate oneDNN's int8 kernels). oneDNN's "
            "int8 kernels are slower than float32's here: under compile_config_for_cpu() (int8_linears='auto') "
            "compiled graphs run FBGEMM's int8 GEMMs (exact at 7 bits) and inductor's dot products instead; an "
            "eager prefill does not."
        )
    _untie_output_layer(model)
    quantize_(
        model,
        Int8DynamicActivationInt8WeightConfig(set_inductor_config=False, reduce_range=bits < 8),
        filter_fn=lambda module, name: isinstance(module, nn.Linear),
    )
    for name in ("_compiled_call", "_last_compile_config"):  # upstream's cached compiled call, float graphs
        model.__dict__.pop(name, None)
    return model


def int8_bits() -> int:
    """The bits `quantize(model, "int8")` gives weights and activations on this CPU: 8, or 7 where the CPU has no
    VNNI (oneDNN's int8 GEMMs would saturate at 8 bits there; see the module docstring). `cpu.cpu_facts().vnni`
    decides, as torchao's `should_reduce_range` does."""
    return 8 if cpu_facts().vnni else 7


def check_compiled_int8(model: nn.Module) -> None:
    """Raise a `ValueError` where `model` holds int8 weights at 8-bit ranges (quantized on a CPU with VNNI) and this
    CPU has none: its compiled int8 GEMMs would saturate (see the module docstring). Called before a compiled call
    changes anything; on a CPU without VNNI, float models pass at the cost of finding their first linear layer."""
    facts = cpu_facts()
    if facts.vnni:  # nothing else runs on a CPU with VNNI
        return
    first = next((module for module in model.modules() if isinstance(module, nn.Linear)), None)
    if first is not None and _is_quantized(first.weight) and not getattr(first.weight, "reduce_range", True):
        raise ValueError(
            "this model's int8 weights use 8-bit ranges, which oneDNN's compiled int8 kernels saturate on this CPU "
            f"(no AVX512-VNNI or AMX: {facts.describe()}), giving wrong outputs: quantize the float model on this "
            'machine (quantize(model, "int8") uses 7 bits here), or run it without compile_config'
        )


def first_linear_quantized(model: nn.Module) -> bool:
    """Whether the first `nn.Linear` of `model` holds int8 weights: as `quantization_of(model) is not None` for a
    model that `quantize` quantized (it quantizes every linear), without walking all of them."""
    first = next((module for module in model.modules() if isinstance(module, nn.Linear)), None)
    return first is not None and _is_quantized(first.weight)


def quantization_of(model: nn.Module) -> str | None:
    """`"int8"` when `quantize(model, "int8")` has quantized `model`, else None."""
    return "int8" if any(_is_quantized(module.weight) for module in _linears(model)) else None


def check_quantizable(model: nn.Module, mode: str = "int8") -> None:
    """Raise a `ValueError` saying why `quantize(model, mode)` would refuse `model`; return None when it would not."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"mode={mode!r} is not one of {QUANTIZE_MODES}")
    linears = _linears(model)
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer: nothing for int8 to quantize")
    if quantization_of(model) is not None:
        raise ValueError(
            f"{type(model).__name__} is quantized already (its linear weights are torchao tensors): quantize a float "
            "model once"
        )
    weight = linears[0].weight
    if weight.device.type != "cpu":
        raise ValueError(
            f'quantize(model, "{mode}") is for the CPU (the only path measured and tested); the model is on '
            f"{weight.device}: call it on the CPU copy of the model"
        )
    if weight.dtype not in QUANTIZED_DTYPES:
        raise ValueError(
            f"the model's linear weights are {weight.dtype}; int8 quantizes float32 or bfloat16 models: "
            "model.to(torch.float32) first"
        )
    unquantizable = _unquantizable_matrices(model)
    if unquantizable:
        listed = "; ".join(unquantizable[:3]) + ("; ..." if len(unquantizable) > 3 else "")
        raise ValueError(
            f"{type(model).__name__} holds matrices of its step outside nn.Linear, which "
            f"Int8DynamicActivationInt8WeightConfig does not quantize ({listed}): int8 would leave them in float "
            "without a word; run this model in float32 or bfloat16"
        )


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [module for module in model.modules() if isinstance(module, nn.Linear)]


def _is_quantized(weight: torch.Tensor) -> bool:
    # torchao's quantized weights are tensor subclasses that flatten into their int8 data and scales
    return type(weight) not in (torch.Tensor, nn.Parameter) and hasattr(weight, "__tensor_flatten__")


def _unquantizable_matrices(model: nn.Module) -> list[str]:
    """Weights that multiply activations outside `nn.Linear`: fused 3-D expert matrices, transformers' `Conv1D`."""
    from transformers.pytorch_utils import Conv1D

    found = []
    for path, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)):
            continue
        for name, parameter in module.named_parameters(recurse=False):
            if isinstance(module, Conv1D) and name == "weight":
                found.append(f"{path}.{name} of {type(module).__name__}, a transposed linear weight")
            elif parameter.dim() == 3:
                found.append(f"{path}.{name} of {type(module).__name__}, fused {list(parameter.shape)}")
    return found


def _untie_output_layer(model: nn.Module) -> None:
    """Give the output layer a weight of its own when it shares the input embeddings' (each is then quantized, or
    not, on its own: the embedding lookup must keep reading floats)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    if isinstance(output, nn.Linear) and id(output.weight) in embeddings:
        output.weight = nn.Parameter(output.weight.detach().clone(), requires_grad=False)
