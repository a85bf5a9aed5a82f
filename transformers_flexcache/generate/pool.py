"""Who may use which storage, and when: the pool of flexible caches held by a model.

Design decisions:
- A model holds a `CachePool`: at most `max_concurrent_calls` caches (default 1), each allocated once and grown
  only when a call needs more. The pool sits beside the model (a weak map), not in its `__dict__`: copying, pickling
  or saving a model never meets it, and a copy starts with an empty pool of its own. It keeps the largest capacities
  planned for each kind of cache even after freeing that storage (a call of another kind took its place), so a
  fixed-shape policy keeps padding to them; `release` forgets them. A `generate` call *leases* one for its duration: nobody else writes that storage until
  the call ends. A call that finds every cache leased waits for one (`on_busy="wait"`, the default) or raises
  (`on_busy="error"`); a thread that already holds a lease of the pool never waits for another one (it would wait
  for itself) and raises instead.
- A steady stream of calls within capacity allocates nothing: each lease reuses a cache's storage. But each lease
  hands out a *new* cache object over that storage (`renewed()`), and marks the object of the previous lease stale.
  So a `past_key_values` returned by an earlier call stays valid until a later call reuses its storage, and from then
  on any use of it raises a `ValueError` that says so and how to keep a cache (`cache.detach()`), instead of
  continuing from someone else's keys. Leases prefer storage whose cache was not returned to the caller, so a kept
  cache survives as long as the pool has other storage to give.
- A cache passed back to `generate` (`past_key_values=...`, a continuation) is leased as it is, not renewed, and
  reserved once for the whole call, its length growing at least twofold when it must grow (see
  `FlexibleStaticCache.reserve`), so continuing, turn by turn or token by token, never reallocates per turn.
- `release(model)` frees every idle cache of the pool at once (and the leased ones when their calls end): upstream
  removed its own hidden cache reuse because "it will keep a big memory footprint without the user noticing"
  (transformers PR #47731). Ours is explicit, counted (`held_nbytes`) and releasable.
- A lease lasts one `generate` call: the call's plan (`generate.plan.CallPlan`) holds it and gives it back when the call ends,
  whatever happened in between. A generate call made inside another one of the same thread (each of Whisper's calls
  per segment and temperature fallback, an assistant model's call per round of assisted decoding) *parks* its leases
  in the enclosing call when it ends: the storage stays that thread's until the outermost call ends, because that
  call still reads it (Whisper's post-processing; the assistant's cache, continued at the next round), and only a
  later call of the same thread may lease it again meanwhile. Given back at once, another thread could reuse it in
  between and the running call would fail on a stale cache. Whoever still needs what a lease's storage holds when a
  later lease is about to reuse it (Whisper's rows kept across a temperature fallback) says so with
  `Lease.before_reuse(hook)`.
- The pool answers the one capacity question of a call (`decide`: what is held, against the call's need and
  `cache_config`, in `cache/capacity.py`); leasing then only builds or grows storage to that answer.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..cache import CacheConfig, CacheKind, Need, Reservation, decide
from ..cache.capacity import PaddedSize
from ..log import get_logger

logger = get_logger(__name__)

DEFAULT_MAX_CONCURRENT_CALLS = 1
# The pool of each model, weakly keyed: it is not in the model's `__dict__`, so `copy.deepcopy(model)`, pickling and
# `torch.save(model)` never meet it (its lock cannot be copied), a copy starts with an empty pool of its own, and a
# model's pool goes with the model.
_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_pool_creation = threading.Lock()


@dataclass
class _Slot:
    """One cache's storage in a pool, and who holds it."""

    cache: object
    kind: CacheKind
    lease: Lease | None = None  # the lease that holds it now (None: idle)
    returned: bool = False  # whether the cache object of the last lease went back to the caller
    lease_count: int = 0
    free_on_return: bool = False

    @property
    def holder(self) -> int | None:
        """Thread id of the generate call that holds it (its lease active or parked), or None."""
        return self.lease.thread if self.lease is not None else None


@dataclass
class Lease:
    """A cache lent to one generate call; `give_back` ends it, `park` keeps it for the enclosing call."""

    pool: CachePool
    slot: _Slot | None
    cache: object
    thread: int = field(default_factory=threading.get_ident)
    given_by_caller: bool = False
    parked: bool = False  # its call ended inside an enclosing generate call of the same thread, which keeps it
    _ended: bool = field(default=False, repr=False)
    _before_reuse: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def before_reuse(self, hook: Callable[[], None]) -> None:
        """Call `hook` before a later lease of the same thread reuses this lease's storage (while it is parked), e.g.
        to copy rows that the running call still reads. Hooks of a lease given back are dropped: its call ended."""
        self._before_reuse.append(hook)

    def give_back(self) -> None:
        if not self._ended:
            self._ended = True
            self.pool._give_back(self)

    def park(self) -> None:
        self.parked = True

    def available_to(self, thread: int) -> bool:
        """Whether a new lease of `thread` may take this one's storage: its call ended, in that same thread."""
        return self.parked and self.thread == thread


