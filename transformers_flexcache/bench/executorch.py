"""The ExecuTorch rows of the benchmark: our `.pte` (fp32 and torchao 8da4w) and transformers' own exported programs,
run on the stream of the torch strategies, interleaved with them.

Design decisions:
- Ours: `export_model` at the stream's capacities, lowered with XNNPACK into one `.pte` (`lower_ours` of
  `bench/export_measure.py`; decoder-only programs without the LLM runner's `forward`, which the stream never calls), run
  by `ExecuTorchPrograms` and decoded by `export.generate`. `executorch-8da4w` quantizes a copy of the override model
  first (`quantize_model_(model, "8da4w")`: int8 dynamic activations, int4 weights in groups of 32).
- transformers' exporter (`Seq2SeqLMExportableModule`, `TorchExportableModuleForDecoderOnlyLM`) fixes the batch at
  export: its programs are exported at batch 1 and at the stream's largest batch (`lower_upstream`); a call of
  another batch runs on the larger program with its rows padded by copies of row 0 (`upstream_generate`). The row
  reports the exports it took and the exports that serving every batch of the stream exactly would take.
- The same decoding as the torch strategies: greedy, exactly `new_tokens` tokens. The logits processors that
  upstream's `generate` applies to the bench's calls (BART's forced EOS; Whisper's begin-suppressed tokens) are
  upstream's own classes, in upstream's order, applied to the programs' logits, and EOS is suppressed as for the
  torch strategies (`stream.NoEndOfSequence`). A generation config that asks for any other processor is refused
  before lowering.
- Per-step latency is measured as for the torch strategies: the same `StepTimer`, a logits processor stamped at
  each step (first token: the time to the first stamp). Export and lowering are timed apart (`lowering`), never in
  the warm time.
- ExecuTorch runs on the CPU at float32, with the benchmark's threads (its threadpool is set to `--threads`).
- Our fp32 program must generate DynamicCache's tokens; the quantized program (other weights) and transformers'
  programs (no padding mask) report how far their tokens agree.
- Memory: the cache of our program is planned once in the `.pte`, its buffers shared by the methods: their bytes are
  the peak cache figure. ExecuTorch exposes no allocation counts (None).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import tempfile
import time

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    ForcedEOSTokenLogitsProcessor,
    LogitsProcessorList,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from .measure import CallRecord, PeakRss, StepTimer
from .stream import NoEndOfSequence

OURS = "executorch"  # runtime of our .pte
TRANSFORMERS = "executorch-transformers"  # runtime of transformers' exported programs
# Generation settings that add a logits processor to upstream's generate, which these rows do not apply.
_UNSUPPORTED_SETTINGS = (
    "repetition_penalty",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "sequence_bias",
    "forced_bos_token_id",
    "exponential_decay_length_penalty",
    "renormalize_logits",
    "remove_invalid_values",
    "min_length",
    "guidance_scale",
    "return_timestamps",
    "no_speech_threshold",
)


class Unavailable(Exception):
    """An ExecuTorch row that cannot run for this model or installation; its message is the report's note."""


def unsupported_generation_settings(generation_config: GenerationConfig) -> list[str]:
    """The settings of `generation_config` that would add a logits processor these rows do not apply."""
    default = GenerationConfig()
    return [
        name
        for name in _UNSUPPORTED_SETTINGS
        if getattr(generation_config, name, None) not in (None, getattr(default, name, None))
    ]


def reference_processors(generation_config: GenerationConfig, *, prefix_len: int, new_tokens: int):
    """Processors that give the scores of upstream's `generate(min_new_tokens=new_tokens, max_new_tokens=new_tokens)`
    for `generation_config`: upstream's own, in upstream's order (`GenerationMixin._get_logits_processor`; Whisper's
    `generate` puts its begin-suppress processor in the same place), with `min_new_tokens`' EOS suppression done as
    the torch strategies do it (`NoEndOfSequence`, last).

    Args:
        generation_config: the model's.
        prefix_len: decoder tokens before the first new one (1 for encoder-decoder models: the start token).
        new_tokens: tokens each call decodes.
    """
    config = generation_config
    processors = LogitsProcessorList()
    if config.forced_eos_token_id is not None:
        processors.append(ForcedEOSTokenLogitsProcessor(prefix_len + new_tokens, config.forced_eos_token_id))
    if config.suppress_tokens is not None:
        processors.append(SuppressTokensLogitsProcessor(config.suppress_tokens))
    if config.begin_suppress_tokens is not None:
        processors.append(SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin_index=prefix_len))
    # min_new_tokens' EOS suppression, as the torch strategies apply it (last, as generate appends custom processors)
    processors.append(NoEndOfSequence(config.eos_token_id))
    return processors


