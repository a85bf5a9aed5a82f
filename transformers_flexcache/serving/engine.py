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
  step for every running request (`steps.StepRunner`, which holds the facts of the model that those need). Each row has its own positions and lengths in the seat cache.
- Under a `compile_config`, the decode step runs at a known set of shapes: the padded policy at the capacities, the
  bucketed one at the next bucket of the seats' span, of the longest running decoder length and of the longest
  encoder length (`CacheConfig.buckets_of`). `warmup()` compiles them all before serving, and the token encoder
  (dynamic shapes, `compile/encoder.py`) where the `compile_config` compiles it; prefills run eagerly.
  `save_artifact()` writes those graphs to a folder that `warmup(artifact=...)` loads in another process without
  tracing (`compile/artifact.py`, `compile/encoder_artifact.py`).
- What the engine is not: it knows nothing of HTTP, tokenization or text (the server does), and it does not grow: a
  request that can never fit is refused by `submit`, with the value, the limit and the `cache_config` that fits.

Shape legend: `B` the decode step's span of seats, `W` its decoder columns, `E_W` its encoder positions.
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import itertools
import threading
import time
from collections import deque

import torch
from transformers.modeling_outputs import ModelOutput

from ..cache import layer_specs_for_model, tensor_slots
from ..cache.capacity import exceeding
from ..cache.config import overflow_message
from ..cache.seats import FlexibleSeatCache, FlexibleSeatEncoderDecoderCache
from ..compile import (
    RECOMPILE_LIMIT_NAME,
    ArtifactRefused,
    artifact_facts,
    check_compiled_int8,
    compile_cache,
    encoder_warmup_calls,
    explained_recompile_limit,
    load_artifact,
    model_facts,
    prepare_linear_kernels,
    recompile_limit,
    write_artifact,
)
from ..generate.policies import POLICIES
from ..log import get_logger
from .exported_step import ExportedStep, slot_names, step_input_names
from .handle import EngineClosedError, QueueFullError, RequestCancelledError, RequestHandle
from .lockstep import HEARTBEAT_S, StepPlan, share, tensor_parallel_rank
from .requests import check_request, engine_config
from .steps import StepRunner
from .worker import CallKind, RequestSpec, RequestWorker

