"""Where each layer's storage goes: read from the loaded model, not from its config alone.

`layer_specs_for_model(model)` refines the config's `LayerSpec`s (`specs.py`) layer by layer:
- **device**: where the layer's attention runs. For a module that accelerate dispatched (`device_map`, offload to CPU
  or disk), that is its hook's `execution_device` (its own parameters may sit on `meta`); otherwise the device of its
  parameters. So a model spread over several devices gets each layer's storage beside the layer.
- **kv heads**: what the layer's key projection produces on this process, `out_features // head_dim`. Under tensor
  parallelism (`tp_plan`) the projection holds a shard, and so does the storage: each rank allocates only its heads.
  Models whose key projection is not found (fused projections) keep the config's heads, divided per rank as upstream's
  `get_kv_heads_per_rank` divides them.
- **dtype**: that of the key projection's weight (the model's dtype when the weight is not floating point, e.g.
  quantized).

A layer's attention module is found generically: the modules of the decoder that carry `layer_idx` (every upstream
attention and Mamba mixer does), the first of each index being the self-attention (or mixer), and one whose name says
encoder/cross attention being its cross-attention.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import weakref

import torch
from torch import nn

from .layers import LayerSpec
from .specs import layer_specs_from_config

# Names of key projections in upstream attention modules (Llama/BART/Whisper/Jamba, T5, Pix2Struct).
KEY_PROJECTION_NAMES = ("k_proj", "k", "key")
# A module path naming a cross-attention module (BART-family `encoder_attn`, T5 `EncDecAttention`, Pix2Struct).
CROSS_ATTENTION_PATH = re.compile(r"encoder_attn|encdecattention|encoder_decoder_attention|cross", re.IGNORECASE)


def _decoder(model: nn.Module) -> nn.Module:
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, nn.Module) else model


def attention_modules(model: nn.Module) -> tuple[dict[int, nn.Module], dict[int, nn.Module]]:
    """`({layer_idx: self-attention or mixer module}, {layer_idx: cross-attention module})` of the model's decoder."""
    return _walk(model).modules()


class _Walk:
    """One walk of a model's module tree (`attention_modules`), held per model (`_WALKS`) while it stays true: its
    decoder is the same module, and each module found still hangs where it was found, under the same ancestors
    (`intact`). Modules are held weakly: the model is the key of a weak table, which a strong reference from its value
    would keep alive."""

    def __init__(self, model: nn.Module):
        decoder = _decoder(model)
        self.decoder = weakref.ref(decoder)
        own, cross = {}, {}
        for path, module in decoder.named_modules():
            layer_idx = getattr(module, "layer_idx", None)
            if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
                continue
            if CROSS_ATTENTION_PATH.search(path) or layer_idx in own:
                cross.setdefault(layer_idx, module)
            else:
                own[layer_idx] = module
        self.own = {i: weakref.ref(module) for i, module in own.items()}
        self.cross = {i: weakref.ref(module) for i, module in cross.items()}
        # (parent, name, child) from the model down to each module found: what `intact` checks, and the ancestors
        # that `execution_device` reads hooks from.
        above = {child: (parent, name) for parent in model.modules() for name, child in parent._modules.items()}
        links = set()
        for module in {*own.values(), *cross.values()}:
            while module in above:
                parent, name = above[module]
                links.add((parent, name, module))
                module = parent
        self.links = [(weakref.ref(parent), name, weakref.ref(child)) for parent, name, child in links]

    def intact(self, model: nn.Module) -> bool:
        if _decoder(model) is not self.decoder():
            return False
        for parent, name, child in self.links:
            parent, child = parent(), child()
            if parent is None or child is None or parent._modules.get(name) is not child:
                return False
        return True

    def modules(self) -> tuple[dict[int, nn.Module], dict[int, nn.Module]]:
        """`attention_modules`'s answer."""
        return {i: ref() for i, ref in self.own.items()}, {i: ref() for i, ref in self.cross.items()}

    def parents(self) -> dict[nn.Module, nn.Module]:
        """`{module: parent}` along the links: every ancestor of the modules found."""
        return {child(): parent() for parent, _, child in self.links}


