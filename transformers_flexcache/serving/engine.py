"""The in-flight engine: requests join and leave a running batch on one preallocated seat cache.

Design decisions:
- One seat cache of `max_batch_size` rows (`cache/seats.py`), allocated when the engine is built, and one scheduler
  thread. A request takes as many seats as `generate` would use rows for it alone (`num_beams` for beam search, or
  `num_return_sequences`; Whisper: both multiplied) and gives them back when it ends: nothing is copied when requests
  come and go, and nothing is allocated in steady state.
- Admission happens between two decode steps, first come first served: the oldest waiting request is admitted as
  soon as enough seats are free, and no later request overtakes it, so a large request is never starved by small
  ones. Seats are taken lowest first, so that the decode step's span of seats stays short.
- Each request runs its own `generate` (`worker.py`), so it returns exactly what `generate` returns for it alone; the
  engine only batches the model calls: encoders of the requests admitted together, their prefills, then one decode
  step for every running request (`steps.py`). Each row has its own positions and lengths in the seat cache.
- Under a `compile_config`, the decode step runs at a known set of shapes: the padded policy at the capacities, the
  bucketed one at the next bucket of the seats' span, of the longest running decoder length and of the longest
  encoder length (`CacheConfig.buckets_of`). `warmup()` compiles them all before serving; prefills and encoders run
  eagerly.
- What the engine is not: it knows nothing of HTTP, tokenization or text (the server does), and it does not grow: a
  request that can never fit is refused by `submit`, with the value, the limit and the `cache_config` that fits.

Shape legend: `B` the decode step's span of seats, `W` its decoder columns, `E_W` its encoder positions.
"""

from __future__ import annotations

import contextlib
import heapq
import inspect
import itertools
import os
import threading
import time
from collections import deque

import torch
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import ModelOutput

from ..cache import CacheConfig, layer_specs_for_model
from ..cache.config import Overflow, overflow_message
from ..cache.placement import KEY_PROJECTION_NAMES, attention_modules
from ..cache.seats import FlexibleSeatCache, FlexibleSeatEncoderDecoderCache
from ..compilation import compile_settings
from . import steps
from .handle import CapacityError, EngineClosedError, QueueFullError, RequestCancelledError, RequestHandle
from .worker import RequestSpec, RequestWorker

# Decoding methods the engine runs: those whose loop makes one model call per step for every row.
SERVED_MODES = (
    GenerationMode.GREEDY_SEARCH,
    GenerationMode.SAMPLE,
    GenerationMode.BEAM_SEARCH,
    GenerationMode.BEAM_SAMPLE,
)
# `generate` arguments the engine decides itself, or cannot honour for one request among others.
REFUSED_KWARGS = {
    "cache": "the engine owns the cache",
    "past_key_values": "the engine owns the cache",
    "cache_implementation": "the engine owns the cache",
    "cache_config": "capacities are the engine's (Engine(model, cache_config=...))",
    "compile_config": "compiling is the engine's (Engine(model, compile_config=...))",
    "streamer": "iterate the handle for the new tokens",
    "assistant_model": "assisted decoding is not served (its candidate steps are not one token per row)",
    "prompt_lookup_num_tokens": "prompt-lookup decoding is not served (its candidate steps are not one token per row)",
    "output_attentions": "attention weights of a batched step are not one request's",
    "output_hidden_states": "hidden states of a batched step are not one request's",
    "synced_gpus": "the engine steps on one process",
}
# Model inputs a request may pass; any other tensor is refused rather than dropped.
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "decoder_input_ids",
    "decoder_attention_mask",
    "input_features",
    "flattened_patches",
    "encoder_outputs",
)
ENGINE_CONFIG_KEYS = ("max_batch_size", "max_cache_len", "max_encoder_len", "shape_policy", "buckets")
_FIFO = itertools.count()


