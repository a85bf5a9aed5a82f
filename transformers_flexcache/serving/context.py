"""Which engine request, if any, the current thread's `generate` call serves.

The serving engine runs each request's own `model.generate(...)` in a worker thread, with that request set here.
`generate`'s hooks (`FlexCacheGenerationMixin`: the encoder call, the cache, the model call) read it to hand their work
to the engine's batched steps. Outside a worker it is None and `generate` is untouched. This module imports nothing of
the package, so that `generation.py` and `modeling.py` can read it without an import circle.
"""

from __future__ import annotations

from contextvars import ContextVar

_CURRENT_REQUEST: ContextVar = ContextVar("transformers_flexcache_engine_request", default=None)


def current_request():
    """The engine request that this thread's `generate` call serves (a `serving.worker.RequestWorker`), or None."""
    return _CURRENT_REQUEST.get()


def serving(request):
    """Set `request` as this thread's (in a worker thread); returns the token to `reset` it with."""
    return _CURRENT_REQUEST.set(request)


def reset(token) -> None:
    _CURRENT_REQUEST.reset(token)
