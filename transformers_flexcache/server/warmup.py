"""The engine's warm-up, run by the server while its port is open: `/health` says `"warming"` with its progress, and
requests get 503 with `Retry-After` until every graph is compiled (or loaded from the compile cache).

Design decisions:
- The port opens first, then the graphs compile in a thread of their own (`Warmup.start`, from the application's
  lifespan): a load balancer's health check gets an answer at once ("warming", graphs done of all, seconds so far)
  instead of a refused connection for minutes, and a person sees the same in `/health` and in the command's progress
  bar. No request runs before the warm-up ends, so none pays a compile (as before: warm-up before serving).
- A failed warm-up is the server's end: `/health` says `"failed"` with the error, requests get 503, and `on_done`
  (the command's) stops the server with exit status 1.
- The thread is a daemon: a server stopped while warming up exits without waiting for the compile; the compile
  cache then keeps nothing of that warm-up (`compile/caching.py`: no manifest, its files removed at the next
  start).
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
from collections.abc import Callable

from ..compile import compiled_graph_count
from ..log import get_logger

logger = get_logger(__name__)


class Warmup:
    """The warm-up of `engine` (`Engine.warmup(cache_dir=..., progress=...)`), started in a thread by `start()`.

    Args:
        engine (`Engine`): an engine built with a `compile_config`.
        cache_dir (`str | os.PathLike`, *optional*): the compile cache folder (None: inductor's own cache only).
        artifact (`str | os.PathLike`, *optional*): a compiled artifact folder to load (`Engine.warmup(artifact=)`).
        progress (`Callable[[int, int], None]`, *optional*): also called with (graphs done, graphs in all).
        on_done (`Callable[[Warmup], None]`, *optional*): called in the thread once it ends, ready or failed.
    """

    def __init__(
        self,
        engine,
        *,
        cache_dir=None,
        artifact=None,
        progress: Callable | None = None,
        on_done: Callable | None = None,
    ):
        self.engine = engine
        self.cache_dir = cache_dir
        self.artifact = artifact
        self._progress = progress
        self._on_done = on_done
        self.state = "pending"  # "warming", "ready", "failed"
        self.done = 0
        self.total: int | None = None
        self.error: BaseException | None = None
        self._started: float | None = None
        self.seconds: float | None = None  # the whole warm-up's, once it ended
        self._thread: threading.Thread | None = None
        self._context = contextvars.copy_context()

    def start(self) -> None:
        """Start the warm-up in its thread (once)."""
        if self._thread is not None:
            return
        self.state = "warming"
        self._started = time.monotonic()
        # torch's config is per thread (a ContextVar): the warm-up compiles under the settings of the thread that
        # built this object (the command's raised recompile limits), not torch's defaults
        self._thread = threading.Thread(
            target=self._context.run, args=(self._run,), name="flexcache-warmup", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def elapsed(self) -> float:
        return 0.0 if self._started is None else time.monotonic() - self._started

    def _update(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        if self._progress is not None:
            self._progress(done, total)

    def _run(self) -> None:
        try:
            self.engine.warmup(cache_dir=self.cache_dir, artifact=self.artifact, progress=self._update)
        except BaseException as error:  # reported by /health and the command; the thread ends
            self.error = error
            self.state = "failed"
            logger.error("the warm-up failed: the server cannot serve", exc_info=error)
        else:
            self.state = "ready"
        self.seconds = self.elapsed
        if self._on_done is not None:
            self._on_done(self)

    def retry_after(self) -> int:
        """Seconds a client should wait: the graphs left at the pace of those done so far (at least 1)."""
        if not self.done or not self.total:
            return max(1, math.ceil(self.elapsed) or 5)
        return max(1, math.ceil(self.elapsed / self.done * (self.total - self.done)))

    def body(self) -> dict:
        """What `/health` says of the warm-up."""
        body = {"state": self.state, "graphs_done": self.done, "graphs_total": self.total}
        body["seconds"] = round(self.seconds if self.seconds is not None else self.elapsed, 1)
        body["traced"] = compiled_graph_count()  # graphs dynamo traced in this process so far
        warm_start = self.engine.warm_start
        if warm_start is not None:
            body["compile_cache"] = {
                "directory": warm_start.directory,
                "found": warm_start.found,
                "traced": warm_start.traced,
                "loaded": warm_start.hits,
                "compiled": warm_start.misses,
            }
        elif self.cache_dir is None:
            body["compile_cache"] = None
        if self.artifact is not None:
            loaded = self.engine.artifact
            body["artifact"] = {
                "directory": str(self.artifact),
                "graphs": len(loaded.packages) if loaded is not None else 0,
                # loaded lazily, when the engine is idle or at a graph's first use (`Engine.warmup(artifact=)`)
                "loaded": sum(graph.loaded for graph in loaded.packages) if loaded is not None else 0,
                "damaged": [g.error for g in loaded.packages if g.error] if loaded is not None else [],
                "refused": self.engine.artifact_refused,
            }
        if self.error is not None:
            body["error"] = f"{type(self.error).__name__}: {self.error}"
        return body
