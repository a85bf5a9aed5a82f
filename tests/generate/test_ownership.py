"""Who may use which storage, and when (`generate/pool.py`), against upstream's DynamicCache on the same tiny models.

- Threads: several threads calling `generate` on one model get DynamicCache's outputs; `max_concurrent_calls` calls
  run at once, each on storage of its own, and no more are allocated; `on_busy="error"` refuses a call beyond the
  bound; a thread that re-enters the pool it holds is refused instead of waiting for itself.
- Kept caches: a returned cache continues like DynamicCache's until a later call reuses its storage, and then raises
  the documented error; `detach()` keeps it.
- Continuation: a returned cache continued token by token reallocates a logarithmic number of times; a continuation
  over a configured capacity is refused before it starts.
- `release(model)` and `held_nbytes(model)`.
- Copies: a model deep-copied, pickled or `torch.save`d after a flexible call works and starts with an empty pool of
  its own; a copied returned cache is the caller's.

Calls that must overlap are held inside generate by a logits processor that waits on an event (`_Gate`): nothing
here depends on timing, and every wait and join has a timeout.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import transformers_flexcache
from tests.helpers import assert_same_generation, assert_same_padded_generation, generate_both, upstream_generate
from tests.model_cases import BART, JAMBA, LLAMA, PIX2STRUCT, T5, WHISPER
from transformers_flexcache.generate.pool import CachePool, pool_of

TIMEOUT_S = 60  # for every wait and join: generous, so that a loaded machine never fails a correct run
FLEX = {"cache_implementation": "flexible_static"}
GREEDY = {"do_sample": False, "return_dict_in_generate": True, "output_scores": True}
THREAD_CASES = [pytest.param(LLAMA, id="llama"), pytest.param(T5, id="t5")]


class _Gate(LogitsProcessor):
    """Holds the generate call it is given to at its first decoding step until `open()`: the call then holds its
    lease. `entered` is set when the call reaches that step. A logits processor changes no scores here."""

    def __init__(self):
        self.entered = threading.Event()
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.entered.is_set():
            self.entered.set()
            if not self._open.wait(TIMEOUT_S):
                raise TimeoutError("the test never opened this gate")
        return scores


class _Thread(threading.Thread):
    """Runs `target` and keeps its result or exception for the test thread."""

    def __init__(self, target, name: str):
        super().__init__(name=name, daemon=True)
        self._target_fn, self.result, self.error = target, None, None

    def run(self) -> None:
        try:
            self.result = self._target_fn()
        except BaseException as error:  # handed to the test thread
            self.error = error

    def outcome(self):
        self.join(TIMEOUT_S)
        assert not self.is_alive(), f"{self.name} did not finish within {TIMEOUT_S} s"
        if self.error is not None:
            raise self.error
        return self.result


def _gated_call(flex, inputs: dict, gate: _Gate, **kwargs):
    return lambda: flex.generate(
        **inputs, **FLEX, **GREEDY, max_new_tokens=3, logits_processor=LogitsProcessorList([gate]), **kwargs
    )


def _storages(flex) -> list[tuple[int, ...]]:
    return [tuple(cache.data_ptrs()) for cache in pool_of(flex).caches()]


# --- threads ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [*THREAD_CASES, pytest.param(WHISPER, id="whisper")])
def test_threads_calling_generate_on_one_model_get_the_outputs_of_dynamic_cache(case):
    # Whisper's own generate reads the cache after each of its inner calls to upstream's generate: those keep their
    # storage until Whisper's call ends (parked leases), or another thread's call could reuse it in between.
    upstream, flex = case.build()
    generator = torch.Generator().manual_seed(0)
    # Different batches and lengths, so that a call that read another's storage would give other tokens.
    inputs = [case.make_inputs(1 + i % 3, 3 + i, generator) for i in range(6)]
    expected = [upstream_generate(upstream, x, **GREEDY, max_new_tokens=4, **case.generate_kwargs) for x in inputs]
    num_threads, calls_per_thread = 4, 3
    start = threading.Barrier(num_threads, timeout=TIMEOUT_S)

    def calls(t: int):
        start.wait()
        order = [(t + j) % len(inputs) for j in range(calls_per_thread)]
        return [
            (i, flex.generate(**inputs[i], **FLEX, **GREEDY, max_new_tokens=4, **case.generate_kwargs)) for i in order
        ]

    threads = [_Thread(lambda t=t: calls(t), name=f"caller-{t}") for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        for i, actual in thread.outcome():
            assert_same_generation(expected[i], actual)
    assert len(pool_of(flex).caches()) == 1  # the default bound: one storage, the calls took turns


@pytest.mark.parametrize("case", THREAD_CASES)
def test_max_concurrent_calls_run_at_once_on_storages_of_their_own_and_one_more_waits(case):
    upstream, flex = case.build()
    generator = torch.Generator().manual_seed(1)
    inputs = [case.make_inputs(2, 4 + i, generator) for i in range(3)]
    config = {"max_concurrent_calls": 2, "max_batch_size": 2, "max_cache_len": 12, "max_encoder_len": 6}
    config = {k: v for k, v in config.items() if k != "max_encoder_len" or flex.config.is_encoder_decoder}
    gates = [_Gate() for _ in inputs]
    threads = [
        _Thread(_gated_call(flex, x, gate, cache_config=config), name=f"caller-{i}")
        for i, (x, gate) in enumerate(zip(inputs, gates, strict=True))
    ]
    threads[0].start()
    threads[1].start()
    assert gates[0].entered.wait(TIMEOUT_S) and gates[1].entered.wait(TIMEOUT_S)
    # Both calls are inside generate at once, each on storage of its own.
    storages = _storages(flex)
    assert len(storages) == 2 and set(storages[0]).isdisjoint(storages[1])
    threads[2].start()
    # The third call waits for a storage: it cannot reach its first step while both are held. (A wrong pool that let
    # it run would set the event well within the wait; a right one never sets it, so this cannot fail spuriously.)
    assert not gates[2].entered.wait(0.5)
    gates[0].open()
    assert gates[2].entered.wait(TIMEOUT_S)
    gates[1].open()
    gates[2].open()
    for x, thread in zip(inputs, threads, strict=True):
        assert_same_generation(upstream_generate(upstream, x, **GREEDY, max_new_tokens=3), thread.outcome())
    assert _storages(flex) == storages  # no third storage, nothing reallocated


def test_threads_sharing_an_assistant_model_get_the_tokens_of_dynamic_cache():
    # The assistant's cache is continued at every round of assisted decoding, by calls of the assistant's own pool;
    # between two rounds another thread's call could reuse that storage if the rounds gave their leases back.
    upstream, flex = LLAMA.build()
    upstream_assistant, assistant = LLAMA.build(seed=1)
    assistant.generation_config.flexible_static = {}  # the assistant uses a flexible cache of its own
    generator = torch.Generator().manual_seed(23)
    inputs = [LLAMA.make_inputs(1, 4 + i, generator) for i in range(3)]
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    expected = [upstream.generate(**x, assistant_model=upstream_assistant, **kwargs) for x in inputs]
    start = threading.Barrier(len(inputs), timeout=TIMEOUT_S)

    def calls(t: int):
        start.wait()
        config = {"max_concurrent_calls": len(inputs)}
        return [
            (i, flex.generate(**inputs[i], **FLEX, cache_config=config, assistant_model=assistant, **kwargs))
            for i in ((t + j) % len(inputs) for j in range(2))
        ]

    threads = [_Thread(lambda t=t: calls(t), name=f"caller-{t}") for t in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        for i, actual in thread.outcome():
            assert torch.equal(expected[i], actual)
    assert len(pool_of(assistant).caches()) == 1  # the assistant's default bound: its rounds took turns


def test_a_call_beyond_max_concurrent_calls_with_on_busy_error_raises_and_later_calls_work():
    upstream, flex = LLAMA.build()
    generator = torch.Generator().manual_seed(2)
    held, refused = LLAMA.make_inputs(2, 5, generator), LLAMA.make_inputs(1, 4, generator)
    gate = _Gate()
    holder = _Thread(_gated_call(flex, held, gate), name="holder")
    holder.start()
    assert gate.entered.wait(TIMEOUT_S)
    with pytest.raises(RuntimeError, match=r"already hold its flexible caches \(max_concurrent_calls=1\).*on_busy"):
        flex.generate(**refused, **FLEX, cache_config={"on_busy": "error"}, max_new_tokens=3)
    gate.open()
    assert_same_generation(upstream_generate(upstream, held, **GREEDY, max_new_tokens=3), holder.outcome())
    expected, actual = generate_both(upstream, flex, refused, cache_config={"on_busy": "error"}, max_new_tokens=3)
    assert_same_generation(expected, actual)


class _ReEnter(LogitsProcessor):
    """Calls generate on the same model from inside a generate call (the same thread), once."""

    def __init__(self, flex, inputs: dict):
        self.flex, self.inputs, self.done = flex, inputs, False

    def __call__(self, input_ids, scores):
        if not self.done:
            self.done = True
            self.flex.generate(**self.inputs, **FLEX, max_new_tokens=2)
        return scores


def test_a_thread_that_reenters_the_pool_it_holds_raises_instead_of_waiting_for_itself():
    upstream, flex = LLAMA.build()
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(3))
    processor = LogitsProcessorList([_ReEnter(flex, inputs)])
    result = {}

    def call():
        with pytest.raises(RuntimeError, match="one of them in this thread, which would wait for itself"):
            flex.generate(**inputs, **FLEX, max_new_tokens=3, logits_processor=processor)
        result["raised"] = True

    thread = _Thread(call, name="re-entering")
    thread.start()
    thread.outcome()  # a deadlock would time out here instead of hanging the suite
    assert result == {"raised": True}
    expected, actual = generate_both(upstream, flex, inputs, max_new_tokens=3)  # the lease was given back
    assert_same_generation(expected, actual)


# --- kept caches --------------------------------------------------------------------------------------------------
def _next_turn(output, inputs: dict, generator: torch.Generator, num_tokens: int = 3) -> dict:
    """Decoder-only inputs that continue `output`: its sequences plus `num_tokens` new tokens, with the mask."""
    # sequences: [B, P + new] -> input_ids: [B, P + new + num_tokens]
    sequences = output.sequences
    new_tokens = torch.randint(
        3, LLAMA.build_config().vocab_size, (sequences.shape[0], num_tokens), generator=generator
    )
    mask = inputs["attention_mask"]
    grown = torch.ones(mask.shape[0], sequences.shape[1] + num_tokens - mask.shape[1], dtype=mask.dtype)
    return {"input_ids": torch.cat([sequences, new_tokens], 1), "attention_mask": torch.cat([mask, grown], 1)}


def test_generate_output_holds_the_cache_under_both_names_of_transformers_5_24():
    _, flex = LLAMA.build()
    out = flex.generate(
        **LLAMA.make_inputs(2, 4, torch.Generator().manual_seed(4)), **FLEX, **GREEDY, max_new_tokens=2
    )
    # 5.24 renamed the output field `cache`; `past_key_values` is its deprecated alias, the same object.
    assert out.cache is out.past_key_values is flex.flexible_cache


def test_a_kept_cache_continues_like_dynamic_cache_and_raises_once_a_later_call_reused_its_storage():
    upstream, flex = LLAMA.build()
    generator = torch.Generator().manual_seed(5)
    first, other = LLAMA.make_inputs(2, 5, generator), LLAMA.make_inputs(3, 7, generator)
    extra = torch.Generator().manual_seed(50)

    expected_first = upstream_generate(upstream, first, **GREEDY, max_new_tokens=3)
    turn = _next_turn(expected_first, first, extra)
    expected = upstream_generate(upstream, turn, cache=expected_first.cache, **GREEDY, max_new_tokens=3)

    out = flex.generate(**first, **FLEX, **GREEDY, max_new_tokens=3)
    assert torch.equal(out.sequences, expected_first.sequences)
    assert_same_generation(
        expected, flex.generate(**turn, past_key_values=out.past_key_values, **GREEDY, max_new_tokens=3)
    )

    kept = flex.generate(**first, **FLEX, **GREEDY, max_new_tokens=3)
    flex.generate(**other, **FLEX, max_new_tokens=3)
    for name in ("cache", "past_key_values"):
        with pytest.raises(
            ValueError,
            match=r"a later generate call \(thread MainThread\) has reused its storage; call "
            r"cache\.detach\(\) on a returned cache",
        ):
            flex.generate(**turn, **{name: kept.cache}, **GREEDY, max_new_tokens=3)
    expected_other = upstream_generate(upstream, other, **GREEDY, max_new_tokens=3)  # the model's own storage is fine
    assert_same_generation(expected_other, flex.generate(**other, **FLEX, **GREEDY, max_new_tokens=3))


@pytest.mark.parametrize("case", [pytest.param(LLAMA, id="llama"), pytest.param(T5, id="t5")])
def test_every_use_of_a_stale_cache_raises_len_and_layers_included(case):
    _, flex = case.build()
    generator = torch.Generator().manual_seed(8)
    kept = flex.generate(**case.make_inputs(2, 5, generator), **FLEX, **GREEDY, max_new_tokens=3).cache
    assert len(kept) == 2  # live: as upstream, the number of decoder layers
    flex.generate(**case.make_inputs(3, 6, generator), **FLEX, max_new_tokens=3)  # reuses the storage
    reused = r"a later generate call \(thread MainThread\) has reused its storage"
    halves = [kept] if not flex.config.is_encoder_decoder else [kept.self_attention_cache, kept.cross_attention_cache]
    for cache in [kept, *halves]:
        with pytest.raises(ValueError, match=reused):
            len(cache)
        with pytest.raises(ValueError, match=reused):
            cache.get_seq_length()
    for cache in halves:
        with pytest.raises(ValueError, match=reused):
            _ = cache.layers
    # What stays readable on a stale object, as documented (`FlexibleStaticCache.mark_stale`).
    assert kept.is_stale and kept.nbytes == 0 and "stale" in repr(kept)


COPIERS = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": lambda obj: _saved_and_loaded(obj),
}


def _saved_and_loaded(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", list(COPIERS))
@pytest.mark.parametrize("case", THREAD_CASES)
def test_a_model_copied_after_a_flexible_call_generates_like_dynamic_cache_with_an_empty_pool_of_its_own(case, how):
    # Issue 21: the pool (with its lock) sat in the model's __dict__, so deepcopy/pickle/torch.save raised after the
    # first flexible call. Assisted decoding, model averaging and training scripts copy models.
    upstream, flex = case.build()
    generator = torch.Generator().manual_seed(9)
    first, other = case.make_inputs(2, 5, generator), case.make_inputs(3, 4, generator)
    flex.generate(**first, **FLEX, **GREEDY, max_new_tokens=3)
    held, pointers = transformers_flexcache.held_nbytes(flex), _storages(flex)

    copied = COPIERS[how](flex)
    assert transformers_flexcache.held_nbytes(copied) == {} and copied.flexible_cache is None
    expected, actual = generate_both(upstream, copied, other, max_new_tokens=3)
    assert_same_generation(expected, actual)
    (copied_storage,) = _storages(copied)
    assert set(copied_storage).isdisjoint(pointers[0])  # storage of its own
    assert transformers_flexcache.held_nbytes(flex) == held and _storages(flex) == pointers  # the original's untouched
    assert_same_generation(expected, flex.generate(**other, **FLEX, **GREEDY, max_new_tokens=3))


@pytest.mark.parametrize("case", THREAD_CASES)
def test_a_state_dict_after_a_flexible_call_holds_the_keys_of_upstreams_and_no_cache(case):
    upstream, flex = case.build()
    flex.generate(**case.make_inputs(2, 5, torch.Generator().manual_seed(10)), **FLEX, max_new_tokens=3)
    assert list(flex.state_dict()) == list(upstream.state_dict())


def test_a_deep_copy_of_a_returned_cache_is_the_callers_and_continues_like_dynamic_cache():
    upstream, flex = LLAMA.build()
    generator = torch.Generator().manual_seed(14)
    first, other = LLAMA.make_inputs(2, 5, generator), LLAMA.make_inputs(3, 7, generator)
    expected_first = upstream_generate(upstream, first, **GREEDY, max_new_tokens=3)
    turn = _next_turn(expected_first, first, torch.Generator().manual_seed(140))
    expected = upstream_generate(upstream, turn, cache=expected_first.cache, **GREEDY, max_new_tokens=3)

    copied = copy.deepcopy(flex.generate(**first, **FLEX, **GREEDY, max_new_tokens=3).cache)
    flex.generate(**other, **FLEX, max_new_tokens=3)  # reuses the model's storage: the copy has its own
    assert not copied.is_stale and set(copied.data_ptrs()).isdisjoint(_storages(flex)[0])
    assert_same_generation(expected, flex.generate(**turn, cache=copied, **GREEDY, max_new_tokens=3))


def test_a_detached_cache_continues_like_dynamic_cache_after_other_calls_which_allocate_new_storage():
    upstream, flex = LLAMA.build()
    generator = torch.Generator().manual_seed(6)
    first, other = LLAMA.make_inputs(2, 5, generator), LLAMA.make_inputs(2, 5, generator)
    expected_first = upstream_generate(upstream, first, **GREEDY, max_new_tokens=3)
    turn = _next_turn(expected_first, first, torch.Generator().manual_seed(60))
    expected = upstream_generate(upstream, turn, cache=expected_first.cache, **GREEDY, max_new_tokens=3)

    kept = flex.generate(**first, **FLEX, **GREEDY, max_new_tokens=3).cache.detach()
    assert transformers_flexcache.held_nbytes(flex) == {}  # the model holds nothing now: the storage is the caller's
    for _ in range(2):
        assert_same_generation(
            upstream_generate(upstream, other, **GREEDY, max_new_tokens=3),
            flex.generate(**other, **FLEX, **GREEDY, max_new_tokens=3),
        )
    (storage,) = _storages(flex)
    assert set(storage).isdisjoint(kept.data_ptrs())  # the model allocated storage of its own, once
    assert_same_generation(expected, flex.generate(**turn, cache=kept, **GREEDY, max_new_tokens=3))


def test_a_later_call_prefers_storage_whose_cache_was_not_returned_so_a_kept_cache_survives_it():
    upstream, flex = LLAMA.build()
    generator = torch.Generator().manual_seed(7)
    first, other = LLAMA.make_inputs(2, 5, generator), LLAMA.make_inputs(2, 6, generator)
    config = {"max_concurrent_calls": 2, "max_batch_size": 2, "max_cache_len": 16}
    expected_first = upstream_generate(upstream, first, **GREEDY, max_new_tokens=3)
    turn = _next_turn(expected_first, first, torch.Generator().manual_seed(70))
    expected = upstream_generate(upstream, turn, cache=expected_first.cache, **GREEDY, max_new_tokens=3)

    # Two overlapping calls make two storages: the first returns its cache (kept), the second only tokens.
    gates = [_Gate(), _Gate()]
    kept_call = _Thread(_gated_call(flex, first, gates[0], cache_config=config), name="kept")
    plain = lambda: flex.generate(  # noqa: E731
        **other, **FLEX, cache_config=config, max_new_tokens=3, logits_processor=LogitsProcessorList([gates[1]])
    )
    plain_call = _Thread(plain, name="plain")
    for thread, gate in zip((kept_call, plain_call), gates, strict=True):
        thread.start()
        assert gate.entered.wait(TIMEOUT_S)
    for gate in gates:
        gate.open()
    kept, _ = kept_call.outcome(), plain_call.outcome()
    assert len(_storages(flex)) == 2

    flex.generate(**other, **FLEX, cache_config=config, max_new_tokens=3)  # takes the storage nobody kept
    assert_same_generation(expected, flex.generate(**turn, cache=kept.cache, **GREEDY, max_new_tokens=3))


# --- continuation -------------------------------------------------------------------------------------------------
CONTINUATION_TOKENS = 50


@pytest.mark.parametrize("case", [pytest.param(LLAMA, id="llama"), pytest.param(JAMBA, id="jamba")])
def test_a_cache_continued_token_by_token_reallocates_a_logarithmic_number_of_times(case):
    upstream, flex = case.build()
    inputs = case.make_inputs(2, 5, torch.Generator().manual_seed(8))
    one = {**GREEDY, "max_new_tokens": 1}
    expected, actual = upstream_generate(upstream, inputs, **one), flex.generate(**inputs, **FLEX, **one)
    start_allocations, storages = actual.cache.num_allocations, set()
    mask = inputs["attention_mask"]
    for _ in range(CONTINUATION_TOKENS):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        expected = upstream.generate(input_ids=expected.sequences, attention_mask=mask, cache=expected.cache, **one)
        actual = flex.generate(input_ids=actual.sequences, attention_mask=mask, cache=actual.cache, **one)
        storages.add(tuple(actual.cache.data_ptrs()))
    assert torch.equal(expected.sequences, actual.sequences)
    reallocations = actual.cache.num_allocations - start_allocations
    # Each growth at least doubles the length: from the first call's 5 positions to 55, at most log2(55 / 5) + 1.
    assert reallocations <= 5, reallocations
    assert len(storages) <= reallocations + 1  # data pointers agree: no allocation went uncounted


def test_one_long_continuation_of_a_returned_cache_reserves_once():
    upstream, flex = LLAMA.build()
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(9))
    expected_first = upstream_generate(upstream, inputs, **GREEDY, max_new_tokens=2)
    actual_first = flex.generate(**inputs, **FLEX, **GREEDY, max_new_tokens=2)
    turn = _next_turn(expected_first, inputs, torch.Generator().manual_seed(90))
    allocations = actual_first.cache.num_allocations
    expected = upstream_generate(
        upstream, turn, cache=expected_first.cache, **GREEDY, max_new_tokens=CONTINUATION_TOKENS
    )
    actual = flex.generate(**turn, cache=actual_first.cache, **GREEDY, max_new_tokens=CONTINUATION_TOKENS)
    assert_same_generation(expected, actual)
    assert actual.cache.num_allocations == allocations + 1  # reserved for the whole call before it started


def test_a_continuation_over_a_configured_capacity_is_refused_before_it_starts_and_the_cache_stays_usable():
    upstream, flex = LLAMA.build()
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(10))
    config = {"max_batch_size": 2, "max_cache_len": 16, "on_overflow": "error"}
    expected_first = upstream_generate(upstream, inputs, **GREEDY, max_new_tokens=3)
    out = flex.generate(**inputs, **FLEX, cache_config=config, **GREEDY, max_new_tokens=3)
    turn = _next_turn(expected_first, inputs, torch.Generator().manual_seed(100))  # 11 positions
    length, pointers = out.cache.get_seq_length(), out.cache.data_ptrs()
    # 11 + 6 - 1 = 16 positions fit; 11 + 7 - 1 = 17 do not, whether or not the call repeats the config.
    for repeat in ({}, {**FLEX, "cache_config": config}):
        with pytest.raises(ValueError, match=r"cache_len=17 exceeds max_cache_len=16; pass cache_config="):
            flex.generate(**turn, cache=out.cache, **repeat, **GREEDY, max_new_tokens=7)
        assert (out.cache.get_seq_length(), out.cache.data_ptrs()) == (length, pointers)
    expected = upstream_generate(upstream, turn, cache=expected_first.cache, **GREEDY, max_new_tokens=6)
    assert_same_generation(expected, flex.generate(**turn, cache=out.cache, **GREEDY, max_new_tokens=6))
    assert out.cache.data_ptrs() == pointers


# --- release ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", THREAD_CASES)
def test_release_frees_the_storage_a_model_holds_and_the_next_call_allocates_again(case):
    upstream, flex = case.build()
    inputs = case.make_inputs(2, 5, torch.Generator().manual_seed(11))
    assert transformers_flexcache.held_nbytes(flex) == {} and transformers_flexcache.release(flex) == 0
    out = flex.generate(**inputs, **FLEX, **GREEDY, max_new_tokens=3)
    held, nbytes = transformers_flexcache.held_nbytes(flex), out.cache.nbytes
    assert held == {"cpu": nbytes} and nbytes > 0

    assert transformers_flexcache.release(flex) == nbytes
    assert transformers_flexcache.held_nbytes(flex) == {}
    assert out.cache.nbytes == 0  # the storage itself is gone, not only the pool's reference to it
    with pytest.raises(ValueError, match=r"freed by transformers_flexcache\.release\(\) on Flex"):
        out.cache.get_seq_length()

    expected, actual = generate_both(upstream, flex, inputs, max_new_tokens=3)
    assert_same_generation(expected, actual)
    assert transformers_flexcache.held_nbytes(flex) == held  # allocated again, at the same capacities


@pytest.mark.parametrize("case", THREAD_CASES)
def test_padded_capacities_are_kept_when_an_exact_call_takes_the_storage_in_between(case):
    # Issue 21: with one storage per model, an exact call frees the padded storage; the next padded call must still pad
    # to the capacities the first one planned (a compiled graph was built for them), not to its own smaller needs.
    upstream, flex = case.build()
    generator = torch.Generator().manual_seed(15)
    padded = {"shape_policy": "padded"}
    first = flex.generate(
        **case.make_inputs(3, 15, generator), **FLEX, **GREEDY, cache_config=padded, max_new_tokens=4
    )
    first = first.cache
    planned = first.capacities()
    length_name = "max_encoder_len" if flex.config.is_encoder_decoder else "max_prompt_len"
    assert planned["max_batch_size"] == 3 and planned[length_name] == 15
    flex.generate(**case.make_inputs(1, 4, generator), **FLEX, **GREEDY, max_new_tokens=3)  # exact: frees the padded
    assert first.is_stale
    inputs = case.make_inputs(2, 2, generator)
    expected, actual = generate_both(upstream, flex, inputs, cache_config=padded, max_new_tokens=3)
    assert_same_padded_generation(upstream, flex, inputs, expected, actual, max_new_tokens=3)
    assert actual.cache.capacities() == planned
    assert actual.cache.batch_size == 3  # padded to the planned rows, not to its own 2


def test_release_forgets_the_planned_capacities():
    _, flex = LLAMA.build()
    generator = torch.Generator().manual_seed(16)
    padded = {"shape_policy": "padded"}
    flex.generate(**LLAMA.make_inputs(3, 15, generator), **FLEX, cache_config=padded, max_new_tokens=4)
    transformers_flexcache.release(flex)
    out = flex.generate(**LLAMA.make_inputs(1, 2, generator), **FLEX, **GREEDY, cache_config=padded, max_new_tokens=2)
    assert out.cache.capacities() == {"max_batch_size": 1, "max_cache_len": 3, "max_prompt_len": 2}


def test_a_detached_cache_survives_a_release():
    upstream, flex = LLAMA.build()
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(12))
    expected_first = upstream_generate(upstream, inputs, **GREEDY, max_new_tokens=3)
    turn = _next_turn(expected_first, inputs, torch.Generator().manual_seed(120))
    kept = flex.generate(**inputs, **FLEX, **GREEDY, max_new_tokens=3).cache.detach()
    flex.generate(**inputs, **FLEX, max_new_tokens=3)  # the model's own storage, which release frees
    nbytes = kept.nbytes
    assert transformers_flexcache.release(flex) > 0
    assert kept.nbytes == nbytes
    expected = upstream_generate(upstream, turn, cache=expected_first.cache, **GREEDY, max_new_tokens=3)
    assert_same_generation(expected, flex.generate(**turn, cache=kept, **GREEDY, max_new_tokens=3))


def test_release_during_a_call_frees_that_storage_when_the_call_ends():
    upstream, flex = LLAMA.build()
    inputs = LLAMA.make_inputs(2, 5, torch.Generator().manual_seed(13))
    gate = _Gate()
    caller = _Thread(_gated_call(flex, inputs, gate), name="caller")
    caller.start()
    assert gate.entered.wait(TIMEOUT_S)
    assert transformers_flexcache.release(flex) == 0  # leased: freed when the call ends, not under its feet
    gate.open()
    assert_same_generation(upstream_generate(upstream, inputs, **GREEDY, max_new_tokens=3), caller.outcome())
    assert transformers_flexcache.held_nbytes(flex) == {}


# --- on_overflow="error": every need of a call is checked before its first decoder step ----------------------------
ERROR_CONFIG = {"max_batch_size": 4, "max_cache_len": 16, "on_overflow": "error"}


class _DecoderSteps:
    """Counts forwards of `model`'s decoder: a call refused before it starts makes none."""

    def __init__(self, model):
        self.count = 0
        model.get_decoder().register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1


