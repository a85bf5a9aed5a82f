"""`TorchRunner`: one strategy of the benchmark run through a torch model's `generate`, one call of the stream at a time.

Design decisions:
- Each call is timed whole (wall time) and per decoding step (`StepTimer`, a logits processor), with the model's
  forward alone timed apart (`ForwardTimer`); cache storages are inspected by a forward hook in eager runs and on the
  returned cache in compiled ones (a hook would be traced into the graph). See `measure.py`.
- The bucketed strategy compiles every shape before the stream (`warm_up_every_shape`, i.e. `warmup()`), as a
  server would. With `bench --artifact DIR` every compiled flexible strategy warms up so, from a compiled artifact
  folder of its own (`warmup(..., artifact=)`: loaded, or built and then loaded).
"""

from __future__ import annotations

import os
import time

import torch
from transformers import LogitsProcessorList

from ..compile import MANIFEST as ARTIFACT_MANIFEST
from ..compile import artifact_of, compile_seconds, compile_settings, compiled_graph_count, warmup
from .measure import CacheStorageTracker, CallRecord, ForwardTimer, PeakRss, StepTimer, returned_cache, top_margins
from .strategies import Strategy
from .stream import NoEndOfSequence


class TorchRunner:
    """Runs one strategy on one model and measures its calls."""

    def __init__(
        self,
        strategy: Strategy,
        model,
        capacities: dict[str, int],
        *,
        buckets: dict | None = None,
        keep_margins: bool = False,
        artifact: str | None = None,
    ):
        self.name = strategy.name
        self.strategy = strategy
        self.model = model
        self.device = model.device
        self.generate_kwargs = strategy.generate_kwargs(capacities, device=self.device, buckets=buckets)
        self.tracker = CacheStorageTracker()
        self.keep_margins = keep_margins  # a reference of other strategies: keep each step's top-1/top-2 margin
        self.keep_scores = strategy.runtime == "torch"  # compared with the reference's where the prefix is the same
        self.no_eos = NoEndOfSequence(model.generation_config.eos_token_id)
        # a compiled artifact folder of this strategy's graphs (`bench --artifact`): its warm-up loads it, or builds it
        self.artifact = artifact if strategy.compile and strategy.flexible else None

    @property
    def warms_up_every_shape(self) -> bool:
        return self.strategy.warm_up_every_shape or self.artifact is not None

    def _on_device(self, inputs: dict) -> dict:
        return {
            key: value.to(self.device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()
        }

    def run(self, inputs: dict, new_tokens: int) -> CallRecord:
        inputs = self._on_device(inputs)
        rss = PeakRss()
        timer = StepTimer(rss)
        self.tracker.start_call()
        # A hook inside a compiled forward would be traced into the graph: compiled runs are inspected at the end.
        hook = (
            None
            if self.strategy.compile
            else self.model.register_forward_hook(self.tracker.forward_hook, with_kwargs=True)
        )
        graphs_before, compile_before = compiled_graph_count(), compile_seconds()
        forwards = ForwardTimer(self.model, compiled=self.strategy.compile)
        try:
            rss.start()
            start = time.perf_counter()
            # Upstream's generate (the static strategies) does not apply freezing from compile_config.options by
            # itself (see compile_settings); ours does. Applied here to every strategy, so that all compile alike.
            with compile_settings(self.generate_kwargs.get("compile_config")), forwards:
                out = self.model.generate(
                    **inputs,
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    num_beams=1,
                    return_dict_in_generate=True,
                    output_scores=self.keep_scores or self.keep_margins,
                    logits_processor=LogitsProcessorList([self.no_eos, timer]),
                    **self.generate_kwargs,
                )
            _synchronize(self.device)
            wall_s = time.perf_counter() - start
            rss.sample()
        finally:
            if hook is not None:
                hook.remove()
        hook_s = self.tracker.hook_s
        self.tracker.observe(returned_cache(out))
        tokens = out.sequences[:, -new_tokens:].cpu()
        first_token_s = timer.first_token_s(start)
        if first_token_s is not None and hook_s:
            first_token_s -= hook_s[0]
        return CallRecord(
            wall_s=wall_s - sum(hook_s),
            num_tokens=tokens.numel(),
            tokens=tokens,
            first_token_s=first_token_s,
            step_s=timer.step_s(hook_s),
            forward_s=forwards.decode_forwards(len(timer.stamps), hook_s),
            cache_allocations=self.tracker.allocations,
            cache_bytes_allocated=self.tracker.bytes_allocated,
            peak_cache_bytes=self.tracker.peak_bytes,
            peak_rss_growth_bytes=rss.growth_bytes,
            compiled_graphs=compiled_graph_count() - graphs_before,
            compile_s=compile_seconds() - compile_before,
            batch_size=tokens.shape[0],
            margins=top_margins(out.scores) if self.keep_margins else None,
            scores=torch.stack(out.scores, dim=1).float().cpu() if self.keep_scores else None,
        )

    def warm_up_every_shape(self, make_inputs, new_tokens: int) -> CallRecord:
        """Compile every shape the strategy's policy can run the stream at (`warmup()`; with `artifact`, its graphs
        loaded from the folder, or built into it first): one record for all."""
        kwargs = {key: value for key, value in self.generate_kwargs.items() if key != "cache_implementation"}
        self.tracker.start_call()
        graphs_before, compile_before = compiled_graph_count(), compile_seconds()
        manifest = None if self.artifact is None else _manifest_stamp(self.artifact)
        start = time.perf_counter()
        if self.artifact is not None:
            kwargs["artifact"] = self.artifact
        shapes = warmup(
            self.model, lambda b, n: self._on_device(make_inputs(b, n)), max_new_tokens=new_tokens, **kwargs
        )
        _synchronize(self.device)
        wall_s = time.perf_counter() - start
        self.tracker.observe(self.model.flexible_cache)
        artifact = None
        if self.artifact is not None:
            artifact = {
                "directory": self.artifact,
                "built": _manifest_stamp(self.artifact) != manifest,  # written by this warm-up, else loaded
                "graphs": len(artifact_of(self.model).loaded.packages),
                "seconds": wall_s,
            }
        return CallRecord(
            wall_s=wall_s,
            num_tokens=0,
            tokens=torch.empty(0, 0, dtype=torch.long),
            cache_allocations=self.tracker.allocations,
            cache_bytes_allocated=self.tracker.bytes_allocated,
            peak_cache_bytes=self.tracker.peak_bytes,
            compiled_graphs=compiled_graph_count() - graphs_before,
            compile_s=compile_seconds() - compile_before,
            batch_size=max(shape.batch_size for shape in shapes),
            artifact=artifact,
        )


def _manifest_stamp(directory: str):
    """(modification time in ns, size) of the artifact folder's manifest, None where it has none."""
    try:
        stat = os.stat(os.path.join(directory, ARTIFACT_MANIFEST))
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
