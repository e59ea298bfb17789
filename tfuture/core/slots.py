"""Host slot bookkeeping: :class:`SlotPool` hands out 1-based slots, :class:`FutureIndices` names them.

Ownership rule. Every handle holds one reference on each of its slots: ``alloc`` creates a
handle with fresh slots, ``filter`` and ``cat`` create handles that take one more reference on
the slots they name. ``release(handle)`` drops the handle's references, exactly once per handle.
A slot returns to the pool when its last reference is dropped, so a slot is never handed out
again while any live handle still names it, and releasing every handle you made returns every
slot exactly once.

Numpy only (torch just builds the device tensor of ``placeholders()``), no per-slot Python
loop. A fresh handle whose slots are one run stays lazy, ``(start, n)`` with no slot array,
until something asks for its slots: the common decode step never builds one.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

from tfuture.core.checks import as_count, host_index
from tfuture.core.errors import FutureError, FutureMapFull


class SlotPool:
    """Reference counts of ``capacity`` slots numbered 1..capacity (slot 0 is never handed out).

    Args:
        capacity: usable slots.
        device, dtype: where and in which int dtype handles build their ``placeholders()``.
        generations: count each slot's allocations, and let handles check that none of their
            slots was handed out again while they name it (debug mode).
    """

    def __init__(
        self,
        capacity: int,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.int64,
        generations: bool = False,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity: int = int(capacity)
        self.device: torch.device = torch.device("cpu") if device is None else device
        self.dtype: torch.dtype = dtype
        # refs[s] = live handles naming slot s; slot 0 is pinned so it is never free.
        # int64: np.add.at with a Python int takes its fast path only on a matching dtype.
        self._refs: np.ndarray = np.zeros(self.capacity + 1, dtype=np.int64)
        self._refs[0] = 1
        self._in_use: int = 0
        self._head: int = 1
        self._gen: np.ndarray | None = np.zeros(self.capacity + 1, dtype=np.int64) if generations else None

    @property
    def in_use(self) -> int:
        """Slots named by at least one live handle."""
        return self._in_use

    @property
    def free(self) -> int:
        return self.capacity - self._in_use

    @property
    def refcounts(self) -> np.ndarray:
        """``[capacity + 1]`` int64 read-only view: live handles naming each slot (slot 0 pinned)."""
        view = self._refs.view()
        view.flags.writeable = False
        return view

    def alloc(self, n: int) -> FutureIndices:
        """A handle on ``n`` fresh slots (``n`` may be 0). Raises :class:`FutureMapFull`."""
        n = as_count("alloc", n, "slot count")
        if n > self.capacity - self._in_use:
            raise FutureMapFull(
                f"FutureMap full: asked for {n} slots, {self._in_use} of {self.capacity} in use "
                f"({self.capacity - self._in_use} free); release handles or raise capacity"
            )
        if n == 0:
            return FutureIndices(self, np.empty(0, dtype=np.int64), -1, 0, False, self._gens_of(None, 0, 0))
        refs, start = self._refs, self._head
        if start + n > self.capacity + 1:
            start = 1
        run = refs[start : start + n]
        slots: np.ndarray | None = None
        if not run.any():
            run[:] = 1
            last = start + n - 1
        else:
            # Fragmented: take the first free slots at or after the head, wrapping around.
            free = np.flatnonzero(refs == 0)
            first = np.searchsorted(free, self._head)
            slots = np.concatenate([free[first:], free[:first]])[:n]
            if slots.size != n:
                raise RuntimeError(f"FutureMap bookkeeping corrupt: {slots.size} free slots, {n} expected")
            refs[slots] = 1
            start, last = -1, int(slots[-1])
        self._in_use += n
        self._head = last + 1 if last < self.capacity else 1
        return FutureIndices(self, slots, start, n, False, self._gens_of(slots, start, n))

    def release(self, fi: FutureIndices) -> None:
        """Drop ``fi``'s references; slots with no reference left become reusable."""
        self.check_handle(fi, "release")
        fi.drop_references()

    def release_live(self, handles: list[FutureIndices]) -> None:
        """Release every handle of ``handles`` that is still live, then empty the list."""
        for h in handles:
            if not h.released:
                self.release(h)
        handles.clear()

    def retain(self, slots: np.ndarray, distinct: bool) -> None:
        """Take one more reference on each of ``slots`` (a new handle naming them)."""
        if distinct:
            self._refs[slots] += 1
        else:
            np.add.at(self._refs, slots, 1)

    def unref_run(self, start: int, n: int, want_freed: bool) -> np.ndarray | None:
        """Drop one reference on slots ``start .. start + n - 1``; the freed slots if asked."""
        run = self._refs[start : start + n]
        run -= 1
        zero = run == 0
        if want_freed:
            freed = np.flatnonzero(zero) + start
            self._in_use -= int(freed.size)
            return freed
        self._in_use -= int(np.count_nonzero(zero))
        return None

    def unref(self, slots: np.ndarray, distinct: bool, want_freed: bool) -> np.ndarray | None:
        """Drop one reference per entry of ``slots``; the freed slots (distinct) if asked."""
        refs = self._refs
        if distinct:
            refs[slots] -= 1
            freed = slots[refs[slots] == 0]
        else:
            np.subtract.at(refs, slots, 1)
            freed = _unique(slots[refs[slots] == 0])
        self._in_use -= int(freed.size)
        return freed if want_freed else None

    def check_handle(self, fi: object, what: str) -> None:
        """Raise unless ``fi`` is a live handle of this pool."""
        if not isinstance(fi, FutureIndices):
            raise TypeError(f"{what} expects a FutureIndices, got {type(fi).__name__}")
        if fi.pool is not self:
            raise ValueError(f"{what} expects a FutureIndices of this FutureMap, got a foreign one")
        fi.check_live(what)

    def check_generations(self, slots: np.ndarray, gens: np.ndarray, what: str) -> None:
        """Debug: raise :class:`FutureError` if a slot was handed out again since ``gens``."""
        assert self._gen is not None
        stale = slots[self._gen[slots] != gens]
        if stale.size:
            raise FutureError(
                f"debug: {what} of a handle whose slot {int(stale[0])} was handed out again while the "
                f"handle still names it ({stale.size} stale slot(s)): a ring overrun or an early release"
            )

    def _gens_of(self, slots: np.ndarray | None, start: int, n: int) -> np.ndarray | None:
        if self._gen is None:
            return None
        if slots is None:
            self._gen[start : start + n] += 1
            return self._gen[start : start + n].copy()
        self._gen[slots] += 1
        return self._gen[slots]


