"""What the benchmark measures in one generate call, and how.

Design decisions:
- Time: wall time of the whole `generate` call with `time.perf_counter`, and per-step latency from a
  `LogitsProcessor` that stamps the time at each decoding step (it runs once per step in every decoding loop,
  eager or compiled, and does not touch the model). The first stamp closes the prefill (encoder plus first decoder
  step); the gaps between later stamps are the decode steps. The time spent inspecting caches (below) is measured
  and taken out of both, so that it does not count against the torch strategies.
- Cache memory: caches are inspected, nothing is patched. After every forward (a forward hook on the model) and on
  the cache that `generate` returns, the tensors the cache holds are grouped by storage. A storage not seen before
  (tracked with weak references, so an address reused by the allocator is not mistaken for an old storage) counts
  as one allocation of `storage.nbytes()`. DynamicCache allocates a new storage per layer at each step (`torch.cat`),
  upstream's static cache new storages per call, the flexible cache one storage per tensor for the whole run.
  Compiled strategies get no hook (it would be traced into the graph); their caches are inspected when returned.
- Peak memory: torch's CPU allocator keeps no statistics and `tracemalloc` does not see it, so the process RSS is
  read (psutil) at the start of the call, at each decoding step and at the end; the figure is the highest reading
  minus the first. It misses peaks inside a forward (activations), and memory that the C allocator freed but kept
  for reuse does not show up again, so it is a rough figure that depends on what ran before. `peak_cache_bytes`
  is the exact one for caches.
- Compiled graphs: the increase of dynamo's `unique_graphs` counter over the call. Compile time: the increase of the
  time dynamo records for its compilations (`compilation_time_metrics["_compile.compile_inner"]`: tracing plus the
  backend, inductor's C++ builds included) over the call. Warm wall time is wall time minus compile time, so that a
  strategy that recompiles in the middle of a stream (upstream's static cache at a new batch) is charged its
  compilations in the compile column, not in the warm one.
- The bandwidth floor of a decode step: the bytes the step must read (the parameters of every module that runs in
  it, found with forward pre-hooks on one real decode step, embedding tables counted by the rows looked up, int8
  weights by their int8 data and scales; plus the cache tensors it attends over) divided by the machine's read
  bandwidth, measured here by summing a buffer larger than the last-level cache with the benchmark's threads (best
  of several). No implementation can step faster on this machine than by reading its weights once.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor
from transformers.cache_utils import Cache, EncoderDecoderCache

try:
    import psutil
except ImportError:  # psutil comes with accelerate; without it the RSS figure is reported as None
    psutil = None


@dataclass
class CallRecord:
    """Figures of one generate call of one strategy; `None` where the strategy cannot report a figure."""

    wall_s: float
    num_tokens: int
    tokens: torch.Tensor  # [B, N] the new tokens
    first_token_s: float | None = None
    step_s: list[float] = field(default_factory=list)  # gaps between decode steps
    forward_s: list[float] = field(default_factory=list)  # the model's forward alone, on each decode step
    cache_allocations: int | None = None
    cache_bytes_allocated: int | None = None
    peak_cache_bytes: int | None = None
    peak_rss_growth_bytes: int | None = None
    compiled_graphs: int | None = None
    compile_s: float | None = None  # time spent compiling during the call
    batch_size: int | None = None  # rows of the call (default: those of `tokens`)
    margins: torch.Tensor | None = None  # [B, N] top-1 minus top-2 score per step (reference strategies only)
    scores: torch.Tensor | None = None  # [B, N, V] each step's scores; dropped once compared (`ModelResult.add_call`)
    # a warm-up from a compiled artifact (`bench --artifact`): {"directory", "built", "graphs", "seconds"}
    artifact: dict | None = None

    def __post_init__(self):
        if self.batch_size is None and self.tokens.dim() == 2:
            self.batch_size = self.tokens.shape[0]

    def figures(self) -> dict:
        return {
            "wall_s": self.wall_s,
            "compile_s": self.compile_s,
            "batch_size": self.batch_size,
            "tokens_per_s": self.num_tokens / self.wall_s,
            "first_token_ms": None if self.first_token_s is None else 1e3 * self.first_token_s,
            "step_latency_ms": 1e3 * statistics.median(self.step_s) if self.step_s else None,
            "forward_ms": 1e3 * statistics.median(self.forward_s) if self.forward_s else None,
            "cache_allocations": self.cache_allocations,
            "cache_bytes_allocated": self.cache_bytes_allocated,
            "peak_cache_bytes": self.peak_cache_bytes,
            "peak_rss_growth_bytes": self.peak_rss_growth_bytes,
            "compiled_graphs": self.compiled_graphs,
            **({"artifact": self.artifact} if self.artifact is not None else {}),
        }


class ForwardTimer:
    """Times the model's forward alone on each decode step of a generate call, without a hook inside it: a wrapper
    around the callable that upstream's `generate` runs each step (`model.__call__`, or under `compile_config` what
    `model.get_compiled_call` returns), set on the instance for the duration of the call.

    A compiled call is timed through `get_compiled_call` only: wrapping `__call__` there would be traced into the
    graph it compiles. Each forward's time in the tracker's forward hook (`hook_s`, eager runs) is taken out.
    """

    def __init__(self, model, *, compiled: bool):
        self.model = model
        self.compiled = compiled
        self.seconds: list[float] = []

    def _timed(self, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            output = call(*args, **kwargs)
            self.seconds.append(time.perf_counter() - start)
            return output

        return timed

    def __enter__(self):
        if self.compiled:
            get_compiled_call = self.model.get_compiled_call
            self.model.get_compiled_call = lambda config: self._timed(get_compiled_call(config))
        else:
            self.model.__call__ = self._timed(self.model.__call__)
        return self

    def __exit__(self, *exc):
        self.model.__dict__.pop("get_compiled_call" if self.compiled else "__call__", None)

    def decode_forwards(self, num_forwards: int, hook_s: list[float] | None = None) -> list[float]:
        """The decode steps' forwards of a call that ran `num_forwards` forwards: all but the first (the prefill),
        which upstream's generate runs through the class's `__call__` (then not timed here). `hook_s[k]`, the time
        of the tracker's hook inside forward `k` (one per forward, prefill included), is taken out of decode forward
        `k`, as `StepTimer.step_s` takes it out of the gap that holds forward `k`: the two stay comparable."""
        seconds = self.seconds
        decode = seconds[1:] if len(seconds) == num_forwards else seconds[-(num_forwards - 1) :]
        if hook_s and len(hook_s) == num_forwards and len(decode) == num_forwards - 1:
            decode = [forward - hook for forward, hook in zip(decode, hook_s[1:], strict=True)]
        return decode


class StepTimer(LogitsProcessor):
    """A logits processor that leaves scores unchanged, stamps the time of each decoding step and samples RSS."""

    def __init__(self, rss: PeakRss | None = None):
        self.stamps: list[float] = []
        self.rss = rss

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        if self.rss is not None:
            self.rss.sample()
        return scores

    def first_token_s(self, start: float) -> float | None:
        return self.stamps[0] - start if self.stamps else None

    def step_s(self, hook_s: list[float] | None = None) -> list[float]:
        """Gaps between steps; `hook_s[k]` (time in a forward hook after forward `k`) is taken out of the gap that
        holds it, when there is one hook call per step."""
        gaps = [later - earlier for earlier, later in zip(self.stamps, self.stamps[1:], strict=False)]
        if hook_s and len(hook_s) == len(self.stamps):
            gaps = [gap - hook for gap, hook in zip(gaps, hook_s[1:], strict=True)]
        return gaps


def top_margins(scores: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per row and step, how far the chosen (greedy) token's score lies above the next one's: how near a tie was.

    Args:
        scores: generate's `scores`, N steps of [B, V] (after the logits processors).

    Returns:
        `torch.Tensor`: [B, N], float32, on the CPU.
    """
    top2 = torch.stack([step.float().topk(2, dim=-1).values for step in scores], dim=1)  # [B, N, 2]
    return (top2[..., 0] - top2[..., 1]).cpu()


