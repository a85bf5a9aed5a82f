"""The ways of serving a stream that `bench-serve` compares: each takes requests at their arrival and records how
each ended (see `bench/serve.py` for the stream, the figures and the goals).

- `OneAtATime`: a queue and one `generate` at a time with upstream's DynamicCache (what `transformers serve` does);
  its tokens are the reference of the others.
- `StaticBatching`: up to `max_batch_size` requests, or those that arrived within a timeout of the first, in one
  `generate` call on the flexible cache (sources right-padded and masked), run until its longest row ends.
- `CTranslate2Batching`: the same batching through CTranslate2's `translate_batch` (fp32, the same weights).
- `InFlight`: the serving engine, eager or compiled (after `warmup()`).

Every strategy decodes as the stream's `Decoding` says: greedy, or beam search of `num_beams` beams returning
`num_return_sequences` hypotheses with their scores (what `/v1/completions` with `n` and `num_beams` asks of the
engine; CTranslate2's `translate_batch` with `beam_size`, `num_hypotheses` and `return_scores`). A batching strategy
then takes `max_batch_size // num_beams` requests per batch: the same cache rows as the engine's seats.

A batch that fails (in `run_batch`, or its results in being recorded) is its requests' failed rows, and the queue
server goes on; one whose thread stops outside a batch keeps what stopped it in `failure`, which `run_stream` raises at
once.
"""

from __future__ import annotations

import contextvars
import math
import queue
import threading
import time
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from ..serving.buckets import default_buckets
from .measure import CacheStorageTracker

STRATEGIES = ("one-at-a-time", "static-batching", "in-flight", "in-flight-compiled", "ctranslate2")


@dataclass(frozen=True)
class LoadRequest:
    """One request of the stream: `arrival` in seconds from the stream's start at unit offered load (1 req/s)."""

    index: int
    arrival: float
    input_ids: torch.Tensor  # [1, L]
    max_new_tokens: int


@dataclass(frozen=True)
class Decoding:
    """How every request of the stream is decoded: greedy (`num_beams=1`), or beam search returning
    `num_return_sequences` hypotheses with their scores."""

    num_beams: int = 1
    num_return_sequences: int = 1

    @property
    def beams(self) -> bool:
        return self.num_beams > 1

    def generate_kwargs(self) -> dict:
        if not self.beams:
            return {"do_sample": False}
        return {
            "do_sample": False,
            "num_beams": self.num_beams,
            "num_return_sequences": self.num_return_sequences,
            "output_scores": True,  # generate's sequences_scores, as the server returns them
            "return_dict_in_generate": True,
        }

    def describe(self) -> str:
        if not self.beams:
            return "greedy"
        return f"beam search: {self.num_beams} beams, {self.num_return_sequences} hypotheses with their scores"


GREEDY = Decoding()


@dataclass
class Outcome:
    arrival: float
    done: float = math.nan
    first_token: float = math.nan
    tokens: list | None = None  # the new tokens; with beams, one list per hypothesis
    scores: list | None = None  # beam search: each hypothesis's score
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        if not self.tokens or not isinstance(self.tokens[0], list):
            return len(self.tokens or [])
        return sum(len(tokens) for tokens in self.tokens)