class CachePool:
    """The flexible caches of one model, each allocated once, each lent to one generate call at a time.

    Args:
        owner_name (`str`): how errors name the model (its class name).
    """

    def __init__(self, *, owner_name: str):
        self.owner_name = owner_name
        self.max_concurrent_calls = DEFAULT_MAX_CONCURRENT_CALLS
        self._slots: list[_Slot] = []
        self._condition = threading.Condition()
        self._given: dict[int, Lease] = {}  # id(cache) -> its lease, for caches passed in that the pool does not hold
        # kind -> the largest capacities planned for it, kept when its storage is freed (a call of another kind took
        # its place) or detached: a fixed-shape policy pads to them, and a user's compiled graphs were built for them.
        self._planned: dict[CacheKind, dict[str, int]] = {}
        # The cache object of the last lease each thread took (`FlexCacheGenerationMixin.flexible_cache`).
        self._last: weakref.WeakKeyDictionary[threading.Thread, object] = weakref.WeakKeyDictionary()

    # --- what the pool holds ----------------------------------------------------------------------------------
    def caches(self) -> list:
        """The cache object of each storage the pool holds (the one its last lease handed out)."""
        with self._condition:
            return [slot.cache for slot in self._slots]

    def held_nbytes(self) -> dict[str, int]:
        """Bytes of storage the pool holds, per device."""
        per_device: dict[str, int] = {}
        for cache in self.caches():
            for device, nbytes in cache.nbytes_per_device().items():
                per_device[device] = per_device.get(device, 0) + nbytes
        return per_device

    def last_cache(self):
        """The cache object of the last lease that this thread took, or None."""
        with self._condition:
            return self._last.get(threading.current_thread())

    def capacities(self, kind: CacheKind) -> dict[str, int]:
        """The largest capacities planned for caches of `kind`: those its caches hold, and those of its storage freed
        since (empty if none was ever planned, or since `release()`)."""
        with self._condition:
            return self._capacities(kind)

    def _capacities(self, kind: CacheKind) -> dict[str, int]:
        for slot in self._slots:
            if slot.kind == kind and not slot.free_on_return:
                self._remember(slot)
        return dict(self._planned.get(kind, {}))

    def _remember(self, slot: _Slot) -> None:
        """Keep the capacities of `slot`'s storage in the plan of its kind (before it is freed or detached)."""
        planned = self._planned.setdefault(slot.kind, {})
        for name, value in slot.cache.capacities().items():
            planned[name] = max(planned.get(name, 0), value)

    # --- the capacity question ---------------------------------------------------------------------------------
    def decide(
        self,
        need: Need,
        config: CacheConfig,
        *,
        kind: CacheKind | None = None,
        given=None,
        padded_size: PaddedSize | None = None,
    ) -> Reservation:
        """The one capacity decision of a generate call (`cache.capacity.decide`): the call's `need` against what the
        pool holds for caches of `kind` (the largest capacities planned for it), or against what `given` holds (a
        cache passed back to continue, whose decoder length then grows geometrically), and the call's `config`.

        Raises:
            ValueError: the call exceeds a capacity with `on_overflow="error"`. Nothing is changed, the pool's
                settings included.
        """
        with self._condition:
            held = given.capacities() if given is not None else self._capacities(kind)
        return decide(held, need, config, padded_size=padded_size, geometric=given is not None)

    # --- leases -------------------------------------------------------------------------------------------------
    def lease(self, *, kind: CacheKind, reservation: Reservation, need: Mapping[str, int]) -> Lease:
        """Lend a cache of `kind`, reset and grown to `reservation` (`decide`'s answer), for one generate call.

        Args:
            kind: what distinguishes caches that cannot stand in for each other (encoder-decoder or not, shape
                policy, the placement of every layer).
            reservation: the call's reservation; new storage is built at its capacities.
            need: the capacities the call needs: storage that holds them already is preferred.

        Raises:
            RuntimeError: every cache is leased and `on_busy="error"`, or this thread already holds one.
        """
        config = reservation.config
        me = threading.get_ident()
        with self._condition:
            if config.max_concurrent_calls is not None:
                self.max_concurrent_calls = config.max_concurrent_calls
            while True:
                slot = self._idle_slot(kind, need, me)
                if slot is not None:
                    break
                if self._room_for_one_more(kind):
                    slot = self._new_slot(kind, reservation)
                    break
                self._refuse_or_wait(me, config)
            previous = slot.lease
            lease = self._take(slot, slot.cache, me)
        try:
            lease.cache = self._renew(slot, previous)
            lease.cache.reserve(reservation)
        except BaseException:
            lease.give_back()
            raise
        self._note_last(lease)
        return lease

    def lease_given(self, cache, *, reservation: Reservation) -> Lease:
        """Lend a cache that the caller passed back to `generate` (a continuation), as it is, for one call, grown to
        `reservation` (`decide`'s answer for it).

        Raises:
            ValueError: the cache is stale (its storage was reused or released).
            RuntimeError: another generate call is using this cache right now.
        """
        cache._check_live()
        me = threading.get_ident()
        with self._condition:
            slot = next((slot for slot in self._slots if slot.cache is cache), None)
            current = slot.lease if slot is not None else self._given.get(id(cache))
            if current is not None and not current.available_to(me):
                raise RuntimeError(
                    f"this cache is in use by another generate call of {self.owner_name} (thread {current.thread}); "
                    "a cache serves one call at a time: wait for that call, or pass a cache of your own"
                )
            lease = self._take(slot, cache, me, given_by_caller=True)
        try:
            cache.reserve(reservation)
        except BaseException:
            lease.give_back()
            raise
        self._note_last(lease)
        return lease

    def _note_last(self, lease: Lease) -> None:
        with self._condition:
            self._last[threading.current_thread()] = lease.cache

    def _take(self, slot: _Slot | None, cache, me: int, *, given_by_caller: bool = False) -> Lease:
        """A new lease of `slot` (or of `cache`, given by a caller, that no slot holds) for thread `me`; a parked lease
        of that storage is superseded (its give-back does nothing: the new one gives it back)."""
        current = slot.lease if slot is not None else self._given.get(id(cache))
        if current is not None:
            current._ended = True
        lease = Lease(pool=self, slot=slot, cache=cache, thread=me, given_by_caller=given_by_caller)
        if slot is not None:
            slot.lease = lease
        else:
            self._given[id(cache)] = lease
        return lease

    def _idle_slot(self, kind: CacheKind, need: Mapping[str, int], me: int) -> _Slot | None:
        idle = [
            slot for slot in self._slots if slot.kind == kind and (slot.lease is None or slot.lease.available_to(me))
        ]
        if not idle:
            return None

        def fits(slot: _Slot) -> bool:
            held = slot.cache.capacities()
            return all(held.get(name, 0) >= value for name, value in need.items())

        # Storage that fits without growing first, then storage whose cache was not returned to a caller (a kept
        # cache stays valid as long as possible), then the least recently leased.
        return min(idle, key=lambda slot: (not fits(slot), slot.returned, slot.lease_count))

    def _room_for_one_more(self, kind: CacheKind) -> bool:
        if len(self._slots) < self.max_concurrent_calls:
            return True
        # Storage of another kind (the model moved, or the call asks for another shape policy) makes room when idle.
        other = next((slot for slot in self._slots if slot.holder is None and slot.kind != kind), None)
        if other is None:
            return False
        logger.warning(
            "The flexible cache of %s is rebuilt for a call of another kind (shape policy, device or dtype); the "
            "previous one (%d bytes) is freed",
            self.owner_name,
            other.cache.nbytes,
        )
        self._remember(other)
        self._slots.remove(other)
        other.cache.free(
            f"this cache's storage was freed: {self.owner_name} was called with another shape policy, device or "
            "dtype, and its pool holds at most max_concurrent_calls caches; call .detach() on a returned cache to keep it"
        )
        return True

    def _new_slot(self, kind: CacheKind, reservation: Reservation) -> _Slot:
        # As large as the largest cache of this kind (the reservation's capacities): any call that one serves, this
        # one serves too.
        slot = _Slot(cache=kind.build(reservation.capacities, on_overflow=reservation.config.on_overflow), kind=kind)
        slot.cache._owner = self
        self._slots.append(slot)
        return slot

    def _refuse_or_wait(self, me: int, config: CacheConfig) -> None:
        mine = any(slot.holder == me for slot in self._slots) or any(
            lease.thread == me for lease in self._given.values()
        )
        busy = (
            f"{self.max_concurrent_calls} generate call(s) of {self.owner_name} already hold its flexible caches "
            f"(max_concurrent_calls={self.max_concurrent_calls})"
        )
        if mine:
            raise RuntimeError(
                f"{busy}, one of them in this thread, which would wait for itself; pass "
                f'cache_config={{"max_concurrent_calls": {self.max_concurrent_calls + 1}}} or more'
            )
        if config.on_busy == "error":
            raise RuntimeError(
                f'{busy}; pass cache_config={{"max_concurrent_calls": {self.max_concurrent_calls + 1}}} or more for '
                'calls to run at once, or {"on_busy": "wait"} to wait for one'
            )
        self._condition.wait()

    def _renew(self, slot: _Slot, previous: Lease | None):
        old = slot.cache
        # Whoever still needs what the previous lease wrote (e.g. Whisper's rows kept across its fallback calls) is
        # told before the storage is reused.
        if previous is not None and previous.parked:
            hooks, previous._before_reuse = previous._before_reuse, []
            for hook in hooks:
                hook()
        slot.cache = old.renewed()
        slot.lease_count += 1
        old.mark_stale(
            f"this cache was returned by an earlier generate call of {self.owner_name}, and a later generate call "
            f"(thread {threading.current_thread().name}) has reused its storage; call cache.detach() on a returned "
            "cache before the next generate call to keep it for continuing (the model then allocates new storage "
            "when it needs it)"
        )
        slot.returned = False
        return slot.cache

    def _give_back(self, lease: Lease) -> None:
        with self._condition:  # reentrant: `_release_slot` takes it again
            if lease.slot is None:
                if self._given.get(id(lease.cache)) is lease:
                    del self._given[id(lease.cache)]
                self._condition.notify_all()
            elif lease.slot.lease is lease:  # not superseded by a later lease of the same thread
                self._release_slot(lease.slot)

    def _release_slot(self, slot: _Slot) -> None:
        with self._condition:
            slot.lease = None
            if slot.free_on_return and slot in self._slots:  # released (which forgets its capacities)
                self._slots.remove(slot)
                slot.cache.free(_released_reason(self.owner_name))
            self._condition.notify_all()

    def mark_returned(self, cache) -> None:
        """Note that `cache` went back to the caller of generate (so leases prefer other storage)."""
        with self._condition:
            for slot in self._slots:
                if slot.cache is cache:
                    slot.returned = True

    def detach(self, cache) -> None:
        """Take `cache`'s storage out of the pool: it is the caller's from now on."""
        with self._condition:
            slot = next((slot for slot in self._slots if slot.cache is cache), None)
            if slot is None:
                return
            if slot.holder is not None and slot.holder != threading.get_ident():
                raise RuntimeError("this cache is in use by a running generate call; detach it after the call")
            self._remember(slot)
            self._slots.remove(slot)
            cache._owner = None
            self._condition.notify_all()

    def release(self) -> int:
        """Free every idle cache now, and each leased one when its call ends; returns the bytes freed now. The
        capacities planned so far are forgotten: the next call plans from its `cache_config` and its needs."""
        freed = 0
        with self._condition:
            self._planned.clear()
            for slot in list(self._slots):
                if slot.holder is None:
                    self._slots.remove(slot)
                    freed += slot.cache.free(_released_reason(self.owner_name))
                else:
                    slot.free_on_return = True
            self._condition.notify_all()
        return freed


