"""What upstream's compiled `generate` runs eagerly in an encoder-decoder call, compiled too: the encoder (one graph
with dynamic shapes) and the first decoder step (the decode step's own graph).

Design decisions (the measurements behind each: docs/compile.md, "Compiling `generate`"):
- Upstream's `generate` compiles the decode step only: the encoder (and the first decoder step) run eagerly. On CPU
  the eager encoder is a large part of an encoder-decoder call's first token. A `compile_config` that asks for it
  (`compile_config_for_cpu(encoder=True)`, the default: `FlexCompileConfig.compile_encoder`) compiles the encoder
  with the same settings (frozen weights, oneDNN linears), under a padded or bucketed policy.
- With dynamic shapes, at the call's own rows and length: the encoder holds no cache, so nothing needs its shapes
  fixed, and padding costs more than static shapes gain: a static graph is faster than eager at equal shapes, but
  padded to the buckets it encodes positions that a dynamic graph does not. Dynamo specializes a size of 1: a call
  of one row gets a graph of its own (`warmup()` compiles both), and an input of one position runs eagerly (no third
  graph for it); but a packed encoder (below) takes its rows unbacked, one graph for one row and for several.
- Token inputs only (`input_ids`): Whisper's features, Pix2Struct's patches and given `inputs_embeds` stay eager, as
  do calls that ask for the encoder's attentions or hidden states, candidate decoding, continuations given
  `encoder_outputs`, models dispatched by accelerate (`device_map`) and tensor-parallel models.
- The first decoder step of a compiled fixed-shape call (`first_step_compiles`) differs from the later ones only in
  that it projects the encoder outputs into the cross-attention keys and values. Those are projected first, eagerly, by
  each layer's own cross-attention module (`cross_attention_projections`, as the serving engine admits a request and as
  the exported `encoder` method does), and written with `cross_attention_cache.update`; the step itself is then a
  decode step, and runs in the compiled decode graph of its shapes (no graph more: the tests count them). Upstream runs
  the whole first step eagerly; the compiled one gives the same tokens sooner. It applies when the decoder prompt is
  one token (the start token; a longer one, as Whisper's forced tokens, is a prefill of several positions: eager), the
  cache is fresh (not a continuation), every layer has the projection, the call decodes greedily or samples (upstream's
  beam search compiles no step), its decode step compiles, and no attentions or hidden states are asked for; candidate
  decoding and chunked prefill stay eager too.
- For a quantized model (`quantize(model, "int8")`) those projections run compiled too, wherever the encoder
  compiles: one graph of all the layers' projections, with dynamic shapes as the encoder's
  (`cross_attention_projector`; in the serving engine as a request joins, warmed up with the encoder). torchao's
  eager int8 linear recomputes each weight's row sums at every call, many times what the compiled projections take.
  In float32 compiling them gains nothing: they stay eager. Their rows are unbacked, as a packed encoder's: one
  graph for a single row and several (`_CrossAttentionProjections.forward`; one compile fewer in a warm-up).
- On a CPU without VNNI an int8 model's encoder side runs FBGEMM's int8 GEMMs (`compile_config_for_cpu(int8_linears=
  "auto")`, `passes.int8_linears.Int8FbgemmMatmuls`), one compile for every size. Under `int8_linears="inductor"` it is
  compiled twice: with its int8 matrix multiplies as exact float32 GEMMs (`passes.int8_linears.Int8FloatGemms`) and
  with oneDNN's int8 linears; a call runs the first for a single row or up to `INT8_FLOAT_GEMM_MAX_ROWS` positions in
  all, the second beyond (`encoder_graph`), where each is the faster. Warm-ups compile both (`encoder_warmup_calls`).
- A padded call of several rows runs on its real tokens only where the model's override has a packed encoder
  (`_flex_encode_packed`: T5, Marian, BART; `models/packing.py`): its linears, norms and activations skip the padding
  positions, as CTranslate2's encoder does (`_PackedOrPlain`, `packs_encoder`): a padded call then costs what the
  same tokens without padding cost.
- One compiled encoder (and projection module) per model and config, held beside the model (weakly keyed, as the
  cache pool is: not in the model's `__dict__`, so `copy.deepcopy`, pickling and `torch.save` of the model are
  unaffected).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.fx.experimental import _config as fx_config
from transformers import CompileConfig
from transformers.generation.configuration_utils import GenerationMode

from ..cache import is_flexible_cache
from ..cache.placement import cross_attention_projections
from ..generate.signatures import signature_of
from ..models.packing import real_positions
from .passes import without_int8_float_gemms
from .quantization import first_linear_quantized

# An int8 model's compiled encoder side runs float32 GEMMs of its integers (`passes.int8_linears.Int8FloatGemms`) at up
# to this many positions in all (rows x positions) or a single row, oneDNN's int8 linears beyond (see the docstring).
INT8_FLOAT_GEMM_MAX_ROWS = 128


# The float attributes of the encoder's modules (norms' epsilons, dropout rates, embeddings' norm types) as constants
# of the graph: with dynamic shapes dynamo traced them as symbolic floats, then found it could not keep them so and
# traced the whole encoder again ("Restarting analysis due to ... _tensorify_python_scalars"), seconds of a server's
# warm start (docs/compile.md, "Warm starts"). They never change between calls.
def _specialized_floats():
    return torch._dynamo.config.patch(specialize_float=True)


# torch 2.13 and 2.14 stamp each output of a graph of dynamic shapes with the dimensions that were symbolic in it
# (`_dynamo_propagated_dynamic_indices`, AOT autograd's runtime wrappers), and dynamo makes those dimensions symbolic
# in a graph that it compiles again for a tensor so stamped. The encoder's outputs reach the fixed-shape decode graphs
# (upstream's generate passes them to every decode step, which does not read them once the cross-attention cache is
# filled): the bucketed policy's graph at the capacities held a symbolic encoder length that the padded policy's graph
# at the same shapes did not, so inductor's FX graph cache, keyed by the graph, compiled the same work twice (the
# bench's T5, AMD EPYC Zen 4: none of 18 graphs shared). The decoder's graphs take the encoder's outputs at the sizes
# they have.
_DYNAMIC_STAMP = "_dynamo_propagated_dynamic_indices"


def _without_dynamic_stamps(outputs):
    """`outputs` (a `ModelOutput`, or a tensor) with the stamp above taken off each tensor, in place."""
    values = outputs.values() if isinstance(outputs, dict) else (outputs,)
    for value in values:
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor) and _DYNAMIC_STAMP in getattr(tensor, "__dict__", {}):
                delattr(tensor, _DYNAMIC_STAMP)
    return outputs


# model -> (compile config, whether quantized, its compiled encoder)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> (compile config, whether quantized, its packed encoder, `_PackedEncoder`, compiled)
_COMPILED_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> the `_PackedOrPlain` of its compiled encoders
_ROUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> (compile config, whether quantized, its decoder's cross-attention projections, compiled)
_COMPILED_PROJECTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Encoder arguments that upstream's `_prepare_text_encoder_decoder_kwargs_for_generation` leaves out.
_NOT_FOR_THE_ENCODER = ("decoder_", "cross_attn", "use_cache", "cache")


def encoder_compiles(model, compile_config) -> bool:
    """Whether `compile_config` compiles `model`'s encoder: it asks for it, and the model is a token
    encoder-decoder model run on one device (see the module docstring)."""
    return bool(
        getattr(compile_config, "compile_encoder", False)
        and model.config.is_encoder_decoder
        and model.main_input_name == "input_ids"
        and not hasattr(model, "hf_device_map")  # accelerate's hooks move the encoder's inputs and outputs
        and (getattr(model, "_tp_size", None) or 1) == 1
    )


def compiles_encoder(model, generation_config, input_name: str, model_inputs: dict, *, candidates: bool) -> bool:
    """Whether this generate call's encoder runs compiled (see the module docstring)."""
    return (
        encoder_compiles(model, generation_config.compile_config)
        and not candidates
        and input_name == "input_ids"
        and isinstance(model_inputs.get("input_ids"), torch.Tensor)
        and model_inputs["input_ids"].shape[-1] > 1  # a size of 1 would be a graph of its own
        and model_inputs.get("encoder_outputs") is None
        and not generation_config.output_attentions
        and not generation_config.output_hidden_states
    )