# (what the call adds to batch 1 x prompt 6 under ERROR_CONFIG, the capacity it exceeds): each needs one more than it
# may use. Llama: positions are prompt + new tokens - 1 (+ prompt-lookup candidates).
REFUSED_CALLS = {
    "beams": ({"batch_size": 3, "num_beams": 2, "max_new_tokens": 3}, r"batch_size=6 exceeds max_batch_size=4"),
    "returned sequences": (
        {"batch_size": 3, "do_sample": True, "num_return_sequences": 2, "max_new_tokens": 3},
        r"batch_size=6 exceeds max_batch_size=4",
    ),
    "prompt-lookup candidates": (
        {"batch_size": 1, "prompt_lookup_num_tokens": 4, "max_new_tokens": 8},
        r"cache_len=17 exceeds max_cache_len=16",
    ),
    "assisted decoding": (
        {"batch_size": 1, "assistant": True, "max_new_tokens": 12},
        r"cache_len=17 exceeds max_cache_len=16",
    ),
    "length": ({"batch_size": 1, "max_new_tokens": 12}, r"cache_len=17 exceeds max_cache_len=16"),
}


def _call_kwargs(spec: dict, generator: torch.Generator) -> tuple[dict, dict]:
    spec = dict(spec)
    inputs = LLAMA.make_inputs(spec.pop("batch_size"), 6, generator)
    if spec.pop("assistant", False):
        spec["assistant_model"] = LLAMA.build()[1]
    return inputs, spec