# model -> its `_Walk`; model -> (what its layer specs were read from, the specs) (`layer_specs_for_model`)
_WALKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _walk(model: nn.Module) -> _Walk:
    walk = _WALKS.get(model)
    if walk is None or not walk.intact(model):
        walk = _WALKS[model] = _Walk(model)
    return walk


def cross_attention_projections(model: nn.Module, num_layers: int) -> list | None:
    """Per decoder layer `0..num_layers - 1`, the function that projects encoder outputs into its cross-attention keys
    and values: the overrides' `_flex_project_kv` (`[B, L_enc, d] -> 2 x [B, H, L_enc, D]`, what their forward calls
    on a call's first decoder step), found on the cross-attention modules of `attention_modules`. None when some layer
    has none: its keys are then written only by a forward of the decoder."""
    _, cross = attention_modules(model)
    if sorted(cross) != list(range(num_layers)) or not all(hasattr(cross[i], "_flex_project_kv") for i in cross):
        return None
    return [cross[i]._flex_project_kv for i in range(num_layers)]


def execution_device(module: nn.Module, parents: dict[nn.Module, nn.Module]) -> torch.device | None:
    """Where `module` runs: the `execution_device` of the nearest accelerate hook on it or above it (`parents` maps
    each module to its parent), else the device of its first parameter or buffer that is not on `meta`; None when
    neither says."""
    node = module
    while node is not None:
        device = _hook_device(vars(node).get("_hf_hook"))  # where accelerate sets it (a miss through getattr is slow)
        if device is not None:
            return device
        node = parents.get(node)
    # Lazily: the first tensor that says is enough (a list of the whole model's parameters took most of the time of
    # `layer_specs_for_model`, which runs at every generate call); in the order of `parameters()` then `buffers()`.
    return _first_device(module, "_parameters") or _first_device(module, "_buffers")


def _first_device(module: nn.Module, kind: str) -> torch.device | None:
    """The device of the first tensor of `kind` (`"_parameters"` or `"_buffers"`) not on `meta`, in the order of
    `module.parameters()` (`module.buffers()`): the module's own, then each child's, depth first. Read from the
    modules' tables directly: `parameters()` walks `named_modules` with a memo, 2-3x the time of this in
    `layer_specs_for_model` (12 modules of the t5-small-sized T5 at every generate call)."""
    for tensor in getattr(module, kind).values():
        if tensor is not None and tensor.device.type != "meta":
            return tensor.device
    for child in module._modules.values():
        if child is not None:
            device = _first_device(child, kind)
            if device is not None:
                return device
    return None


def _hook_device(hook) -> torch.device | None:
    if hook is None:
        return None
    for inner in getattr(hook, "hooks", None) or [hook]:  # accelerate's SequentialHook holds several
        device = getattr(inner, "execution_device", None)
        if device is not None:
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    return None


def _key_projection(module: nn.Module) -> torch.Tensor | None:
    for name in KEY_PROJECTION_NAMES:
        weight = getattr(getattr(module, name, None), "weight", None)
        if isinstance(weight, torch.Tensor):
            to_local = getattr(weight, "to_local", None)  # a DTensor shard under tensor parallelism
            return to_local() if callable(to_local) else weight
    return None


