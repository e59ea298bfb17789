"""Host-side validation and dispatch shared by the kernel launchers."""

from __future__ import annotations

import os

import torch

INT_DTYPES = (torch.int32, torch.int64)

# The interpreter is chosen when triton is imported; reading it once keeps the per-call path lean.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Error-flag layout shared by every kernel: [count of bad entries, most negative bad value].
ERR_LEN = 2


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


def record_bad_(err: torch.Tensor, bad: torch.Tensor, values: torch.Tensor) -> None:
    """Torch twin of the kernels' error flag: count ``bad`` rows and keep the minimum value."""
    err[0] += bad.sum()
    worst = torch.where(bad, values.to(torch.int64), torch.zeros_like(values, dtype=torch.int64))
    err[1] = torch.minimum(err[1], worst.min()) if values.numel() else err[1]
