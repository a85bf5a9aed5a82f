"""The load benchmark's transcription stream: `bench-serve --models whisper`.

Design decisions:
- One seeded stream of recordings (stand-ins for speech: tones under noise, 16 kHz) of mixed lengths, uniform in
  5-75 s (1-8 s with `--quick`, whose tiny model has 3 s windows), so that some are long-form (over the 30 s window),
  arriving as a Poisson process, open loop, at offered loads in multiples of one-at-a-time's service rate (as the text
  streams of `bench/serve.py`).
- The model: a random Whisper with whisper-tiny's layout and a real checkpoint's special tokens
  (`zoo.whisper_checkpoint_parts("real")`; `"tiny"` with `--quick`). Every strategy transcribes with greedy decoding,
  timestamps, `language="en"` (no detection), no conditioning on previous text, and at most `--max-new-tokens` per
  window (a random model rarely ends a window by itself).
- Strategies, in one process, one after the other per load:
  - `one-at-a-time`: upstream's `WhisperForConditionalGeneration.generate` (DynamicCache) on one recording at a time,
    long-form where it is long; its tokens are the reference.
  - `in-flight`: the serving engine, one request per recording (its windows' steps batched with the others').
  - `faster-whisper`: faster-whisper's `WhisperModel.transcribe` (CTranslate2, fp32, the same weights converted by
    CTranslate2's converter, the same threads), one recording at a time, `beam_size=1`, `vad_filter=False`. Its own
    long-form loop (openai-whisper's) and its own feature extractor differ from upstream's, so its tokens are
    reported, not required to be equal. Left out, with a note, where faster-whisper is not installed.
- Figures as in `bench/serve.py`: completed recordings/s, tokens/s, p50/p95/p99 latency (arrival to the whole
  transcript), seats; "tokens equal" compares each recording's tokens (all windows, timestamps included) with
  one-at-a-time's.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .. import zoo
from .serve_strategies import Outcome, Strategy, _QueueServer

STRATEGIES = ("one-at-a-time", "in-flight", "faster-whisper")


@dataclass(frozen=True)
class AudioRequest:
    """One recording of the stream: `arrival` in seconds at unit offered load (1 recording/s)."""

    index: int
    arrival: float
    samples: np.ndarray  # [N] float32 at 16 kHz
    features: torch.Tensor  # [1, mel, frames]: one padded window, or the whole recording when longer


def make_audio_stream(processor, *, num_requests: int, seed: int, quick: bool) -> list[AudioRequest]:
    """Seeded recordings of 5-75 s (1-8 s quick), Poisson arrivals at 1/s; the second is always long-form."""
    generator = np.random.default_rng(seed)
    extractor = processor.feature_extractor
    window_s = extractor.n_samples / extractor.sampling_rate
    low, high = (1.0, 8.0) if quick else (5.0, 75.0)
    arrival, stream = 0.0, []
    for index in range(num_requests):
        arrival += float(generator.exponential())
        seconds = float(generator.uniform(low, high)) if index != 1 else high  # at least one long-form recording
        time_s = np.arange(round(seconds * extractor.sampling_rate)) / extractor.sampling_rate
        tones = sum(np.sin(2 * np.pi * f * time_s) for f in generator.uniform(100, 3000, 4))
        samples = (0.1 * tones + 0.1 * generator.uniform(-1, 1, time_s.size)).astype(np.float32)
        padding = {"truncation": False, "padding": "longest"} if seconds > window_s else {}
        features = extractor(samples, sampling_rate=extractor.sampling_rate, return_tensors="pt", **padding)
        stream.append(AudioRequest(index, arrival, samples, features["input_features"]))
    return stream


def generate_kwargs(processor, max_new_tokens: int) -> dict:
    frame_s = processor.feature_extractor.hop_length / processor.feature_extractor.sampling_rate
    return {
        "language": "en",
        "task": "transcribe",
        "do_sample": False,
        "return_timestamps": True,
        "condition_on_prev_tokens": False,
        "max_new_tokens": max_new_tokens,
        "time_precision": 2 * frame_s,
        "time_precision_features": frame_s,
    }


def tokens_of(output, pad_token_id: int) -> list[int]:
    """A recording's tokens (every window's, timestamps included) from Whisper's generate output, padding cut."""
    sequences = output if isinstance(output, torch.Tensor) else output["sequences"]
    tokens = sequences[0].tolist()
    while tokens and tokens[-1] == pad_token_id:
        tokens.pop()
    return tokens


