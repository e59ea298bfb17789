"""Field layout for :mod:`tfuture.kernels.fields`: word views, row strides and widths, argument checks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tfuture.kernels._common import INT_DTYPES, cdiv, check_same_device, check_vector, next_pow2

_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# A column tile is at most 512 words, and a row is copied in at most 8 unrolled chunks.
_COL_CAP = 512


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as signed integer words of its element size (no copy, bits unchanged)."""
    word = _WORDS.get(t.element_size())
    if word is None:
        raise TypeError(f"field dtype must have 1, 2, 4 or 8 bytes per element, got {t.dtype}")
    return t if t.dtype == word else t.view(word)


def block_cols(width: int) -> int:
    """Columns per tile for a field of ``width`` words: at most 8 unrolled chunks per row."""
    return max(min(next_pow2(width), _COL_CAP), next_pow2(cdiv(width, 8)))


def row_width(t: torch.Tensor) -> int:
    """Words per row of a ``[n, *shape]`` tensor."""
    return math.prod(t.shape[1:])


def row_stride(name: str, t: torch.Tensor) -> int:
    """Stride between rows of ``t [n, *shape]`` whose rows must each be one contiguous block."""
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size > 1 and stride != expect:
            raise ValueError(
                f"{name} must have contiguous rows (inner strides of a [n, *shape] tensor), "
                f"got strides {t.stride()} for shape {tuple(t.shape)}"
            )
        expect *= size
    return t.stride(0) if t.shape[0] > 1 else expect


def check_slots(slots: object, n_slots: int, ref: torch.Tensor) -> int:
    if isinstance(slots, range):
        if slots.step != 1:
            raise ValueError(f"slots as a range must have step 1, got step {slots.step}")
        if len(slots) and (slots.start < 1 or slots.stop > n_slots):
            raise ValueError(f"slots must lie in [1, {n_slots - 1}], got {slots.start}..{slots.stop - 1}")
        return len(slots)
    check_vector("slots", slots, INT_DTYPES)
    assert isinstance(slots, torch.Tensor)
    check_same_device("slots", slots, "buffers[0]", ref)
    return slots.numel()


def check_pairs(
    buffers: Sequence[torch.Tensor], values: Sequence[torch.Tensor], values_name: str
) -> torch.Tensor:
    """Validate buffers against ``values`` (the payloads or the outputs); return ``buffers[0]``."""
    if not isinstance(buffers, Sequence) or not isinstance(values, Sequence):
        raise TypeError(f"buffers and {values_name} must be sequences of tensors")
    if not buffers:
        raise ValueError("buffers must name at least one field, got none")
    if len(values) != len(buffers):
        raise ValueError(f"{values_name} must have one tensor per buffer ({len(buffers)}), got {len(values)}")
    ref = buffers[0]
    for i, (buf, val) in enumerate(zip(buffers, values, strict=True)):
        for name, t in ((f"buffers[{i}]", buf), (f"{values_name}[{i}]", val)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            check_same_device(name, t, "buffers[0]", ref)
        if buf.dim() < 1 or not buf.is_contiguous():
            raise ValueError(f"buffers[{i}] must be a contiguous [n_slots, *shape] tensor")
        if buf.shape[0] != ref.shape[0]:
            raise ValueError(f"buffers[{i}] must have {ref.shape[0]} slot rows, got {buf.shape[0]}")
        if val.dtype != buf.dtype:
            raise TypeError(f"{values_name}[{i}] must have dtype {buf.dtype}, got {val.dtype}")
        if val.dim() < 1 or tuple(val.shape[1:]) != tuple(buf.shape[1:]):
            want = ("n", *buf.shape[1:])
            raise ValueError(f"{values_name}[{i}] must have shape {want}, got {tuple(val.shape)}")
        if val.shape[0] != values[0].shape[0]:
            raise ValueError(
                f"{values_name}[{i}] has {val.shape[0]} rows but {values_name}[0] has {values[0].shape[0]}"
            )
        as_words(buf)
    return ref


def check_outs(buffers: Sequence[torch.Tensor], out: Sequence[torch.Tensor], n: int) -> None:
    check_pairs(buffers, out, "out")
    for i, t in enumerate(out):
        if t.shape[0] != n:
            raise ValueError(f"out[{i}] must have one row per slot ({n}), got {t.shape[0]}")
        if not t.is_contiguous():
            raise ValueError(f"out[{i}] must be contiguous, got strides {t.stride()}")
