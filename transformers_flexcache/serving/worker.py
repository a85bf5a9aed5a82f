"""One request's `generate` call, run in a thread of its own, whose model work the engine batches with the others'.

Design decisions:
- Each admitted request runs `model.generate(**inputs, **generation_kwargs)` itself, unchanged: upstream's own
  preparation (special tokens, logits processors, stopping criteria, beam bookkeeping, Whisper's prompts, fallbacks and
  post-processing) decides everything about the request, so the engine returns what `generate` returns for it alone.
  Three hooks hand the model's work to the engine instead of running it: the encoder call
  (`FlexCacheGenerationMixin._prepare_text_encoder_decoder_kwargs_for_generation`), the cache (`RequestSeats`, from
  `_prepare_cache_for_generation`) and the model call (`FlexModelMixin.__call__` given a `RequestSeats`).
- Workers take turns: the scheduler resumes one, and waits until it hands back its next model call (or ends), before
  resuming the next. So a request's Python work (logits processors, token choice, stopping) never runs beside
  another's, and the model runs in one thread, the scheduler's.
- Each request has its own random state: while its worker runs, torch's CPU generator (and the model device's) holds
  the request's state, set from its `seed` (`torch.manual_seed(seed)` then `generate` alone draws the same numbers),
  and the caller's state is put back when its turn ends. Sampling is thereby reproducible whatever runs beside it.
  (Another thread of yours that draws from torch's global generator during a worker's turn would interleave.)
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from .. import plan as calls
from ..cache.config import Overflow, overflow_message
from ..cache.seats import RequestSeats
from ..plan import rows_per_input
from .handle import RequestHandle


@dataclass
class EngineCall:
    """What a worker hands back to the scheduler: `"encode"` (encoder kwargs), `"forward"` (`(seats, model_inputs)`),
    `"done"` (generate's output) or `"failed"` (the error)."""

    kind: str
    payload: Any = None


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
    the worker's next `EngineCall`.
    """

    def __init__(self, *, engine, spec: RequestSpec, seats: list[int]):
        self.engine = engine
        self.spec = spec
        self.handle = spec.handle
        self.seats = torch.tensor(seats, dtype=torch.long)
        self.session: RequestSeats | None = None
        self.pending: EngineCall | None = None
        self._turn = threading.Event()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._reply: tuple = (None, None)
        self._rng = _rng_state_for(spec.seed, engine.model_device)
        self._outer_rng = None
        self._thread = threading.Thread(
            target=self._main, name=f"flexcache-request-{spec.handle.request_id}", daemon=True
        )

    # --- the scheduler's side ---------------------------------------------------------------------------------
    def start(self) -> EngineCall:
        self._thread.start()
        return self.resume()

    def resume(self, result=None, error: BaseException | None = None) -> EngineCall:
        """Give the worker its turn, with the answer to its last call; wait for its next call."""
        self._reply = (result, error)
        self._turn.set()
        self.pending = self._calls.get()
        return self.pending

    # --- the worker's side ------------------------------------------------------------------------------------
    def call(self, kind: str, payload):
        """Hand `payload` to the scheduler and wait for the answer (raised when it is an error)."""
        self._hand_back(EngineCall(kind, payload))
        self._wait_turn()
        result, error = self._reply
        if error is not None:
            raise error
        return result

    def encode(self, encoder_kwargs: dict):
        """The request's encoder outputs, computed in the engine's next batched encoder call."""
        return self.call("encode", encoder_kwargs)

    def open_session(self, generation_config, model_kwargs: dict, batch_size: int, max_cache_length: int):
        """The cache for one `generate` call of this request (Whisper makes one per segment and fallback): the
        request's seats, checked to hold what the call needs.

        Raises:
            ValueError: the call needs more rows than the request's seats, or more decoder or encoder positions than
                the engine's capacities (value, limit and the `cache_config` that fits).
        """
        need = {
            # Upstream's own numbers, as generate states them (`CallPlan.need_of`): rows of the call's batch, its
            # decoder positions (at least the `max_cache_len` option) and its encoder length.
            "max_batch_size": batch_size * rows_per_input(self.engine.model, generation_config),
            "max_cache_len": max(max_cache_length, generation_config.max_cache_len or 0),
        }
        if self.engine.is_encoder_decoder:
            need["max_encoder_len"] = model_kwargs["encoder_outputs"][0].shape[1]
        limits = {
            "max_batch_size": len(self.seats),
            "max_cache_len": self.engine.max_cache_len,
            "max_encoder_len": self.engine.max_encoder_len,
        }
        exceeded = [Overflow(name, value, limits[name]) for name, value in need.items() if value > limits[name]]
        if exceeded:
            raise ValueError(f"the serving engine cannot run this request: {overflow_message(exceeded)}")
        if self.session is not None:
            self.session.close()
        self.session = RequestSeats(
            run_forward=lambda seats, model_inputs: self.call("forward", (seats, model_inputs)),
            reorder_rows=self.engine.reorder_seats,
            owner=self,
            rows=self.seats[: need["max_batch_size"]],
            encoder_len=need.get("max_encoder_len"),
            layer_flags=self.engine.layer_flags,
        )
        return self.session

    def _main(self) -> None:
        self._wait_turn()
        token = calls.serve_request(self)
        try:
            kwargs = dict(self.spec.generation_kwargs)
            if self.spec.stream:
                kwargs["streamer"] = _HandleStreamer(self.handle)
            output = self.engine.model.generate(**self.spec.inputs, **kwargs)
        except BaseException as error:  # the request fails, the engine goes on
            self._hand_back(EngineCall("failed", error))
        else:
            self._hand_back(EngineCall("done", output))
        finally:
            calls.stop_serving(token)

    def _wait_turn(self) -> None:
        self._turn.wait()
        self._turn.clear()
        self._outer_rng = _get_rng(self.engine.model_device)
        _set_rng(self._rng, self.engine.model_device)

    def _hand_back(self, call: EngineCall) -> None:
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
