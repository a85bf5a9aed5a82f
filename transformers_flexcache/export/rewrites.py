"""Rewrites, for the time of an export, that keep whole transformer blocks inside one XNNPACK partition.

Shape legend as in `transformers_flexcache.export`; `M` rows of a grouped query, `N` keys.

Why: lowering to ExecuTorch costs time per *partition* (XNNPACK re-runs its passes and serializes each delegated
subgraph: about a second per partition on a 2-core machine), and at run time every partition boundary is a trip
through ExecuTorch's portable kernels. XNNPACK refuses a few ops that upstream models use on every layer, and each
refusal splits the layer into several partitions (t5-small lowered into 283 partitions):
- `mean` over the last dim (RMS and layer norms): XNNPACK's `mean.dim` takes 4-d tensors reduced over dims 2-3
  only. Here a mean is a `linear` against a constant row of `1/d`, which XNNPACK runs.
- `native_layer_norm` (BART, Whisper): no XNNPACK kernel. Here it is written with the same linear means.
- upstream's eager attention multiplies scores by a Python scalar (`mul.Scalar`, refused) and repeats grouped
  keys/values with `expand` (refused); its sdpa path decomposes into a NaN-safe softmax with `any`/`where` (refused).
  The export attention scales the query by a 0-d tensor and groups the query rows instead of repeating keys.
- `bmm(query, key^T)` over a cache: XNNPACK's batched matmul takes no transposed operand (executorch 1.4.1), so
  every key would be copied transposed at every step. Over a cache the keys are the first operand, `bmm(key,
  query^T)^T`, which transposes the M query rows and the scores instead (whisper-tiny's decode step: 1.38x eager's
  to 1.10x); an encoder's attention over itself keeps `bmm(query, key^T)` (M = N there).
- attention over a whole fixed-length buffer (Whisper's 1500 cross-attention positions, `read_all_rows`): both
  batched matmuls are marked (`KERNEL_BMM`) and run in ExecuTorch's kernels, outside XNNPACK. XNNPACK's batched
  matmul tiles its second operand's columns (one query row here: most of each tile is wasted) or packs a dynamic
  second operand at every call; measured at 12 batch-heads x 1500 keys x 64, one thread: scores 2.6 ms in XNNPACK
  against 1.2 in ExecuTorch's kernel (eager torch 1.1), weights x values 2.6 against 1.0 (eager 0.5). whisper-tiny's
  decode step: 1.10-1.27x eager's before, 0.92-1.00x after (docs/export.md). Elsewhere (keys of at most the
  capacities, shorter) the matmuls stay in XNNPACK: each one outside splits a partition, and lowering time grows
  with partitions.
- views whose shape holds a symbolic size (any dynamic dimension) and no-op `expand`s: `infer_symbolic_view_dims`
  writes the single symbolic size of a view as `-1`, which XNNPACK's reshape infers, and drops `expand`s that change
  no size.
All of them compute the same function as upstream; float sums run in another order (a few ulps). Everything is
undone when the export ends: `export_friendly` restores the norm classes and the attention implementation.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

EXPORT_ATTENTION = "flexcache_export"
# Node meta (`node.meta["custom"]`) of the batched matmuls that XNNPACK is not given (`lowering._partitioners`): those
# over a fixed-length buffer read whole (Whisper's 1500 cross-attention positions).
KERNEL_BMM = "flexcache_kernel_bmm"


def export_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    position_bias=None,
    _kernel_bmm=False,
    **kwargs,
):
    """Eager attention, as upstream's `eager_attention_forward` (T5's adds `position_bias`), in ops that XNNPACK
    delegates.

    Grouped keys/values are not repeated: the query's heads are folded into rows per key/value head instead.
    """
    # query: [B, H, S, D]; key, value: [B, H_kv, N, D]; attention_mask, position_bias: [B | 1, 1 | H, S, N] additive
    # -> [B, S, H, D]
    if position_bias is not None:
        attention_mask = position_bias if attention_mask is None else position_bias + attention_mask
    call_batch, rows = query.shape[0], key.shape[0]
    if isinstance(rows, int) and (not isinstance(call_batch, int) or call_batch != rows):
        # The cache gave every row of its buffers (`BufferViewLayer.read_all_rows`): the rows past the call's batch
        # run on zero queries (and masks), and their outputs are dropped.
        query = _rows_padded(query, rows)
        if attention_mask is not None and attention_mask.shape[0] != 1:
            attention_mask = _rows_padded(attention_mask, rows)
        output, weights = export_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, _kernel_bmm=True
        )
        return output[:call_batch], weights
    batch_size, num_heads, num_queries, head_dim = query.shape
    num_kv_heads = key.shape[1]
    num_groups = num_heads // num_kv_heads
    if scaling is None:
        scaling = head_dim**-0.5
    if scaling != 1.0:
        query = query * torch.full((), scaling, dtype=query.dtype, device=query.device)
    if num_groups > 1 and attention_mask is not None and attention_mask.shape[1] != 1:
        # A per-head mask (bias) cannot follow the folded rows: repeat keys/values as upstream does.
        key = key.repeat_interleave(num_groups, dim=1)
        value = value.repeat_interleave(num_groups, dim=1)
        num_kv_heads, num_groups = num_heads, 1
    num_rows, num_keys = num_groups * num_queries, key.shape[-2]
    # 3-d batched matmuls (`bmm`): a 4-d matmul would add an `expand` that XNNPACK refuses.
    query = query.contiguous().view(batch_size * num_kv_heads, num_rows, head_dim)  # [B * H_kv, M, D]
    key = key.reshape(batch_size * num_kv_heads, num_keys, head_dim)
    value = value.reshape(batch_size * num_kv_heads, num_keys, value.shape[-1])

    # Over a whole fixed-length buffer, the matmuls run in ExecuTorch's kernels rather than XNNPACK's (`KERNEL_BMM`).
    def matmuls():
        return torch.fx.traceback.annotate({KERNEL_BMM: True}) if _kernel_bmm else contextlib.nullcontext()

    if statically_known_true(num_queries == num_keys):  # attention of a sequence over itself (an encoder)
        scores = torch.bmm(query, key.transpose(1, 2))  # [B * H_kv, M, N]
    else:
        # Over a cache: keys as the first operand, in the cache's layout. `bmm(query, key^T)` would copy every key
        # transposed at every step (XNNPACK's batched matmul takes no transposed operand: executorch 1.4.1 sets no
        # flag); transposing the query and the scores moves M rows only.
        with matmuls():
            scores = torch.bmm(key, query.transpose(1, 2)).transpose(1, 2)
    scores = scores.reshape(batch_size, num_kv_heads, num_rows, num_keys)
    if attention_mask is not None:
        mask = attention_mask[..., :num_keys]
        if num_groups > 1:
            mask = mask.repeat(1, 1, num_groups, 1)  # rows ordered (group, query), as the folded query
        scores = scores + mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32)
    if weights.dtype != query.dtype:
        weights = weights.to(query.dtype)
    with matmuls():
        output = torch.bmm(weights.view(batch_size * num_kv_heads, num_rows, num_keys), value)  # [B * H_kv, M, D]
    output = output.view(batch_size, num_kv_heads, num_groups, num_queries, output.shape[-1])
    output = output.permute(0, 3, 1, 2, 4).reshape(batch_size, num_queries, num_heads, output.shape[-1])
    return output, None


def _rows_padded(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`x` `[B, ...]` followed by zero rows up to `[num_rows, ...]` (a fixed shape, whatever `B`)."""
    rows = torch.arange(x.shape[0], device=x.device)
    return x.new_zeros((num_rows, *x.shape[1:])).index_put((rows,), x)


