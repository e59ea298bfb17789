"""The lines every kernel sweep measures tfuture against, besides eager torch.

* :func:`compiled`: ``torch.compile`` of a torch reference, compiled before timing.
* :func:`empty_launch`: one launch of a Triton kernel that does nothing, the floor (GPU only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import triton


def compiled(fn: Callable[..., Any], *example: Any) -> Callable[..., Any] | None:
    """``torch.compile(fn, dynamic=False)``, compiled now on ``example``; None if that fails.

    A fresh dynamo cache per call: past its recompile limit (8) dynamo falls back to eager.
    On CPU inductor needs a C++ compiler; without one the compile raises and this says so.
    """
    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        out = torch.compile(fn, dynamic=False)
        out(*example)
    except Exception as exc:
        print(f"torch.compile of {fn.__name__} failed: {type(exc).__name__}: {str(exc)[:300]}")
        return None
    print(f"torch.compile of {fn.__name__}: {time.perf_counter() - t0:.1f} s")
    return out


@triton.jit
def _empty_kernel(x_ptr):
    pass


def empty_launch(x: torch.Tensor) -> None:
    """One launch of a Triton kernel that does nothing (needs a GPU driver)."""
    _empty_kernel[(1,)](x)
