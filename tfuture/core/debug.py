"""Debug-mode slot state machine of a FutureMap, kept on the device.

Per slot: FREE -> (alloc) ALLOCATED -> (store) WRITTEN -> (resolve) READ -> (release) FREE.
A store needs ALLOCATED (else write-twice or write-after-release) and is read back (a store
that wrote other slots fails), a read needs WRITTEN or READ (else read-before-write or
read-after-release). Released slots are poisoned with the dtype's minimum, so any path that
skips these checks still sees an out-of-range placeholder. Each check copies its verdict to
the host: debug mode costs one sync per call.

:class:`SlotStates` knows the map's tensors, not the map: ``FutureMap(debug=True)`` composes one.
"""

from __future__ import annotations

import numpy as np
import torch

from tfuture.core.errors import FutureError, raise_if_flagged
from tfuture.kernels._common import INT32_MAX, narrows

FREE, ALLOCATED, WRITTEN, READ = 0, 1, 2, 3
_NAMES = {FREE: "free (released)", ALLOCATED: "allocated, never written", WRITTEN: "written", READ: "read"}


class SlotStates:
    """The state of every slot of ``token_map [capacity + 1]``, and the checks on it.

    ``err`` is the map's ``[2]`` int64 error flag: a read checks it at once.
    """

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

    def on_alloc(self, slots: np.ndarray) -> None:
        self.state[self._dev(slots)] = ALLOCATED

    def on_store(self, slots: np.ndarray, tokens: torch.Tensor) -> None:
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

    def after_store(self, slots: np.ndarray, tokens: torch.Tensor) -> None:
        """Read the slots back: a store that wrote other slots (handle confusion) fails here."""
        idx = self._dev(slots)
        landed = self.token_map[idx] == tokens.to(self.token_map.dtype)
        if not bool(landed.all()):
            miss = idx[~landed]
            raise FutureError(
                f"debug: store did not land in slot(s) {miss[:8].tolist()} ({miss.numel()} missed)"
            )

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

    def on_release(self, freed: np.ndarray) -> None:
        idx = self._dev(freed)
        self.state[idx] = FREE
        self.token_map[idx] = torch.iinfo(self.token_map.dtype).min
