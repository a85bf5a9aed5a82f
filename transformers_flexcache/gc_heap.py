"""The garbage collector's heap frozen once a process has started (its models built, its graphs compiled), and its
collections recorded.

Design decisions:
- Python's full collections walk every object the collector tracks. A process that holds a compiled model holds
  about a million (dynamo's and inductor's graphs, guards, sympy expressions, the model's modules: 877,000 after a
  t5-small-sized T5's bucketed compiled warm-up), and on an AMD EPYC Zen 3, one thread, a full collection there
  took 520-875 ms (0.01-0.2 ms frozen), stopping whatever request ran then (every thread waits for the
  interpreter). `gc.freeze()` moves every object alive at that moment into a generation that
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
    `(generation, seconds)` for every collection in that time, in every thread."""

    def __init__(self):
        self.seen: list[tuple[int, float]] = []
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seen.append((info["generation"], time.perf_counter() - self._started))
            self._started = None

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    @contextlib.contextmanager
    def paused(self):
        """Collections in this block are not recorded (the caller's own, e.g. `freeze_heap()`'s)."""
        gc.callbacks.remove(self._callback)
        try:
            yield
        finally:
            self._started = None
            gc.callbacks.append(self._callback)

    def summary(self) -> dict:
        """`{"collections": n, "full": n, "longest_ms": ms, "total_ms": ms}` of what was seen."""
        return {
            "collections": len(self.seen),
            "full": sum(1 for generation, _ in self.seen if generation == 2),
            "longest_ms": 1e3 * max((seconds for _, seconds in self.seen), default=0.0),
            "total_ms": 1e3 * sum(seconds for _, seconds in self.seen),
        }