@pytest.mark.parametrize("name", list(REFUSED_CALLS))
def test_a_call_over_a_capacity_is_refused_before_its_first_decoder_step_and_the_next_call_is_correct(name):
    upstream, flex = LLAMA.build()
    generator = torch.Generator().manual_seed(14)
    fits = LLAMA.make_inputs(2, 6, generator)
    generate_both(upstream, flex, fits, cache_config=ERROR_CONFIG, max_new_tokens=3)
    pointers, steps = flex.flexible_cache.data_ptrs(), _DecoderSteps(flex)

    spec, message = REFUSED_CALLS[name]
    inputs, kwargs = _call_kwargs(spec, generator)
    with pytest.raises(ValueError, match=message + r".*pass cache_config="):
        flex.generate(**inputs, **FLEX, cache_config=ERROR_CONFIG, **kwargs)
    assert steps.count == 0
    assert _storages(flex) == [tuple(pointers)]

    # One less fits, on the same storage, with DynamicCache's outputs.
    smaller = {**kwargs, "max_new_tokens": kwargs["max_new_tokens"] - 1} if "exceeds max_cache_len" in message else {}
    if "batch_size" in message:
        inputs = {key: value[:2] for key, value in inputs.items()}
        smaller = kwargs
    expected, actual = generate_both(upstream, flex, inputs, cache_config=ERROR_CONFIG, seed=1, **smaller)
    assert_same_generation(expected, actual)
    assert _storages(flex) == [tuple(pointers)]


