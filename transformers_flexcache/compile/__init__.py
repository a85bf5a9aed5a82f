"""The CPU compile stack: every use of torch's private names in the runtime package lives here.

This module is the wing's face: the rest of the package (and `model_overrides/`) imports the names of `__all__` from
`transformers_flexcache.compile` and nothing from the modules behind it (`tests/test_layout.py` checks it). The
names are loaded on first use (PEP 562), so that importing the face imports no compile machinery: the command line's
`--help` and a server's start read `cpu_facts()` or `freeze_heap` without loading inductor.

Behind the face:
- `config.py`: `compile_config_for_cpu()`, `FlexCompileConfig`, `compile_settings` (the inductor settings dynamo
  reads while tracing); `warming.py`: `warmup()`, every graph of a fixed-shape policy compiled before serving;
- `hooks.py`: the compile answers to `generate.hooks.GenerateHooks` (`COMPILE_HOOKS`: settings around a compiled
  call, the compiled encoder, the first decoder step in the decode graph, guards checked at a call's first step,
  static addresses);
- `encoder.py`: the compiled encoder and cross-attention projections;
- `passes/`: inductor graph passes (fp32 linears, int8 linears, a decode step's attention);
- `quantization.py`: `quantize(model, "int8")`; `cpu.py`: what the CPU can do;
- `artifact.py`: compiled artifacts (`transformers-flexcache compile`, `serve --compiled DIR`): graphs compiled
  once with AOTInductor, loaded by later processes without tracing; `encoder_artifact.py`: the compiled encoder
  side's graphs in them (dynamic shapes); `generate_artifact.py`: those of generate's
  fixed-shape calls (`warmup(..., artifact=DIR)`, `bench --artifact DIR`);
- `caching.py`: the compile cache (`--compile-cache DIR`, `warmup(..., cache_dir=DIR)`), with `fx_cache.py`,
  which lets inductor's FX graph cache take frozen graphs; `runtime.py`: what the rest reads or sets of torch's
  compile machinery (recompile limits, counters, inductor's cache folder); `gc_heap.py`: the collector around
  compiles and after a start.

`utils/torch_drift.py` lists every private torch name used here, with what it is for.
"""

from __future__ import annotations

import importlib

# name -> the module of this wing that defines it
_NAMES = {
    # settings of a compiled call
    "FlexCompileConfig": "config",
    "compile_config_for_cpu": "config",
    "compile_settings": "config",
    # the answers to generate's hooks (`models.modeling.FlexModelMixin`)
    "COMPILE_HOOKS": "hooks",
    # every graph compiled before serving
    "warmup": "warming",
    "explained_recompile_limit": "warming",
    # the compiled encoder side (the serving engine's steps and warm-up)
    "compiled_encoder": "encoder",
    "cross_attention_projector": "encoder",
    "encoder_compiles": "encoder",
    "encoder_warmup_calls": "encoder",
    # int8
    "quantize": "quantization",
    "int8_bits": "quantization",
    "check_compiled_int8": "quantization",
    # the CPU and the kernels its "auto" options pick
    "cpu_facts": "cpu",
    "isa_limit": "cpu",
    "resolve_int8_linears": "passes",
    "resolve_linear_kernels": "passes",
    "resolve_one_row_linears": "passes",
    "prepare_linear_kernels": "kernel_choice",
    "measured_linear_kernels": "kernel_choice",
    "model_linear_shapes": "kernel_choice",
    # compiled artifacts
    "ArtifactRefused": "artifact",
    "MANIFEST": "artifact",
    "LoadedArtifact": "artifact",
    "PackageGraph": "artifact",
    "artifact_facts": "artifact",
    "load_artifact": "artifact",
    "write_artifact": "artifact",
    "ArtifactGraph": "artifact",
    "encoder_artifact_graphs": "encoder_artifact",
    "encoder_graph_names": "encoder_artifact",
    "loaded_encoder_side": "encoder_artifact",
    "artifact_of": "generate_artifact",
    "set_artifact": "generate_artifact",
    # the compile cache
    "WarmStart": "caching",
    "compile_cache": "caching",
    "default_cache_dir": "caching",
    "model_facts": "caching",
    # torch's compile machinery, read or set
    "RECOMPILE_LIMIT_NAME": "runtime",
    "compile_seconds": "runtime",
    "compiled_graph_count": "runtime",
    "inductor_cache_dir": "runtime",
    "kernel_profile_compile": "runtime",
    "raise_recompile_limits": "runtime",
    "recompile_limit": "runtime",
    "recompile_limits": "runtime",
    # the garbage collector
    "Collections": "gc_heap",
    "freeze_heap": "gc_heap",
    "frozen_heap": "gc_heap",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