def _released_reason(owner_name: str) -> str:
    return (
        f"this cache's storage was freed by transformers_flexcache.release() on {owner_name}; the next generate call "
        "allocates new storage (call cache.detach() on a returned cache to keep it through a release)"
    )


def pool_of(model, *, create: bool = True) -> CachePool | None:
    """The `CachePool` of `model` (created on first use when `create`)."""
    pool = _pools.get(model)
    if pool is None and create:
        with _pool_creation:
            pool = _pools.get(model)
            if pool is None:
                pool = _pools[model] = CachePool(owner_name=type(model).__name__)
    return pool


def release(model) -> int:
    """Free the flexible storage that `model` holds for `generate(cache_implementation="flexible_static")`.

    Idle caches are freed at once and leased ones when their calls end; every cache object over freed storage
    (a `past_key_values` returned earlier included) becomes stale and raises on use, except those taken out of the
    pool with `cache.detach()`. The next flexible call allocates again.

    Returns:
        `int`: the bytes freed now.
    """
    pool = pool_of(model, create=False)
    return pool.release() if pool is not None else 0


def held_nbytes(model) -> dict[str, int]:
    """Bytes of flexible storage that `model` holds, per device (`{}` when none)."""
    pool = pool_of(model, create=False)
    return pool.held_nbytes() if pool is not None else {}


__all__ = [
    "CachePool",
    "Lease",
    "held_nbytes",
    "pool_of",
    "release",
]