def test_a_configured_capacity_stays_a_limit_after_the_storage_grew_past_it():
    upstream, flex = LLAMA.build()
    generator = torch.Generator().manual_seed(15)
    flex.generate(**LLAMA.make_inputs(6, 6, generator), **FLEX, max_new_tokens=20)  # grows to 6 rows x 25 positions
    pointers = _storages(flex)
    for inputs, kwargs, message in (
        (LLAMA.make_inputs(5, 6, generator), {"max_new_tokens": 3}, r"batch_size=5 exceeds max_batch_size=4"),
        (LLAMA.make_inputs(1, 6, generator), {"max_new_tokens": 12}, r"cache_len=17 exceeds max_cache_len=16"),
        (
            LLAMA.make_inputs(1, 6, generator),
            {"max_new_tokens": 8, "prompt_lookup_num_tokens": 4},
            r"cache_len=17 exceeds max_cache_len=16",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            flex.generate(**inputs, **FLEX, cache_config=ERROR_CONFIG, **kwargs)
        assert _storages(flex) == pointers
    expected, actual = generate_both(
        upstream, flex, LLAMA.make_inputs(4, 6, generator), cache_config=ERROR_CONFIG, max_new_tokens=11
    )
    assert_same_generation(expected, actual)
    assert _storages(flex) == pointers


def test_a_refused_first_call_allocates_nothing_and_changes_no_setting_of_the_pool():
    _, flex = LLAMA.build()
    inputs = LLAMA.make_inputs(5, 6, torch.Generator().manual_seed(16))
    with pytest.raises(ValueError, match=r"batch_size=5 exceeds max_batch_size=4"):
        flex.generate(**inputs, **FLEX, cache_config={**ERROR_CONFIG, "max_concurrent_calls": 3}, max_new_tokens=3)
    assert transformers_flexcache.held_nbytes(flex) == {}
    assert pool_of(flex).max_concurrent_calls == 1


def test_an_assistant_with_capacities_of_its_own_is_refused_before_the_main_decoder_runs():
    upstream, flex = LLAMA.build()
    _, assistant = LLAMA.build()
    # The assistant asks for the flexible cache itself (the saved form of its generation config); upstream's candidate
    # generator clears the main call's request for it.
    assistant.generation_config.flexible_static = {"max_cache_len": 8, "on_overflow": "error"}
    inputs = LLAMA.make_inputs(1, 6, torch.Generator().manual_seed(17))
    steps = _DecoderSteps(flex)
    with pytest.raises(ValueError, match=r"exceeds max_cache_len=8; pass cache_config="):
        flex.generate(**inputs, **FLEX, assistant_model=assistant, max_new_tokens=6, do_sample=False)
    assert steps.count == 0
    assistant.generation_config.flexible_static = {"max_cache_len": 16, "on_overflow": "error"}
    expected, actual = generate_both(upstream, flex, inputs, assistant_model=assistant, max_new_tokens=6)
    assert_same_generation(expected, actual)
    (assistant_storage,) = _storages(assistant)  # the assistant, continued at every round, allocated once
    assert pool_of(assistant).caches()[0].num_allocations == 1


# --- what a call needs, stated before it starts ---------------------------------------------------------------------
def test_whisper_needs_batch_times_returned_sequences_times_beams_rows():
    upstream, flex = WHISPER.build()
    inputs = WHISPER.make_inputs(2, WHISPER.decoding_input_len, torch.Generator().manual_seed(18))
    kwargs = {"num_beams": 2, "num_return_sequences": 2, "max_new_tokens": 3}
    # Whisper's generate repeats its inputs num_return_sequences times, then beam search expands each: 2 x 2 x 2 rows.
    with pytest.raises(ValueError, match=r"batch_size=8 exceeds max_batch_size=7"):
        flex.generate(**inputs, **FLEX, cache_config={"max_batch_size": 7, "on_overflow": "error"}, **kwargs)
    assert transformers_flexcache.held_nbytes(flex) == {}
    config = {"max_batch_size": 8, "on_overflow": "error"}
    expected, actual = generate_both(upstream, flex, inputs, cache_config=config, **kwargs)
    assert_same_generation(expected, actual)
    assert flex.flexible_cache.max_batch_size == 8


ENCODER_DECODER = [pytest.param(case, id=case.name) for case in (T5, BART, WHISPER, PIX2STRUCT)]


@pytest.mark.parametrize("candidates", ["prompt_lookup", "assistant_model"])
@pytest.mark.parametrize("case", ENCODER_DECODER)
def test_candidate_decoding_on_encoder_decoder_models_equals_dynamic_cache(case, candidates, monkeypatch):
    # Both roll rejected candidates back with `crop`, which a flexible encoder-decoder cache applies to its
    # self-attention half (upstream's EncoderDecoderCache.crop refuses any cache but DynamicCache).
    crops = []
    crop = transformers_flexcache.FlexibleEncoderDecoderCache.crop
    monkeypatch.setattr(
        transformers_flexcache.FlexibleEncoderDecoderCache, "crop", lambda self, n: (crops.append(n), crop(self, n))[1]
    )
    upstream, flex = case.build()
    inputs = case.make_inputs(1, case.decoding_input_len or 6, torch.Generator().manual_seed(31))
    if candidates == "prompt_lookup":
        kwargs = {"prompt_lookup_num_tokens": 3}
    else:
        kwargs = {"assistant_model": case.build(seed=1)[1]}  # another model: some candidates are rejected
    expected, actual = generate_both(upstream, flex, inputs, max_new_tokens=8, **kwargs, **case.generate_kwargs)
    assert_same_generation(expected, actual)
    assert any(tokens_to_remove < 0 for tokens_to_remove in crops)  # candidates were rejected and rolled back


def test_crop_of_an_encoder_decoder_cache_removes_decoder_positions_and_keeps_the_encoder_ones():
    _, flex = T5.build()
    cache = transformers_flexcache.FlexibleEncoderDecoderCache.for_model(
        flex, max_batch_size=2, max_cache_len=8, max_encoder_len=5
    )
    keys = torch.randn(2, 4, 6, 8)
    cache.update(keys, keys + 1, 0)
    cache.cross_attention_kv(0, torch.randn(2, 5, 32), lambda states: (torch.randn(2, 4, 5, 8),) * 2)
    cache.crop(-2)  # upstream's semantics: a negative count of positions to remove
    assert cache.get_seq_length(0) == 4 and cache.get_encoder_length(0) == 5
    torch.testing.assert_close(cache.get_kv(0, 2, 4)[0], keys[:, :, :4], rtol=0, atol=0)


@pytest.mark.parametrize(
    "where", ["list", "string", "saved generation config"], ids=["list", "string", "saved-generation-config"]
)
def test_a_cache_config_that_is_not_a_dict_is_refused_before_anything_is_built(where):
    _, flex = LLAMA.build()
    inputs = LLAMA.make_inputs(1, 4, torch.Generator().manual_seed(20))
    bad = {"list": [("max_batch_size", 4)], "string": "max_batch_size=4"}.get(where, "max_batch_size=4")
    if where == "saved generation config":
        flex.generation_config.flexible_static = bad
        kwargs = {}
    else:
        kwargs = {**FLEX, "cache_config": bad}
    with pytest.raises(TypeError, match=r"cache_config must be a dict such as \{\"max_batch_size\": 8, "):
        flex.generate(**inputs, max_new_tokens=2, **kwargs)
    assert transformers_flexcache.held_nbytes(flex) == {} and flex.flexible_cache is None


@pytest.mark.parametrize("case", [pytest.param(LLAMA, id="llama"), pytest.param(WHISPER, id="whisper")])
def test_a_returned_cache_is_marked_so_before_its_storage_can_be_leased_again(case, monkeypatch):
    # Leases prefer storage whose cache nobody kept. If the mark came after the lease was given back, a call of
    # another thread could take that storage in between, although another one was free.
    _, flex = case.build()
    marked_when_given_back = []
    give_back = CachePool._release_slot

    def recording(self, slot):
        marked_when_given_back.append(slot.returned)
        give_back(self, slot)

    monkeypatch.setattr(CachePool, "_release_slot", recording)
    inputs = case.make_inputs(2, case.decoding_input_len or 5, torch.Generator().manual_seed(21))
    out = flex.generate(**inputs, **FLEX, **GREEDY, max_new_tokens=2, **case.generate_kwargs)
    assert out.cache is flex.flexible_cache
    assert marked_when_given_back == [True]


PADDED_CASES = [pytest.param(case, id=case.name) for case in (LLAMA, JAMBA, T5)]


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
@pytest.mark.parametrize("case", PADDED_CASES)
def test_a_cache_of_the_padded_policy_continues_like_dynamic_cache(case, name):
    # The first call ran padded: 2 rows padded to 4, a prompt of 5 left-padded to 8 (decoder-only), encoder outputs of
    # 5 right-padded to 8 (encoder-decoder). The continuation must run at those shapes too, or it reads the padding.
    upstream, flex = case.build()
    inputs = case.make_inputs(2, 5, torch.Generator().manual_seed(22))
    config = {"shape_policy": "padded", "max_batch_size": 4, "max_cache_len": 40}
    config.update({"max_encoder_len": 8} if flex.config.is_encoder_decoder else {"max_prompt_len": 8})
    expected_first = upstream_generate(upstream, inputs, **GREEDY, max_new_tokens=4)
    actual_first = flex.generate(**inputs, **FLEX, cache_config=config, **GREEDY, max_new_tokens=4)
    atol = assert_same_padded_generation(upstream, flex, inputs, expected_first, actual_first, max_new_tokens=4)
    if flex.config.is_encoder_decoder:  # upstream continues a decoder from its sequences, with the same encoder input
        expected_turn = {**inputs, "decoder_input_ids": expected_first.sequences}
        actual_turn = {**inputs, "decoder_input_ids": actual_first.sequences}
    else:
        expected_turn = actual_turn = _next_turn(expected_first, inputs, torch.Generator().manual_seed(220))
    expected = upstream_generate(upstream, expected_turn, cache=expected_first.cache, **GREEDY, max_new_tokens=4)
    actual = flex.generate(**actual_turn, **{name: actual_first.cache}, **GREEDY, max_new_tokens=4)
    assert_same_generation(expected, actual, atol=atol)  # it runs at the padded shapes of the first call


@pytest.mark.parametrize("candidates", ["prompt_lookup", "assistant_model"])
@pytest.mark.parametrize("case", [pytest.param(case, id=case.name) for case in (LLAMA, T5, WHISPER)])
def test_candidate_decoding_with_the_padded_policy_equals_dynamic_cache(case, candidates):
    # Padding rows would make upstream refuse candidate decoding (batch 1 only), and an encoder-decoder assistant
    # re-encodes the inputs at their own length: such calls are padded in their decoder-only prompt only.
    upstream, flex = case.build()
    inputs = case.make_inputs(1, case.decoding_input_len or 6, torch.Generator().manual_seed(31))
    config = {"shape_policy": "padded", "max_batch_size": 2, "max_cache_len": 40}
    config.update({"max_encoder_len": 16} if flex.config.is_encoder_decoder else {"max_prompt_len": 8})
    if candidates == "prompt_lookup":
        kwargs = {"prompt_lookup_num_tokens": 3}
    else:
        kwargs = {"assistant_model": case.build(seed=1)[1]}
    expected, actual = generate_both(upstream, flex, inputs, cache_config=config, max_new_tokens=8, **kwargs)
    assert_same_padded_generation(upstream, flex, inputs, expected, actual, max_new_tokens=8, **kwargs)


def test_a_stale_cache_object_does_not_keep_storage_alive_after_a_growth_and_a_release():
    import gc
    import weakref

    _, flex = LLAMA.build()
    generator = torch.Generator().manual_seed(90)
    small = LLAMA.make_inputs(1, 4, generator)
    kept = flex.generate(
        **small, max_new_tokens=2, cache_implementation="flexible_static", return_dict_in_generate=True
    )
    before_growth = [weakref.ref(tensor) for tensor in kept.cache.layers[0].storages()]
    flex.generate(**LLAMA.make_inputs(3, 9, generator), max_new_tokens=4, cache_implementation="flexible_static")
    assert kept.cache.is_stale and kept.cache.nbytes == 0
    gc.collect()
    assert all(ref() is None for ref in before_growth), "the stale object kept the storage the growth replaced"
    assert transformers_flexcache.release(flex) > 0
    assert transformers_flexcache.held_nbytes(flex) == {}
