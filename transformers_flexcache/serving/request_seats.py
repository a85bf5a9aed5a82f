"""The serving engine's answers to generate's plug-in seam (`generate.hooks`): one request's cache and model work.

A request's `generate` runs in a worker thread of its own (`worker.py`), unchanged: upstream's preparation decides
everything about it. While it runs, its worker plugs `RequestSeatsHooks` in (`generate.hooks.plugged`), and
generate asks them instead of planning a flexible call of its own:
- `plans_calls`: no plan and no lease of the model's pool: upstream's generate runs as it is;
- `take_cache`: the request's seats of the engine's cache (`RequestSeats`), checked to hold what the call needs;
- `encodes` / `encode`: the encoder runs in the engine's next batched encoder call, with the other requests admitted
  at that step;
- the model calls given its `RequestSeats` (a `generate.hooks.ForwardingCache`) run in the engine's next batched step.
"""

from __future__ import annotations

import torch

from ..cache.capacity import exceeding
from ..cache.config import overflow_message
from ..generate.hooks import ForwardingCache, GenerateHooks
from ..generate.plan import rows_per_input


class RequestSeatsHooks(GenerateHooks):
    """The hooks one request's `generate` asks while it runs in the engine (module docstring).

    Args:
        worker: the request's `worker.RequestWorker`.
    """

    def __init__(self, worker):
        self.worker = worker

    def plans_calls(self, model) -> bool:
        return False

    def encodes(self, model) -> bool:
        return True

    def encode(self, model, encoder_kwargs: dict):
        return self.worker.encode(encoder_kwargs)

    def take_cache(self, model, generation_config, model_kwargs: dict, batch_size: int, max_cache_length: int):
        """The cache for one `generate` call of this request (Whisper makes one per segment and fallback): the
        request's seats, checked to hold what the call needs.

        Raises:
            ValueError: the call needs more rows than the request's seats, or more decoder or encoder positions than
                the engine's capacities (value, limit and the `cache_config` that fits).
        """
        worker, engine = self.worker, self.worker.engine
        need = {
            # Upstream's own numbers, as generate states them (`CallPlan.need_of`): rows of the call's batch, its
            # decoder positions (at least the `max_cache_len` option) and its encoder length.
            "max_batch_size": batch_size * rows_per_input(engine.model, generation_config),
            "max_cache_len": max(max_cache_length, generation_config.max_cache_len or 0),
        }
        if engine.is_encoder_decoder:
            need["max_encoder_len"] = model_kwargs["encoder_outputs"][0].shape[1]
        limits = {
            "max_batch_size": len(worker.seats),
            "max_cache_len": engine.max_cache_len,
            "max_encoder_len": engine.max_encoder_len,
        }
        exceeded = exceeding(need, limits)
        if exceeded:
            raise ValueError(f"the serving engine cannot run this request: {overflow_message(exceeded)}")
        if worker.session is not None:
            worker.session.close()
        worker.session = RequestSeats(
            run_forward=worker.forward,
            reorder_rows=engine.reorder_seats,
            owner=worker,
            rows=worker.seats[: need["max_batch_size"]],
            encoder_len=need.get("max_encoder_len"),
            layer_flags=engine.layer_flags,
        )
        return worker.session


class RequestSeats(ForwardingCache):
    """The cache that one request's `generate` call sees in the serving engine: its seats of the engine's seat cache.

    It holds no tensors. The model call given it (`FlexModelMixin.__call__`, for every `ForwardingCache`) goes to
    `run_forward`, which the engine
    answers from a batched step; `get_seq_length` counts what this request has written, and `reorder_cache` reorders
    beams within the request's own seats (`reorder_rows`).

    Args:
        run_forward (`Callable[[RequestSeats, dict], ModelOutput]`): runs the model call's kwargs for this request.
        reorder_rows (`Callable[[RequestSeats, torch.Tensor], None]`): beam reordering within its seats.
        rows (`torch.Tensor`): `[R]` the seats of the request's rows, in order.
        encoder_len (`int`, *optional*): its encoder length (encoder-decoder models).
        layer_flags (`dict`): `is_sliding` and `is_linear` of the engine's layers, as upstream's `Cache` reports them.
        owner (*optional*): who runs it (the engine's `RequestWorker`).
    """

    def __init__(
        self, *, run_forward, reorder_rows, rows: torch.Tensor, encoder_len: int | None, layer_flags: dict, owner=None
    ):
        super().__init__(layers=[])
        self.owner = owner
        self._run_forward, self._reorder_rows = run_forward, reorder_rows
        self.rows = rows  # [R] seats, in the order of the request's rows
        self.last_seat = int(rows.max())  # the span a decode step needs for it, read at every step
        self.encoder_len = encoder_len
        self.length = 0  # decoder columns written by this generate call
        self.admitted = False  # its prefill ran (or it joined the decode step): its model calls are decode steps
        self._flags = layer_flags
        self._closed = False

    @property
    def is_compileable(self) -> bool:
        return False  # the request's own generate never compiles: the engine's step does

    @property
    def is_sliding(self) -> list[bool]:
        return self._flags["is_sliding"]

    @property
    def is_linear(self) -> list[bool]:
        return self._flags["is_linear"]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self._flags["is_linear"])

    def __len__(self) -> int:
        return len(self._flags["is_linear"])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._check_open()
        return self.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` of the request takes what its row `beam_idx[i]` holds (within its own seats)."""
        self._check_open()
        self._reorder_rows(self, beam_idx)

    def forward(self, model_inputs: dict):
        """Run `model(**model_inputs)` for this request in the engine's next batched step; returns its outputs."""
        self._check_open()
        return self._run_forward(self, model_inputs)

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(
                "this cache belonged to a request of a serving engine that has finished: its seats serve other "
                "requests now, so it cannot be read or continued"
            )

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an engine request's cache cannot be cropped (assisted decoding is not served)")
