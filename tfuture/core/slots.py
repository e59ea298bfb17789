"""Host slot bookkeeping: :class:`SlotPool` hands out 1-based slots, :class:`FutureIndices` names them.

``FutureIndices``, the handle, lives in :mod:`tfuture.core.handles`; it is imported here (the pool
makes handles) and stays importable from this module.

Ownership rule. Every handle holds one reference on each of its slots: ``alloc`` creates a
handle with fresh slots, ``filter`` and ``cat`` create handles that take one more reference on
the slots they name. ``release(handle)`` drops the handle's references, exactly once per handle.
A slot returns to the pool when its last reference is dropped, so a slot is never handed out
again while any live handle still names it, and releasing every handle you made returns every
slot exactly once.

Numpy only (torch just builds the device tensor of ``placeholders()``), no per-slot Python
loop. A fresh handle whose slots are one run stays lazy, ``(start, n)`` with no slot array,
until something asks for its slots: the common decode step never builds one.

The hot path (alloc, filter by a host bool mask, placeholders, release) is a few vectorised
numpy operations on the pool's own arrays: a run's references are one slice, a mask filter of a
run adds the mask to that slice, and a release counts the references left with
``np.count_nonzero`` instead of searching for zeros. A handle the pool made is checked by one
guard (live, not in debug mode); anything else takes the full checks with their messages.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from tfuture.core.checks import as_count, count_nonzero
from tfuture.core.errors import FutureError, FutureMapFull
from tfuture.core.handles import FutureIndices

_count_nonzero = count_nonzero


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
        # Placeholders of a CPU pool are made by numpy (the device's type never changes).
        self._on_cpu: bool = torch.device(self.device).type == "cpu"
        self.dtype: torch.dtype = dtype
        # refs[s] = live handles naming slot s; slot 0 is pinned so it is never free.
        # int64: np.add.at with a Python int takes its fast path only on a matching dtype.
        self._refs: np.ndarray = np.zeros(self.capacity + 1, dtype=np.int64)
        self._refs[0] = 1
        self._in_use: int = 0
        self._head: int = 1
        self._gen: np.ndarray | None = np.zeros(self.capacity + 1, dtype=np.int64) if generations else None
        # Slot numbers 0..capacity: a run's slot array is a slice of it (never written).
        self._iota: np.ndarray = np.arange(self.capacity + 1, dtype=np.int64)

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
        if type(n) is not int or n < 1:
            n = as_count("alloc", n, "slot count")
        cap = self.capacity
        if n > cap - self._in_use:
            raise FutureMapFull(
                f"FutureMap full: asked for {n} slots, {self._in_use} of {cap} in use "
                f"({cap - self._in_use} free); release handles or raise capacity"
            )
        if n == 0:
            return FutureIndices(self, np.empty(0, dtype=np.int64), -1, 0, False, self._gens_of(None, 0, 0))
        start = self._head
        stop = start + n
        if stop > cap + 1:
            start, stop = 1, n + 1
        run = self._refs[start:stop]
        if _count_nonzero(run):
            return self._alloc_fragmented(n)
        run.fill(1)
        self._in_use += n
        self._head = stop if stop <= cap else 1
        gen = self._gen
        gens = None
        if gen is not None:
            g = gen[start:stop]
            g += 1
            gens = g.copy()
        return FutureIndices(self, None, start, n, False, gens)

    def _alloc_fragmented(self, n: int) -> FutureIndices:
        """Take the first free slots at or after the head, wrapping around."""
        refs = self._refs
        free = np.flatnonzero(refs == 0)
        first = np.searchsorted(free, self._head)
        slots = np.concatenate([free[first:], free[:first]])[:n]
        if slots.size != n:
            raise RuntimeError(f"FutureMap bookkeeping corrupt: {slots.size} free slots, {n} expected")
        refs[slots] = 1
        last = int(slots[-1])
        self._in_use += n
        self._head = last + 1 if last < self.capacity else 1
        return FutureIndices(self, slots, -1, n, False, self._gens_of(slots, -1, n))

    def release(self, fi: FutureIndices) -> None:
        """Drop ``fi``'s references; slots with no reference left become reusable."""
        if type(fi) is not FutureIndices or fi._pool is not self or fi._released or fi._gens is not None:
            self.check_handle(fi, "release")
        fi.drop_references()

    def release_live(self, handles: list[FutureIndices]) -> None:
        """Release every handle of ``handles`` that is still live, then empty the list."""
        for h in handles:
            if not h._released:
                self.release(h)
        handles.clear()

    def retain(self, slots: np.ndarray, distinct: bool) -> None:
        """Take one more reference on each of ``slots`` (a new handle naming them)."""
        if distinct:
            self._refs[slots] += 1
        else:
            np.add.at(self._refs, slots, 1)

    def unref(self, slots: np.ndarray, distinct: bool, want_freed: bool) -> np.ndarray | None:
        """Drop one reference per entry of ``slots``; the freed slots (distinct) if asked."""
        refs = self._refs
        if distinct:
            left = refs[slots]
            left -= 1
            refs[slots] = left
            if want_freed:
                freed = slots[left == 0]
                self._in_use -= int(freed.size)
                return freed
            self._in_use -= slots.size - int(_count_nonzero(left))
            return None
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


def _unique(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values (sort and compare: several times faster than np.unique here)."""
    a = np.sort(a)
    return a[np.concatenate(([True], a[1:] != a[:-1]))] if a.size else a