def executorch_available() -> str | None:
    """Why the ExecuTorch rows cannot run in this installation, or None."""
    if importlib.util.find_spec("executorch") is None:
        return 'executorch is not installed: no ExecuTorch rows (pip install "transformers-flexcache[executorch]")'
    return None


@contextlib.contextmanager
def executorch_threads(threads: int):
    """ExecuTorch's threadpool at `threads` threads within the block (XNNPACK runs on it), as before afterwards."""
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count, _unsafe_reset_threadpool

    before = _threadpool_get_thread_count()
    _unsafe_reset_threadpool(threads)
    try:
        yield
    finally:
        _unsafe_reset_threadpool(before)


class _ProgramRunner:
    """Runs the stream's calls on exported programs, timed and measured like a torch strategy's generate calls."""

    peak_cache_bytes: int | None = None

    def __init__(self, *, name: str, upstream, lowering: dict, workdir: tempfile.TemporaryDirectory):
        self.name = name
        self.upstream = upstream
        self.generation_config = upstream.generation_config
        self.is_encoder_decoder = bool(upstream.config.is_encoder_decoder)
        self.lowering = lowering  # figures of the export and lowering; the report reads them after the stream
        self._workdir = workdir  # the .pte files, kept while the runner lives

    def _decode(self, inputs: dict, new_tokens: int, processors: LogitsProcessorList) -> torch.Tensor:
        raise NotImplementedError

    def run(self, inputs: dict, new_tokens: int) -> CallRecord:
        # inputs: input_ids, attention_mask [B, L] (or input_features) -> tokens [B, new_tokens]
        prefix_len = 1 if self.is_encoder_decoder else inputs["input_ids"].shape[1]
        rss = PeakRss()
        timer = StepTimer(rss)
        processors = reference_processors(self.generation_config, prefix_len=prefix_len, new_tokens=new_tokens)
        processors.append(timer)  # last, as the torch strategies' timer after generate's own processors
        rss.start()
        start = time.perf_counter()
        sequences = self._decode(inputs, new_tokens, processors)
        wall_s = time.perf_counter() - start
        rss.sample()
        tokens = sequences[:, -new_tokens:]
        return CallRecord(
            wall_s=wall_s,
            num_tokens=tokens.numel(),
            tokens=tokens,
            first_token_s=timer.first_token_s(start),
            step_s=timer.step_s(),
            peak_cache_bytes=self.peak_cache_bytes,
            peak_rss_growth_bytes=rss.growth_bytes,
        )


class OursRunner(_ProgramRunner):
    """Our `.pte` (one program for every batch and length of the stream), decoded by `export.generate`."""

    ours = True

    def __init__(self, *, programs, cache_bytes: int, **kwargs):
        super().__init__(**kwargs)
        self.programs = programs  # ExecuTorchPrograms
        self.peak_cache_bytes = cache_bytes

    @classmethod
    def lower(cls, name: str, flex, upstream, capacities: dict, *, quantize: str = "none") -> OursRunner:
        """Export `flex` (a quantized copy for `quantize != "none"`) at `capacities` and lower it with XNNPACK."""
        from ..export.runners import ExecuTorchPrograms
        from .export_measure import lower_ours

        workdir = tempfile.TemporaryDirectory(prefix="flexcache-bench-executorch-")
        path = os.path.join(workdir.name, f"{name}.pte")
        lowered = lower_ours(flex, capacities, path, backend="xnnpack", quantize=quantize)
        lowering = {
            "lowering_s": lowered["export_s"] + lowered["lower_s"],
            "export_s": lowered["export_s"],
            "lower_s": lowered["lower_s"],
            "pte_bytes": lowered["pte_bytes"],
            "cache_bytes": lowered["cache_bytes"],
            "quantize": quantize,
            "quantized_linears": lowered["quantized_linears"],
            "exports": 1,
            "exports_for_every_batch": 1,
        }
        return cls(
            name=name,
            upstream=upstream,
            lowering=lowering,
            workdir=workdir,
            programs=ExecuTorchPrograms(path),
            cache_bytes=lowered["cache_bytes"],
        )

    def _decode(self, inputs: dict, new_tokens: int, processors: LogitsProcessorList) -> torch.Tensor:
        from ..export.decoding import generate

        # No eos_token_id: EOS is suppressed until the last token (NoEndOfSequence), so no row finishes early.
        return generate(
            self.programs,
            **inputs,
            max_new_tokens=new_tokens,
            decoder_start_token_id=self.generation_config.decoder_start_token_id,
            logits_processor=processors,
        )