def _register_export_attention() -> None:
    # Idempotent, and a new name only: upstream's own implementations are untouched.
    AttentionInterface.register(EXPORT_ATTENTION, export_attention_forward)
    AttentionMaskInterface.register(EXPORT_ATTENTION, eager_mask)


def _mean_weight(module: nn.Module) -> torch.Tensor:
    # [1, d]: a linear against it is a mean over the last dim. A tensor attribute set before tracing (not a buffer):
    # torch.export lifts it as a constant, and the state dict is untouched.
    return module._flexcache_mean_weight


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # hidden_states: [..., d] -> [..., d]; upstream's RMS norm (T5, Llama, Jamba, Pix2Struct) with its mean as a linear
    # (`.to` only where it changes the dtype: each would be a node that every lowering pass visits)
    input_dtype = hidden_states.dtype
    hidden = hidden_states if input_dtype == torch.float32 else hidden_states.to(torch.float32)
    variance = F.linear(hidden.pow(2), _mean_weight(self))  # [..., 1]
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    hidden = hidden * torch.rsqrt(variance + eps)
    return self.weight * (hidden if input_dtype == torch.float32 else hidden.to(input_dtype))


def _layer_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # hidden_states: [..., d] -> [..., d]; `nn.LayerNorm` over the last dim, its means as linears (`.to` only where
    # it changes the dtype, as in `_rms_norm_forward`)
    mean_weight = _mean_weight(self)
    if mean_weight.dtype != hidden_states.dtype:
        mean_weight = mean_weight.to(hidden_states.dtype)
    centered = hidden_states - F.linear(hidden_states, mean_weight)
    variance = F.linear(centered * centered, mean_weight)
    normed = centered * torch.rsqrt(variance + self.eps)
    if self.weight is not None:
        normed = normed * self.weight
    if self.bias is not None:
        normed = normed + self.bias
    return normed


