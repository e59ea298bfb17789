"""Debug-mode slot state machine of a FutureMap, kept on the device.

Per slot: FREE -> (alloc) ALLOCATED -> (store) WRITTEN -> (resolve) READ -> (release) FREE.
A store needs ALLOCATED (else write-twice or write-after-release) and is read back (a store
that wrote other slots fails), a read needs WRITTEN or READ (else read-before-write or
read-after-release). Released slots are poisoned with the dtype's minimum, so any path that
skips these checks still sees an out-of-range placeholder. Each check copies its verdict to
the host: debug mode costs one sync per call.

:class:`SlotStates` knows the map's tensors, not the map. Every ``FutureMap`` composes a checker
(:class:`SlotChecker`) and calls its hooks unconditionally: ``SlotStates`` with ``debug=True``,
:class:`NoChecks` (every hook returns at once, nothing reaches the device) without.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeAlias

import numpy as np
import torch

from tfuture.core.errors import FutureError, raise_if_flagged
from tfuture.kernels._common import INT32_MAX, narrows
from tfuture.kernels.prepared import PreparedInputs, check_prepare_args, check_segments

if TYPE_CHECKING:
    from tfuture.core.slots import FutureIndices

#: Where a device effect of alloc/release runs (``FutureMap.device_exec``); None: right here.
DeviceExec: TypeAlias = Callable[[Callable[[], None]], None] | None

FREE, ALLOCATED, WRITTEN, READ = 0, 1, 2, 3
_NAMES = {FREE: "free (released)", ALLOCATED: "allocated, never written", WRITTEN: "written", READ: "read"}


class SlotChecker(Protocol):
    """The hooks a ``FutureMap`` calls around its bookkeeping and launches, debug mode or not.

    ``wants_freed``: release must compute the slots it frees (a host cost) for :meth:`on_release`.
    The ``before_*`` hooks run before the call's launch, the ``after_*`` hooks after it.
    """

    wants_freed: bool

    def on_alloc(self, fi: FutureIndices, device_exec: DeviceExec) -> None: ...

    def on_release(self, freed: np.ndarray | None, device_exec: DeviceExec) -> None: ...

    def before_store(self, fi: FutureIndices, tokens: torch.Tensor) -> None: ...

    def after_store(self, fi: FutureIndices, tokens: torch.Tensor) -> None: ...

    def before_prepare(
        self,
        tokens: torch.Tensor,
        seg_starts: torch.Tensor,
        prefix_lens: torch.Tensor,
        n_rows: int | None,
        out: PreparedInputs | None,
    ) -> None: ...

    def before_read(self, ids: torch.Tensor) -> None: ...

    def after_read(self, ids: torch.Tensor) -> None: ...


class NoChecks:
    """Debug off: every hook returns at once (the host hot path pays one empty call per hook)."""

    __slots__ = ()

    wants_freed = False

    def on_alloc(self, fi: FutureIndices, device_exec: DeviceExec) -> None:
        return

    def on_release(self, freed: np.ndarray | None, device_exec: DeviceExec) -> None:
        return

    def before_store(self, fi: FutureIndices, tokens: torch.Tensor) -> None:
        return

    def after_store(self, fi: FutureIndices, tokens: torch.Tensor) -> None:
        return

    def before_prepare(
        self,
        tokens: torch.Tensor,
        seg_starts: torch.Tensor,
        prefix_lens: torch.Tensor,
        n_rows: int | None,
        out: PreparedInputs | None,
    ) -> None:
        return

    def before_read(self, ids: torch.Tensor) -> None:
        return

    def after_read(self, ids: torch.Tensor) -> None:
        return


NO_CHECKS = NoChecks()


class SlotStates:
    """The state of every slot of ``token_map [capacity + 1]``, and the checks on it.

    ``err`` is the map's ``[2]`` int64 error flag: a read checks it at once. A
    :class:`SlotChecker`: ``FutureMap(debug=True)`` composes one.
    """

    wants_freed = True

    def __init__(self, token_map: torch.Tensor, err: torch.Tensor) -> None:
        self.token_map, self.err = token_map, err
        self.capacity = token_map.numel() - 1
        self.state = torch.zeros(token_map.numel(), dtype=torch.int8, device=token_map.device)

    def _dev(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(slots, dtype=np.int64)).to(self.token_map.device)

    @staticmethod
    def _fail(what: str, slots: torch.Tensor, states: torch.Tensor) -> None:
        s, st = int(slots[0]), int(states[0])
        raise FutureError(
            f"debug: {what} of slot {s} which is {_NAMES.get(st, st)} "
            f"({slots.numel()} slot(s) affected, first {slots[:8].tolist()})"
        )

    @staticmethod
    def _run(effect: Callable[[], None], device_exec: DeviceExec) -> None:
        if device_exec is None:
            effect()
        else:
            device_exec(effect)

    def on_alloc(self, fi: FutureIndices, device_exec: DeviceExec) -> None:
        """Mark ``fi``'s fresh slots allocated, through ``device_exec`` (stream order)."""
        if len(fi):
            slots = fi.slots
            self._run(lambda: self.mark_allocated(slots), device_exec)

    def mark_allocated(self, slots: np.ndarray) -> None:
        self.state[self._dev(slots)] = ALLOCATED

    def before_store(self, fi: FutureIndices, tokens: torch.Tensor) -> None:
        slots = fi.slots
        negative = tokens[tokens < 0]
        if negative.numel():
            raise FutureError(
                f"debug: {negative.numel()} negative token(s) to store: {negative[:8].tolist()}"
            )
        if narrows(self.token_map.dtype, tokens.dtype):
            big = tokens[tokens > INT32_MAX]
            if big.numel():
                raise FutureError(
                    f"debug: {big.numel()} token(s) past the int32 map's range to store: {big[:8].tolist()}"
                )
        idx = self._dev(slots)
        st = self.state[idx]
        bad = st != ALLOCATED
        if bool(bad.any()):
            self._fail("store", idx[bad], st[bad])
        self.state[idx] = WRITTEN

    def after_store(self, fi: FutureIndices, tokens: torch.Tensor) -> None:
        """Read the slots back: a store that wrote other slots (handle confusion) fails here."""
        idx = self._dev(fi.slots)
        landed = self.token_map[idx] == tokens.to(self.token_map.dtype)
        if not bool(landed.all()):
            miss = idx[~landed]
            raise FutureError(
                f"debug: store did not land in slot(s) {miss[:8].tolist()} ({miss.numel()} missed)"
            )

    def before_prepare(
        self,
        tokens: torch.Tensor,
        seg_starts: torch.Tensor,
        prefix_lens: torch.Tensor,
        n_rows: int | None,
        out: PreparedInputs | None,
    ) -> None:
        """Every check of ``prepare_inputs`` first (the debug read marks slots read), then the read."""
        check_prepare_args(tokens, seg_starts, prefix_lens, self.token_map, n_rows, out, None)
        if not self.token_map.is_cuda:
            check_segments(seg_starts, prefix_lens)
        self.before_read(tokens)

    def before_read(self, ids: torch.Tensor) -> None:
        idx = -ids[ids < 0].to(torch.int64)
        idx = idx[(idx >= 1) & (idx <= self.capacity)]
        st = self.state[idx]
        bad = (st != WRITTEN) & (st != READ)
        if bool(bad.any()):
            self._fail("read", idx[bad], st[bad])
        self.state[idx] = READ

    def after_read(self, ids: torch.Tensor) -> None:
        left = ids[ids < 0]
        if left.numel():
            raise FutureError(f"debug: {left.numel()} negative id(s) survived resolve: {left[:8].tolist()}")
        flags = self.err.tolist()
        if flags[0]:
            self.err.zero_()  # reported now: the next call starts clean
        raise_if_flagged(flags)

    def on_release(self, freed: np.ndarray | None, device_exec: DeviceExec) -> None:
        """Mark the freed slots free and poison them, through ``device_exec`` (stream order)."""
        if freed is not None and freed.size:
            self._run(lambda: self.mark_freed(freed), device_exec)

    def mark_freed(self, freed: np.ndarray) -> None:
        idx = self._dev(freed)
        self.state[idx] = FREE
        self.token_map[idx] = torch.iinfo(self.token_map.dtype).min
