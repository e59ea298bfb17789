"""Handles on host slots: a :class:`FutureIndices` names slots of one :class:`~tfuture.core.slots.SlotPool`.

A handle holds one reference on each of its slots (the ownership rule of
:mod:`tfuture.core.slots`): ``filter`` and ``cat`` make new handles that take their own
references, ``drop_references`` gives a handle's references back once, when its pool releases it.

A fresh handle whose slots are one run stays lazy, ``(start, n)`` with no slot array, until
something asks for its slots: the common decode step never builds one. Its hot path (filter by
a host bool mask, placeholders, release) works in place on its pool's arrays: a mask filter of a
run adds the mask to the run's references, and a release counts the references left with
``np.count_nonzero`` instead of searching for zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from tfuture.core.checks import count_nonzero, host_index

_BOOL = np.dtype(np.bool_)
_count_nonzero = count_nonzero
# A 0-d operand: in-place arithmetic with it skips the Python scalar's conversion (about half
# the cost of ``run -= 1``).
_ONE = np.ones((), dtype=np.int64)
_INT64 = np.dtype(np.int64)


def _is_iota(idx: np.ndarray, n: int) -> bool:
    """Whether the int64 index array ``idx`` is exactly ``0, 1, ..., n - 1`` (n >= 1)."""
    if idx.ndim != 1 or idx.shape[0] != n or n == 0 or idx.item(0) != 0 or idx.item(-1) != n - 1:
        return False
    return n <= 2 or bool((idx[1:] > idx[:-1]).all())  # n increasing ints in [0, n - 1]: all of them


class SlotPool(Protocol):
    """What a handle uses of its pool, a :class:`tfuture.core.slots.SlotPool` (typing only:
    that module imports this one). The arrays are the pool's own; a handle updates them in
    place on its hot path."""

    device: torch.device
    dtype: torch.dtype
    _on_cpu: bool
    _refs: np.ndarray  # [capacity + 1] int64 references per slot
    _iota: np.ndarray  # [capacity + 1] int64 slot numbers
    _in_use: int

    def retain(self, slots: np.ndarray, distinct: bool) -> None: ...

    def unref(self, slots: np.ndarray, distinct: bool, want_freed: bool) -> np.ndarray | None: ...

    def check_generations(self, slots: np.ndarray, gens: np.ndarray, what: str) -> None: ...


class FutureIndices:
    """A handle on future slots of one :class:`SlotPool` (a ``FutureMap``), one slot per row.

    Rows keep their order. Build new handles with :meth:`filter` and :meth:`cat`; give every
    handle back with ``FutureMap.release``.
    """

    __slots__ = ("_base", "_dups", "_gens", "_n", "_pool", "_released", "_slots", "_start", "_weights")

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
        # A mask filter of a fresh run: its references are ``weights`` (int64 0/1, the mask)
        # added to the run's counts at ``base``; release subtracts them the same way.
        self._base = -1
        self._weights: np.ndarray | None = None

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
        """The slot array itself (a slice of the pool's slot numbers for a run); never handed
        out, never written."""
        slots = self._slots
        if slots is None:
            start = self._start
            slots = self._slots = self._pool._iota[start : start + self._n]
        return slots

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
        if self._released or self._gens is not None:
            self.check_live("host_placeholders")
        return -self._array()

    def placeholders(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[n]`` device tensor of ``-slot`` (default dtype: the map's), made without a sync.

        Every call makes a fresh tensor (``resolve`` works in place, so a shared one would turn
        into tokens). It is allocated on the current stream; reading it on another stream
        needs ``record_stream`` (the runtime does this for you).
        """
        if self._released or self._gens is not None:
            self.check_live("placeholders")
        pool = self._pool
        if dtype is None:
            dtype = pool.dtype
        elif dtype is not torch.int64 and dtype is not torch.int32:
            if dtype not in (torch.int32, torch.int64):
                raise ValueError(f"placeholders dtype must be torch.int32 or torch.int64, got {dtype}")
        if pool._on_cpu:
            neg = -self._array()  # a fresh array: the tensor owns its memory
            return torch.from_numpy(neg if dtype is torch.int64 else neg.astype(np.int32))
        dev = pool.device
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
        if self._released or self._gens is not None:
            self.check_live("filter")
        n = self._n
        pool = self._pool
        start = self._start
        if type(keep) is np.ndarray and keep.dtype is _INT64 and start >= 0 and _is_iota(keep, n):
            # Every row in order (the scheduler's decode rows of a step that ran them all): the
            # new handle is the same fresh run, one more reference on each of its slots.
            run = pool._refs[start : start + n]
            run += _ONE
            return FutureIndices(
                pool, None, start, n, False, None if self._gens is None else self._gens.copy()
            )
        if type(keep) is np.ndarray and keep.dtype is _BOOL and keep.ndim == 1 and keep.shape[0] == n:
            idx = keep
        else:
            idx = host_index(keep, n)
        gens = None if self._gens is None else self._gens[idx]
        if idx.dtype is _BOOL:
            if start >= 0 and n > 1 and _count_nonzero(idx) == n:
                # A mask that keeps a whole fresh run (every request of a decode step samples):
                # the new handle is that run too, one more reference on each of its slots.
                run = pool._refs[start : start + n]
                run += _ONE
                return FutureIndices(pool, None, start, n, False, gens)
            if start >= 0:
                # A mask over a fresh run: one more reference on the kept slots is the mask
                # itself (as int64 weights: no cast in the adds), added to the run's counts.
                slots = pool._iota[start : start + n][idx]
                weights = idx.astype(np.int64)
                if n == 1:
                    refs = pool._refs
                    refs[start] = refs.item(start) + int(weights[0])  # scalar, as in a release
                else:
                    run = pool._refs[start : start + n]
                    run += weights
                fi = FutureIndices(pool, slots, -1, slots.shape[0], False, gens)
                fi._base, fi._weights = start, weights
                return fi
            slots = self._slots[idx]  # type: ignore[index]
            # A mask keeps a duplicate-free handle duplicate-free.
            dups = False if self._dups is False else None
        else:
            slots = self._array()[idx]
            dups = None
        pool.retain(slots, dups is False)
        return FutureIndices(pool, slots, -1, int(slots.size), dups, gens)

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
            if h._released or h._gens is not None:
                h.check_live("cat")
        pool = handles[0]._pool
        for h in handles:
            if h._pool is not pool:
                raise ValueError("cat expects handles of one FutureMap, got handles of two maps")
        parts = [h for h in handles if h._n]
        if len(parts) == 1:
            slots = parts[0]._array().copy()
            dups = parts[0]._dups
        else:
            slots = np.concatenate([h._array() for h in handles]) if parts else np.empty(0, dtype=np.int64)
            dups = None if parts else False
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
        n = self._n
        if n == 0:
            return np.empty(0, dtype=np.int64) if want_freed else None
        pool = self._pool
        start = self._start
        if start >= 0:
            if n == 1 and not want_freed:
                # One slot: scalar arithmetic (an in-place ufunc on one element costs twice
                # what it costs on two: numpy's overlap check).
                refs = pool._refs
                left = refs.item(start) - 1
                refs[start] = left
                if not left:
                    pool._in_use -= 1
                return None
            run = pool._refs[start : start + n]
            run -= _ONE
            if want_freed:
                freed = np.flatnonzero(run == 0) + start
                pool._in_use -= int(freed.size)
                return freed
            pool._in_use -= n - int(_count_nonzero(run))
            return None
        slots = self._slots
        weights = self._weights
        if weights is not None:
            # Subtract the weights from the run's counts; the slots freed are the counts that
            # went from nonzero to zero (counts only fall here): two counts, no gather.
            base = self._base
            if weights.shape[0] == 1 and not want_freed:
                refs = pool._refs
                left = refs.item(base) - 1  # one slot, kept (n > 0): scalar arithmetic, as above
                refs[base] = left
                if not left:
                    pool._in_use -= 1
                return None
            run = pool._refs[base : base + weights.shape[0]]
            if want_freed:
                run -= weights
                freed = slots[pool._refs[slots] == 0]  # type: ignore[index]
                pool._in_use -= int(freed.size)
                return freed
            live = _count_nonzero(run)
            run -= weights
            pool._in_use -= int(live - _count_nonzero(run))
            return None
        if self._dups is False or not self.has_duplicates():
            refs = pool._refs
            left = refs[slots]
            left -= _ONE
            refs[slots] = left
            if want_freed:
                freed = slots[left == 0]  # type: ignore[index]
                pool._in_use -= int(freed.size)
                return freed
            pool._in_use -= n - int(_count_nonzero(left))
            return None
        return pool.unref(slots, False, want_freed)  # type: ignore[arg-type]
