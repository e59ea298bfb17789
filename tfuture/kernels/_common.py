"""What every kernel family shares: the dispatch, host checks, and the error-flag helpers.

``use_triton`` is the one dispatch: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``,
run the Triton kernel; other CPU tensors run :mod:`tfuture.kernels.cpu` (the bitmask:
:mod:`tfuture.kernels.cpu_bitmask`). ``block_rows``,
``in_range``, ``load_slots`` and ``flag_bad`` are the ``@triton.jit`` pieces that every kernel's
rows, bounds check and error flag are made of; ``record_bad_`` is the references' error flag.
"""

from __future__ import annotations

import numbers
import os
from typing import TypeAlias

import torch
import triton
import triton.language as tl

INT_DTYPES = (torch.int32, torch.int64)

# The interpreter is chosen when triton is imported; reading it once keeps the per-call path lean.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Slot numbers: an index tensor, or a step-1 range for a contiguous run (no index read then).
Slots: TypeAlias = torch.Tensor | range

# Error-flag layout shared by every kernel: [count of bad entries, most negative bad value].
ERR_LEN = 2

# What an int32 buffer holds: a wider value is flagged, never wrapped into it.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel should run (CUDA, or CPU under the interpreter)."""
    return t.is_cuda or INTERPRET


def cdiv(a: int, b: int) -> int:
    """Ceiling division. Plain int math: ``triton.cdiv`` costs about 3 us a call on the host."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``), without ``triton.next_power_of_2``'s cost."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block_for(n: int) -> int:
    """Block size for ``n`` elements: 128 for small batches, else 1024.

    Two buckets only: each distinct constexpr is one more compile, and a compile in the middle
    of a step stalls the overlap (about 160 ms cold), so few variants beat a tight fit.
    """
    return 128 if n <= 128 else 1024


def search_steps(n_reqs: int) -> int:
    """Binary-search steps over ``n_reqs`` segments, rounded up to a multiple of 4 (few variants)."""
    steps = max(n_reqs - 1, 0).bit_length()
    return -(-steps // 4) * 4


def as_int(name: str, value: object) -> int:
    """``value`` (any integer, numpy's included, not a bool) as a Python int, else a ``TypeError``."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def narrows(dst: torch.dtype, *src: torch.dtype) -> bool:
    """True when ``dst`` is int32 and a ``src`` is int64: some values would not fit."""
    return dst == torch.int32 and torch.int64 in src


def check_vector(name: str, t: object, dtypes: tuple[torch.dtype, ...] = INT_DTYPES) -> None:
    """Raise unless ``t`` is a contiguous 1-D tensor of one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got a {t.dim()}-D tensor of shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise unless ``t`` lives on the same device as ``ref``."""
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_err(err: object, ref: torch.Tensor) -> None:
    """Raise unless ``err`` is a length-2 int64 error flag on ``ref``'s device."""
    check_vector("err", err, (torch.int64,))
    assert isinstance(err, torch.Tensor)
    if err.numel() != ERR_LEN:
        raise ValueError(f"err must have {ERR_LEN} elements, got {err.numel()}")
    check_same_device("err", err, "token_map", ref)


def record_bad_(err: torch.Tensor | None, bad: torch.Tensor, values: torch.Tensor) -> None:
    """The references' error flag: ``err[0] += bad.sum()``, ``err[1] = min(err[1], values[bad])``."""
    if err is not None:
        err[0] += bad.sum()
        err[1:] = torch.cat([err[1:], values.to(torch.int64)[bad]]).min()


@triton.jit
def block_rows(BLOCK: tl.constexpr):
    """This program's ``BLOCK`` row numbers, int64 so that ``row * stride`` never wraps in int32."""
    return tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def in_range(slots, n_slots):
    """Slot 0 is the padding row and slots past the map do not exist: neither is ever touched."""
    return (slots >= 1) & (slots < n_slots)


@triton.jit
def load_slots(slots_ptr, offs, live, slot_start, CONTIGUOUS: tl.constexpr, NEGATED: tl.constexpr):
    """Slot numbers of rows ``offs`` as int64: ``slot_start + offs`` for a contiguous run (no
    index read), else ``slots[offs]``, negated when the index holds placeholders ``-slot``."""
    if CONTIGUOUS:
        slots = slot_start + offs
    else:
        slots = tl.load(slots_ptr + offs, mask=live, other=0).to(tl.int64)
        if NEGATED:
            slots = -slots
    return slots


@triton.jit
def flag_bad(err_ptr, bad, value, BLOCK: tl.constexpr):
    """Count the ``bad`` lanes in ``err[0]`` and keep the minimum of their ``value`` in ``err[1]``.

    The atomics are masked to the bad lanes: a clean batch issues none.
    """
    zero = tl.zeros([BLOCK], dtype=tl.int64)
    tl.atomic_add(err_ptr + zero, tl.full([BLOCK], 1, tl.int64), mask=bad)
    tl.atomic_min(err_ptr + 1 + zero, value.to(tl.int64), mask=bad)