class FutureIndices:
    """A handle on future slots of one :class:`SlotPool` (a ``FutureMap``), one slot per row.

    Rows keep their order. Build new handles with :meth:`filter` and :meth:`cat`; give every
    handle back with ``FutureMap.release``.
    """

    __slots__ = ("_dups", "_gens", "_n", "_pool", "_released", "_slots", "_start")

    def __init__(
        self,
        pool: SlotPool,
        slots: np.ndarray | None,
        start: int,
        n: int,
        dups: bool | None,
        gens: np.ndarray | None = None,
    ) -> None:
        self._pool = pool
        self._slots = slots  # None while a fresh run is lazy
        self._start = start  # first slot of a fresh increasing run, or -1
        self._n = n
        self._dups = dups  # does a slot appear twice? None: not computed yet
        self._gens = gens  # debug: each slot's allocation generation when this handle was made
        self._released = False

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"FutureIndices(n={self._n}, {state}, slots={self.slots[:8].tolist()}...)"

    @property
    def slots(self) -> np.ndarray:
        """``[n]`` int64 host array (a read-only view) of the 1-based slot numbers."""
        view = self._array().view()
        view.flags.writeable = False
        return view

    def _array(self) -> np.ndarray:
        """The slot array itself (built on first use for a lazy run); never handed out."""
        if self._slots is None:
            self._slots = np.arange(self._start, self._start + self._n, dtype=np.int64)
        return self._slots

    @property
    def span(self) -> range | None:
        """The slots as ``range(start, start + n)`` for a fresh handle on one run, else None."""
        return range(self._start, self._start + self._n) if self._start >= 0 else None

    @property
    def is_contiguous(self) -> bool:
        """True for a fresh handle whose slots are one increasing run (stores need no index)."""
        return self._start >= 0

    @property
    def pool(self) -> SlotPool:
        """The pool (the ``FutureMap``) whose slots this handle names."""
        return self._pool

    @property
    def map(self) -> SlotPool:
        """The ``FutureMap`` whose slots this handle names (same as :attr:`pool`)."""
        return self._pool

    @property
    def released(self) -> bool:
        return self._released

    def host_placeholders(self) -> np.ndarray:
        """``[n]`` int64 host array of ``-slot``, for building a mixed token stream on the host."""
        self.check_live("host_placeholders")
        if self._slots is None:
            return np.arange(-self._start, -self._start - self._n, -1, dtype=np.int64)
        return -self._slots

    def placeholders(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[n]`` device tensor of ``-slot`` (default dtype: the map's), made without a sync.

        Every call makes a fresh tensor (``resolve`` works in place, so a shared one would turn
        into tokens). It is allocated on the current stream; reading it on another stream
        needs ``record_stream`` (the runtime does this for you).
        """
        self.check_live("placeholders")
        dtype = self._pool.dtype if dtype is None else dtype
        if dtype not in (torch.int32, torch.int64):
            raise ValueError(f"placeholders dtype must be torch.int32 or torch.int64, got {dtype}")
        dev = self._pool.device
        if self._start >= 0:
            return torch.arange(-self._start, -self._start - self._n, -1, dtype=dtype, device=dev)
        return torch.from_numpy(-self._array()).to(device=dev, dtype=dtype, non_blocking=True)

    def __copy__(self) -> FutureIndices:
        raise TypeError("a FutureIndices cannot be copied (a copy holds no slot reference); use filter()")

    def __deepcopy__(self, memo: object) -> FutureIndices:
        return self.__copy__()

    def filter(self, keep: torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]) -> FutureIndices:
        """A new handle on the rows picked by ``keep`` (a bool mask of ``len(self)`` or indices).

        The new handle holds its own reference on its slots and must be released too. A device
        ``keep`` is copied to the host (a sync); pass host masks on the hot path.
        """
        self.check_live("filter")
        idx = host_index(keep, self._n)
        slots = self._array()[idx]
        # A mask keeps a duplicate-free handle duplicate-free; indices may repeat rows.
        dups = False if idx.dtype == np.bool_ and self._dups is False else None
        self._pool.retain(slots, dups is False)
        gens = None if self._gens is None else self._gens[idx]
        return FutureIndices(self._pool, slots, -1, int(slots.size), dups, gens)

    @classmethod
    def cat(cls, handles: Sequence[FutureIndices]) -> FutureIndices:
        """Concatenate handles of one map, order kept; the result holds its own references."""
        if isinstance(handles, FutureIndices) or not isinstance(handles, Sequence):
            raise TypeError(f"cat expects a sequence of FutureIndices, got {type(handles).__name__}")
        if not handles:
            raise ValueError("cat expects at least one FutureIndices, got an empty sequence")
        for h in handles:
            if not isinstance(h, FutureIndices):
                raise TypeError(f"cat expects FutureIndices, got {type(h).__name__}")
            h.check_live("cat")
        pool = handles[0]._pool
        for h in handles[1:]:
            if h._pool is not pool:
                raise ValueError("cat expects handles of one FutureMap, got handles of two maps")
        slots = np.concatenate([h._array() for h in handles])
        parts = [h for h in handles if len(h)]
        dups = parts[0]._dups if len(parts) == 1 else (False if not parts else None)
        pool.retain(slots, dups is False)
        gens = None
        if all(h._gens is not None for h in handles):
            gens = np.concatenate([h._gens for h in handles])
        return cls(pool, slots, -1, int(slots.size), dups, gens)

    def has_duplicates(self) -> bool:
        """True if a slot appears twice (computed once, by sorting: cheaper than np.unique)."""
        if self._dups is None:
            srt = np.sort(self._array())
            self._dups = bool(srt.size > 1 and (srt[1:] == srt[:-1]).any())
        return self._dups

    def check_live(self, what: str) -> None:
        """Raise unless the handle is live (and, in debug mode, none of its slots moved on)."""
        if self._released:
            raise ValueError(f"{what}: expected a live FutureIndices, got a released one")
        if self._gens is not None:
            self._pool.check_generations(self._array(), self._gens, what)

    def drop_references(self, want_freed: bool = False) -> np.ndarray | None:
        """Give this handle's references back to its pool; the freed slots if ``want_freed``.

        The pool's ``release`` calls this after its checks: call ``FutureMap.release`` instead.
        """
        self._released = True
        if self._n == 0:
            return np.empty(0, dtype=np.int64) if want_freed else None
        if self._start >= 0:
            return self._pool.unref_run(self._start, self._n, want_freed)
        return self._pool.unref(self._array(), not self.has_duplicates(), want_freed)


def _unique(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values (sort and compare: several times faster than np.unique here)."""
    a = np.sort(a)
    return a[np.concatenate(([True], a[1:] != a[:-1]))] if a.size else a