def new_tokens_of(row: torch.Tensor, request: LoadRequest, eos_token_id: int) -> list[int]:
    """An encoder-decoder output row `[T]` as the request alone would end it: after the decoder start token, at most
    `max_new_tokens`, up to its first EOS included."""
    tokens = row[1 : 1 + request.max_new_tokens].tolist()
    return tokens[: tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens


def results_of(output, requests: list[LoadRequest], decoding: Decoding, eos_token_id: int) -> list[tuple]:
    """`(tokens, scores)` of each request of a `generate` output on `requests` (in order): greedy, its row's tokens
    and None; beam search, its `num_return_sequences` rows' tokens and `sequences_scores`."""
    if not decoding.beams:
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        return [
            (new_tokens_of(row, request, eos_token_id), None) for row, request in zip(sequences, requests, strict=True)
        ]
    per = decoding.num_return_sequences
    results = []
    for index, request in enumerate(requests):
        rows = range(index * per, (index + 1) * per)
        tokens = [new_tokens_of(output.sequences[row], request, eos_token_id) for row in rows]
        results.append((tokens, [float(output.sequences_scores[row]) for row in rows]))
    return results


class _FirstStep(BaseStreamer):
    """Stamps the first decoded step (the first `put` after the prompt's)."""

    def __init__(self):
        self.puts, self.stamp = 0, math.nan

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.stamp = time.perf_counter()

    def end(self) -> None:
        return None


# --- strategies -------------------------------------------------------------------------------------------------
class Strategy:
    """Takes requests at their arrival (`submit`, never blocking) and records each outcome."""

    name = ""
    compile_s: float | None = None

    hooked = None  # the model whose forwards the allocation counter sees (None: not counted that way)
    failure: Exception | None = None  # what stopped the strategy's server (run_stream raises it at once)

    def __init__(self):
        self.outcomes: dict[int, Outcome] = {}
        self.seats: list[int] = []
        self.tracker = CacheStorageTracker()
        self.notes: list[str] = []
        self._hook = None

    def start(self) -> None:
        self.outcomes, self.seats = {}, []
        self.tracker.start_call()
        if self.hooked is not None:  # only while this strategy runs: a compiled one shares the model, unhooked
            self._hook = self.hooked.register_forward_hook(self.tracker.forward_hook, with_kwargs=True)

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def submit(self, request: LoadRequest, arrival: float) -> None:
        raise NotImplementedError

    def allocations(self) -> int | None:
        return self.tracker.allocations

    def close(self) -> None:
        return None


class _QueueServer(Strategy):
    """A thread that serves its queue: one request at a time, or batches of them."""

    def __init__(self):
        super().__init__()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # in a copy of this thread's context: torch's config is per thread (a ContextVar)
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._serve,), daemon=True)
        self._thread.start()

    def submit(self, request: LoadRequest, arrival: float) -> None:
        self.outcomes[request.index] = Outcome(arrival=arrival)
        self._queue.put(request)

    def _serve(self) -> None:
        try:
            while (batch := self._next_batch()) is not None:
                self._serve_batch(batch)
        except Exception as error:  # noqa: BLE001 - outside a batch: the thread stops and run_stream raises it
            self.failure = error
            unserved = [index for index, outcome in list(self.outcomes.items()) if math.isnan(outcome.done)]
            self._fail(unserved, f"the server thread stopped with {error!r}")

    def _serve_batch(self, batch: list[LoadRequest]) -> None:
        with torch.no_grad():
            try:
                first_step, results = self.run_batch(batch)
                finished = [
                    (request, tokens, scores) for request, (tokens, scores) in zip(batch, results, strict=True)
                ]
            except Exception as error:  # noqa: BLE001 - a failed batch is a row of the report, not a crash
                self._fail([request.index for request in batch], repr(error))
                return
        done = time.perf_counter()
        for request, tokens, scores in finished:
            outcome = self.outcomes[request.index]
            outcome.tokens, outcome.scores, outcome.first_token, outcome.done = tokens, scores, first_step, done

    def _fail(self, indices: list[int], error: str) -> None:
        done = time.perf_counter()
        for index in indices:
            self.outcomes[index].error, self.outcomes[index].done = error, done

    def _next_batch(self) -> list[LoadRequest] | None:
        request = self._queue.get()
        return None if request is None else [request]

    def run_batch(self, batch: list[LoadRequest]) -> tuple[float, list[tuple]]:
        """`(first step's time, [(tokens, scores) of each request])`."""
        raise NotImplementedError

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(60)


class OneAtATime(_QueueServer):
    name = "one-at-a-time"

    def __init__(self, model, *, decoding: Decoding = GREEDY):
        self.model = self.hooked = model
        self.decoding = decoding
        super().__init__()

    def run_batch(self, batch):
        (request,) = batch
        self.seats.append(self.decoding.num_beams)
        streamer = None if self.decoding.beams else _FirstStep()  # generate streams no beam search
        out = self.model.generate(
            input_ids=request.input_ids,
            max_new_tokens=request.max_new_tokens,
            streamer=streamer,
            **self.decoding.generate_kwargs(),
        )
        eos = self.model.generation_config.eos_token_id
        return (math.nan if streamer is None else streamer.stamp), results_of(out, batch, self.decoding, eos)