class Engine:
    """Serves independent `generate` requests on one preallocated cache, admitting them into a running batch.

    Args:
        model: an override model (`transformers_flexcache.convert(model)`, or loaded after `register()`), in eval
            mode, with `attn_implementation` `"sdpa"` or `"eager"`.
        cache_config (`dict`): `max_batch_size` (seats: rows of the cache), `max_cache_len` (decoder positions per
            seat: prompt plus new tokens), `max_encoder_len` (encoder-decoder models; Whisper defaults to its
            `max_source_positions`), and optionally `shape_policy` (`"exact"`, `"padded"`, `"bucketed"`) and
            `buckets`, as for `generate`.
        compile_config (`transformers.CompileConfig`, *optional*): compile the decode step
            (`transformers_flexcache.compile_config_for_cpu()` on CPU); needs a `"padded"` or `"bucketed"` policy.
        max_queue (`int`, *optional*, defaults to 64): requests that may wait for seats; `submit` raises
            `QueueFullError` beyond it.
        tokenizer (*optional*): passed to each request's `generate` (what `stop_strings` needs).

    Raises:
        ValueError: a capacity is missing or not a positive int, a `cache_config` key is not an engine's, the
            attention implementation or the model's layers are not supported, or `compile_config` comes without a
            fixed-shape policy.
        TypeError: `model` is not an override model.

    Example:

    ```python
    >>> engine = Engine(model, cache_config={"max_batch_size": 8, "max_cache_len": 64, "max_encoder_len": 128})
    >>> handle = engine.submit(input_ids=ids[:1], max_new_tokens=16)
    >>> tokens = handle.result(timeout=60)  # what model.generate(input_ids=ids[:1], max_new_tokens=16) returns
    >>> engine.close()
    ```
    """

    def __init__(self, model, *, cache_config: dict, compile_config=None, max_queue: int = 64, tokenizer=None):
        from ..modeling import FlexModelMixin  # modeling imports generation, which reads `serving.context`

        if not isinstance(model, FlexModelMixin):
            raise TypeError(
                f"Engine serves override models; {type(model).__name__} is upstream's: call "
                "transformers_flexcache.convert(model) first (or load it after transformers_flexcache.register())"
            )
        self.model = model
        self.config = _engine_config(model, cache_config)
        if compile_config is not None and self.config.shape_policy == "exact":
            raise ValueError(
                'compile_config needs fixed shapes: pass cache_config={"shape_policy": "bucketed", ...} (or "padded") '
                "with it; the exact policy would compile a new graph at every step"
            )
        self.compile_config = compile_config
        self.max_queue = int(max_queue)
        self.tokenizer = tokenizer
        self.is_encoder_decoder = bool(model.config.is_encoder_decoder)
        self.max_batch_size = self.config.max_batch_size
        self.max_cache_len = self.config.max_cache_len
        self.max_encoder_len = self.config.max_encoder_len if self.is_encoder_decoder else 0
        self._check_attention_implementation()
        self.cache = self._build_cache()
        self.model_device = self.cache.device
        own = self.cache.self_attention_cache if self.is_encoder_decoder else self.cache
        self.layer_flags = {"is_sliding": own.is_sliding, "is_linear": own.is_linear}
        self.has_linear_layers = any(own.is_linear)
        self.mask_kinds = self._mask_kinds(own)
        self.input_ids_key = "decoder_input_ids" if self.is_encoder_decoder else "input_ids"
        self.position_ids_key = self._position_ids_key()
        self.encoder_mask_key = getattr(model, "_flex_encoder_mask_key", "attention_mask")
        self.pad_token_id = _pad_token_id(model)
        self.output_type = steps.OUTPUT_TYPES[self.is_encoder_decoder]
        self.encoder_dummy = self._encoder_dummy() if self.is_encoder_decoder else None
        self.decode_forward = model.get_compiled_call(compile_config) if compile_config is not None else model
        self._mask_fill = torch.finfo(model.dtype).min if model.config._attn_implementation == "eager" else None

        self._lock = threading.Condition()
        self._queue: deque[RequestSpec] = deque()
        self._workers: list[RequestWorker] = []
        self._free_seats = list(range(self.max_batch_size))  # a heap: lowest seats first
        self._request_ids = itertools.count()
        self._closing = False
        self._drain = False
        self._closed = False
        self._model_lock = threading.RLock()  # the scheduler's model work, and warmup
        self.stats = {"submitted": 0, "finished": 0, "failed": 0, "cancelled": 0, "decode_steps": 0, "rows": 0}
        self._scheduler = threading.Thread(target=self._run, name="flexcache-engine", daemon=True)
        self._scheduler.start()

    # --- construction -----------------------------------------------------------------------------------------
    def _check_attention_implementation(self) -> None:
        implementation = self.model.config._attn_implementation
        if implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"the engine builds its decode masks for attn_implementation 'sdpa' or 'eager', not "
                f"{implementation!r}; load the model with attn_implementation='sdpa'"
            )

    def _build_cache(self):
        specs, cross_specs = layer_specs_for_model(self.model)
        if self.is_encoder_decoder:
            return FlexibleSeatEncoderDecoderCache(
                layer_specs=specs,
                cross_layer_specs=cross_specs,
                max_batch_size=self.max_batch_size,
                max_cache_len=self.max_cache_len,
                max_encoder_len=self.max_encoder_len,
            )
        return FlexibleSeatCache(
            layer_specs=specs, max_batch_size=self.max_batch_size, max_cache_len=self.max_cache_len
        )

    def _mask_kinds(self, own: FlexibleSeatCache) -> dict:
        """`{layer_type: sliding_window or None}` of the attention masks a decode step passes."""
        kinds = {}
        for spec in own.layer_specs:
            if spec.layer_type != "linear_attention":
                kinds[spec.layer_type] = spec.sliding_window
        if len(set(kinds.values())) > 1:
            source = inspect.getsource(type(self.model.base_model).forward)
            if "isinstance(causal_mask_mapping := attention_mask, dict)" not in source:
                raise ValueError(
                    f"{type(self.model).__name__} mixes full and sliding-window layers but its forward takes one "
                    "attention mask for all of them: the engine cannot give each kind its own; serve it with "
                    "generate"
                )
        elif len(kinds) == 1:
            kinds = {"attention": next(iter(kinds.values()))}
        return kinds

    def _position_ids_key(self) -> str | None:
        names = inspect.signature(self.model.forward).parameters
        key = "decoder_position_ids" if self.is_encoder_decoder else "position_ids"
        return key if key in names else None

    def _encoder_dummy(self) -> torch.Tensor:
        """`[1, 1, d]` zeros: the encoder states a decode step passes (only their batch size is read)."""
        _, cross = attention_modules(self.model)
        module = next(iter(cross.values()))
        projection = next(getattr(module, name) for name in KEY_PROJECTION_NAMES if hasattr(module, name))
        return torch.zeros(1, 1, projection.in_features, dtype=self.model.dtype, device=self.model_device)

    # --- what steps.py asks -----------------------------------------------------------------------------------
    def format_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """`[B, W]` bool -> the 4D mask `[B, 1, 1, W]` of the model's attention implementation."""
        mask = valid[:, None, None, :]
        if self._mask_fill is None:
            return mask
        return torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(~mask, self._mask_fill)

    def decode_shape(self, items: list) -> tuple[int, int, int | None]:
        """`(B, W, E_W)` of a decode step over `items` (`(seats, model_inputs)`), per the shape policy."""
        span = 1 + max(int(seats.rows.max()) for seats, _ in items)
        window = 1 + max(seats.length for seats, _ in items)
        encoder = max((seats.encoder_len or 1) for seats, _ in items) if self.is_encoder_decoder else None
        shape = (
            self._bucket("max_batch_size", span, self.max_batch_size),
            self._bucket("max_cache_len", window, self.max_cache_len),
            self._bucket("max_encoder_len", encoder, self.max_encoder_len) if encoder is not None else None,
        )
        return shape

    def _bucket(self, name: str, value: int, capacity: int) -> int:
        policy = self.config.shape_policy
        if policy == "padded":
            return capacity
        if policy == "bucketed":
            return min(self.config.bucket_for(name, value, capacity=capacity), capacity)
        return value

    def compile_settings(self):
        return compile_settings(self.compile_config) if self.compile_config is not None else contextlib.nullcontext()

    def note_admitted(self, seats) -> None:
        """A request's prefill ran: record when (the first one, for a request of several generate calls)."""
        handle = seats.worker.handle
        if handle.admitted_at is None:
            handle.admitted_at = time.perf_counter()
            handle.admitted_at_step = self.stats["decode_steps"]

    def reorder_seats(self, seats, beam_idx: torch.Tensor) -> None:
        """Beam search within one request: its row `i` takes what its row `beam_idx[i]` holds."""
        rows = seats.rows
        self.cache.copy_rows(rows, rows[beam_idx.to("cpu")], seats.length)

    # --- the public API ---------------------------------------------------------------------------------------
    @property
    def seats_in_use(self) -> int:
        with self._lock:
            return self.max_batch_size - len(self._free_seats)

    @property
    def num_queued(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._workers)

    @property
    def nbytes(self) -> int:
        """Bytes of the seat cache (allocated once, when the engine was built)."""
        return self.cache.nbytes

    def submit(self, *, seed: int | None = None, **kwargs) -> RequestHandle:
        """Queue one request: what `model.generate` takes for batch 1 (`input_ids`/`attention_mask`,
        `input_features` for Whisper, `flattened_patches` for Pix2Struct, ...) and its generation arguments.

        Args:
            seed (`int`, *optional*): the request's random seed: sampling then gives what `torch.manual_seed(seed)`
                followed by `generate` alone gives, whatever runs beside it. Without one, a random seed.

        Returns:
            `RequestHandle`: at once; `result()` waits for what `generate` returns for this request alone.

        Raises:
            ValueError: not one request (batch 1), or an argument the engine cannot serve. Nothing is queued.
            CapacityError: a `ValueError` for a request that can never fit (the value, the limit and the
                `cache_config` that fits; `needed` and `limits` by capacity). Nothing is queued.
            QueueFullError: `max_queue` requests are already waiting.
            EngineClosedError: the engine is closed (or closing).
        """
        spec = self._checked_request(seed, kwargs)
        with self._lock:
            if self._closing:
                raise EngineClosedError("the engine is closed: it takes no new requests")
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._queue)} requests are already waiting for seats (max_queue={self.max_queue}); retry "
                    "later, or build the engine with a larger max_queue or max_batch_size",
                    retry_after=1.0,
                )
            spec.handle.request_id = next(self._request_ids)
            self._queue.append(spec)
            self.stats["submitted"] += 1
            self._lock.notify_all()
        return spec.handle

    def warmup(self) -> int:
        """Compile the decode step at every shape the policy can give, before serving; returns how many.

        Raises:
            ValueError: no `compile_config`, or more shapes than dynamo keeps graphs of one function.
            RuntimeError: requests are running (warm up before serving).
        """
        if self.compile_config is None:
            raise ValueError("warmup() compiles the decode step: build the engine with a compile_config")
        shapes = self.decode_shapes()
        limit = torch._dynamo.config.recompile_limit
        if len(shapes) > limit:
            raise ValueError(
                f"{len(shapes)} decode shapes exceed torch._dynamo.config.recompile_limit={limit}: set it to "
                f"{len(shapes)} (or more) first, or list fewer sizes in cache_config['buckets']"
            )
        with self._model_lock, torch.no_grad():
            if self.num_running:
                raise RuntimeError("warmup() runs before serving: requests are running")
            for span, window, cross_window in shapes:
                self._dummy_step(span, window, cross_window)
        return len(shapes)

    def decode_shapes(self) -> list[tuple]:
        """Every `(B, W, E_W)` a decode step can run at under the shape policy (E_W None without an encoder)."""
        if self.config.shape_policy == "exact":
            raise ValueError("the exact policy has no fixed set of decode shapes")

        def sizes(name: str, capacity: int) -> tuple[int, ...]:
            if self.config.shape_policy == "padded":
                return (capacity,)
            return self.config.buckets_of(name, capacity)

        encoders = sizes("max_encoder_len", self.max_encoder_len) if self.is_encoder_decoder else (None,)
        return list(
            itertools.product(
                sizes("max_batch_size", self.max_batch_size), sizes("max_cache_len", self.max_cache_len), encoders
            )
        )

    def _dummy_step(self, span: int, window: int, cross_window: int | None) -> None:
        # Every seat is free here: each attends to its column 0 and writes there; nothing of a request is touched.
        cache = self.cache
        if self.is_encoder_decoder:
            cache.begin_decode(span=span, window=window, cross_window=cross_window)
        else:
            cache.begin_decode(span=span, window=window)
        try:
            cache.mark_written(span)
            empty = torch.zeros(0, dtype=torch.long, device=cache.device)
            kwargs = steps.decode_inputs(
                self,
                span=span,
                window=window,
                cross_window=cross_window,
                rows=empty,
                tokens=empty,
                positions=empty if self.position_ids_key is not None else None,
            )
            with self.compile_settings():
                self.decode_forward(**kwargs)
        finally:
            cache.end_step()

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the engine and free its storage.

        Args:
            drain (`bool`, *optional*, defaults to `False`): finish the running and queued requests first (no new
                ones are taken); otherwise they fail with `EngineClosedError`.
            timeout (`float`, *optional*): the most seconds to wait for the scheduler.

        Raises:
            TimeoutError: the scheduler did not stop within `timeout` (the engine stays closing).
        """
        with self._lock:
            self._closing = True
            self._drain = self._drain or drain
            if not drain:
                while self._queue:
                    self._queue.popleft().handle.finish(error=EngineClosedError("the engine was closed"))
            self._lock.notify_all()
        self._scheduler.join(timeout)
        if self._scheduler.is_alive():
            raise TimeoutError(f"the engine's scheduler did not stop within {timeout} s")
        if not self._closed:
            self._closed = True
            self.cache.release()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(drain=exc_type is None)

    # --- submit's checks --------------------------------------------------------------------------------------
    def _checked_request(self, seed: int | None, kwargs: dict) -> RequestSpec:
        for name, reason in REFUSED_KWARGS.items():
            if kwargs.get(name) not in (None, False):
                raise ValueError(f"Engine.submit does not take {name}: {reason}")
        if kwargs.get("use_cache") is False:
            raise ValueError("Engine.submit does not take use_cache=False: the engine serves from its cache")
        for name, value in kwargs.items():
            if isinstance(value, (torch.Tensor, ModelOutput)) and name not in MODEL_INPUTS:
                raise ValueError(
                    f"Engine.submit does not take the model input {name!r}: the engine's batched steps would drop it; "
                    f"it takes {list(MODEL_INPUTS)}"
                )
            batch = _batch_of(value)
            if batch is not None and batch != 1:
                raise ValueError(
                    f"Engine.submit takes one request: {name} has batch {batch}; submit each row on its own (the "
                    "engine batches requests itself)"
                )
        generation_kwargs = {k: v for k, v in kwargs.items() if k not in MODEL_INPUTS}
        generation_config, _ = self.model._prepare_generation_config(
            generation_kwargs.pop("generation_config", None), **dict(generation_kwargs)
        )
        mode = generation_config.get_generation_mode()
        if mode not in SERVED_MODES:
            raise ValueError(
                f"Engine.submit serves greedy search, sampling and beam search (with sampling), not {mode.value}"
            )
        num_beams, num_sequences = generation_config.num_beams or 1, generation_config.num_return_sequences or 1
        # As many rows as generate uses for it alone; Whisper's generate repeats the input per returned sequence first.
        num_seats = num_beams * num_sequences if _is_whisper_like(self.model) else max(num_beams, num_sequences)
        inputs = {name: kwargs[name] for name in MODEL_INPUTS if name in kwargs}
        self._check_fits(generation_config, inputs, num_seats)
        forwarded = {k: v for k, v in kwargs.items() if k not in inputs}
        forwarded["use_cache"] = True
        if self.tokenizer is not None and generation_config.stop_strings and "tokenizer" not in forwarded:
            forwarded["tokenizer"] = self.tokenizer
        stream = generation_config.num_beams == 1 and not _is_whisper_like(self.model)
        handle = RequestHandle(request_id=-1, num_seats=num_seats, on_cancel=self._cancel)
        return RequestSpec(
            inputs=inputs,
            generation_kwargs=forwarded,
            num_seats=num_seats,
            seed=seed if seed is not None else int.from_bytes(os.urandom(7), "little"),
            stream=stream,
            handle=handle,
            prompt_len=self._prompt_len(inputs),
        )

    def _prompt_len(self, inputs: dict) -> int:
        """Columns of `generate`'s result that come before the new tokens (known ahead for most models)."""
        if self.is_encoder_decoder:
            decoder_ids = inputs.get("decoder_input_ids")
            return decoder_ids.shape[1] if decoder_ids is not None else 1
        return inputs["input_ids"].shape[1] if "input_ids" in inputs else 0

    def _check_fits(self, generation_config, inputs: dict, num_seats: int) -> None:
        prompt_len = self._prompt_len(inputs)
        if generation_config.max_new_tokens is not None:
            positions = prompt_len + generation_config.max_new_tokens - 1
        else:
            positions = generation_config.max_length - 1
        need = {"max_batch_size": num_seats, "max_cache_len": positions}
        encoder_len = self._encoder_len(inputs)
        if encoder_len is not None:
            need["max_encoder_len"] = encoder_len
        limits = {"max_batch_size": self.max_batch_size, "max_cache_len": self.max_cache_len}
        limits["max_encoder_len"] = self.max_encoder_len
        exceeded = [Overflow(name, value, limits[name]) for name, value in need.items() if value > limits[name]]
        if exceeded:
            raise CapacityError(
                f"this request can never fit the engine: {overflow_message(exceeded)}",
                needed={overflow.name: overflow.value for overflow in exceeded},
                limits={overflow.name: overflow.limit for overflow in exceeded},
            )

    def _encoder_len(self, inputs: dict) -> int | None:
        if not self.is_encoder_decoder:
            return None
        if inputs.get("encoder_outputs") is not None:
            return inputs["encoder_outputs"][0].shape[1]
        if "input_features" in inputs:
            return getattr(self.model.config, "max_source_positions", None)
        for name in ("input_ids", "flattened_patches"):
            if name in inputs:
                return inputs[name].shape[1]
        return None

    # --- the scheduler ----------------------------------------------------------------------------------------
    def _cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            for spec in self._queue:
                if spec.handle is handle:
                    self._queue.remove(spec)
                    self.stats["cancelled"] += 1
                    handle.finish(error=RequestCancelledError(f"request {handle.request_id} was cancelled"))
                    break
            self._lock.notify_all()

    def _has_work(self) -> bool:
        admissible = bool(self._queue) and self._queue[0].num_seats <= len(self._free_seats)
        return bool(self._workers) or admissible or self._closing

    def _run(self) -> None:
        try:
            with torch.no_grad():
                while True:
                    with self._lock:
                        while not self._has_work():
                            self._lock.wait()
                        if self._closing and not self._workers and (not self._drain or not self._queue):
                            return
                        admitted = self._take_admissible()
                    with self._model_lock:
                        for spec, seats in admitted:
                            self._start(spec, seats)
                        self._advance()
        except BaseException as error:  # a bug of the engine: fail everything rather than hang
            self._fail_everything(error)
            raise

    def _take_admissible(self) -> list[tuple]:
        admitted = []
        while (
            self._queue
            and self._queue[0].num_seats <= len(self._free_seats)
            and not (self._closing and not self._drain)
        ):
            spec = self._queue.popleft()
            seats = sorted(heapq.heappop(self._free_seats) for _ in range(spec.num_seats))
            admitted.append((spec, seats))
        return admitted

    def _start(self, spec: RequestSpec, seats: list[int]) -> None:
        worker = RequestWorker(engine=self, spec=spec, seats=seats)
        self._workers.append(worker)
        worker.start()
        self._settle(worker)

    def _advance(self) -> None:
        """Run every worker's pending model calls: encoders, then prefills (until none is left), then one decode
        step for every running request."""
        while True:
            encoding = self._pending("encode")
            if encoding:
                self._answer(encoding, steps.run_encoders(self, encoding))
                continue
            prefilling = [worker for worker in self._pending("forward") if worker.pending.payload[0].length == 0]
            if prefilling:
                self._answer(prefilling, steps.run_prefills(self, prefilling))
                continue
            break
        decoding = self._pending("forward")
        if decoding:
            self._check_room(decoding)
            decoding = self._pending("forward")
            if decoding:
                self.stats["decode_steps"] += 1
                self.stats["rows"] += sum(len(worker.pending.payload[0].rows) for worker in decoding)
                self._answer(decoding, steps.run_decode(self, decoding))

    def _pending(self, kind: str) -> list[RequestWorker]:
        found = []
        for worker in list(self._workers):
            if worker.pending is not None and worker.pending.kind == kind:
                if self._stopping(worker):
                    self._resume(worker, error=self._stop_error(worker))
                    continue
                found.append(worker)
        return [worker for worker in found if worker.pending is not None and worker.pending.kind == kind]

    def _check_room(self, workers: list[RequestWorker]) -> None:
        for worker in workers:
            seats = worker.pending.payload[0]
            if seats.length >= self.max_cache_len:
                message = overflow_message([Overflow("max_cache_len", seats.length + 1, self.max_cache_len)])
                self._resume(worker, error=ValueError(f"the request outgrew the engine: {message}"))

    def _stopping(self, worker: RequestWorker) -> bool:
        return worker.handle.cancel_requested or (self._closing and not self._drain)

    def _stop_error(self, worker: RequestWorker) -> BaseException:
        if worker.handle.cancel_requested:
            return RequestCancelledError(f"request {worker.handle.request_id} was cancelled")
        return EngineClosedError("the engine was closed while the request ran")

    def _answer(self, workers: list[RequestWorker], outcomes: list[tuple]) -> None:
        for worker, (result, error) in zip(workers, outcomes, strict=True):
            self._resume(worker, result=result, error=error)

    def _resume(self, worker: RequestWorker, *, result=None, error: BaseException | None = None) -> None:
        if error is None and self._stopping(worker):
            error = self._stop_error(worker)
        worker.resume(result, error)
        self._settle(worker)

    def _settle(self, worker: RequestWorker) -> None:
        """If `worker` ended, give its seats back, then its result to its handle (so that a caller who sees the result
        sees the seats free)."""
        call = worker.pending
        if call.kind not in ("done", "failed"):
            return
        if worker.session is not None:
            worker.session.close()
        self.cache.free(worker.seats)
        with self._lock:
            self._workers.remove(worker)
            for seat in worker.seats.tolist():
                heapq.heappush(self._free_seats, seat)
            self._lock.notify_all()
        handle = worker.handle
        if call.kind == "done":
            result = _without_cache(call.payload)
            if not worker.spec.stream:
                _push_result_tokens(handle, result, worker.spec.prompt_len)
            self.stats["finished"] += 1
            handle.finish(result=result)
        else:
            self.stats["cancelled" if isinstance(call.payload, RequestCancelledError) else "failed"] += 1
            handle.finish(error=call.payload)

    def _fail_everything(self, error: BaseException) -> None:
        with self._lock:
            self._closing = True
            failure = RuntimeError(f"the serving engine stopped on an internal error: {error!r}")
            for spec in self._queue:
                spec.handle.finish(error=failure)
            self._queue.clear()
            for worker in self._workers:
                worker.handle.finish(error=failure)


