"""The errors tfuture raises, and the host check of a map's device error flag (bottom layer)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class FutureMapFull(RuntimeError):
    """``alloc`` asked for more slots than are free. Nothing was overwritten."""


class FutureError(RuntimeError):
    """A device-side check failed: a bad placeholder, or (debug) a slot used out of order."""


def raise_if_flagged(err: Sequence[int] | np.ndarray) -> None:
    """Raise :class:`FutureError` for a host copy ``[count, most negative value]`` of an error flag."""
    count, worst = int(err[0]), int(err[1])
    if count:
        raise FutureError(
            f"{count} placeholder(s) pointed outside the FutureMap, token(s) did not fit the dtype or "
            f"segment(s) were malformed, or negative token(s) were stored (most negative: {worst}); "
            "bad ids were replaced by token 0 and never read"
        )