class _Batcher(_QueueServer):
    """Collects up to `max_batch_size` requests, or what arrived within `timeout` seconds of the first."""

    def __init__(self, *, max_batch_size: int, timeout: float):
        self.max_batch_size, self.timeout = max_batch_size, timeout
        super().__init__()

    def _next_batch(self):
        first = self._queue.get()
        if first is None:
            return None
        batch, deadline = [first], time.perf_counter() + self.timeout
        while len(batch) < self.max_batch_size:
            try:
                request = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if request is None:
                self._queue.put(None)  # served after this batch
                break
            batch.append(request)
        self.seats.append(len(batch))
        return batch


def _right_padded(batch: list[LoadRequest], pad_token_id: int) -> dict:
    longest = max(request.input_ids.shape[1] for request in batch)
    input_ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, request in enumerate(batch):
        input_ids[row, : request.input_ids.shape[1]] = request.input_ids[0]
        attention_mask[row, : request.input_ids.shape[1]] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class StaticBatching(_Batcher):
    name = "static-batching"

    def __init__(self, model, *, cache_config: dict, decoding: Decoding = GREEDY, **kwargs):
        self.model = self.hooked = model
        self.cache_config = cache_config
        self.decoding = decoding
        super().__init__(**kwargs)

    def run_batch(self, batch):
        streamer = None if self.decoding.beams else _FirstStep()
        out = self.model.generate(
            **_right_padded(batch, self.model.generation_config.pad_token_id),
            max_new_tokens=max(request.max_new_tokens for request in batch),
            streamer=streamer,
            cache_implementation="flexible_static",
            cache_config=self.cache_config,
            **self.decoding.generate_kwargs(),
        )
        eos = self.model.generation_config.eos_token_id
        return (math.nan if streamer is None else streamer.stamp), results_of(out, batch, self.decoding, eos)


class CTranslate2Batching(_Batcher):
    name = "ctranslate2"

    def __init__(self, model, *, threads: int, decoding: Decoding = GREEDY, **kwargs):
        from .ctranslate2 import CTranslate2Runner

        (self.runner,) = CTranslate2Runner.from_model(model, threads=threads)  # fp32, the torch rows' type
        self.eos_token_id = model.generation_config.eos_token_id
        self.decoding = decoding
        super().__init__(**kwargs)

    def allocations(self) -> int | None:
        return None  # CTranslate2 grows its caches internally and counts nothing

    def run_batch(self, batch):
        vocabulary, index = self.runner.vocabulary, self.runner.index
        source = [[vocabulary[i] for i in request.input_ids[0].tolist()] for request in batch]
        stamps: list[float] = []

        def on_token(step) -> None:
            if not stamps:
                stamps.append(time.perf_counter())

        beams = self.decoding.beams
        results = self.runner.translator.translate_batch(
            source,
            beam_size=self.decoding.num_beams,
            num_hypotheses=self.decoding.num_return_sequences,
            return_scores=beams,
            max_decoding_length=max(request.max_new_tokens for request in batch),
            return_end_token=True,
            callback=None if beams else on_token,  # CTranslate2 calls it for greedy search only
        )
        answers = []
        for result, request in zip(results, batch, strict=True):
            hypotheses = []
            for hypothesis in result.hypotheses:
                ids = [index[token] for token in hypothesis][: request.max_new_tokens]
                hypotheses.append(ids[: ids.index(self.eos_token_id) + 1] if self.eos_token_id in ids else ids)
            answers.append((hypotheses, list(result.scores)) if beams else (hypotheses[0], None))
        return (stamps[0] if stamps else math.nan), answers


