"""In-flight serving: independent requests join and leave a running batch on one preallocated seat cache.

- `engine.py`: `Engine` (seats, admission, the scheduler); `steps.py`: the batched model work (encoders, prefills,
  the decode step); `worker.py`: each request's own `generate`, run in a thread of its own, whose model calls the
  engine batches; `handle.py`: what `submit` returns, and the errors; `requests.py`: what `submit` accepts;
  `lockstep.py`: tensor-parallel steps; `buckets.py`: a compiled engine's buckets when none are named. Which request
  a thread serves is `generate.hooks.plugged_hooks()`, in the generate layer.

The engine knows nothing of HTTP or tokenization.
"""

from .handle import CapacityError, EngineClosedError, QueueFullError, RequestCancelledError, RequestHandle

__all__ = ["CapacityError", "Engine", "EngineClosedError", "QueueFullError", "RequestCancelledError", "RequestHandle"]


def __getattr__(name: str):
    # The engine imports the model classes' machinery: loaded on first use, as the package's other entry points.
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
