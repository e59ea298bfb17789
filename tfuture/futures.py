"""Future slots on the device: :class:`FutureMap` owns them, :class:`FutureIndices` names them.

Ownership rule. Every handle holds one reference on each of its slots: ``alloc`` creates a
handle with fresh slots, ``filter`` and ``cat`` create handles that take one more reference on
the slots they name. ``release(handle)`` drops the handle's references, exactly once per handle.
A slot returns to the pool when its last reference is dropped, so a slot is never handed out
again while any live handle still names it, and releasing every handle you made returns every
slot exactly once. Release a handle once every resolve that reads its placeholders has been
enqueued on the map's stream (stream order then protects the value).

Host bookkeeping is numpy over slot arrays (no per-slot Python loop, no host-device sync).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tfuture import _debug, _planted
from tfuture.indices import FutureIndices
from tfuture.kernels._common import ERR_LEN, INT_DTYPES, check_same_device, check_vector
from tfuture.kernels.resolve import PreparedInputs, launch_resolve_, prepare_inputs
from tfuture.kernels.store import launch_store, store_futures


class FutureMapFull(RuntimeError):
    """``alloc`` asked for more slots than are free. Nothing was overwritten."""


class FutureError(RuntimeError):
    """A device-side check failed: a bad placeholder, or (debug) a slot used out of order."""


class FutureMap:
    """``capacity`` future slots (1-based) in a device buffer ``token_map[capacity + 1]``.

    Args:
        capacity: number of usable slots; slot 0 is a padding row that is never handed out.
        device: where the map lives (default: CUDA when available, else CPU).
        dtype: ``torch.int32`` or ``torch.int64`` token dtype.
        debug: add device-side checks that cost a host sync per call: every read slot was
            written since its alloc, no slot is written twice, no slot is used after release,
            no placeholder survives resolve. Violations raise :class:`FutureError` at once.
    """

    def __init__(
        self,
        capacity: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.int64,
        debug: bool = False,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if dtype not in INT_DTYPES:
            raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.capacity: int = int(capacity)
        self.device: torch.device = torch.device(device)
        self.dtype: torch.dtype = dtype
        self.debug: bool = bool(debug)
        self.token_map: torch.Tensor = torch.zeros(self.capacity + 1, dtype=dtype, device=self.device)
        # "cuda" becomes "cuda:0": tensors report an indexed device, and comparisons must match.
        self.device = self.token_map.device
        self.err: torch.Tensor = torch.zeros(ERR_LEN, dtype=torch.int64, device=self.device)
        # refs[s] = live handles naming slot s; slot 0 is pinned so it is never free.
        # int64: np.add.at with a Python int takes its fast path only on a matching dtype.
        self._refs: np.ndarray = np.zeros(self.capacity + 1, dtype=np.int64)
        self._refs[0] = 1
        self._in_use: int = 0
        self._head: int = 1
        self._state: torch.Tensor | None = _debug.new_state(self) if debug else None
        # debug: allocation generation per slot; a handle whose slot moved on is stale.
        self._gen: np.ndarray | None = np.zeros(self.capacity + 1, dtype=np.int64) if debug else None
        # Where debug-mode device effects of alloc/release run; a runtime points it at its
        # forward stream so they stay ordered with that stream's resolves and stores.
        self.device_exec: Callable[[Callable[[], None]], None] | None = None

    def __repr__(self) -> str:
        return (
            f"FutureMap(capacity={self.capacity}, in_use={self._in_use}, "
            f"device={self.device}, dtype={self.dtype}, debug={self.debug})"
        )

    @property
    def in_use(self) -> int:
        """Slots named by at least one live handle."""
        return self._in_use

    @property
    def free(self) -> int:
        return self.capacity - self._in_use

    def alloc(self, n: int) -> FutureIndices:
        """A handle on ``n`` fresh slots (``n`` may be 0). Raises :class:`FutureMapFull`."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"alloc expects an int slot count, got {type(n).__name__}")
        n = int(n)
        if n < 0:
            raise ValueError(f"alloc expects n >= 0, got {n}")
        if n > self.capacity - self._in_use:
            raise FutureMapFull(
                f"FutureMap full: asked for {n} slots, {self._in_use} of {self.capacity} in use "
                f"({self.capacity - self._in_use} free); release handles or raise capacity"
            )
        refs, start = self._refs, self._head
        if start + n > self.capacity + 1:
            start = 1
        if not refs[start : start + n].any():
            slots = np.arange(start, start + n, dtype=np.int64)
            refs[start : start + n] = 1
        else:
            # Fragmented: take the first free slots at or after the head, wrapping around.
            free = np.flatnonzero(refs == 0)
            first = np.searchsorted(free, self._head)
            slots = np.concatenate([free[first:], free[:first]])[:n].astype(np.int64)
            refs[slots] = 1
            start = -1
        if slots.size != n:
            raise RuntimeError(f"FutureMap bookkeeping corrupt: {slots.size} free slots found, {n} expected")
        self._in_use += n
        if n:
            last = int(slots[-1])
            self._head = last + 1 if last < self.capacity else 1
        gens = None
        if self._gen is not None:
            self._gen[slots] += 1
            gens = self._gen[slots]
            if n:
                self._on_device(lambda: _debug.on_alloc(self, slots))
        return FutureIndices(self, slots, start if n else -1, False, gens)

    def release(self, fi: FutureIndices) -> None:
        """Drop ``fi``'s references; slots with no reference left become reusable."""
        self._check_handle(fi, "release")
        slots, refs = fi._slots, self._refs
        if "ignore_refcount" in _planted.ACTIVE:
            freed = _unique(slots[refs[slots] > 0])
            refs[freed] = 0
        elif fi._start >= 0:
            a, b = fi._start, fi._start + len(fi)
            refs[a:b] -= 1
            freed = np.arange(a, b)[refs[a:b] == 0]
        elif fi._has_dups():
            np.subtract.at(refs, slots, 1)
            freed = _unique(slots[refs[slots] == 0])
        else:
            refs[slots] -= 1
            freed = slots[refs[slots] == 0]
        self._in_use -= int(freed.size)
        fi._released = True
        if self._state is not None and freed.size:
            self._on_device(lambda: _debug.on_release(self, freed))

    def store(self, fi: FutureIndices, tokens: torch.Tensor) -> None:
        """Enqueue ``slot <- token`` per row of ``fi`` on the current stream.

        ``tokens``: ``[len(fi)]`` int32/int64 on the map's device. Works for every handle whose
        slots are distinct; a handle that names a slot twice is rejected (no write-twice).
        """
        self._check_handle(fi, "store")
        check_vector("tokens", tokens)
        check_same_device("tokens", tokens, "the FutureMap", self.token_map)
        if tokens.numel() != len(fi):
            raise ValueError(f"store expects {len(fi)} tokens (one per slot), got {tokens.numel()}")
        if fi._has_dups():
            raise ValueError("store expects a handle with distinct slots, got one naming a slot twice")
        if len(fi) == 0:
            return
        if self._state is not None:
            _debug.on_store(self, fi._slots, tokens)
        if tokens.is_cuda:
            tokens.record_stream(torch.cuda.current_stream(tokens.device))
        if "store_as_interval" in _planted.ACTIVE:
            first = int(fi._slots[0])
            store_futures(
                self.token_map,
                range(first, min(first + len(fi), self.capacity + 1)),
                tokens[: self.capacity + 1 - first],
            )
        elif fi._start >= 0:
            # tokens were checked above; the map and the handle's slots are the map's own.
            launch_store(self.token_map, range(fi._start, fi._start + len(fi)), tokens, self.err)
        else:
            dev_slots = torch.from_numpy(fi._slots).to(self.device, non_blocking=True)
            launch_store(self.token_map, dev_slots, tokens, self.err)
        if self._state is not None:
            _debug.after_store(self, fi._slots, tokens)

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """In place on the current stream, every negative id ``-s`` becomes slot ``s``'s token.

        ``ids``: ``[n]`` int32/int64 on the map's device. A placeholder outside the map is never
        read: it becomes 0 and is flagged; :meth:`check` (or the runtime's next sync) raises.
        """
        self._check_ids(ids)
        if ids.is_cuda:
            ids.record_stream(torch.cuda.current_stream(ids.device))
        if self._state is not None:
            _debug.before_read(self, ids)
        if "skip_resolve" in _planted.ACTIVE:
            launch_resolve_(ids, self.token_map[:1], None)
        else:
            launch_resolve_(ids, self.token_map, self.err)
        if self._state is not None:
            _debug.after_read(self, ids)
        return ids

    def prepare_inputs(
        self,
        tokens: torch.Tensor,
        seg_starts: torch.Tensor,
        prefix_lens: torch.Tensor,
        *,
        n_rows: int | None = None,
        out: PreparedInputs | None = None,
    ) -> PreparedInputs:
        """:func:`tfuture.kernels.resolve.prepare_inputs` against this map, with its checks."""
        if self._state is not None:
            self._check_ids(tokens)  # before the debug read; otherwise the launcher checks
            _debug.before_read(self, tokens)
        if "skip_resolve" in _planted.ACTIVE:
            res = prepare_inputs(tokens, seg_starts, prefix_lens, self.token_map[:1], n_rows=n_rows, out=out)
        else:
            res = prepare_inputs(
                tokens, seg_starts, prefix_lens, self.token_map, n_rows=n_rows, out=out, err=self.err
            )
        if self._state is not None:
            _debug.after_read(self, res.input_ids)
        return res

    def check(self) -> None:
        """Host sync: raise :class:`FutureError` if a kernel flagged a bad placeholder."""
        flags = self.err.tolist()
        self.err.zero_()
        raise_if_flagged(flags)

    def release_live(self, handles: list[FutureIndices]) -> None:
        """Release every handle of ``handles`` that is still live, then empty the list."""
        for h in handles:
            if not h.released:
                self.release(h)
        handles.clear()

    def _check_generations(self, fi: FutureIndices, what: str) -> None:
        assert self._gen is not None and fi._gens is not None
        stale = fi._slots[self._gen[fi._slots] != fi._gens]
        if stale.size:
            raise FutureError(
                f"debug: {what} of a handle whose slot {int(stale[0])} was handed out again while the "
                f"handle still names it ({stale.size} stale slot(s)): a ring overrun or an early release"
            )

    def _on_device(self, fn: Callable[[], None]) -> None:
        if self.device_exec is None:
            fn()
        else:
            self.device_exec(fn)

    def _retain(self, slots: np.ndarray, distinct: bool) -> None:
        if distinct:
            self._refs[slots] += 1
        else:
            np.add.at(self._refs, slots, 1)

    def _check_handle(self, fi: object, what: str) -> None:
        if not isinstance(fi, FutureIndices):
            raise TypeError(f"{what} expects a FutureIndices, got {type(fi).__name__}")
        if fi._map is not self:
            raise ValueError(f"{what} expects a FutureIndices of this FutureMap, got a foreign one")
        fi._check_live(what)

    def _check_ids(self, ids: torch.Tensor) -> None:
        check_vector("ids", ids)
        check_same_device("ids", ids, "the FutureMap", self.token_map)


def _unique(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values (sort and compare: several times faster than np.unique here)."""
    a = np.sort(a)
    return a[np.concatenate(([True], a[1:] != a[:-1]))] if a.size else a


def raise_if_flagged(err: Sequence[int] | np.ndarray) -> None:
    """Raise :class:`FutureError` for a host copy of a map's ``err`` flag that is set."""
    count, worst = int(err[0]), int(err[1])
    if count:
        raise FutureError(
            f"{count} placeholder(s) pointed outside the FutureMap or negative token(s) were stored "
            f"(most negative: {worst}); they were replaced by token 0 and never read"
        )