class InFlight(Strategy):
    def __init__(self, model, *, cache_config: dict, compile_config=None, max_queue: int, decoding: Decoding = GREEDY):
        from ..serving import Engine

        super().__init__()
        self.decoding = decoding
        self.name = "in-flight-compiled" if compile_config is not None else "in-flight"
        self.model = model
        self.engine = Engine(model, cache_config=cache_config, compile_config=compile_config, max_queue=max_queue)
        if compile_config is not None:
            start = time.perf_counter()
            self.engine.warmup()
            self.compile_s = time.perf_counter() - start
        else:
            self.hooked = model
        self._pointers = self.engine.cache.data_ptrs()
        self._lock = threading.Lock()

    def start(self) -> None:
        super().start()
        self.tracker.observe(self.engine.cache)  # already allocated: not counted in the stream
        self.tracker.allocations = self.tracker.bytes_allocated = 0

    def submit(self, request: LoadRequest, arrival: float) -> None:
        outcome = self.outcomes[request.index] = Outcome(arrival=arrival)
        eos = self.model.generation_config.eos_token_id
        decoding = self.decoding
        self.seats.append(self.engine.seats_in_use)

        def finished(handle) -> None:
            error = handle.exception(timeout=0)
            if error is None:
                ((outcome.tokens, outcome.scores),) = results_of(handle.result(timeout=0), [request], decoding, eos)
            else:
                outcome.error = repr(error)
            # with beams the tokens come at the end, whole: no first token to time
            streamed = handle.first_token_at is not None and not decoding.beams
            outcome.first_token = handle.first_token_at if streamed else math.nan
            outcome.done = handle.finished_at
            with self._lock:
                self.seats.append(self.engine.seats_in_use)

        handle = self.engine.submit(
            input_ids=request.input_ids, max_new_tokens=request.max_new_tokens, **decoding.generate_kwargs()
        )
        handle.add_done_callback(finished)

    def allocations(self) -> int | None:
        moved = self.engine.cache.data_ptrs() != self._pointers
        return self.tracker.allocations + int(moved)

    def close(self) -> None:
        self.engine.close(drain=True, timeout=120)


def build_strategies(
    names, upstream, flex, *, args, max_encoder_len: int, decoding: Decoding = GREEDY
) -> list[Strategy]:
    capacities = {"max_batch_size": args.max_batch_size, "max_cache_len": args.max_new_tokens + 1}
    capacities["max_encoder_len"] = max_encoder_len
    batch_requests = max(1, args.max_batch_size // decoding.num_beams)  # a batch's requests: as many rows as seats
    strategies = []
    for name in names:
        if name == "one-at-a-time":
            strategies.append(OneAtATime(upstream, decoding=decoding))
        elif name == "static-batching":
            strategies.append(
                StaticBatching(
                    flex,
                    cache_config={**capacities, "on_overflow": "error"},
                    decoding=decoding,
                    max_batch_size=batch_requests,
                    timeout=args.batch_timeout,
                )
            )
        elif name == "in-flight":
            strategies.append(InFlight(flex, cache_config=capacities, max_queue=args.max_queue, decoding=decoding))
        elif name == "in-flight-compiled":
            if args.quick:  # one graph, traced by dynamo and run eagerly: the path, not the speed
                compile_config, shapes = _quick_compile_config(), {"shape_policy": "padded"}
            else:
                from ..compile import compile_config_for_cpu  # not imported for the command line's help

                compile_config = compile_config_for_cpu()
                shapes = {"shape_policy": "bucketed", "buckets": default_buckets(capacities)}  # as `serve --compile`
            strategy = InFlight(
                flex,
                cache_config={**capacities, **shapes},
                compile_config=compile_config,
                max_queue=args.max_queue,
                decoding=decoding,
            )
            if args.quick:
                strategy.notes.append("--quick: compiled with dynamo's eager backend (no inductor), padded policy")
            strategies.append(strategy)
        elif name == "ctranslate2":
            strategies.append(
                CTranslate2Batching(
                    upstream,
                    threads=args.threads,
                    decoding=decoding,
                    max_batch_size=batch_requests,
                    timeout=args.batch_timeout,
                )
            )
        else:
            raise ValueError(f"unknown strategy {name!r}; choose from {list(STRATEGIES)}")
    return strategies


def _quick_compile_config():
    from transformers import CompileConfig

    config = CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    return config
