"""``FutureIndices``: a handle on future slots of one FutureMap (see :mod:`tfuture.futures`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tfuture.futures import FutureMap


class FutureIndices:
    """A handle on a set of future slots of one :class:`FutureMap`, one slot per row.

    Rows keep their order. Build new handles with :meth:`filter` and :meth:`cat`; give every
    handle back with :meth:`FutureMap.release`.
    """

    __slots__ = ("_dups", "_gens", "_map", "_released", "_slots", "_start")

    def __init__(
        self,
        fmap: FutureMap,
        slots: np.ndarray,
        start: int,
        dups: bool | None,
        gens: np.ndarray | None = None,
    ) -> None:
        self._map = fmap
        self._gens = gens  # debug: each slot's allocation generation when this handle was made
        self._slots = slots
        self._start = start  # first slot of a contiguous fresh run, or -1
        self._dups = dups  # does a slot appear twice? None: not computed yet
        self._released = False

    def __len__(self) -> int:
        return int(self._slots.size)

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"FutureIndices(n={len(self)}, {state}, slots={self._slots[:8].tolist()}...)"

    @property
    def slots(self) -> np.ndarray:
        """``[n]`` int64 host array (a read-only view) of the 1-based slot numbers."""
        view = self._slots.view()
        view.flags.writeable = False
        return view

    @property
    def map(self) -> FutureMap:
        """The :class:`FutureMap` whose slots this handle names."""
        return self._map

    @property
    def released(self) -> bool:
        return self._released

    @property
    def is_contiguous(self) -> bool:
        """True for a fresh handle whose slots are one increasing run (stores need no index)."""
        return self._start >= 0

    def host_placeholders(self) -> np.ndarray:
        """``[n]`` int64 host array of ``-slot``, for building a mixed token stream on the host."""
        self._check_live("host_placeholders")
        return -self._slots

    def placeholders(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[n]`` device tensor of ``-slot`` (default dtype: the map's), made without a sync.

        Every call makes a fresh tensor (``resolve`` works in place, so a shared one would turn
        into tokens). It is allocated on the current stream; reading it on another stream
        needs ``record_stream`` (the runtime does this for you).
        """
        self._check_live("placeholders")
        dtype = self._map.dtype if dtype is None else dtype
        if dtype not in (torch.int32, torch.int64):
            raise ValueError(f"placeholders dtype must be torch.int32 or torch.int64, got {dtype}")
        dev, n = self._map.device, len(self)
        if self._start >= 0:
            return torch.arange(-self._start, -self._start - n, -1, dtype=dtype, device=dev)
        return torch.from_numpy(-self._slots).to(device=dev, dtype=dtype, non_blocking=True)

    def __copy__(self) -> FutureIndices:
        raise TypeError("a FutureIndices cannot be copied (a copy holds no slot reference); use filter()")

    def __deepcopy__(self, memo: object) -> FutureIndices:
        return self.__copy__()

    def filter(self, keep: torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]) -> FutureIndices:
        """A new handle on the rows picked by ``keep`` (a bool mask of ``len(self)`` or indices).

        The new handle holds its own reference on its slots and must be released too. A device
        ``keep`` is copied to the host (a sync); pass host masks on the hot path.
        """
        self._check_live("filter")
        idx = _host_index(keep, len(self))
        slots = self._slots[idx]
        # A mask keeps a duplicate-free handle duplicate-free; indices may repeat rows.
        dups = False if idx.dtype == np.bool_ and self._dups is False else None
        self._map._retain(slots, dups is False)
        gens = None if self._gens is None else self._gens[idx]
        return FutureIndices(self._map, slots, -1, dups, gens)

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
            h._check_live("cat")
        fmap = handles[0]._map
        for h in handles[1:]:
            if h._map is not fmap:
                raise ValueError("cat expects handles of one FutureMap, got handles of two maps")
        slots = np.concatenate([h._slots for h in handles])
        parts = [h for h in handles if len(h)]
        dups = parts[0]._dups if len(parts) == 1 else (False if not parts else None)
        fmap._retain(slots, dups is False)
        gens = None
        if all(h._gens is not None for h in handles):
            gens = np.concatenate([h._gens for h in handles])
        return cls(fmap, slots, -1, dups, gens)

    def _has_dups(self) -> bool:
        """True if a slot appears twice (computed once, by sorting: cheaper than np.unique)."""
        if self._dups is None:
            srt = np.sort(self._slots)
            self._dups = bool(srt.size > 1 and (srt[1:] == srt[:-1]).any())
        return self._dups

    def _check_live(self, what: str) -> None:
        if self._released:
            raise ValueError(f"{what}: expected a live FutureIndices, got a released one")
        if self._gens is not None:
            self._map._check_generations(self, what)


def _host_index(keep: object, n: int) -> np.ndarray:
    """Validate ``keep`` and return it as a numpy bool mask or int64 index array."""
    if isinstance(keep, torch.Tensor):
        if keep.dim() != 1:
            raise ValueError(f"keep must be 1-D, got shape {tuple(keep.shape)}")
        if keep.device.type == "meta":
            raise ValueError("keep must hold data (a cpu or cuda tensor), got a tensor on the meta device")
        arr = keep.detach().cpu().numpy()
    elif isinstance(keep, np.ndarray | list | tuple | range):
        arr = np.asarray(keep)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    else:
        raise TypeError(f"keep must be a bool mask or an int index tensor, got {type(keep).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"keep must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.bool_:
        if arr.size != n:
            raise ValueError(f"keep as a bool mask must have {n} entries, got {arr.size}")
        return arr
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"keep must be bool or integer, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < -n or arr.max() >= n):
        raise ValueError(f"keep indices must lie in [-{n}, {n}), got {arr.min()}..{arr.max()}")
    return arr