class OneAtATimeWhisper(_QueueServer):
    name = "one-at-a-time"

    def __init__(self, model, kwargs: dict):
        self.model, self.kwargs = model, kwargs
        super().__init__()

    def run_batch(self, batch):
        (request,) = batch
        self.seats.append(1)
        output = self.model.generate(input_features=request.features, **self.kwargs)
        return math.nan, [(tokens_of(output, self.model.generation_config.pad_token_id), None)]  # (tokens, scores)


class InFlightWhisper(Strategy):
    name = "in-flight"

    def __init__(self, model, kwargs: dict, *, max_batch_size: int, max_cache_len: int):
        from ..serving import Engine

        super().__init__()
        self.kwargs = kwargs
        self.pad_token_id = model.generation_config.pad_token_id
        self.engine = Engine(model, cache_config={"max_batch_size": max_batch_size, "max_cache_len": max_cache_len})

    def submit(self, request: AudioRequest, arrival: float) -> None:
        outcome = self.outcomes[request.index] = Outcome(arrival=arrival)
        handle = self.engine.submit(input_features=request.features, **self.kwargs)
        self.seats.append(self.engine.seats_in_use)

        def done(handle) -> None:
            outcome.done = time.perf_counter()
            error = handle.exception(timeout=0)
            if error is not None:
                outcome.error = repr(error)
            else:
                outcome.tokens = tokens_of(handle.result(timeout=0), self.pad_token_id)

        handle.add_done_callback(done)

    def allocations(self) -> int | None:
        return None  # the engine allocates its seats once, when it is built

    def close(self) -> None:
        self.engine.close()


class FasterWhisper(_QueueServer):
    name = "faster-whisper"

    def __init__(self, model_dir: str, *, threads: int, max_new_tokens: int):
        from faster_whisper import WhisperModel

        self.whisper = WhisperModel(model_dir, device="cpu", compute_type="float32", cpu_threads=threads)
        self.max_new_tokens = max_new_tokens
        super().__init__()

    def run_batch(self, batch):
        (request,) = batch
        self.seats.append(1)
        segments, _ = self.whisper.transcribe(
            request.samples,
            language="en",
            task="transcribe",
            beam_size=1,
            best_of=1,
            temperature=0.0,
            condition_on_previous_text=False,
            without_timestamps=False,
            vad_filter=False,
            max_new_tokens=self.max_new_tokens,
        )
        return math.nan, [([token for segment in segments for token in segment.tokens], None)]  # (tokens, scores)

    def allocations(self) -> int | None:
        return None


def convert_for_faster_whisper(upstream, processor, folder: str) -> str:
    """The checkpoint saved, then converted by CTranslate2's converter (fp32) with its tokenizer and processor
    config, as faster-whisper loads models; returns the converted folder."""
    import ctranslate2

    source = f"{folder}/hf"
    upstream.save_pretrained(source)
    processor.tokenizer.save_pretrained(source)
    processor.feature_extractor.save_pretrained(source)  # preprocessor_config.json, which faster-whisper reads
    converter = ctranslate2.converters.TransformersConverter(
        source, copy_files=["tokenizer.json", "preprocessor_config.json"]
    )
    return converter.convert(f"{folder}/ct2", quantization="float32", force=True)


def build_models(*, quick: bool, seed: int):
    """`(upstream, flex, processor)`: one seeded random Whisper, upstream's model and the override."""
    from transformers import WhisperForConditionalGeneration

    from ..models.registry import convert

    config, generation_config, processor = zoo.whisper_checkpoint_parts("tiny" if quick else "real")
    torch.manual_seed(seed)
    upstream = WhisperForConditionalGeneration(config).eval()
    upstream.generation_config = generation_config
    flex = convert(WhisperForConditionalGeneration(config).eval())
    flex.load_state_dict(upstream.state_dict())
    flex.generation_config = generation_config
    return upstream, flex, processor


