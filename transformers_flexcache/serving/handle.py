"""What `Engine.submit` returns: a handle on one request, and the errors a request can end with.

A handle is filled by the engine's threads and read by the caller's: `result()` waits for what `model.generate`
returns for that request alone, iterating yields the new token ids as they are decoded, `cancel()` gives the
request's seats back within one step.
"""

from __future__ import annotations

import queue
import threading
import time

import torch


class EngineClosedError(RuntimeError):
    """The engine was closed before the request finished (or it was submitted after `close()`)."""


class CapacityError(ValueError):
    """A request that can never fit the engine's capacities. `needed` and `limits` map each capacity it exceeds
    (`"max_batch_size"`, `"max_cache_len"`, `"max_encoder_len"`) to what the request needs and what the engine has,
    so that a caller can name its own setting (a server's flag) in the fix."""

    def __init__(self, message: str, *, needed: dict[str, int], limits: dict[str, int]):
        super().__init__(message)
        self.needed = needed
        self.limits = limits


class QueueFullError(RuntimeError):
    """`max_queue` requests are already waiting for seats; `retry_after` is a suggested wait in seconds."""

    def __init__(self, message: str, *, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class RequestCancelledError(RuntimeError):
    """The request was cancelled (`handle.cancel()`) before it finished."""


_END = object()


class RequestHandle:
    """One request submitted to an `Engine`.

    Attributes:
        request_id (`int`): the engine's number for it, in submission order.
        num_seats (`int`): the seats (cache rows) it takes while it runs.
        submitted_at, admitted_at, first_token_at, finished_at (`float | None`): `time.perf_counter()` stamps.
        admitted_at_step (`int | None`): how many decode steps the engine had run when the request's prefill ran.
    """

    def __init__(self, *, request_id: int, num_seats: int, on_cancel):
        self.request_id = request_id
        self.num_seats = num_seats
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.admitted_at_step: int | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.num_new_tokens = 0
        self._on_cancel = on_cancel
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel_requested = False
        self._callbacks: list = []
        self._callbacks_lock = threading.Lock()

    # --- the caller's side ------------------------------------------------------------------------------------
    def result(self, timeout: float | None = None):
        """What `model.generate(**inputs, **generation_kwargs)` returns for this request alone.

        Raises:
            TimeoutError: not finished within `timeout` seconds (the request goes on).
            RequestCancelledError, EngineClosedError, or the error the request's `generate` raised.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the request ended with, or None (waits like `result`)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._error

    def done(self) -> bool:
        return self._done.is_set()

    def add_done_callback(self, callback) -> None:
        """Call `callback(handle)` when the request ends (at once if it has): in the engine's thread, so keep it
        short (a server wakes its event loop with it)."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def cancel(self) -> bool:
        """Stop the request: its seats are free within one step and `result()` raises `RequestCancelledError`.
        Returns False when it had already finished."""
        if self._done.is_set():
            return False
        self._cancel_requested = True
        self._on_cancel(self)
        return True

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def __iter__(self):
        """Yields each step's new token ids, a LongTensor `[num_return_sequences]`, as they are decoded; the last
        item comes when the request ends. Raises what `result()` raises."""
        while True:
            item = self._tokens.get()
            if item is _END:
                break
            yield item
        if self._error is not None:
            raise self._error

    # --- the engine's side ------------------------------------------------------------------------------------
    def push_tokens(self, tokens: torch.Tensor) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.num_new_tokens += 1
        self._tokens.put(tokens)

    def finish(self, result=None, error: BaseException | None = None) -> None:
        with self._callbacks_lock:
            if self._done.is_set():
                return
            self._result, self._error = result, error
            self.finished_at = time.perf_counter()
            self._tokens.put(_END)
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
