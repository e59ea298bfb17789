"""The floor of a checked bookkeeping API: ``bench_host_cycle``'s ``checked_floor`` line.

:class:`FloorMap` is the host cycle's seven calls (``alloc``, ``store``, ``filter``,
``placeholders``, ``resolve``, two ``release``) as the least a public API can do on a CPU map:
each call is one method with only the checks a public call owes its caller, then straight-line
numpy on the map's own arrays. No class hierarchy, no dispatch to kernels, no debug hooks, no
general paths: only a fresh run's handle and a bool-mask filter of it (what the cycle uses).

What it keeps, as ``FutureMap`` does: reference counts (a filter takes its own reference on the
kept slots; each handle is released once), ``in_use``, exhaustion raising, a handle's liveness
and owner checked on every call, a tensor's type, rank, dtype, contiguity, device and length
checked where it enters, a negative token refused, a placeholder outside the map never read.

It is a measuring stick, not a replacement: ``tfuture / checked_floor`` is what tfuture's own
layering costs above it, and ``checked_floor / pool_indexed`` is what any API with these calls
and checks costs above a buffer indexed by request row with no checks at all.
"""

from __future__ import annotations

import numpy as np
import torch

_BOOL = np.dtype(np.bool_)
_INT = (torch.int32, torch.int64)


class FloorHandle:
    """A handle: a fresh run ``[start, start + n)``, or a mask filter of one (``slots`` and the
    int64 ``weights`` it added to the run's counts at ``start``)."""

    __slots__ = ("live", "map", "n", "slots", "start", "weights")

    def __init__(
        self, fmap: FloorMap, start: int, n: int, slots: np.ndarray | None, weights: np.ndarray | None
    ) -> None:
        self.map, self.start, self.n, self.live = fmap, start, n, True
        self.slots, self.weights = slots, weights


class FloorMap:
    """``capacity`` slots on the CPU; slot 0 is never handed out."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.in_use, self.head = capacity, 0, 1
        self.refs = np.zeros(capacity + 1, dtype=np.int64)
        self.refs[0] = 1
        self.iota = np.arange(capacity + 1, dtype=np.int64)
        self.token_map = torch.zeros(capacity + 1, dtype=torch.int64)
        self.view = self.token_map.numpy()
        self.back = self.view[:0:-1]  # index -s reads slot s; a placeholder past the map raises
        self.device = self.token_map.device

    def _check(self, h: object) -> FloorHandle:
        if type(h) is not FloorHandle or h.map is not self or not h.live:
            raise ValueError(f"expected a live handle of this map, got {h!r}")
        return h

    def _check_tensor(self, name: str, t: object, n: int | None) -> np.ndarray:
        if type(t) is not torch.Tensor or t.dim() != 1 or t.dtype not in _INT or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int32/int64 tensor, got {t!r}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}, the map on {self.device}")
        if n is not None and t.numel() != n:
            raise ValueError(f"{name} must have {n} entries, got {t.numel()}")
        return t.numpy()

    def alloc(self, n: int) -> FloorHandle:
        if type(n) is not int or n < 1:
            raise ValueError(f"alloc expects a positive int, got {n!r}")
        if n > self.capacity - self.in_use:
            raise RuntimeError(f"full: {n} asked, {self.capacity - self.in_use} free")
        start = self.head
        stop = start + n
        if stop > self.capacity + 1:
            start, stop = 1, n + 1
        run = self.refs[start:stop]
        if np.count_nonzero(run):
            raise RuntimeError("the floor handles one run only (the cycle never fragments)")
        run.fill(1)
        self.in_use += n
        self.head = stop if stop <= self.capacity else 1
        return FloorHandle(self, start, n, None, None)

    def store(self, h: FloorHandle, tokens: torch.Tensor) -> None:
        h = self._check(h)
        vals = self._check_tensor("tokens", tokens, h.n)
        if h.slots is not None:
            raise ValueError("the floor stores into a fresh run only")
        if vals.size:
            if vals[vals.argmin()] < 0:
                raise ValueError("tokens must be >= 0")
            self.view[h.start : h.start + h.n] = vals

    def filter(self, h: FloorHandle, keep: np.ndarray) -> FloorHandle:
        h = self._check(h)
        if type(keep) is not np.ndarray or keep.dtype is not _BOOL or keep.shape != (h.n,):
            raise ValueError(f"keep must be a bool mask of {h.n}, got {keep!r}")
        if h.slots is not None:
            raise ValueError("the floor filters a fresh run only")
        weights = keep.astype(np.int64)
        self.refs[h.start : h.start + h.n] += weights
        slots = self.iota[h.start : h.start + h.n][keep]
        return FloorHandle(self, h.start, slots.size, slots, weights)

    def placeholders(self, h: FloorHandle) -> torch.Tensor:
        h = self._check(h)
        slots = self.iota[h.start : h.start + h.n] if h.slots is None else h.slots
        return torch.from_numpy(-slots)

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        a = self._check_tensor("ids", ids, None)
        neg = a < 0
        a[neg] = self.back[a[neg]]  # IndexError for a placeholder past the map: never read
        return ids

    def release(self, h: FloorHandle) -> None:
        h = self._check(h)
        h.live = False
        if h.weights is None:
            run = self.refs[h.start : h.start + h.n]
            run -= 1
            self.in_use -= h.n - np.count_nonzero(run)
        else:
            run = self.refs[h.start : h.start + h.weights.size]
            live = np.count_nonzero(run)
            run -= h.weights
            self.in_use -= live - np.count_nonzero(run)