def same_prefix_score_diff(record: CallRecord, reference: CallRecord) -> float | None:
    """The largest |score difference| between two runs of one call at the steps where both had generated the same
    tokens so far (so both scored the same input): how far their logits lie apart, before any divergence.

    None when either kept no scores or their shapes differ."""
    if record.scores is None or reference.scores is None or record.scores.shape != reference.scores.shape:
        return None
    # tokens: [B, N]; scores: [B, N, V]
    equal = record.tokens == reference.tokens
    same_prefix = torch.cat([torch.ones_like(equal[:, :1]), equal[:, :-1].cummin(dim=1).values], dim=1)  # [B, N]
    finite = torch.isfinite(reference.scores) & torch.isfinite(record.scores)
    compared = finite & same_prefix[..., None]
    if not compared.any():
        return None
    return (record.scores - reference.scores).abs()[compared].max().item()


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes that `tensor` holds: a quantized tensor subclass (torchao's int8 weights) counts the tensors it is made
    of (int8 data and scales), not its float facade."""
    if hasattr(tensor, "__tensor_flatten__") and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def cache_storages(cache) -> list[torch.UntypedStorage]:
    """The distinct storages of every tensor that `cache` (any upstream or flexible cache) holds."""
    if isinstance(cache, EncoderDecoderCache):
        return cache_storages(cache.self_attention_cache) + cache_storages(cache.cross_attention_cache)
    storages = {}
    for layer in getattr(cache, "layers", ()):
        # `vars` finds stored tensors whatever their name (keys, storage buffers, conv/ssm states); `keys`/`values`
        # may be properties (live views), which `vars` does not list.
        candidates = list(vars(layer).values()) + [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for tensor in candidates:
            if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
                storage = tensor.untyped_storage()
                storages[id(storage)] = storage
    return list(storages.values())


def returned_cache(output):
    """The cache held by a model or generate output (`cache`, or the deprecated `past_key_values`), or None."""
    # No `or`: a cache with no layers yet has length 0 and would read as false.
    for name in ("cache", "past_key_values"):
        cache = getattr(output, name, None)
        if isinstance(cache, Cache):
            return cache
    return None


class CacheStorageTracker:
    """Counts cache storages that appear for the first time, across the calls of one strategy."""

    def __init__(self):
        self._known: dict[int, weakref.ref] = {}
        self.start_call()

    def start_call(self) -> None:
        self._known = {key: ref for key, ref in self._known.items() if ref() is not None}
        self.hook_s: list[float] = []  # time spent in each forward_hook call, to take out of the timings
        self.allocations = 0
        self.bytes_allocated = 0
        self.peak_bytes = 0

    def observe(self, cache) -> None:
        if not isinstance(cache, Cache):
            return
        live_bytes = 0
        for storage in cache_storages(cache):
            nbytes = storage.nbytes()
            live_bytes += nbytes
            known = self._known.get(id(storage))
            if known is None or known() is not storage:
                self._known[id(storage)] = weakref.ref(storage)
                self.allocations += 1
                self.bytes_allocated += nbytes
        self.peak_bytes = max(self.peak_bytes, live_bytes)

    def forward_hook(self, module, args, kwargs, output) -> None:
        """For `register_forward_hook(..., with_kwargs=True)`: inspect the cache after each forward."""
        start = time.perf_counter()
        cache = returned_cache(output)
        if cache is None:
            cache = next((value for value in kwargs.values() if isinstance(value, Cache)), None)
        self.observe(cache)
        self.hook_s.append(time.perf_counter() - start)


class PeakRss:
    """The highest process RSS seen by `sample()` since `start()`, minus the RSS at `start()`.

    Sampled at each decoding step rather than by a thread: a sampling thread competes for the GIL with the
    decoding loop and slowed steps of small models by a quarter in a trial.
    """

    def __init__(self):
        self._process = psutil.Process() if psutil is not None else None
        self._start = self._peak = 0

    def _rss(self) -> int:
        return self._process.memory_info().rss

    def start(self) -> None:
        if self._process is not None:
            self._start = self._peak = self._rss()

    def sample(self) -> None:
        if self._process is not None:
            self._peak = max(self._peak, self._rss())

    @property
    def growth_bytes(self) -> int | None:
        return None if self._process is None else self._peak - self._start


def read_bandwidth(*, nbytes: int = 256 * 2**20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second that this process reads from memory: `nbytes` summed, best of `repeats` (after one untimed
    pass), with torch's current threads. The buffer is larger than any last-level cache, so it comes from memory."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        buffer.sum()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class DecodeStepBytes:
    """The bytes one decode step reads: parameters of the modules that run in it, and the cache it attends over.

    Measured on a real eager `generate` call: forward pre-hooks on every module that holds parameters record, during
    the `step`-th forward (a decode step), which modules ran and the cache they were given. A parameter counts once
    (tied embeddings), an embedding table by the rows looked up, the cache by the bytes of the live tensors it holds
    (DynamicCache holds exactly what attention reads).
    """

    def __init__(self, model, *, step: int):
        self.model = model
        self.step = step
        self.forwards = 0
        self.weight_bytes = 0
        self.cache_bytes = 0
        self._seen: set[int] = set()
        self._handles = []

    def __enter__(self) -> DecodeStepBytes:
        self._handles.append(self.model.register_forward_pre_hook(self._count_forward, with_kwargs=True))
        for module in self.model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_pre_hook(self._count_module))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _count_forward(self, module, args, kwargs) -> None:
        self.forwards += 1
        if self.forwards == self.step:
            cache = next((value for value in kwargs.values() if isinstance(value, Cache)), None)
            self.cache_bytes = sum(storage.nbytes() for storage in cache_storages(cache)) if cache is not None else 0

    def _count_module(self, module, args) -> None:
        if self.forwards != self.step:
            return
        for parameter in module.parameters(recurse=False):
            # tied weights share storage; a quantized subclass has no storage of its own: counted by identity
            key = parameter.data_ptr() if type(parameter) in (torch.Tensor, torch.nn.Parameter) else id(parameter)
            if key in self._seen:
                continue
            self._seen.add(key)
            if isinstance(module, torch.nn.Embedding) and args and isinstance(args[0], torch.Tensor):
                self.weight_bytes += args[0].numel() * parameter.shape[-1] * parameter.element_size()
            else:
                self.weight_bytes += tensor_nbytes(parameter)


def summarize(records: list[CallRecord], *, warm_up: CallRecord | None = None) -> dict:
    """Figures of a strategy over a stream: totals, medians over all decode steps, maxima over calls.

    The untimed warm-up call counts only in the totals of allocations, bytes allocated, compiled graphs and compile
    time: what it allocates or compiles is part of serving the stream. `warm_wall_s` (and tokens per second) leave
    out the compile time of the stream's calls; `largest_batch_step_ms` is the median step of the calls at the
    stream's largest batch.
    """
    counted = [warm_up, *records] if warm_up is not None else records
    wall_s = sum(r.wall_s for r in records)
    steps = [s for r in records for s in r.step_s]
    firsts = [r.first_token_s for r in records if r.first_token_s is not None]
    largest = max((r.batch_size or 0 for r in records), default=0)
    largest_steps = [s for r in records if r.batch_size == largest for s in r.step_s]
    forwards = [s for r in records for s in r.forward_s]
    largest_forwards = [s for r in records if r.batch_size == largest for s in r.forward_s]

    def total(name):
        values = [getattr(r, name) for r in counted]
        return None if any(v is None for v in values) else sum(values)

    def peak(name):
        values = [getattr(r, name) for r in records]
        return None if any(v is None for v in values) else max(values)

    compile_s = total("compile_s")
    stream_compile_s = sum(r.compile_s or 0.0 for r in records)
    batches = sorted({r.batch_size for r in records if r.batch_size})
    return {
        "wall_s": wall_s,
        "compile_s": compile_s,
        "warm_wall_s": wall_s - stream_compile_s,
        "tokens_per_s": sum(r.num_tokens for r in records) / (wall_s - stream_compile_s),
        "first_token_ms": 1e3 * statistics.median(firsts) if firsts else None,
        "step_latency_ms": 1e3 * statistics.median(steps) if steps else None,
        "largest_batch_step_ms": 1e3 * statistics.median(largest_steps) if largest_steps else None,
        "forward_ms": 1e3 * statistics.median(forwards) if forwards else None,
        "largest_batch_forward_ms": 1e3 * statistics.median(largest_forwards) if largest_forwards else None,
        "cache_allocations": total("cache_allocations"),
        "cache_bytes_allocated": total("cache_bytes_allocated"),
        "peak_cache_bytes": peak("peak_cache_bytes"),
        "peak_rss_growth_bytes": peak("peak_rss_growth_bytes"),
        "compiled_graphs": total("compiled_graphs"),
        # Median decode step (and forward) of the calls at each batch size of the stream: the small-batch figures.
        "step_ms_by_batch": _median_ms_by_batch(records, batches, "step_s"),
        "forward_ms_by_batch": _median_ms_by_batch(records, batches, "forward_s"),
    }


def _median_ms_by_batch(records: list[CallRecord], batches: list[int], name: str) -> dict[int, float | None]:
    by_batch = {}
    for batch in batches:
        values = [v for r in records if r.batch_size == batch for v in getattr(r, name)]
        by_batch[batch] = 1e3 * statistics.median(values) if values else None
    return by_batch


FIGURES = (
    "wall_s",
    "compile_s",
    "warm_wall_s",
    "tokens_per_s",
    "first_token_ms",
    "step_latency_ms",
    "largest_batch_step_ms",
    "forward_ms",
    "largest_batch_forward_ms",
    "cache_allocations",
    "cache_bytes_allocated",
    "peak_cache_bytes",
    "peak_rss_growth_bytes",
    "compiled_graphs",
)


def ratios(figures: dict, baseline: dict) -> dict:
    """Each figure divided by the baseline's (DynamicCache's); None where either is missing or the baseline is 0."""
    return {
        name: (figures[name] / baseline[name] if figures[name] is not None and baseline[name] else None)
        for name in FIGURES
    }