def build_strategies(names: list[str], upstream, flex, processor, *, args, folder: str) -> tuple[list, list[str]]:
    kwargs = generate_kwargs(processor, args.max_new_tokens)
    strategies, notes = [OneAtATimeWhisper(upstream, kwargs)], []
    if "in-flight" in names:
        # decoder positions per window: the initial tokens (start, language, task) and at most max_new_tokens
        strategies.append(
            InFlightWhisper(flex, kwargs, max_batch_size=args.max_batch_size, max_cache_len=args.max_new_tokens + 8)
        )
    if "faster-whisper" in names and args.quick:
        notes.append("faster-whisper: left out with --quick (it assumes 30 s windows; the tiny model's are 3 s)")
    elif "faster-whisper" in names:
        try:
            import faster_whisper  # noqa: F401
        except ImportError:
            notes.append("faster-whisper: not installed (pip install faster-whisper): its row is left out")
        else:
            model_dir = convert_for_faster_whisper(upstream, processor, folder)
            strategies.append(FasterWhisper(model_dir, threads=args.threads, max_new_tokens=args.max_new_tokens))
    return strategies, notes


def run(args, *, serve) -> dict:
    """The transcription stream under each strategy and load; prints its table, returns its part of the report.
    `serve` is `bench/serve.py` (its stream runner, rows and table), passed in: it imports this module."""

    from .serve_strategies import STRATEGIES as TEXT_STRATEGIES

    requested = [name.strip() for name in args.strategies.split(",")] if args.strategies else list(TEXT_STRATEGIES)
    # the default --strategies names the text streams' strategies: the transcription stream then runs all of its own
    names = list(STRATEGIES) if requested == list(TEXT_STRATEGIES) else [n for n in requested if n in STRATEGIES]
    upstream, flex, processor = build_models(quick=args.quick, seed=args.seed)
    stream = make_audio_stream(processor, num_requests=args.requests, seed=args.seed, quick=args.quick)
    with tempfile.TemporaryDirectory(prefix="flexcache-bench-whisper-") as folder, torch.no_grad():
        strategies, notes = build_strategies(names, upstream, flex, processor, args=args, folder=folder)
        base_rate = _service_rate(strategies[0], stream, serve)
        loads = (
            [float(load) for load in args.loads.split(",")]
            if args.loads
            else [round(base_rate * multiple, 3) for multiple in serve.LOAD_MULTIPLES]
        )
        rows = []
        for rate in loads:
            reference = None
            for strategy in strategies:
                serve.run_stream(strategy, stream, rate, timeout=args.timeout)
                row = serve.summarize("whisper", strategy, rate, reference)
                if strategy.name == "one-at-a-time":
                    reference = {index: outcome.tokens for index, outcome in strategy.outcomes.items()}
                    row.tokens_equal = row.num_requests - row.failed
                rows.append(row)
        for strategy in strategies:
            strategy.close()
    seconds = [request.samples.size / zoo.WHISPER_SAMPLING_RATE for request in stream]
    window_s = processor.feature_extractor.chunk_length
    print(
        f"\nwhisper transcription ({'tiny' if args.quick else 'whisper-tiny-sized, random'}): {len(stream)} "
        f"recordings per load of {min(seconds):.0f}-{max(seconds):.0f} s ({sum(s > window_s for s in seconds)} over "
        f"the {window_s} s window), "
        f"at most {args.max_new_tokens} tokens per window; one-at-a-time serves {base_rate:.2f} recordings/s"
    )
    print(serve.format_table(rows))
    for note in sorted({*notes, *(note for row in rows for note in row.notes)}):
        print(f"note: {note}")
    return {"rows": [asdict(row) for row in rows], "loads": loads, "notes": notes, "durations_s": seconds}


def _service_rate(one_at_a_time: Strategy, stream: list[AudioRequest], serve) -> float:
    """Recordings per second that one-at-a-time serves, from its first two recordings run back to back."""
    sample = [AudioRequest(i, 0.0, r.samples, r.features) for i, r in enumerate(stream[:2])]
    start = time.perf_counter()
    with contextlib.suppress(TimeoutError):
        serve.run_stream(one_at_a_time, sample, 1.0, timeout=1800)
    return len(sample) / (time.perf_counter() - start)