def encode_compiled(model, generation_config, input_ids: torch.Tensor, model_kwargs: dict, *, encoder=None) -> dict:
    """Derived from `GenerationMixin._prepare_text_encoder_decoder_kwargs_for_generation` (transformers==5.24.0):
    `model_kwargs` with `encoder_outputs` added. Differences: the encoder is the compiled one (`compiled_encoder`), or
    `encoder` where given (a compiled artifact's, `encoder_artifact.LoadedEncoderSide.encoder`); arguments reach it
    as upstream passes them."""
    accepted = set(signature_of(model.get_encoder().forward).parameters)
    wildcard = "kwargs" in accepted or "model_kwargs" in accepted
    arguments = {
        name: value
        for name, value in model_kwargs.items()
        if not name.startswith(_NOT_FOR_THE_ENCODER) and (wildcard or name in accepted)
    }
    arguments.update(
        input_ids=input_ids,
        output_attentions=generation_config.output_attentions,
        output_hidden_states=generation_config.output_hidden_states,
        return_dict=True,
    )
    encoder = encoder or compiled_encoder(model, generation_config.compile_config)
    model_kwargs["encoder_outputs"] = encoder(**arguments)
    return model_kwargs


def compiled_encoder(model, compile_config: CompileConfig):
    """`torch.compile(model.get_encoder(), **compile_config.to_dict(), dynamic=True)`, once per model and config (two
    compiles for an int8 model, chosen by a call's rows: `encoder_graph`). For a model whose override packs its
    encoder (`packs_encoder`), a call of several rows with an attention mask runs the packed encoder instead
    (`_PackedOrPlain`)."""
    plain = _compiled_once(
        _COMPILED, model, compile_config, model.get_encoder, lambda **kwargs: kwargs["input_ids"].shape
    )
    encoder, packed = model.get_encoder(), None
    if packs_encoder(model):
        encode = type(model)._flex_encode_packed
        packed = _compiled_once(
            _COMPILED_PACKED,
            model,
            compile_config,
            lambda: _PackedEncoder(encoder, encode),
            lambda input_ids, attention_mask, index: input_ids.shape,
        )
    held = _ROUTED.get(model)
    if held is None or held.encoder is not encoder or held.plain is not plain or held.packed is not packed:
        held = _ROUTED[model] = _PackedOrPlain(encoder, plain, packed)
    return held