class TransformersRunner(_ProgramRunner):
    """transformers' exported programs at batch 1 and the stream's largest batch, rows padded to the larger one."""

    ours = False

    def __init__(self, *, methods: dict[int, dict], **kwargs):
        super().__init__(**kwargs)
        self.methods = methods  # program batch -> method name -> ExecuTorch method
        self.batches_seen: set[int] = set()

    @classmethod
    def lower(cls, name: str, upstream, capacities: dict) -> TransformersRunner:
        """Export copies of `upstream` with transformers' exporter at batch 1 and `max_batch_size`, lower each with
        XNNPACK."""
        from .export_measure import load_upstream_methods, lower_upstream

        workdir = tempfile.TemporaryDirectory(prefix="flexcache-bench-transformers-et-")
        batches = sorted({1, capacities["max_batch_size"]})
        lowered = {
            batch: lower_upstream(copy.deepcopy(upstream), capacities, workdir.name, batch_size=batch)
            for batch in batches
        }
        export_s = sum(figures["export_s"] for figures in lowered.values())
        lower_s = sum(figures["lower_s"] for figures in lowered.values())
        lowering = {
            "lowering_s": export_s + lower_s,
            "export_s": export_s,
            "lower_s": lower_s,
            "pte_bytes": sum(figures["pte_bytes"] for figures in lowered.values()),
            "exported_batches": batches,
            "exports": len(batches),
            "exports_for_every_batch": None,  # counted over the calls
        }
        methods = load_upstream_methods({batch: figures["paths"] for batch, figures in lowered.items()})
        return cls(name=name, upstream=upstream, lowering=lowering, workdir=workdir, methods=methods)

    def _decode(self, inputs: dict, new_tokens: int, processors: LogitsProcessorList) -> torch.Tensor:
        from .export_measure import upstream_generate, upstream_program_batch

        batch_size = next(iter(inputs.values())).shape[0]
        self.batches_seen.add(batch_size)
        self.lowering["exports_for_every_batch"] = len(self.batches_seen)
        program_batch = upstream_program_batch(batch_size, self.methods)
        tokens, _ = upstream_generate(
            self.upstream,
            self.methods[program_batch],
            inputs,
            program_batch,
            new_tokens=new_tokens,
            logits_processor=processors,
        )
        return tokens


def check_runnable(strategy, *, upstream, device: str, dtype: str) -> None:
    """Raise `Unavailable` with the reason if the ExecuTorch `strategy` cannot run for `upstream` here: no executorch
    (or torchao to quantize), another device or dtype, a model type that export refuses, or a generation config
    with logits processors these rows do not apply. Checked before anything is exported."""
    from ..export.cli import NOT_EXPORTABLE

    reason = executorch_available()
    if reason:
        raise Unavailable(reason)
    if device != "cpu" or dtype != "float32":
        raise Unavailable(f"ExecuTorch rows run on the CPU at float32 only (--device {device}, --dtype {dtype})")
    model_type = upstream.config.model_type
    if model_type in NOT_EXPORTABLE:
        raise Unavailable(f"model_type={model_type!r} cannot be exported: {NOT_EXPORTABLE[model_type]}")
    unsupported = unsupported_generation_settings(upstream.generation_config)
    if unsupported:
        raise Unavailable(
            f"its generation config sets {unsupported}, logits processors that the ExecuTorch rows do not apply"
        )
    if strategy.quantize != "none" and importlib.util.find_spec("torchao") is None:
        raise Unavailable(f"{strategy.name} quantizes with torchao, which is not installed: pip install torchao")


def build_runner(strategy, *, upstream, flex, capacities: dict):
    """The runner of an ExecuTorch `strategy` for this model, exported and lowered here (minutes at real sizes);
    `check_runnable` first.

    Args:
        strategy: a `strategies.Strategy` whose `runtime` is `OURS` or `TRANSFORMERS`.
        upstream: the upstream model (fp32, CPU); transformers' exporter exports copies of it.
        flex: the override model with the same weights (ours export it; a copy is quantized).
        capacities: the stream's capacities (`stream.capacities_for`); `max_prompt_len` is not exported.

    Raises:
        ValueError: a strategy of another runtime.
    """
    export_capacities = {
        name: capacities[name] for name in ("max_batch_size", "max_cache_len", "max_encoder_len") if name in capacities
    }
    if strategy.runtime == OURS:
        return OursRunner.lower(strategy.name, flex, upstream, export_capacities, quantize=strategy.quantize)
    if strategy.runtime == TRANSFORMERS:
        return TransformersRunner.lower(strategy.name, upstream, export_capacities)
    raise ValueError(f"strategy {strategy.name!r} has runtime={strategy.runtime!r}, not {OURS!r} or {TRANSFORMERS!r}")
