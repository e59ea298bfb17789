"""Future slots on the device: :class:`FutureMap` owns them, ``FutureIndices`` names them.

The slot bookkeeping and the ownership rule live in :mod:`tfuture.core.slots` and
:mod:`tfuture.core.handles` (host, numpy);
this layer adds the device buffer ``token_map``, its error flag, the store/resolve/prepare
launches, and the checker of :mod:`tfuture.core.debug` it calls around them: the device-side
slot state machine in debug mode, a checker whose hooks return at once otherwise.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from tfuture.core.debug import NO_CHECKS, DeviceExec, SlotChecker, SlotStates
from tfuture.core.errors import FutureError, FutureMapFull, raise_if_flagged
from tfuture.core.slots import FutureIndices, SlotPool
from tfuture.kernels import _common
from tfuture.kernels._common import (
    ERR_LEN,
    INT32_MAX,
    INT32_MIN,
    INT_DTYPES,
    check_same_device,
    check_vector,
    narrows,
)
from tfuture.kernels.cpu import host_view, pin_host_view, resolve_in_range_, store_run
from tfuture.kernels.resolve import (
    PreparedInputs,
    launch_prepare,
    launch_resolve_,
    prepare_inputs,
)
from tfuture.kernels.store import launch_store

__all__ = ["FutureError", "FutureIndices", "FutureMap", "FutureMapFull"]

# Maps driven by a running runtime (a map has one driver at a time), guarded by the lock.
_DRIVEN: set[int] = set()
_DRIVEN_LOCK = threading.Lock()


class FutureMap(SlotPool):
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
        if dtype not in INT_DTYPES:
            raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(device, torch.device | str):
            raise TypeError(f"device must be a torch.device or a str, got {type(device).__name__}")
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a cpu or cuda device, got {dev}")
        super().__init__(capacity, device=dev, dtype=dtype, generations=bool(debug))
        self.debug: bool = bool(debug)
        self.token_map: torch.Tensor = torch.zeros(self.capacity + 1, dtype=dtype, device=self.device)
        # "cuda" becomes "cuda:0": tensors report an indexed device, and comparisons must match.
        self.device = self.token_map.device
        self.err: torch.Tensor = torch.zeros(ERR_LEN, dtype=torch.int64, device=self.device)
        # An int32 map narrows int64 tokens (checked on the host for CPU tokens).
        self._narrow32: bool = narrows(dtype, torch.int64)
        # The host fast path of store and resolve: a CPU map outside debug mode, whose calls
        # take numpy on these views directly (unless the kernels run in the interpreter).
        self._host: np.ndarray | None = None
        self._host_back: np.ndarray | None = None
        if self.device.type == "cpu":
            # The map owns these buffers and never resizes them: the numpy path may keep views.
            pin_host_view(self.token_map)
            pin_host_view(self.err)
            if not debug:
                self._host = host_view(self.token_map)
                self._host_back = self._host[:0:-1]
        # Called around every bookkeeping call and launch; only debug mode's checks do anything.
        self._checks: SlotChecker = SlotStates(self.token_map, self.err) if debug else NO_CHECKS
        # Where debug-mode device effects of alloc/release run; a runtime points it at its
        # forward stream so they stay ordered with that stream's resolves and stores.
        self.device_exec: DeviceExec = None

    def __repr__(self) -> str:
        return (
            f"FutureMap(capacity={self.capacity}, in_use={self.in_use}, "
            f"device={self.device}, dtype={self.dtype}, debug={self.debug})"
        )

    def claim_driver(self) -> None:
        """Mark this map as driven by a running runtime (``RuntimeError`` if one drives it
        already: a map has one driver at a time); :meth:`release_driver` ends the claim."""
        with _DRIVEN_LOCK:
            if id(self) in _DRIVEN:
                raise RuntimeError(
                    f"{self!r} is already driven by a running OverlapRuntime; a FutureMap is driven by one "
                    "runtime at a time (give each runtime its own map)"
                )
            _DRIVEN.add(id(self))

    def release_driver(self) -> None:
        """End :meth:`claim_driver`'s claim (idempotent)."""
        with _DRIVEN_LOCK:
            _DRIVEN.discard(id(self))

    def take_handles(self, handles: Any, what: str) -> list[FutureIndices]:
        """``handles`` (``what`` names it in errors), a list of live handles of this map, taken
        over by the caller: the runtime takes a batch's consumed handles this way.

        Every entry is checked (``TypeError``/``ValueError``). On a bad entry, every valid
        handle of this map in the list is released first (they were handed over), then the
        error raises, so nothing leaks.
        """
        if not isinstance(handles, list):
            raise TypeError(f"{what} must be a list of FutureIndices, got {type(handles).__name__}")
        for i, h in enumerate(handles):
            try:
                self.check_handle(h, f"{what}[{i}]")
            except (TypeError, ValueError):
                self.release_live([g for g in handles if isinstance(g, FutureIndices) and g.pool is self])
                raise
        return handles

    @property
    def slot_states(self) -> SlotStates | None:
        """Debug mode's device-side slot state machine (None without debug)."""
        checks = self._checks
        return checks if isinstance(checks, SlotStates) else None

    @property
    def checks(self) -> SlotChecker:
        """The checker this map calls around its calls: :attr:`slot_states`, or a no-op one."""
        return self._checks

    def alloc(self, n: int) -> FutureIndices:
        """A handle on ``n`` fresh slots (``n`` may be 0). Raises :class:`FutureMapFull`."""
        fi = SlotPool.alloc(self, n)
        if self.debug:
            self._checks.on_alloc(fi, self.device_exec)
        return fi

    def release(self, fi: FutureIndices) -> None:
        """Drop ``fi``'s references; slots with no reference left become reusable."""
        # One guard for a live handle of this map (outside debug mode); anything else takes
        # every check with its message.
        if type(fi) is not FutureIndices or fi._pool is not self or fi._released or fi._gens is not None:
            self.check_handle(fi, "release")
        if self.debug:
            checks = self._checks
            checks.on_release(fi.drop_references(want_freed=checks.wants_freed), self.device_exec)
        else:
            fi.drop_references()  # no checker: the freed slots are not computed (a hot-path cost)

    def store(self, fi: FutureIndices, tokens: torch.Tensor) -> None:
        """Enqueue ``slot <- token`` per row of ``fi`` on the current stream.

        ``tokens``: ``[len(fi)]`` int32/int64 on the map's device. Works for every handle whose
        slots are distinct; a handle that names a slot twice is rejected (no write-twice).

        A token must fit the map's dtype (int64 tokens into an int32 map): on the CPU a token
        past int32 raises ``ValueError`` here; on CUDA (no sync) the store writes 0 and flags it,
        like a negative token, and :meth:`check` (or the runtime's next sync) raises.
        """
        if type(fi) is not FutureIndices or fi._pool is not self or fi._released or fi._gens is not None:
            self.check_handle(fi, "store")
        check_vector("tokens", tokens)
        if tokens.device != self.device:  # the map's own device object: no second one to build
            check_same_device("tokens", tokens, "the FutureMap", self.token_map)
        n = fi._n
        if tokens.numel() != n:
            raise ValueError(f"store expects {n} tokens (one per slot), got {tokens.numel()}")
        if fi._dups is not False and fi.has_duplicates():
            raise ValueError("store expects a handle with distinct slots, got one naming a slot twice")
        if n == 0:
            return
        # tokens were checked above; the map and the handle's slots are the map's own.
        self._store(fi, tokens, n)

    def launch_store(self, fi: FutureIndices, tokens: torch.Tensor) -> np.ndarray | None:
        """:meth:`store` without the checks its caller made: for the runtime, whose ``fi`` is a
        live handle it allocated itself (fresh, distinct slots) and whose ``tokens`` are a
        contiguous int32/int64 ``[len(fi)]`` vector (checked by the sample path). The device
        and the int32 fit are still checked, and debug mode still checks every slot.

        Returns the numpy view of ``tokens`` that a CPU map's store read them through (the
        caller may read it too: the same memory), else None."""
        if fi._gens is not None:
            fi.check_live("store")  # debug: none of its slots was handed out again
        if tokens.device != self.device:
            check_same_device("tokens", tokens, "the FutureMap", self.token_map)
        n = fi._n
        return self._store(fi, tokens, n) if n else None

    def _store(self, fi: FutureIndices, tokens: torch.Tensor, n: int) -> np.ndarray | None:
        """The store itself, ``n = len(fi) > 0``, every argument checked by the caller; the
        tokens' numpy view when the CPU fast path took them."""
        host = self._host
        start = fi._start
        if host is not None and start >= 0 and not _common.INTERPRET:
            words = tokens.numpy()
            if store_run(host, start, words):
                return words  # the common case on a CPU map: one slice assignment
        is_cuda = tokens.is_cuda
        if not is_cuda and self._narrow32 and tokens.dtype == torch.int64:
            _check_fits(tokens.numpy(), self.dtype)
        checks = self._checks
        checks.before_store(fi, tokens)
        if is_cuda:
            tokens.record_stream(torch.cuda.current_stream(tokens.device))
        if start >= 0:
            launch_store(self.token_map, range(start, start + n), tokens, self.err)
        else:
            dev_slots = torch.from_numpy(fi._array())
            if is_cuda:
                dev_slots = dev_slots.to(self.device, non_blocking=True)
            launch_store(self.token_map, dev_slots, tokens, self.err)
        checks.after_store(fi, tokens)
        return None

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """In place on the current stream, every negative id ``-s`` becomes slot ``s``'s token.

        ``ids``: ``[n]`` int32/int64 on the map's device. A placeholder outside the map is never
        read, and one whose token does not fit ``ids.dtype`` (int32 ids, an int64 map) is never
        wrapped: it becomes 0 and is flagged; :meth:`check` (or the runtime's next sync) raises.
        """
        check_vector("ids", ids)
        if ids.device != self.device:  # the map's own device object: no second one to build
            check_same_device("ids", ids, "the FutureMap", self.token_map)
        if ids.is_cuda:
            ids.record_stream(torch.cuda.current_stream(ids.device))
        return self.launch_resolve(ids)

    def launch_resolve(self, ids: torch.Tensor, host: np.ndarray | None = None) -> torch.Tensor:
        """:meth:`resolve` without its argument checks, for a caller that built ``ids`` itself
        (the runtime: a contiguous int64 vector on the map's device, from a checked
        :class:`tfuture.core.batch.Batch`). Debug mode still checks every slot it reads.

        ``host``: on a CPU map, ``ids``' own memory as a numpy array when the caller has it
        (the step's staged array), which saves making that view."""
        back = self._host_back
        if back is not None and not _common.INTERPRET:
            if resolve_in_range_(ids.numpy() if host is None else host, back):
                return ids  # the common case on a CPU map: a few numpy ops on the map's own view
        checks = self._checks
        checks.before_read(ids)
        launch_resolve_(ids, self.token_map, self.err)
        checks.after_read(ids)
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
        checks = self._checks
        # Debug mode checks every argument before its read marks slots read; else the launcher checks.
        checks.before_prepare(tokens, seg_starts, prefix_lens, n_rows, out)
        res = prepare_inputs(
            tokens, seg_starts, prefix_lens, self.token_map, n_rows=n_rows, out=out, err=self.err
        )
        checks.after_read(res.input_ids)
        return res

    def launch_prepare(
        self,
        tokens: torch.Tensor,
        seg_starts: torch.Tensor,
        prefix_lens: torch.Tensor,
        n_rows: int,
        out: PreparedInputs | None,
    ) -> PreparedInputs:
        """:meth:`prepare_inputs` without its argument checks, for a caller that built well-formed
        tensors itself (the runtime: from a checked :class:`tfuture.core.batch.Batch`). Debug mode
        still checks every slot it reads."""
        checks = self._checks
        checks.before_read(tokens)
        res = launch_prepare(tokens, seg_starts, prefix_lens, self.token_map, n_rows, out, self.err)
        checks.after_read(res.input_ids)
        return res

    def check(self) -> None:
        """Host sync: raise :class:`FutureError` if a kernel flagged a bad placeholder."""
        flags = self.err.tolist()
        self.err.zero_()
        raise_if_flagged(flags)


def _check_fits(values: np.ndarray, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` if a token of ``values`` does not fit an int32 map (host, CPU only)."""
    lo, hi = int(values.min()), int(values.max())
    if lo < INT32_MIN or hi > INT32_MAX:
        bad = hi if hi > INT32_MAX else lo
        raise ValueError(
            f"tokens must fit the FutureMap's {dtype} ([{INT32_MIN}, {INT32_MAX}]), got {bad}; "
            "use an int64 map for token ids past int32"
        )