class _Placer:
    """Refines config specs for one model, from the modules of its `_Walk`."""

    def __init__(self, model: nn.Module, walk: _Walk):
        self.model = model
        self.parents = walk.parents()
        self.default_device = execution_device(model, self.parents) or torch.device("cpu")
        self.default_dtype = getattr(model, "dtype", torch.float32)
        self.tp_heads = _tp_heads(model)

    def read(self, module: nn.Module | None) -> tuple:
        """What `refined` reads of `module`: where it runs, and its key projection's dtype and shape."""
        if module is None:
            return ()
        weight = _key_projection(module)
        return (
            execution_device(module, self.parents),
            None if weight is None else (weight.dtype, tuple(weight.shape)),
        )

    def refined(self, spec: LayerSpec, module: nn.Module | None) -> LayerSpec:
        if module is None:
            return dataclasses.replace(spec, device=self.default_device, dtype=self.default_dtype)
        device = execution_device(module, self.parents) or self.default_device
        return _refined(spec, module, device=device, dtype=self.default_dtype, tp_heads=self.tp_heads)


def _refined(spec: LayerSpec, module: nn.Module, *, device, dtype, tp_heads) -> LayerSpec:
    changes = {"device": device, "dtype": dtype}
    if spec.layer_type == "linear_attention":
        return dataclasses.replace(spec, **changes)
    weight = _key_projection(module)
    if weight is not None:
        if weight.dtype.is_floating_point:
            changes["dtype"] = weight.dtype
        if weight.dim() == 2 and weight.shape[0] % spec.k_head_dim == 0:
            changes["num_heads"] = weight.shape[0] // spec.k_head_dim
    elif tp_heads is not None:
        changes["num_heads"] = tp_heads(spec.num_heads)
    return dataclasses.replace(spec, **changes)


def _tp_heads(model: nn.Module):
    tp_size = getattr(model, "_tp_size", None) or 1
    if tp_size <= 1:
        return None
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    return lambda num_heads: get_kv_heads_per_rank(model.tp_plan, num_heads, tp_size)


def layer_specs_for_model(model: nn.Module) -> tuple[list[LayerSpec], list[LayerSpec] | None]:
    """`(self-attention specs, cross-attention specs or None)` for `model`'s decoder, each layer placed where the
    model runs it, with the heads its projections produce and in their dtype (see the module docstring).

    It runs at every generate call: the specs are held per model with what they were read from (the config's values,
    and per layer where its modules run and their key projections' dtype and shape), and made anew when any of it
    changed (`model.to`, a hook that accelerate adds, a module replaced, a config value)."""
    walk = _walk(model)
    own, cross = walk.modules()
    placer = _Placer(model, walk)
    read = (
        placer.default_device,
        placer.default_dtype,
        getattr(model, "_tp_size", None),
        tuple(placer.read(own.get(i)) for i in sorted(own)),
        tuple(placer.read(cross.get(i)) for i in sorted(cross)),
    )
    held = _PLACED.get(model)
    if held is not None and held[1] == read and _equal(vars(model.config), held[0]):
        return _copies(held[2])
    config_specs = layer_specs_from_config(model.config)
    self_specs = [placer.refined(spec, own.get(i)) for i, spec in enumerate(config_specs)]
    placed = self_specs, None
    if model.config.is_encoder_decoder:
        # Cross-attention layers run beside their decoder layer; their own projections give their heads.
        cross_specs = [
            placer.refined(spec, cross.get(i, own.get(i)))
            for i, spec in enumerate(config_specs)
            if spec.layer_type != "linear_attention"
        ]
        placed = self_specs, cross_specs
    try:
        _PLACED[model] = (copy.deepcopy(vars(model.config)), read, _copies(placed))
    except (TypeError, RuntimeError, copy.Error):  # a config value that cannot be copied: read at every call
        _PLACED.pop(model, None)
    return placed


def _equal(values: dict, held: dict) -> bool:
    """Whether a config's values equal those held; False where they cannot be compared (a tensor among them)."""
    try:
        return bool(values == held)
    except (TypeError, RuntimeError, ValueError):
        return False


def _copies(placed: tuple) -> tuple:
    """New lists of the same (frozen) specs: a caller may change its lists."""
    self_specs, cross_specs = placed
    return list(self_specs), None if cross_specs is None else list(cross_specs)
