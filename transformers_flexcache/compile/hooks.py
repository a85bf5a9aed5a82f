"""The compile wing's answers to `generate.hooks.GenerateHooks`: what a compiled flexible call adds to generate.

`CompileHooks` is what every override model's generate asks (`models.modeling.FlexModelMixin._flex_hooks`); where
a call is not compiled each answer is the default one, upstream's behaviour:
- `call_context`: a call whose `compile_config` is set is refused where its int8 weights would saturate this CPU's
  kernels (`quantization.check_compiled_int8`), then runs with the inductor settings that dynamo reads while tracing
  (`config.compile_settings`: freezing).
- `encode_padded_call`: a fixed-shape encoder-decoder call's encoder runs compiled, with dynamic shapes, at the call's
  own rows (`encoder.compiles_encoder`, `encoder.encode_compiled`).
- `first_step`: its first decoder step runs in the compiled decode graph (`encoder.first_step_compiles`).
- `call_padded`: this CPU's fp32 linear kernels measured for the call's padded rows where not yet measured
  (`kernel_choice.prepare`, before its encoder, first step or decode graph compiles, since the passes' cache identity
  names the table's choices).
- `compiled_call`: the compiled forward checks dynamo's guards in full at
  the call's first step only (`GuardsOfFirstStep`, `FlexCompileConfig(step_guards="first")`).
- `cache_leased`: a fixed-shape cache on an accelerator gets static addresses for CUDA graphs
  (`mark_static_addresses`).

Where `warmup(..., artifact=DIR)` set a compiled artifact on the model (`generate_artifact.ARTIFACT_ATTRIBUTE`: a
`Recorder` while it builds one, a `Replayer` once loaded), the compiled forward is the artifact's
(`generate_artifact.py`), the first decoder step one of its calls (recorded, then replayed), and the encoder and
the first step's cross-attention projections the artifact's encoder side where it holds one (`Replayer.encoder_side`;
eager while it builds, or where it holds none): nothing is traced.
"""

from __future__ import annotations

import torch

from ..generate.hooks import GenerateHooks
from ..generate.plan import rows_per_input
from . import kernel_choice
from .config import compile_settings
from .encoder import (
    compiles_encoder,
    cross_attention_projector,
    encode_compiled,
    first_step_compiled,
    first_step_compiles,
)
from .generate_artifact import artifact_of
from .quantization import check_compiled_int8


class GuardsOfFirstStep:
    """One generate call's compiled forward (upstream's generate asks for it once per call): its first call checks
    every guard dynamo holds for the compiled graphs, the later ones (the call's further decode steps) only those that
    tell the graphs apart (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`: tensor shapes, strides and
    dtypes, and whatever guard once made dynamo compile another graph).

    Why: a decode step of the t5-small-sized T5 holds about 3000 guards (on the model's modules, its config, the
    cache's attributes), a share of a small step's time worth saving (docs/compile.md). Why it is safe here:
    within one call, step after step, the same model, cache object and arguments reach the graph, with tensors of the
    same shapes (the flexible cache's fixed shapes): what a skipped guard checks is what the first step checked in
    full. A Python value that changed from step to step would make every call recompile at that step, which the
    tests' counts of compiled graphs would show. Between calls (another shape, a model changed in place) the first
    step checks everything again. Where the stance is not the default (a user's `set_stance`), nothing is skipped;
    `FlexCompileConfig(step_guards="every")` turns it off.
    """

    __slots__ = ("compiled", "checked")

    def __init__(self, compiled):
        self.compiled, self.checked = compiled, False

    def __call__(self, *args, **kwargs):
        if self.checked and _default_stance():
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self.compiled(*args, **kwargs)
        outputs = self.compiled(*args, **kwargs)
        self.checked = True
        return outputs


