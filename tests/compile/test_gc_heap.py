"""`gc_heap`: the collector's heap frozen for a block and handed back, its collections recorded."""

from __future__ import annotations

import gc
import weakref

from transformers_flexcache.compile.gc_heap import Collections, frozen_heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_heap_collects_first_freezes_the_living_and_hands_them_back():
    garbage, kept = _Cycle(), _Cycle()
    gone = weakref.ref(garbage)
    del garbage  # unreachable, but only a collection frees a cycle: freed before the freeze, not frozen for good
    with frozen_heap() as frozen:
        assert gone() is None
        assert frozen > 0 and gc.get_freeze_count() > 0
        assert not any(obj is kept for obj in gc.get_objects())  # frozen: no collection looks at it
        made = _Cycle()
        assert any(obj is made for obj in gc.get_objects())  # made after: collected as usual
    assert gc.get_freeze_count() == 0
    assert any(obj is kept for obj in gc.get_objects())


def test_collections_records_each_pause_with_its_generation_while_open():
    with Collections() as pauses:
        gc.collect(0)
        gc.collect()
    gc.collect()  # after the block: not recorded
    assert [generation for generation, _ in pauses.seen] == [0, 2]
    summary = pauses.summary()
    assert summary["collections"] == 2 and summary["full"] == 1
    assert 0 < summary["longest_ms"] <= summary["total_ms"]


def test_collections_during_a_compile_are_recorded_apart():
    from torch._guards import CompileContext, CompileId, compile_context

    with Collections() as pauses:
        gc.collect()
        with compile_context(CompileContext(CompileId(frame_id=0, frame_compile_id=0))):
            gc.collect()
            gc.collect(0)
    assert [generation for generation, _ in pauses.seen] == [2]
    assert [generation for generation, _ in pauses.compiling] == [2, 0]
    summary = pauses.summary()
    assert summary["full"] == 1 and summary["compiling"]["collections"] == 2 and summary["compiling"]["full"] == 1
