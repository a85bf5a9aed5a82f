"""What every flexible cache does with its storage, defined once: bytes, reservation, renewal, staleness, release.

A cache of layers (`FlexibleStaticCache`, `FlexibleCrossAttentionCache`) is one part; `FlexibleEncoderDecoderCache` is
made of two, its halves. `FlexibleStorage` implements the lifecycle over `_parts()` (loop over the halves, as mlx-lm's
`CacheList` forwards each method), so that the composite repeats none of it.

Design decisions:
- Capacity is decided by `capacity.decide` (asked by the pool of the model, or by whoever builds a cache by hand);
  `reserve(reservation)` only applies the answer: each part grows to the capacities it holds and keeps the call's
  limits.
- A cache object can be superseded: `renewed()` returns a new cache object over the same storage (a pool hands one to
  each generate call) and the old object is marked stale with the reason. Any later use of a stale object raises a
  `ValueError` that says what overwrote its storage and how to keep a cache (`detach()`), instead of reading someone
  else's keys. A stale object lets go of its layers, so that storage a growth or a release drops is freed even while a
  caller still holds the object.
- A copy (`copy.deepcopy`, pickling) is nobody's: the pool that held the original is not copied with it.
"""

from __future__ import annotations

import copy

import torch

from ..log import get_logger
from .capacity import Reservation
from .config import overflow_message

logger = get_logger(__name__)


class FlexibleStorage:
    """The storage lifecycle shared by every flexible cache (module docstring).

    Subclasses provide `_parts()` (the caches of layers that make it up: itself, or its halves), `_storages()` (the
    tensors it holds), `_let_go()` (drop references to storage once stale), `_renew_from(old)` (what a renewed object
    resets) and, for a cache of layers, `_apply(reservation)` and `_own_capacities()`.
    """

    _stale: str | None = None  # why this object may no longer be used (see `renewed`), or None
    _owner = None  # the pool that holds this cache's storage (see `generate/pool.py`), or None

    def _parts(self) -> tuple[FlexibleStorage, ...]:
        raise NotImplementedError

    def _storages(self) -> list[torch.Tensor]:
        return [tensor for part in self._parts() for tensor in part._storages()]

    # --- what is held ---------------------------------------------------------------------------------------------
    def capacities(self) -> dict[str, int]:
        """What the cache holds, by capacity name (`max_batch_size`, `max_cache_len`, `max_encoder_len`;
        `max_prompt_len`, a shape held by the self-attention cache: 0 until a fixed-shape call sets it)."""
        found: dict[str, int] = {}
        for part in self._parts():
            found.update(part._own_capacities())
        return found

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_per_device().values())

    def nbytes_per_device(self) -> dict[str, int]:
        """Bytes held on each device (`{}` for a stale object, which holds none)."""
        per_device: dict[str, int] = {}
        for tensor in self._storages():
            key = str(tensor.device)
            per_device[key] = per_device.get(key, 0) + tensor.untyped_storage().nbytes()
        return per_device

    def static_tensors(self) -> list[torch.Tensor]:
        """The storage tensors a compiled step mutates in place, whose addresses must stay fixed for CUDA graphs:
        those of the fixed-shape layers (`compile.hooks.mark_static_addresses` marks them on an accelerator)."""
        return [
            tensor
            for part in self._parts()
            for layer in part.layers
            if getattr(layer, "is_compileable", False)
            for tensor in layer.static_tensors()
        ]

    def data_ptrs(self) -> list[int]:
        """Data pointers of every storage tensor: equal across calls exactly when no reallocation happened."""
        return [tensor.data_ptr() for tensor in self._storages()]

    # --- a call's reservation -------------------------------------------------------------------------------------
    def reserve(self, reservation: Reservation) -> None:
        """Apply `reservation` (`capacity.decide`'s answer for a call): every part grows to the capacities it holds
        (keeping its live content; a no-op when it holds them already) and keeps the call's limits for its `update`s.

        Raises:
            ValueError: this cache object is stale.
        """
        self._check_live()
        if reservation.exceeded:
            logger.warning(
                "%s grows (one reallocation): %s", type(self).__name__, overflow_message(list(reservation.exceeded))
            )
        for part in self._parts():
            part._apply(reservation)

    # --- ownership ------------------------------------------------------------------------------------------------
    def renewed(self):
        """A new, reset cache object over the same storage; this one is left for `mark_stale`.

        A pool gives each generate call a renewed object, so that a cache returned by an earlier call is a different
        object, which can be told that its storage was reused.
        """
        cache = copy.copy(self)
        cache._owner = self._owner
        cache._stale = None
        cache._renew_from(self)
        return cache

    def _renew_from(self, old) -> None:
        raise NotImplementedError

    def mark_stale(self, reason: str) -> None:
        """From now on, any use of this object raises `ValueError(reason)`: every method, `layers` and `len(cache)`.
        What stays readable: `is_stale`, `repr()`, `nbytes`/`nbytes_per_device()` (0) and `data_ptrs()` (`[]`): it
        holds nothing; and the settings it was built with (`shape_policy`, `on_overflow`, `layer_specs`).

        The object also lets go of its layers: storage that a later growth or `release` drops is then freed even while
        a caller still holds this object.
        """
        self._stale = reason
        self._let_go(reason)

    def _let_go(self, reason: str) -> None:
        raise NotImplementedError

    @property
    def is_stale(self) -> bool:
        return self._stale is not None

    def _check_live(self) -> None:
        # Not while dynamo traces: a compiled step would guard on it. Stale caches are refused before (generate).
        if self._stale is not None and not torch.compiler.is_compiling():
            raise ValueError(self._stale)

    def free(self, reason: str) -> int:
        """Give the storage back now (every object over it, this one included, becomes stale); returns the bytes."""
        freed = self.nbytes
        for tensor in self._storages():
            tensor.untyped_storage().resize_(0)
        self.mark_stale(reason)
        return freed

    def detach(self):
        """Take this cache out of the pool of the model that returned it, so that no later `generate` call reuses its
        storage: it is yours to continue from, for as long as you hold it. Returns the cache."""
        self._check_live()
        if self._owner is not None:
            self._owner.detach(self)
        return self

    def __repr__(self) -> str:
        if self._stale is not None:
            return f"{type(self).__name__}(stale)"
        return super().__repr__()

    def __getstate__(self) -> dict:
        # A copy (`copy.deepcopy`, pickling) is nobody's: it is not in the pool of the model that returned the
        # original, whose lock cannot be copied anyway. (`renewed` sets the owner of its copy again.)
        state = dict(self.__dict__)
        state.pop("_owner", None)
        return state