def packs_encoder(model) -> bool:
    """Whether `model`'s compiled encoder runs a padded call on its real tokens only (`models/packing.py`): its
    override has `_flex_encode_packed` (T5, Marian, BART), and it runs inference in a type other than float16 (whose
    layers clamp on a check over every position, padding included)."""
    return hasattr(type(model), "_flex_encode_packed") and model.dtype != torch.float16


class _PackedEncoder(torch.nn.Module):
    """`encode(encoder, input_ids, attention_mask, index)` (an override's `_flex_encode_packed`) as a module, so
    that one graph runs it with the encoder's weights frozen in it."""

    def __init__(self, encoder: torch.nn.Module, encode):
        super().__init__()
        self.encoder, self.encode = encoder, encode

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor):
        # The rows are unbacked (`_PackedOrPlain._call`): two sizes that dynamo cannot compare unless told they agree.
        torch._check(input_ids.shape[0] == attention_mask.shape[0])
        return self.encode(self.encoder, input_ids, attention_mask, index)


def is_token_call(kwargs: dict, allowed: frozenset | set, encoder) -> bool:
    """Whether an encoder call of `kwargs` is one a compiled (or exported) encoder graph stands for: only `allowed`
    arguments, token ids and a mask of their shape (2-D tensors), a dict output, no attentions or hidden states asked
    for, the encoder in eval mode."""
    input_ids, attention_mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    return (
        set(kwargs) <= allowed
        and kwargs.get("return_dict", True)
        and not kwargs.get("output_attentions")
        and not kwargs.get("output_hidden_states")
        and isinstance(input_ids, torch.Tensor)
        and isinstance(attention_mask, torch.Tensor)
        and input_ids.dim() == 2
        and attention_mask.shape == input_ids.shape
        and not encoder.training
    )