def _engine_config(model, cache_config) -> CacheConfig:
    if not isinstance(cache_config, dict):
        raise TypeError("cache_config must be a dict such as {'max_batch_size': 8, 'max_cache_len': 64}")
    unknown = sorted(set(cache_config) - set(ENGINE_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"cache_config keys {unknown} do not apply to the serving engine; it takes {list(ENGINE_CONFIG_KEYS)}"
        )
    cache_config = dict(cache_config)
    if model.config.is_encoder_decoder and "max_encoder_len" not in cache_config:
        default = getattr(model.config, "max_source_positions", None)  # Whisper: its fixed encoder length
        if default is not None:
            cache_config["max_encoder_len"] = default
    config = CacheConfig.parse(cache_config)
    needed = ["max_batch_size", "max_cache_len"] + (["max_encoder_len"] if model.config.is_encoder_decoder else [])
    missing = [name for name in needed if getattr(config, name) is None]
    if missing:
        raise ValueError(
            f"the engine allocates its seats up front: cache_config needs {missing} (e.g. "
            '{"max_batch_size": 8, "max_cache_len": 128, "max_encoder_len": 128})'
        )
    return config


def _pad_token_id(model) -> int:
    for config in (model.generation_config, model.config):
        value = getattr(config, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0


def _is_whisper_like(model) -> bool:
    from ..generation import FlexCacheInnerGenerateMixin

    return isinstance(model, FlexCacheInnerGenerateMixin)


def _batch_of(value) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() > 0 else None
    if isinstance(value, ModelOutput):
        return _batch_of(value[0])
    return None


def _without_cache(output):
    """`generate`'s output without the request's cache (its seats serve others now)."""
    if isinstance(output, ModelOutput) and output.get("cache") is not None:
        output["cache"] = None
    return output


def _push_result_tokens(handle: RequestHandle, output, prompt_len: int) -> None:
    sequences = output if isinstance(output, torch.Tensor) else output["sequences"]
    for column in range(prompt_len, sequences.shape[1]):
        handle.push_tokens(sequences[:, column].cpu())
