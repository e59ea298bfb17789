"""Debug-mode slot state machine of a FutureMap, kept on the device.

Per slot: FREE -> (alloc) ALLOCATED -> (store) WRITTEN -> (resolve) READ -> (release) FREE.
A store needs ALLOCATED (else write-twice or write-after-release) and is read back (a store
that wrote other slots fails), a read needs WRITTEN or READ (else read-before-write or
read-after-release). Released slots are poisoned with the
dtype's minimum, so any path that skips these checks still sees an out-of-range placeholder.
Each check copies its verdict to the host: debug mode costs one sync per call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tfuture.futures import FutureMap

FREE, ALLOCATED, WRITTEN, READ = 0, 1, 2, 3
_NAMES = {FREE: "free (released)", ALLOCATED: "allocated, never written", WRITTEN: "written", READ: "read"}


def new_state(fmap: FutureMap) -> torch.Tensor:
    return torch.zeros(fmap.capacity + 1, dtype=torch.int8, device=fmap.device)


def _dev(fmap: FutureMap, slots: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(fmap.device)


def _fail(fmap: FutureMap, what: str, slots: torch.Tensor, states: torch.Tensor) -> None:
    from tfuture.futures import FutureError

    s, st = int(slots[0]), int(states[0])
    raise FutureError(
        f"debug: {what} of slot {s} which is {_NAMES.get(st, st)} "
        f"({slots.numel()} slot(s) affected, first {slots[:8].tolist()})"
    )


def on_alloc(fmap: FutureMap, slots: np.ndarray) -> None:
    assert fmap._state is not None
    fmap._state[_dev(fmap, slots)] = ALLOCATED


def on_store(fmap: FutureMap, slots: np.ndarray, tokens: torch.Tensor) -> None:
    from tfuture.futures import FutureError

    state = fmap._state
    assert state is not None
    negative = tokens[tokens < 0]
    if negative.numel():
        raise FutureError(f"debug: {negative.numel()} negative token(s) to store: {negative[:8].tolist()}")
    idx = _dev(fmap, slots)
    st = state[idx]
    bad = st != ALLOCATED
    if bool(bad.any()):
        _fail(fmap, "store", idx[bad], st[bad])
    state[idx] = WRITTEN


def after_store(fmap: FutureMap, slots: np.ndarray, tokens: torch.Tensor) -> None:
    """Read the slots back: a store that wrote other slots (handle confusion) fails here."""
    from tfuture.futures import FutureError

    idx = _dev(fmap, slots)
    landed = fmap.token_map[idx] == tokens.to(fmap.dtype)
    if not bool(landed.all()):
        miss = idx[~landed]
        raise FutureError(f"debug: store did not land in slot(s) {miss[:8].tolist()} ({miss.numel()} missed)")


def before_read(fmap: FutureMap, ids: torch.Tensor) -> None:
    state = fmap._state
    assert state is not None
    idx = -ids[ids < 0].to(torch.int64)
    idx = idx[(idx >= 1) & (idx <= fmap.capacity)]
    st = state[idx]
    bad = (st != WRITTEN) & (st != READ)
    if bool(bad.any()):
        _fail(fmap, "read", idx[bad], st[bad])
    state[idx] = READ


def after_read(fmap: FutureMap, ids: torch.Tensor) -> None:
    from tfuture.futures import FutureError, raise_if_flagged

    left = ids[ids < 0]
    if left.numel():
        raise FutureError(f"debug: {left.numel()} negative id(s) survived resolve: {left[:8].tolist()}")
    flags = fmap.err.tolist()
    if flags[0]:
        fmap.err.zero_()  # reported now: the next call starts clean
    raise_if_flagged(flags)


def on_release(fmap: FutureMap, freed: np.ndarray) -> None:
    assert fmap._state is not None
    idx = _dev(fmap, freed)
    fmap._state[idx] = FREE
    fmap.token_map[idx] = torch.iinfo(fmap.dtype).min
