"""The garbage collector's heap frozen once a process has started (its models built, its graphs compiled), and its
collections recorded.

Design decisions:
- Python's full collections walk every object the collector tracks. A process that holds a compiled model holds
  about a million (dynamo's and inductor's graphs, guards, sympy expressions, the model's modules), and a full
  collection there takes hundreds of milliseconds (docs/performance.md), stopping whatever request runs then (every
  thread waits for the interpreter). `gc.freeze()` moves every object alive at that moment into a generation that
  collections skip; what is made later is still collected. vLLM does the same after its start
  (`vllm.utils.gc_utils.freeze_gc_heap`).
- It collects first: freezing keeps whatever is alive or not yet collected, so garbage frozen would never be freed.
- A choice for the whole process, so it is made by the commands that own theirs (`serve` before it opens its port,
  `bench` around each model's timed stream), not by the library: an application that embeds the engine calls
  `freeze_heap()` itself after its warm-up.
"""

from __future__ import annotations

import contextlib
import gc
import time

from torch._guards import CompileContext


def freeze_heap() -> int:
    """Collect, then freeze every object alive (`gc.freeze()`); returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap():
    """`freeze_heap()` for the block, the frozen objects handed back to the collector after it (`gc.unfreeze()`):
    yields the number frozen."""
    frozen = freeze_heap()
    try:
        yield frozen
    finally:
        gc.unfreeze()


class Collections:
    """Records the collector's pauses while open (`with Collections() as pauses:`): `pauses.seen` holds
    `(generation, seconds)` for every collection in that time, in every thread, and `pauses.compiling` those that
    ran while torch compiled a graph (`CompileContext`: dynamo's tracing and inductor's compile, whose
    objects they walk), apart: a benchmark takes compile time out of its timings, and its collections with it."""

    def __init__(self):
        self.seen: list[tuple[int, float]] = []
        self.compiling: list[tuple[int, float]] = []
        self._started: float | None = None
        self._in_compile = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self._in_compile = CompileContext.current_compile_id() is not None
        elif self._started is not None:
            pause = (info["generation"], time.perf_counter() - self._started)
            (self.compiling if self._in_compile else self.seen).append(pause)
            self._started = None

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """`{"collections": n, "full": n, "longest_ms": ms, "total_ms": ms}` of what was seen outside compiles, and
        `{"compiling": {the same}}` of those during them."""
        return {**_figures(self.seen), "compiling": _figures(self.compiling)}


def _figures(pauses: list[tuple[int, float]]) -> dict:
    return {
        "collections": len(pauses),
        "full": sum(1 for generation, _ in pauses if generation == 2),
        "longest_ms": 1e3 * max((seconds for _, seconds in pauses), default=0.0),
        "total_ms": 1e3 * sum(seconds for _, seconds in pauses),
    }