def _norm_rewrites() -> dict[type, object]:
    """Upstream norm classes -> the forward that replaces theirs during an export."""
    from transformers.models.jamba.modeling_jamba import JambaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.pix2struct.modeling_pix2struct import Pix2StructLayerNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    rewrites = dict.fromkeys((T5LayerNorm, LlamaRMSNorm, JambaRMSNorm, Pix2StructLayerNorm), _rms_norm_forward)
    rewrites[nn.LayerNorm] = _layer_norm_forward
    return rewrites


_EXPORT_NORM_CLASSES: dict[type, type] = {}


def _export_norm_class(norm_class: type, forward) -> type:
    if norm_class not in _EXPORT_NORM_CLASSES:
        _EXPORT_NORM_CLASSES[norm_class] = type(f"Export{norm_class.__name__}", (norm_class,), {"forward": forward})
    return _EXPORT_NORM_CLASSES[norm_class]


@contextlib.contextmanager
def export_friendly(model: nn.Module):
    """Within the block, `model` runs the export attention and norms written for XNNPACK; restored on exit.

    Only the class of norm modules and the attention implementation change (no weights, no state dict entries);
    models whose norms are other classes keep them.
    """
    _register_export_attention()
    rewrites = _norm_rewrites()
    swapped = []
    for module in model.modules():
        forward = rewrites.get(type(module))
        if forward is not None and getattr(module, "elementwise_affine", True):
            swapped.append((module, type(module)))
            size = module.weight.shape[-1]
            # RMS norms compute in float32 (as upstream's), layer norms in the weights' dtype
            dtype = module.weight.dtype if forward is _layer_norm_forward else torch.float32
            module._flexcache_mean_weight = torch.full((1, size), 1.0 / size, dtype=dtype, device=module.weight.device)
            module.__class__ = _export_norm_class(type(module), forward)
    previous = model.config._attn_implementation
    model.set_attn_implementation(EXPORT_ATTENTION)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
        for module, norm_class in swapped:
            module.__class__ = norm_class
            module.__dict__.pop("_flexcache_mean_weight", None)


def infer_symbolic_view_dims(program: torch.export.ExportedProgram) -> int:
    """In place on an exported (ATen) program: a view whose target shape holds exactly one symbolic size gets `-1`
    there, and `expand`s that change no size are removed. Returns how many nodes changed.

    XNNPACK delegates neither otherwise (see the module docstring). Done on the ATen graph, before ExecuTorch sees
    it: the view arguments survive its re-tracing as they are, and an edge pass would cost a verification of every
    method.
    """
    views = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)
    graph = program.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in views:
            shape = list(node.args[1])
            symbolic = [i for i, size in enumerate(shape) if not isinstance(size, int)]
            if len(symbolic) == 1 and -1 not in shape:
                shape[symbolic[0]] = -1
                node.args = (node.args[0], shape, *node.args[2:])
                changed += 1
        elif node.target == torch.ops.aten.expand.default:
            source = node.args[0]
            if _same_shape(source.meta.get("val"), node.meta.get("val")):
                node.replace_all_uses_with(source)
                graph.erase_node(node)
                changed += 1
    if changed:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return changed


def _same_shape(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != b.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape, strict=True))
