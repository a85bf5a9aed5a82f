"""The compiled encoder side of an encoder-decoder model as graphs of a compiled artifact (`artifact.py`): what a
compiled serving engine runs with dynamic shapes (`encoder.py`: the token encoder, an int8 model's cross-attention
projections), exported with dynamic dimensions, compiled with AOTInductor, and loaded in their place, so that a
server started from an artifact traces nothing.

Design decisions:
- The graphs are the work the compiled encoder side runs, with the same settings (`write_artifact` compiles them
  under the engine's `compile_config`: freezing, the passes): the packed encoder where the model packs
  (`encoder.packs_encoder`: T5, BART, Marian; every encoder call of the engine's passes its tokens and their mask,
  which is what the compiled encoder packs), else the encoder on its tokens and mask; an int8 model's cross-attention
  projections (`encoder.cross_attention_projector`, compiled for int8 models only); and where an int8 model's config
  compiles the encoder side twice (`encoder.has_int8_variants`), each graph twice, a call running one by its rows
  (`encoder.encoder_graph`).
- One graph of dynamic sizes each, as the compiled ones: rows from 1 (a single row and several share the graph, as
  the packed encoder's unbacked rows do), positions from 2 (an input of one position runs eagerly, as without an
  artifact), real tokens from 2, each up to the engine's capacities (`max_batch_size`, `max_encoder_len`), which the
  manifest keeps with the graph; a call beyond them (none that the engine admits) runs eagerly. `torch.export` takes
  them as `Dim`s; its example is 2 rows of 3 positions with one padding position (export specializes the sizes 0
  and 1 of its example, and sizes of its example that are equal).
- A module that `torch.export` refuses (a float16 BART's or Marian's encoder: a branch on its states' values) fails
  `save_artifact` with the reason before anything compiles (the encoder's graphs are exported first); such an
  engine's artifact is one of `compile_config_for_cpu(encoder=False)`, whose encoder runs eagerly.
- Tensors in, tensors out: the encoder's last hidden state `[B, L, d]`, the projections' keys and values flat
  (`[k_0, v_0, k_1, v_1, ...]`); the loaded graphs are wrapped back into what the compiled ones return, and count
  the shapes of their calls (`LoadedEncoderSide.calls`, `Engine.encoder_graph_calls`: what a test reads to know the
  encoder ran from the package).
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from transformers.modeling_outputs import BaseModelOutput

from .artifact import ArtifactGraph
from .encoder import (
    _ByRows,
    _CrossAttentionProjections,
    _PackedEncoder,
    _PackedOrPlain,
    encoder_compiles,
    has_int8_variants,
    is_token_call,
    packs_encoder,
)
from .passes import without_int8_float_gemms
from .quantization import first_linear_quantized

PACKED_ENCODER = "packed_encoder"
ENCODER = "encoder"
PROJECTIONS = "projections"
LIBRARY = "library"  # the suffix of an int8 model's second compile (`encoder.has_int8_variants`)
# A float16 BART's or Marian's encoder layers clamp where `torch.isfinite(states).all()` fails: a branch on data,
# which torch.export refuses (probed: their float32 encoders, packed or not, and T5's in float16 export).
_EXPORT_HINT = (
    "; its encoder side cannot be in an artifact: compile the artifact with --eager-encoder (in Python: "
    "compile_config_for_cpu(encoder=False)) and serve it with --eager-encoder too (its server then runs the encoder "
    "eagerly), or serve with --compile"
)
_PLAIN_ARGUMENTS = frozenset(
    ("input_ids", "attention_mask", "output_attentions", "output_hidden_states", "return_dict")
)


def encoder_graph_names(model, compile_config, projections: list | None, *, max_positions: int) -> list[str]:
    """The names of the encoder side's graphs an artifact of `model` under `compile_config` holds (`[]` where the
    encoder does not compile, or takes fewer than 2 positions: `encoder.encoder_warmup_calls`): the artifact's key
    holds them, so that an artifact with other ones (or none, written before encoders were exported) is refused by
    name."""
    if not encoder_compiles(model, compile_config) or max_positions < 2:
        return []
    kinds = [PACKED_ENCODER if packs_encoder(model) else ENCODER]
    if projections and first_linear_quantized(projections[0].__self__):
        kinds.append(PROJECTIONS)
    variants = has_int8_variants(model, compile_config)
    return [name for kind in kinds for name in ((kind, f"{kind}_{LIBRARY}") if variants else (kind,))]


class _EncoderStates(torch.nn.Module):
    """The encoder's last hidden state `[B, L, d]` of `(input_ids, attention_mask)`, packed (`(input_ids,
    attention_mask, index)`, `encoder._PackedEncoder`) where `packed`."""

    def __init__(self, model, *, packed: bool):
        super().__init__()
        encoder = model.get_encoder()
        self.packed = _PackedEncoder(encoder, type(model)._flex_encode_packed) if packed else None
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor | None = None):
        if self.packed is not None:
            return self.packed(input_ids, attention_mask, index).last_hidden_state
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state


class _FlatProjections(torch.nn.Module):
    """`encoder._CrossAttentionProjections` with its keys and values as one flat list `[k_0, v_0, k_1, ...]`."""

    def __init__(self, projections: list):
        super().__init__()
        self.projections = _CrossAttentionProjections(projections)

    def forward(self, states: torch.Tensor) -> list:
        return [part for pair in self.projections(states) for part in pair]


def encoder_artifact_graphs(
    model, compile_config, projections: list | None, *, max_rows: int, max_positions: int
) -> dict[tuple, ArtifactGraph]:
    """`{(name,): ArtifactGraph}` of the encoder side's graphs (`encoder_graph_names`), for `write_artifact`."""
    names = encoder_graph_names(model, compile_config, projections, max_positions=max_positions)
    if not names:
        return {}
    device = next(model.parameters()).device
    input_ids = torch.tensor([[4, 5, 6], [7, 8, 9]], device=device)  # [2, 3]: sizes export does not specialize
    attention_mask = torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)
    index = attention_mask.reshape(-1).nonzero().squeeze(1)  # `models.packing.real_positions`
    rows = torch.export.Dim("rows", min=1, max=max(max_rows, 2))
    positions = torch.export.Dim("positions", min=2, max=max(max_positions, 3))
    tokens = torch.export.Dim("tokens", min=2, max=max(max_rows * max_positions, 5))
    limits = {"max_rows": max_rows, "max_positions": max_positions}
    library = without_int8_float_gemms(compile_config) if has_int8_variants(model, compile_config) else None
    graphs = {}
    with torch.no_grad():
        states = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    for name in names:
        config = library if name.endswith(f"_{LIBRARY}") else None
        if name.startswith(PROJECTIONS):
            module, inputs, dynamic = _FlatProjections(projections), [states], ({0: rows, 1: positions},)
        elif name.startswith(PACKED_ENCODER):
            module = _EncoderStates(model, packed=True)
            inputs = [input_ids, attention_mask, index]
            dynamic = ({0: rows, 1: positions}, {0: rows, 1: positions}, {0: tokens})
        else:
            module = _EncoderStates(model, packed=False)
            inputs, dynamic = [input_ids, attention_mask], ({0: rows, 1: positions}, {0: rows, 1: positions})
        graphs[(name,)] = ArtifactGraph(
            module, inputs, extra=limits, dynamic_shapes=dynamic, compile_config=config, export_hint=_EXPORT_HINT
        )
    return graphs


class _LoadedGraph:
    """A loaded graph of the encoder side (`run`, AOTInductor's), with the sizes it was compiled for and the count of
    its calls."""

    def __init__(self, run, limits: dict):
        self.run, self.max_rows, self.max_positions = run, limits["max_rows"], limits["max_positions"]
        self.shapes: collections.Counter = collections.Counter()  # (rows, positions) of each call

    def fits(self, rows: int, positions: int) -> bool:
        return rows <= self.max_rows and 2 <= positions <= self.max_positions

    def __call__(self, *tensors: torch.Tensor) -> list:
        self.shapes[tuple(tensors[0].shape[:2])] += 1
        return self.run([tensor.contiguous() for tensor in tensors])


@dataclasses.dataclass
class LoadedEncoderSide:
    """The encoder side of an artifact, loaded: `encoder` stands for `encoder.compiled_encoder(model, ...)`,
    `project` for `encoder.cross_attention_projector(model, ...)` (None: the caller's eager projections);
    `graphs` by name."""

    encoder: object
    project: object
    graphs: dict

    @property
    def calls(self) -> dict[str, collections.Counter]:
        """The calls each graph has run: `{name: Counter({(rows, positions): calls})}`."""
        return {name: collections.Counter(graph.shapes) for name, graph in self.graphs.items()}


def loaded_encoder_side(
    model, compile_config, projections: list | None, loaded, *, max_positions: int
) -> LoadedEncoderSide | None:
    """The encoder side of the artifact `loaded` (`artifact.LoadedArtifact`, whose key held
    `encoder_graph_names(model, compile_config, projections, max_positions=max_positions)`); None where it holds
    none."""
    names = encoder_graph_names(model, compile_config, projections, max_positions=max_positions)
    graphs = {name: _LoadedGraph(loaded.graphs[(name,)], loaded.extras[(name,)]) for name in names}
    if not graphs:
        return None
    encoder = model.get_encoder()

    def by_rows(kind: str, shape_of):
        if f"{kind}_{LIBRARY}" not in graphs:
            return graphs[kind]
        return _ByRows(graphs[kind], graphs[f"{kind}_{LIBRARY}"], shape_of)

    if PACKED_ENCODER in graphs:
        packed_graph = by_rows(PACKED_ENCODER, lambda input_ids, attention_mask, index: input_ids.shape)
        limits, encode = graphs[PACKED_ENCODER], type(model)._flex_encode_packed

        def packed(input_ids, attention_mask, index):
            if not limits.fits(*input_ids.shape):
                return encode(encoder, input_ids, attention_mask, index)
            return BaseModelOutput(last_hidden_state=packed_graph(input_ids, attention_mask, index)[0])

        compiled = _PackedOrPlain(encoder, encoder, packed)
    else:
        plain_graph = by_rows(ENCODER, lambda input_ids, attention_mask: input_ids.shape)
        compiled = _LoadedPlainEncoder(encoder, plain_graph, graphs[ENCODER])
    project = None
    if PROJECTIONS in graphs:
        project = _loaded_projector(
            by_rows(PROJECTIONS, lambda states: states.shape[:2]), graphs[PROJECTIONS], projections
        )
    return LoadedEncoderSide(compiled, project, graphs)


class _LoadedPlainEncoder:
    """The encoder of a model that does not pack: the graph for calls of tokens and their mask alone (as the compiled
    encoder's), the eager encoder for any other."""

    def __init__(self, encoder, graph, limits: _LoadedGraph):
        self.encoder, self.graph, self.limits = encoder, graph, limits

    def __call__(self, **kwargs):
        if is_token_call(kwargs, _PLAIN_ARGUMENTS, self.encoder) and self.limits.fits(*kwargs["input_ids"].shape):
            input_ids, attention_mask = kwargs["input_ids"], kwargs["attention_mask"]
            return BaseModelOutput(last_hidden_state=self.graph(input_ids, attention_mask)[0])
        return self.encoder(**kwargs)


def _loaded_projector(graph, limits: _LoadedGraph, projections: list):
    """`states [B, L_enc, d] -> [(keys, values) [B, H, L_enc, D] per layer]`: the graph for two positions or more
    within its sizes, else the eager projections (as `encoder.cross_attention_projector`)."""

    def project(states: torch.Tensor) -> list:
        if not limits.fits(*states.shape[:2]):
            return [project_kv(states) for project_kv in projections]
        parts = graph(states)
        return list(zip(parts[0::2], parts[1::2], strict=True))

    return project
