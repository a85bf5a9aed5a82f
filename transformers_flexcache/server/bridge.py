"""Request handles seen from the event loop.

Waiting on a `RequestHandle` blocks (its iteration and `result()` wait on thread primitives), and a request may wait
in the engine's queue for long: a shared thread pool would run dry under load. So each handle gets a small daemon
thread of its own that iterates it and hands each step's new token ids (for a stream), then the end, to an
`asyncio.Queue` on the loop (`loop.call_soon_threadsafe`). The engine already runs a thread per running request; this adds one per request.
"""

from __future__ import annotations

import asyncio
import threading

END = None  # what `follow` puts after a handle's last step, once the handle is done


def follow(handle, key, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop, *, steps: bool = True) -> None:
    """Put `(key, token_ids)` on `queue` for each step of `handle` (token ids a list, one per returned sequence) if
    `steps`, then `(key, END)` once `handle.done()`; the caller reads the outcome from the handle itself."""

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def forward() -> None:
        if steps:
            try:
                for tokens in handle:
                    put((key, tokens.tolist()))
            except Exception:  # the request's error: read from the handle
                pass
        handle.exception()  # waits for the end (iterating ends just before the handle is marked done)
        put((key, END))

    threading.Thread(target=forward, name=f"flexcache-server-{handle.request_id}", daemon=True).start()
