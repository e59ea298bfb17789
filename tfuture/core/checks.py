"""Host-side argument checks shared by the layers: counts and row selections (bottom layer)."""

from __future__ import annotations

import importlib
import numbers
from collections.abc import Callable

import numpy as np
import torch


def _c_count_nonzero() -> Callable[[np.ndarray], int]:
    """numpy's C ``count_nonzero``: ``np.count_nonzero`` wraps it in two Python calls (its
    dispatcher and its axis handling), a third of its cost on the small arrays of a step."""
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1
        try:
            fn = importlib.import_module(name).count_nonzero
        except (ImportError, AttributeError):
            continue
        if callable(fn):
            return fn
    return np.count_nonzero


#: ``count_nonzero(a)`` of a whole array (no ``axis``), the C function when numpy exposes it.
count_nonzero: Callable[[np.ndarray], int] = _c_count_nonzero()


def as_count(name: str, n: object, what: str = "count") -> int:
    """``n`` (any integer, numpy's too) as a Python int >= 0, else a ``TypeError``/``ValueError``
    naming ``name``."""
    if type(n) is not int:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name} expects an int {what}, got {type(n).__name__}")
        n = int(n)
    if n < 0:
        raise ValueError(f"{name} expects {'n' if what == 'slot count' else 'an int'} >= 0, got {n}")
    return n


def host_index(keep: object, n: int) -> np.ndarray:
    """Validate ``keep`` and return it as a numpy bool mask or int64 index array."""
    if isinstance(keep, torch.Tensor):
        if keep.dim() != 1:
            raise ValueError(f"keep must be 1-D, got shape {tuple(keep.shape)}")
        if keep.device.type == "meta":
            raise ValueError("keep must hold data (a cpu or cuda tensor), got a tensor on the meta device")
        arr = keep.detach().cpu().numpy()
    elif isinstance(keep, np.ndarray | list | tuple | range):
        arr = np.asarray(keep)
        if arr.size == 0 and not isinstance(keep, np.ndarray):
            arr = arr.astype(np.int64)  # [] is float64 to numpy: an empty index
    else:
        raise TypeError(f"keep must be a bool mask or an int index tensor, got {type(keep).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"keep must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.bool_:
        if arr.size != n:
            raise ValueError(f"keep as a bool mask must have {n} entries, got {arr.size}")
        return arr
    if arr.dtype == np.uint8:
        # torch's old mask dtype: read as indices it would keep the wrong rows, silently.
        raise TypeError(
            "keep must be a bool mask or an int index tensor, got uint8 "
            "(ambiguous: pass keep.bool() for a mask, int64 for indices)"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"keep must be bool or integer, got dtype {arr.dtype}")
    if arr.size:
        # As Python ints: a uint64 past int64 would wrap to a negative in an int64 cast.
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -n or hi >= n:
            raise ValueError(f"keep indices must lie in [-{n}, {n}), got {lo}..{hi}")
    return arr.astype(np.int64, copy=False)