class _PackedOrPlain:
    """A model's compiled encoder. Where the model `packs_encoder` (`packed` is not None), a call of two real tokens or
    more whose only arguments are its tokens and their attention mask (as generate's and the serving engine's) runs
    `packed` on its real tokens (their positions found eagerly, `models.packing.real_positions`), its rows unbacked
    (`unbacked_rows`): one graph for one row and for several; any other call runs `plain`, the encoder as it is.

    Dynamo's duck sizing is off for both: with it, a first call whose rows, length or number of real tokens are
    equal (the serving engine's warm-up of 2 rows of 2 tokens) compiles a graph for such calls only, and the next
    call another."""

    _PACKED_ARGUMENTS = frozenset(
        ("input_ids", "attention_mask", "output_attentions", "output_hidden_states", "return_dict")
    )

    def __init__(self, encoder, plain, packed):
        self.encoder, self.plain, self.packed = encoder, plain, packed

    def __call__(self, **kwargs):
        with fx_config.patch(use_duck_shape=False), _specialized_floats():
            return _without_dynamic_stamps(self._call(**kwargs))

    def _call(self, **kwargs):
        if self.packed is None or not is_token_call(kwargs, self._PACKED_ARGUMENTS, self.encoder):
            return self.plain(**kwargs)
        input_ids, attention_mask = kwargs["input_ids"], kwargs["attention_mask"]
        index = real_positions(attention_mask)
        if index.numel() < 2:  # dynamo would give 0 or 1 real tokens a graph of their own
            return self.plain(**kwargs)
        return self.packed(*unbacked_rows(input_ids, attention_mask), index)