def _default_stance() -> bool:
    """Whether dynamo runs at its default stance, with every guard checked and no backend forced."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return (
        stance is not None
        and stance.stance == "default"
        and not stance.skip_guard_eval_unsafe
        and stance.backend is None
    )


def mark_static_addresses(cache) -> None:
    """`torch._dynamo.mark_static_address` on each storage tensor of a fixed-shape flexible `cache` (its
    `static_tensors()`) that is not on the CPU: CUDA graphs then read it in place, across calls, instead of copying
    it (a compiled step with `mode="reduce-overhead"` copies mutated inputs into its own buffers or skips CUDA
    graphs). Not while dynamo traces, as for upstream's `StaticLayer`: a no-op then.

    Never on the CPU: a static address is for CUDA graphs, which the CPU does not have, and under a frozen compile
    (`compile_config_for_cpu()`, `freezing=True`) dynamo makes a marked tensor an attribute of the graph, bound to that
    storage, without a guard on its identity (torch==2.13.0, `VariableBuilder.wrap_tensor`): another cache of the same
    shapes (a second seat of the pool, a model copy, the cache allocated after `release()`) would then run on the
    first one's storage, or on freed storage (a segmentation fault). Unmarked, the storage is an input of the graph
    like any other, and every cache of the same shapes shares the graph correctly.
    """
    if torch.compiler.is_compiling() or not getattr(cache, "is_compileable", False):
        return
    for tensor in cache.static_tensors():
        if tensor.device.type != "cpu":
            torch._dynamo.mark_static_address(tensor)


class CompileHooks(GenerateHooks):
    """The compile wing's answers (module docstring)."""

    def call_context(self, model, generation_config):
        if generation_config.compile_config is None:
            return super().call_context(model, generation_config)
        check_compiled_int8(model)  # 8-bit int8 weights on a CPU whose int8 kernels saturate: refused here
        return compile_settings(generation_config.compile_config)

    def call_padded(self, model, plan, generation_config) -> None:
        # this CPU's fp32 linear kernels measured for the call's padded rows where not yet measured, before its
        # encoder, first step or decode graph compiles (the passes' cache identity names the table's choices)
        compile_config = generation_config.compile_config
        if compile_config is None or artifact_of(model) is not None:
            return
        rows = plan.padding.padded_batch_size * rows_per_input(model, generation_config)
        kernel_choice.prepare(model, compile_config, [rows])

    def encode_padded_call(self, model, generation_config, input_name: str, model_inputs: dict, *, candidates: bool):
        encoder = None
        artifact = artifact_of(model)
        if artifact is not None:  # the artifact's encoder, where it holds one
            encoder = getattr(getattr(artifact, "encoder_side", None), "encoder", None)
            if encoder is None:
                return None
        if not compiles_encoder(model, generation_config, input_name, model_inputs, candidates=candidates):
            return None
        encoder_kwargs = {key: value for key, value in model_inputs.items() if key != input_name}
        return encode_compiled(model, generation_config, model_inputs[input_name], encoder_kwargs, encoder=encoder)

    def first_step(self, model, plan, input_ids, generation_config, model_kwargs: dict):
        projections = first_step_compiles(model, plan, input_ids, generation_config, model_kwargs)
        if projections is None:
            return None
        project = None
        artifact = artifact_of(model)
        if artifact is not None:  # the artifact's projections where it holds them, else eager ones (nothing traced)
            project = getattr(getattr(artifact, "encoder_side", None), "project", None)
            project = project or cross_attention_projector(model, None, projections)
        return first_step_compiled(
            model, plan, projections, input_ids, generation_config, model_kwargs, project=project
        )

    def compiled_call(self, model, plan, compile_config, compiled):
        artifact = artifact_of(model)
        if artifact is not None:
            return artifact.wrap(compiled)
        if getattr(compile_config, "step_guards", "every") != "first":
            return compiled
        return GuardsOfFirstStep(compiled)

    def cache_leased(self, model, cache) -> None:
        mark_static_addresses(cache)


COMPILE_HOOKS = CompileHooks()
