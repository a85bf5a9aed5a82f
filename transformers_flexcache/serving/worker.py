"""One request's `generate` call, run in a thread of its own, whose model work the engine batches with the others'.

Design decisions:
- Each admitted request runs `model.generate(**inputs, **generation_kwargs)` itself, unchanged: upstream's own
  preparation (special tokens, logits processors, stopping criteria, beam bookkeeping, Whisper's prompts, fallbacks and
  post-processing) decides everything about the request, so the engine returns what `generate` returns for it alone.
  Generate's plug-in seam hands the model's work to the engine instead of running it (`request_seats.py`: the worker
  plugs `RequestSeatsHooks` in for its call): the encoder call, the cache (`RequestSeats`) and the model call.
- Workers take turns: the scheduler resumes one, and waits until it hands back its next model call (or ends), before
  resuming the next. So a request's Python work (logits processors, token choice, stopping) never runs beside
  another's, and the model runs in one thread, the scheduler's.
- Each request has its own random state: while its worker runs, torch's CPU generator (and the model device's) holds
  the request's state, set from its `seed` (`torch.manual_seed(seed)` then `generate` alone draws the same numbers),
  and the caller's state is put back when its turn ends. Sampling is thereby reproducible whatever runs beside it.
  (Another thread of yours that draws from torch's global generator during a worker's turn would interleave.)
"""

from __future__ import annotations

import contextvars
import enum
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from ..generate.hooks import plugged
from .handle import RequestHandle
from .request_seats import RequestSeats, RequestSeatsHooks


class CallKind(enum.Enum):
    """What a worker's pending call asks of the scheduler."""

    ENCODE = "encode"  # the request's encoder outputs
    FORWARD = "forward"  # a model call on the request's seats: its prefill, or a decode step
    DONE = "done"  # the request's generate returned
    FAILED = "failed"  # the request's generate raised


@dataclass
class PendingCall:
    """What a worker hands back to the scheduler and waits on: its next model call, or how its `generate` ended.

    Attributes:
        kind (`CallKind`): which of the fields below it carries.
        encoder_kwargs (`dict`): `ENCODE`: the encoder's kwargs, as upstream's generate builds them.
        seats (`RequestSeats`), model_inputs (`dict`): `FORWARD`: the request's seats and the model call's kwargs.
        output: `DONE`: what `generate` returned.
        error (`BaseException`): `FAILED`: what it raised.
    """

    kind: CallKind
    encoder_kwargs: dict | None = None
    seats: Any = None
    model_inputs: dict | None = None
    output: Any = None
    error: BaseException | None = None


@dataclass
class RequestSpec:
    """One submitted request, as `Engine.submit` checked it."""

    inputs: dict
    generation_kwargs: dict
    num_seats: int
    seed: int
    stream: bool  # new tokens reach the handle step by step (a streamer); otherwise from the result, at the end
    handle: RequestHandle
    prompt_len: int = 0  # decoder prompt columns of the result, for the tokens pushed at the end

    def wire(self) -> dict:
        """What another rank needs to run the same request (everything but the handle), picklable."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "handle"}

    @classmethod
    def from_wire(cls, wire: dict, *, handle: RequestHandle) -> RequestSpec:
        return cls(**wire, handle=handle)


class _HandleStreamer(BaseStreamer):
    """Passes each step's new tokens to the handle; the first `put` (the prompt) is skipped."""

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.handle.push_tokens(value.detach().reshape(-1).cpu())

    def end(self) -> None:
        return None


class RequestWorker:
    """Runs one request's `generate` in its own thread, taking turns with the engine's scheduler.

    The scheduler calls `start()` once, then `resume(result)` with the answer to each call the worker made; both return
    the worker's next `PendingCall`.
    """

    def __init__(self, *, engine, spec: RequestSpec, seats: list[int]):
        self.engine = engine
        self.spec = spec
        self.handle = spec.handle
        self.seats = torch.tensor(seats, dtype=torch.long)
        self.session: RequestSeats | None = None
        self.pending: PendingCall | None = None
        self._turn = threading.Event()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._reply: tuple = (None, None)
        self._rng = _rng_state_for(spec.seed, engine.model_device)
        self._outer_rng = None
        # in a copy of the scheduler's context: torch's config is per thread (see `Engine.__init__`)
        self._thread = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._main,),
            name=f"flexcache-request-{spec.handle.request_id}",
            daemon=True,
        )

    # --- the scheduler's side ---------------------------------------------------------------------------------
    def start(self) -> PendingCall:
        self._thread.start()
        return self.resume()

    def resume(self, result=None, error: BaseException | None = None) -> PendingCall:
        """Give the worker its turn, with the answer to its last call; wait for its next call."""
        self._reply = (result, error)
        self._turn.set()
        self.pending = self._calls.get()
        return self.pending

    # --- the worker's side ------------------------------------------------------------------------------------
    def call(self, call: PendingCall):
        """Hand `call` to the scheduler and wait for the answer (raised when it is an error)."""
        self._hand_back(call)
        self._wait_turn()
        result, error = self._reply
        if error is not None:
            raise error
        return result

    def encode(self, encoder_kwargs: dict):
        """The request's encoder outputs, computed in the engine's next batched encoder call."""
        return self.call(PendingCall(CallKind.ENCODE, encoder_kwargs=encoder_kwargs))

    def forward(self, seats, model_inputs: dict):
        """The outputs of a model call on the request's `seats`, run in the engine's next batched step."""
        return self.call(PendingCall(CallKind.FORWARD, seats=seats, model_inputs=model_inputs))

    def _main(self) -> None:
        self._wait_turn()
        try:
            kwargs = dict(self.spec.generation_kwargs)
            if self.spec.stream:
                kwargs["streamer"] = _HandleStreamer(self.handle)
            with plugged(RequestSeatsHooks(self)):  # generate's cache, encoder and model calls go to the engine
                output = self.engine.model.generate(**self.spec.inputs, **kwargs)
        except BaseException as error:  # the request fails, the engine goes on
            self._hand_back(PendingCall(CallKind.FAILED, error=error))
        else:
            self._hand_back(PendingCall(CallKind.DONE, output=output))

    def _wait_turn(self) -> None:
        self._turn.wait()
        self._turn.clear()
        self._outer_rng = _get_rng(self.engine.model_device)
        _set_rng(self._rng, self.engine.model_device)

    def _hand_back(self, call: PendingCall) -> None:
        self._rng = _get_rng(self.engine.model_device)
        _set_rng(self._outer_rng, self.engine.model_device)
        self._calls.put(call)


def _rng_state_for(seed: int, device: torch.device) -> tuple:
    """The random state `torch.manual_seed(seed)` gives torch's CPU generator and, for an accelerator, the device's."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    if device.type == "cuda":
        return cpu, torch.Generator(device=device).manual_seed(seed).get_state()
    return cpu, None


def _get_rng(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