def unbacked_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` as new tensors on the same memory whose first dimension (their rows) is unbacked for dynamo
    (`mark_unbacked`): a compiled graph then holds for any number of rows, one included, where a dynamic size of 1
    would be specialized into a graph of its own. New tensors, so that the caller's stay unmarked (a mark would
    follow them into the user's own compiled functions); detached, not views, whose base dynamo would guard on."""
    aliases = tuple(tensor.detach() for tensor in tensors)
    for alias in aliases:
        torch._dynamo.decorators.mark_unbacked(alias, 0)
    return aliases


def cross_attention_projector(model, compile_config: CompileConfig | None, projections: list):
    """A function `states [B, L_enc, d] -> [(keys, values) [B, H, L_enc, D] per layer]` that runs `projections`
    (`cross_attention_projections`): compiled, as one graph with dynamic shapes, where `model` is quantized and
    `compile_config` compiles its encoder (`encoder_compiles`), else eagerly, one after the other (see the module
    docstring). Encoder states of one position run eagerly (dynamo would give that size a graph of its own)."""
    compiled = None
    if encoder_compiles(model, compile_config) and first_linear_quantized(projections[0].__self__):
        compiled = _compiled_once(
            _COMPILED_PROJECTIONS,
            model,
            compile_config,
            lambda: _CrossAttentionProjections(projections),
            lambda states: states.shape[:2],
        )

    def project(states: torch.Tensor) -> list:
        if compiled is not None and states.shape[1] > 1:
            # Fresh and dense: dynamo guards a view's base and strides, and the states may be a cut of padded ones.
            # No duck sizing, as for the encoder (`_PackedOrPlain`): 2 rows of 2 positions would compile for those.
            # Rows unbacked: one graph for a single row and for several (`_CrossAttentionProjections.forward`).
            with fx_config.patch(use_duck_shape=False), _specialized_floats():
                return compiled(*unbacked_rows(states.clone(memory_format=torch.contiguous_format)))
        return [project_kv(states) for project_kv in projections]

    return project


class _CrossAttentionProjections(torch.nn.Module):
    """The decoder layers' cross-attention projections (`_flex_project_kv` of the modules `projections` are bound
    to) as one module, so that one graph runs them all, their weights frozen in it."""

    def __init__(self, projections: list):
        super().__init__()
        self.attentions = torch.nn.ModuleList(project_kv.__self__ for project_kv in projections)

    def forward(self, states: torch.Tensor) -> list:
        # states [B, L, d], B unbacked (`cross_attention_projector`), L > 1 -> per layer (keys, values) [B, H, L, D].
        # torchao's per-token quantization asks whether the rows it is given are 1, which an unbacked size cannot
        # answer: the states go in as one row of B x L positions (each position is quantized on its own, the same
        # values), a size that the checks below bound to 2 or more; each projection comes back as B rows of L.
        rows, positions, width = states.shape
        torch._check(rows >= 1)
        torch._check(positions >= 2)
        flat = states.reshape(1, rows * positions, width)
        projected = []
        for attention in self.attentions:
            keys, values = attention._flex_project_kv(flat)  # [1, H, B x L, D]: views of [1, B x L, H, D]
            heads, head_dim = keys.shape[1], keys.shape[3]
            projected.append(
                tuple(
                    part.transpose(1, 2).reshape(rows, positions, heads, head_dim).transpose(1, 2)
                    for part in (keys, values)
                )
            )
        return projected


def _compiled_once(table: weakref.WeakKeyDictionary, model, compile_config: CompileConfig, module, shape_of):
    """`torch.compile(module(), **compile_config.to_dict(), dynamic=True)`, held in `table` once per model and config
    and quantization. For an int8 model whose config writes int8 GEMMs of dynamic rows in float32
    (`passes.int8_linears.Int8FloatGemms`), a second compile without them, and a function that calls one or the other
    by the rows of the call (`shape_of(*args, **kwargs)` gives its `(batch, positions)`; see `encoder_graph`)."""
    quantized = first_linear_quantized(model)  # `quantize` after a float call compiles anew
    held = table.get(model)
    if held is None or held[:2] != (compile_config, quantized):
        arguments = {**compile_config.to_dict(), "dynamic": True}  # one graph for every rows and length
        compiled = torch.compile(module(), **arguments)
        library = without_int8_float_gemms(compile_config) if quantized else None
        if library is not None:
            compiled = _ByRows(compiled, torch.compile(module(), **{**library.to_dict(), "dynamic": True}), shape_of)
        held = (compile_config, quantized, compiled)
        table[model] = held
    return held[2]


class _ByRows:
    """Calls `float_gemms` or `library` (two compiles of one module) by the rows of the call (`encoder_graph`)."""

    def __init__(self, float_gemms, library, shape_of):
        self.float_gemms, self.library, self.shape_of = float_gemms, library, shape_of

    def __call__(self, *args, **kwargs):
        batch, positions = self.shape_of(*args, **kwargs)
        library = encoder_graph(batch, positions, int8_variants=True)[1] == "library"
        return (self.library if library else self.float_gemms)(*args, **kwargs)


def encoder_graph(batch: int, positions: int, *, int8_variants: bool) -> tuple[bool, str]:
    """Which graph of the compiled encoder (and cross-attention projections) a call of `batch` rows of `positions`
    runs: `(one row, kind)`, dynamo compiling a single row apart (but for a packed encoder and an int8 model's
    projections, whose rows are unbacked: there the two share one graph); `kind` is `"library"` for an int8 model's
    calls of 2 rows or more and more than `INT8_FLOAT_GEMM_MAX_ROWS` positions in all (`int8_variants`: oneDNN's int8
    linears), else `"float_gemms"` (its config's own kernels)."""
    library = int8_variants and batch > 1 and batch * positions > INT8_FLOAT_GEMM_MAX_ROWS
    return batch == 1, "library" if library else "float_gemms"


def has_int8_variants(model, compile_config) -> bool:
    """Whether `model`'s compiled encoder side has two compiles (`_compiled_once`)."""
    return without_int8_float_gemms(compile_config) is not None and first_linear_quantized(model)


def encoder_warmup_calls(model, compile_config, max_batch_size: int, max_positions: int) -> list[tuple[int, int]]:
    """`(batch, positions)` of encoder calls that compile every graph of the compiled encoder side (`encoder_graph`)
    that calls within the capacities can run; `[]` where the encoder does not compile."""
    if not encoder_compiles(model, compile_config) or max_positions < 2:
        return []
    variants = has_int8_variants(model, compile_config)
    calls = [(1, 2)] + ([(2, 2)] if max_batch_size > 1 else [])
    if max_batch_size * max_positions > INT8_FLOAT_GEMM_MAX_ROWS and variants:
        calls.append((max_batch_size, INT8_FLOAT_GEMM_MAX_ROWS // max_batch_size + 1))
    return calls


def first_step_compiles(model, plan, input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> list | None:
    """The cross-attention projections of the decoder's layers when this call's first decoder step runs in its
    compiled decode graph (see the module docstring), else None."""
    cache = model_kwargs.get("cache")
    if not (
        plan is not None
        and plan.policy.fixed_shapes
        and model.config.is_encoder_decoder
        and not (plan.padding is not None and plan.padding.candidates)
        # the decoding methods whose later steps upstream compiles (`_sample`): not beam search's
        and generation_config.get_generation_mode() in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
        and input_ids.shape[1] == 1
        and model_kwargs.get("encoder_outputs") is not None
        and generation_config.prefill_chunk_size is None
        and not generation_config.output_attentions
        and not generation_config.output_hidden_states
        and is_flexible_cache(cache)
        and hasattr(cache, "cross_attention_cache")
        and cache.get_seq_length() == 0
        and cache.get_encoder_length() == 0
        and model._valid_auto_compile_criteria(model_kwargs, generation_config)
    ):
        return None
    return cross_attention_projections(model, len(cache.cross_attention_cache.layers))


def first_step_compiled(
    model, plan, projections: list, input_ids: torch.Tensor, generation_config, model_kwargs: dict, *, project=None
):
    """Stands for `GenerationMixin._prefill` (transformers==5.25.0) on a call that `first_step_compiles`: the
    cross-attention keys and values projected (by `cross_attention_projector`, or `project` where given: a compiled
    artifact's) and written, then the step in the compiled decode graph.

    Only the call's own rows and encoder positions are projected (as DynamicCache's call projects them); the padding
    rows and positions get zero keys and values. Padding positions are masked, and padding rows are cut from the
    outputs: neither reaches a real row.
    """
    # input_ids: [B_pad, 1] start tokens; encoder states: [B_pad, L_pad, d] -> per layer 2 x [B_pad, H, L_pad, D]
    cache = model_kwargs["cache"]
    states = own = model_kwargs["encoder_outputs"][0]
    if plan.padding is not None:  # [B, L_enc, d]: the call's own rows and positions
        own = plan.padding.cut_rows(states)[:, : plan.padding.encoder_len or states.shape[1]]
    padding = (0, 0, 0, states.shape[1] - own.shape[1], 0, 0, 0, states.shape[0] - own.shape[0])
    project = project or cross_attention_projector(model, generation_config.compile_config, projections)
    projected = project(own)
    for layer_idx, (key_states, value_states) in enumerate(projected):  # [B, H, L_enc, D] -> [B_pad, H, L_pad, D]
        if any(padding):
            key_states, value_states = F.pad(key_states, padding), F.pad(value_states, padding)
        cache.cross_attention_cache.update(key_states, value_states, layer_idx)
    model_inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
    with model._optimize_model_for_decode():  # as upstream runs its decode steps
        return model.get_compiled_call(generation_config.compile_config)(**model_inputs, return_dict=True)
