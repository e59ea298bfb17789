"""CPU paths of resolve and input preparation, in numpy on the tensors' own memory.

Without the Triton interpreter, CPU tensors take these paths. A chain of small torch ops costs
several microseconds each on the host; numpy on the same memory costs far less, and on the
host reading a count (to skip work) costs no device sync. Results equal the kernels'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tfuture.kernels.resolve import PreparedInputs


def resolve_host_(ids: np.ndarray, token_map: np.ndarray, err: torch.Tensor | None) -> None:
    """In place on host arrays (CPU tensors share their memory); numpy costs far less per call
    than a chain of small torch ops, and on the host reading a count costs no sync."""
    where = np.flatnonzero(ids < 0)
    if not where.size:
        return
    # Negate in int64: the int32 minimum then becomes 2**31 (out of range), and the int64
    # minimum wraps to itself (negative, out of range): both are bad, never read.
    slots = -ids[where].astype(np.int64)
    ok = (slots >= 1) & (slots < token_map.size)
    if ok.all():
        ids[where] = token_map[slots]
        return
    ids[where[ok]] = token_map[slots[ok]]
    bad = where[~ok]
    if err is not None:
        err[0] += bad.size
        err[1] = min(int(err[1]), int(ids[bad].min()))
        ids[bad] = 0


def prepare_cpu_into(
    tokens: torch.Tensor,
    seg: torch.Tensor,
    prefix_lens: torch.Tensor,
    token_map: torch.Tensor,
    out: PreparedInputs,
    err: torch.Tensor | None,
) -> bool:
    """The CPU path, in numpy on the tensors' memory: live rows only, host counts cost no sync.

    Returns False (nothing written) when the segments are not well formed (``seg[0] != 0`` or
    decreasing); the general path then gives the kernel's exact answer for them too.
    """
    sg = seg.numpy()
    total = min(int(sg[-1]), tokens.numel())
    seg_c = np.minimum(sg, total)
    lens = np.diff(seg_c)
    if sg[0] != 0 or (lens < 0).any():
        return False
    # Resolve in the stream's dtype, then cast into the output, as the kernel does.
    live = tokens.numpy()[:total].copy()
    resolve_host_(live, token_map.numpy(), err)
    ids, pos = out.input_ids.numpy(), out.positions.numpy()
    ids[:total] = live
    ids[total:] = 0
    pos[total:] = 0
    if prefix_lens.numel():
        pos[:total] = np.repeat(prefix_lens.numpy() - seg_c[:-1], lens) + np.arange(total)
        out.last_rows.numpy()[:] = np.maximum(seg_c[1:] - 1, 0)
    return True