logger = get_logger(__name__)


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
        from ..models.modeling import FlexModelMixin  # loaded on first use, as the package loads model code

        if not isinstance(model, FlexModelMixin):
            raise TypeError(
                f"Engine serves override models; {type(model).__name__} is upstream's: call "
                "transformers_flexcache.convert(model) first (or load it after transformers_flexcache.register())"
            )
        self.model = model
        self.config = engine_config(model, cache_config)
        if compile_config is not None and not POLICIES[self.config.shape_policy].fixed_shapes:
            raise ValueError(
                'compile_config needs fixed shapes: pass cache_config={"shape_policy": "bucketed", ...} (or "padded") '
                "with it; the exact policy would compile a new graph at every step"
            )
        if compile_config is not None:
            check_compiled_int8(model)
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
        # The batched model work, and the facts of the model it needs.
        self.steps = StepRunner(
            model=model,
            cache=self.cache,
            config=self.config,
            compile_config=compile_config,
            on_admitted=self._admitted,
        )
        self.warm_start = None  # what warmup(cache_dir=...) found in the compile cache (`compile.caching.WarmStart`)
        self.artifact = None  # the compiled artifact warmup(artifact=...) loaded (`compile.artifact.LoadedArtifact`)
        self.artifact_refused: str | None = None  # why warmup(artifact=...) compiled instead

        self._lock = threading.Condition()
        self._queue: deque[RequestSpec] = deque()
        self._workers: list[RequestWorker] = []
        self._free_seats = list(range(self.max_batch_size))  # a heap: lowest seats first
        self._request_ids = itertools.count()
        self._closing = False
        self._drain = False
        self._closed = False
        self._model_lock = threading.RLock()  # the scheduler's model work, and warmup
        self._stops: dict[int, str] = {}  # the running requests that stop at this step (see `_plan`)
        self._rank = tensor_parallel_rank(model)
        self.is_leader = self._rank in (None, 0)
        self.stats = {
            "submitted": 0,
            "finished": 0,
            "failed": 0,
            "cancelled": 0,
            "decode_steps": 0,
            "rows": 0,  # rows decoded, summed over decode steps
            "joined": 0,  # encoder-decoder requests whose first token was decoded in a decode step (no prefill)
        }
        # torch's config (dynamo's recompile limits, inductor's options) is per thread (a ContextVar): the scheduler
        # runs in a copy of the constructing thread's context, so that what its caller set applies to its compiles
        self._scheduler = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run,), name="flexcache-engine", daemon=True
        )
        self._scheduler.start()

    @staticmethod
    def nbytes_for(model, cache_config: dict) -> int:
        """Bytes an engine for `model` with these capacities allocates for its seats, without allocating them (each
        layer sized as `layer_specs_for_model` places it: heads of this tensor-parallel rank, the layer's dtype)."""
        config = engine_config(model, cache_config)
        specs, cross_specs = layer_specs_for_model(model)
        if model.config.is_encoder_decoder:
            return FlexibleSeatEncoderDecoderCache.nbytes_for(
                layer_specs=specs,
                cross_layer_specs=cross_specs,
                max_batch_size=config.max_batch_size,
                max_cache_len=config.max_cache_len,
                max_encoder_len=config.max_encoder_len,
            )
        return FlexibleSeatCache.nbytes_for(
            layer_specs=specs, max_batch_size=config.max_batch_size, max_cache_len=config.max_cache_len
        )

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

    # --- what the steps and the requests ask ------------------------------------------------------------------
    def _admitted(self, seats) -> None:
        """A request's prefill ran: record when (the first one, for a request of several generate calls)."""
        handle = seats.owner.handle
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
        if not self.is_leader:
            raise RuntimeError(
                f"this is rank {self._rank} of a tensor-parallel model: requests go to rank 0's engine, and this one "
                "follows it (call engine.follow())"
            )
        spec = check_request(self, seed, kwargs, on_cancel=self._cancel)
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

    def warmup(self, *, cache_dir=None, artifact=None, progress=None) -> int:
        """Compile the decode step at every shape the policy can give, before serving; returns how many.

        Args:
            artifact (`str | os.PathLike`, *optional*): a compiled artifact folder (`save_artifact`,
                `transformers-flexcache compile`): nothing is compiled. Its key and the compiled encoder side (the
                token encoder, an int8 model's cross-attention projections, where the engine compiles them;
                `encoder_graph_calls` counts their calls) are checked and loaded now; its decode graphs while the
                engine is idle or at their first use, whichever comes first, and one whose file is found damaged then
                is a warning and a compile of its shape. A folder compiled for another key (torch, CPU, weights,
                shapes...), missing, or whose encoder side is damaged is not used: a warning says why
                (`artifact_refused`), and the graphs are compiled as without it (with `cache_dir` where given).
            cache_dir (`str | os.PathLike`, *optional*): a compile cache folder (`compile/caching.py`): the graphs
                that an earlier process compiled for this model, shapes, settings, versions and CPU are loaded
                instead of compiled, and this warm-up's are written back. `warm_start` says what it found.
            progress (`Callable[[int, int], None]`, *optional*): called with (graphs done, graphs in all) before the
                first graph and after each (the decode shapes, then the compiled encoder's).

        Raises:
            ValueError: no `compile_config`, or more shapes than dynamo keeps graphs of one function.
            RuntimeError: requests are running (warm up before serving).
        """
        if self.compile_config is None:
            raise ValueError("warmup() compiles the decode step: build the engine with a compile_config")
        shapes = self.decode_shapes()
        if artifact is not None and self._load_artifact(artifact, progress):
            return len(shapes)
        limit = recompile_limit()
        if len(shapes) > limit:
            raise ValueError(
                f"{len(shapes)} decode shapes exceed {RECOMPILE_LIMIT_NAME}={limit}: set it to "
                f"{len(shapes)} (or more) first, or list fewer sizes in cache_config['buckets']"
            )
        # this CPU's fp32 linear kernels measured at every decode graph's rows before any compiles
        # (`compile.kernel_choice`; a no-op where the compile config does not read them)
        prepare_linear_kernels(self.model, self.compile_config, [rows for rows, _, _ in shapes])
        # the compiled encoder's graphs: a single row (a graph of its own where the encoder does not pack; an int8
        # model's projections share one), several rows, and an int8 model's library kernels for many
        # (`compile.encoder.encoder_graph`)
        encoder_calls = encoder_warmup_calls(
            self.model, self.compile_config, self.max_batch_size, self.max_encoder_len
        )
        total = len(shapes) + len(encoder_calls)
        cache = (
            contextlib.nullcontext() if cache_dir is None else self._compile_cache(cache_dir, shapes, encoder_calls)
        )
        with self._model_lock, torch.no_grad():
            if self.num_running:
                raise RuntimeError("warmup() runs before serving: requests are running")
            with explained_recompile_limit(len(shapes)), cache as self.warm_start:
                if progress is not None:
                    progress(0, total)
                for done, (span, window, cross_window) in enumerate(shapes, start=1):
                    self.steps.run_dummy_decode(span, window, cross_window)
                    if progress is not None:
                        progress(done, total)
                for done, (rows, positions) in enumerate(encoder_calls, start=len(shapes) + 1):
                    self.steps.run_dummy_encoder(rows, positions)
                    if progress is not None:
                        progress(done, total)
        return len(shapes)

    def save_artifact(self, directory, *, progress=None) -> dict:
        """Compile the decode step at every shape of the policy, and the compiled encoder side (`compile_config`'s
        token encoder and an int8 model's projections, dynamic shapes: `compile/encoder_artifact.py`), into a compiled
        artifact folder `directory` (replaced when it is one; `compile/artifact.py`), which `warmup(artifact=directory)`
        loads in a later process without tracing; returns its manifest.

        Args:
            progress (`Callable[[int, int], None]`, *optional*): called with (graphs done, graphs in all).

        Raises:
            ValueError: no `compile_config`; a model whose layers take masks of several kinds; a compiled encoder
                that `torch.export` refuses (a float16 BART or Marian: build the engine with
                `compile_config_for_cpu(encoder=False)`); `directory` exists and is not an artifact.
            RuntimeError: requests are running.
        """
        if self.compile_config is None:
            raise ValueError("save_artifact() compiles the decode step: build the engine with a compile_config")
        shapes = self.decode_shapes()
        # the linear kernels `warmup()` measures first (`compile.kernel_choice`): the graphs are those `serve --compile`
        # compiles, and the key's compile settings (which name the measured table) those a later warm-up sees
        prepare_linear_kernels(self.model, self.compile_config, [rows for rows, _, _ in shapes])
        with self._model_lock, torch.no_grad():
            if self.num_running:
                raise RuntimeError("save_artifact() runs before serving: requests are running")
            # the compiled encoder side first (dynamic shapes): a module that torch.export refuses fails before any
            # decode graph compiles
            graphs, names = dict(self.steps.encoder_artifact_graphs()), None
            for shape in shapes:
                with self.steps.dummy_decode(shape) as kwargs:
                    names = step_input_names(self.steps, kwargs)
                    module = ExportedStep(self.steps, shape, names)
                    graphs[shape] = (module, [*(kwargs[name] for name in names), *module.cache_tensors()])
            facts = self._artifact_facts(names)
            return write_artifact(directory, facts, graphs, self.compile_config, progress=progress)

    @property
    def encoder_graph_calls(self) -> dict:
        """The calls each encoder-side graph of the loaded artifact has run, `{name: Counter({(rows, positions):
        calls})}` (`{}` without one)."""
        side = self.steps.loaded_encoder_side
        return side.calls if side is not None else {}

    def _step_input_names(self) -> list[str]:
        with self._model_lock, self.steps.dummy_decode(self.decode_shapes()[0]) as kwargs:
            return step_input_names(self.steps, kwargs)

    def _artifact_facts(self, names: list[str]) -> dict:
        caller = {
            "graph": "serving engine decode step",
            "inputs": names,
            "cache": slot_names(self.cache),
            "cache_config": self.config.to_dict(),
            "encoder": self.steps.encoder_graph_names(),
        }
        return artifact_facts(self.model, self.compile_config, shapes=self.decode_shapes(), caller=caller)

    def _load_artifact(self, directory, progress=None) -> bool:
        """Load the artifact `directory` into the decode step; False (with a warning that says why) where it is
        not used."""
        try:
            names = self._step_input_names()
            loaded = load_artifact(directory, self._artifact_facts(names), lazy=True)
            decode_shapes = set(self.decode_shapes())
            for shape, graph in loaded.graphs.items():
                if shape not in decode_shapes:  # the encoder side: every request needs it, checked and loaded now
                    graph.load()
        except (ArtifactRefused, ValueError) as error:
            self.artifact_refused = str(error)
            logger.warning("compiled artifact not used, compiling instead: %s", error)
            return False
        with self._model_lock:
            if self.num_running:
                raise RuntimeError("warmup() runs before serving: requests are running")
            decode = {shape: loaded.graphs[shape] for shape in self.decode_shapes()}
            self.steps.load_graphs(decode, names, tensor_slots(self.cache), loaded)
        self.artifact = loaded
        with self._lock:
            self._lock.notify_all()  # an idle engine loads the graphs now (`_load_artifact_graph_when_idle`)
        if progress is not None:
            progress(len(loaded.graphs), len(loaded.graphs))
        return True

    def _compile_cache(self, cache_dir, shapes: list, encoder_calls: list):
        facts = {
            "model": model_facts(self.model, self.compile_config),
            "engine": {"decode_shapes": [list(shape) for shape in shapes], "encoder_calls": encoder_calls},
        }
        return compile_cache(cache_dir, facts)

    def decode_shapes(self) -> list[tuple]:
        """Every `(B, W, E_W)` a decode step can run at under the shape policy (E_W None without an encoder)."""
        return self.steps.decode_shapes()

    def follow(self, timeout: float | None = None) -> None:
        """On a rank other than 0 of a tensor-parallel model: run the steps rank 0's engine decides, until it closes;
        then free the storage.

        Raises:
            RuntimeError: this engine takes requests itself (rank 0, or no tensor parallelism).
            TimeoutError: rank 0 did not close within `timeout` seconds.
        """
        if self.is_leader:
            raise RuntimeError("follow() is for ranks other than 0 of a tensor-parallel model; this engine leads")
        self._scheduler.join(timeout)
        if self._scheduler.is_alive():
            raise TimeoutError(f"rank 0's engine did not close within {timeout} s")
        if not self._closed:
            self._closed = True
            self.cache.release()

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the engine and free its storage.

        Args:
            drain (`bool`, *optional*, defaults to `False`): finish the running and queued requests first (no new
                ones are taken); otherwise they fail with `EngineClosedError`.
            timeout (`float`, *optional*): the most seconds to wait for the scheduler.

        Raises:
            TimeoutError: the scheduler did not stop within `timeout` (the engine stays closing).
        """
        if not self.is_leader:
            self.follow(timeout)  # rank 0 decides when the steps end
            return
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
                    if self._load_artifact_graph_when_idle():
                        continue
                    plan = self._plan() if self.is_leader else None
                    if self._rank is not None:  # every rank runs rank 0's plan
                        plan = share(plan, leader=self.is_leader)
                        if not self.is_leader:
                            self._claim(plan)
                    if plan.exit:
                        return
                    with self._model_lock:
                        self._stops = plan.stops
                        for spec, seats in plan.admitted:
                            self._start(spec, seats)
                        self._advance()
        except BaseException as error:  # a bug of the engine: fail everything rather than hang
            self._fail_everything(error)
            raise

    def _load_artifact_graph_when_idle(self) -> bool:
        """Load one graph of the artifact that is not loaded yet, when no request is waiting or running (True: one
        was loaded; `compile.artifact.load_artifact(lazy=True)`). A request that comes meanwhile waits for that one
        graph (about a second for a t5-small-sized T5's), not for the whole set."""
        if not self._artifact_pending():
            return False
        with self._lock:
            if self._has_work():
                return False
        with self._model_lock:
            return self.artifact.load_next()

    def _artifact_pending(self) -> bool:
        return self.artifact is not None and self._rank is None and self.artifact.pending > 0

    def _claim(self, plan: StepPlan) -> None:
        """A follower takes the seats rank 0 gave each admitted request."""
        taken = {seat for _, seats in plan.admitted for seat in seats}
        with self._lock:
            self._free_seats = [seat for seat in self._free_seats if seat not in taken]
            heapq.heapify(self._free_seats)

    def _plan(self) -> StepPlan:
        """What the next step does: admissions (first come first served) and which running requests stop."""
        with self._lock:
            while not self._has_work():
                if self._artifact_pending():
                    return StepPlan()  # idle: `_run` loads a graph of the artifact, then plans again
                if not self._lock.wait(HEARTBEAT_S if self._rank is not None else None):
                    return StepPlan()  # tensor parallel: tell the other ranks rank 0 is alive
            if self._closing and not self._workers and (not self._drain or not self._queue):
                return StepPlan(exit=True)
            admitted = []
            while (
                self._queue
                and self._queue[0].num_seats <= len(self._free_seats)
                and not (self._closing and not self._drain)
            ):
                spec = self._queue.popleft()
                admitted.append((spec, sorted(heapq.heappop(self._free_seats) for _ in range(spec.num_seats))))
            stops = {}
            for worker in self._workers:
                if worker.handle.cancel_requested:
                    stops[worker.handle.request_id] = "cancelled"
                elif self._closing and not self._drain:
                    stops[worker.handle.request_id] = "closed"
        return StepPlan(admitted=admitted, stops=stops)

    def _start(self, spec: RequestSpec, seats: list[int]) -> None:
        worker = RequestWorker(engine=self, spec=spec, seats=seats)
        self._workers.append(worker)
        worker.start()
        self._settle(worker)

    def _advance(self) -> None:
        """Run every worker's pending model calls: encoders, then prefills (until none is left), then one decode
        step for every running request."""
        while True:
            encoding = self._pending(CallKind.ENCODE)
            if encoding:
                self._answer(encoding, self.steps.run_encoders(encoding))
                continue
            prefilling = [worker for worker in self._pending(CallKind.FORWARD) if not worker.pending.seats.admitted]
            joining = [worker for worker in prefilling if self.steps.joins(worker.pending)]
            if joining:
                self.stats["joined"] += len(joining)
                for worker, (_, error) in zip(joining, self.steps.run_joins(joining), strict=True):
                    if error is not None:
                        self._resume(worker, error=error)
                continue
            if prefilling:
                self._answer(prefilling, self.steps.run_prefills(prefilling))
                continue
            break
        decoding = self._pending(CallKind.FORWARD)
        if decoding:
            self._check_room(decoding)
            decoding = self._pending(CallKind.FORWARD)
            if decoding:
                self.stats["decode_steps"] += 1
                self.stats["rows"] += sum(len(worker.pending.seats.rows) for worker in decoding)
                self._answer(decoding, self.steps.run_decode(decoding))

    def _pending(self, kind: CallKind) -> list[RequestWorker]:
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
            seats = worker.pending.seats
            exceeded = exceeding({"max_cache_len": seats.length + 1}, {"max_cache_len": self.max_cache_len})
            if exceeded:
                message = overflow_message(exceeded)
                self._resume(worker, error=ValueError(f"the request outgrew the engine: {message}"))

    def _stopping(self, worker: RequestWorker) -> bool:
        # Decided once per step (`_plan`), so that every rank of a tensor-parallel model stops the same requests.
        return worker.handle.request_id in self._stops

    def _stop_error(self, worker: RequestWorker) -> BaseException:
        if self._stops[worker.handle.request_id] == "cancelled":
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
        if call.kind not in (CallKind.DONE, CallKind.FAILED):
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
        if call.kind == CallKind.DONE:
            result = _without_cache(call.output)
            if not worker.spec.stream:
                _push_result_tokens(handle, result, worker.spec.prompt_len)
            self.stats["finished"] += 1
            handle.finish(result=result)
        else:
            self.stats["cancelled" if isinstance(call.error, RequestCancelledError) else "failed"] += 1
            handle.finish(error=call.error)

    def _fail_everything(self, error: BaseException) -> None:
        with self._lock:
            self._closing = True
            failure = RuntimeError(f"the serving engine stopped on an internal error: {error!r}")
            for spec in self._queue:
                spec.handle.finish(error=failure)
            self._queue.clear()
            for worker in self._workers:
                worker.handle.finish(error=failure)


def _without_cache(output):
    """`generate`'s output without the request's cache (its seats serve others now)."""
    if isinstance(output, ModelOutput) and output.get("cache") is not None:
        output["cache"] = None
    return output


def _push_result_tokens(handle: RequestHandle, output, prompt_len: int) -> None:
    sequences = output if isinstance(output, torch.Tensor) else output["sequences"]
    for column in range(prompt_len, sequences.shape[1]):
        handle.push_tokens(sequences[:, column].cpu())
