"""Store and gather several per-slot fields of different widths and dtypes, one launch each.

Field ``f`` lives in its own buffer ``buffers[f]: [n_slots, *shape_f]`` (any dtype of 1, 2, 4 or
8 bytes); slot ``s`` is row ``s`` and row 0 is padding. The kernels never do arithmetic on
field values: every buffer and payload is viewed as integer words of its element size
(bf16 -> int16, float32 -> int32, ...), so floats move bit for bit (NaN payloads, -0.0) and the
interpreter's bf16 arithmetic is never involved. The per-field pointers, row strides and widths
go in as kernel-argument tuples: one launch covers every field, and no pointer table has to be
copied to the device per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import torch
import triton
import triton.language as tl

from tfuture.kernels import cpu
from tfuture.kernels._common import (
    Slots,
    block_rows,
    cdiv,
    check_err,
    flag_bad,
    in_range,
    load_slots,
    next_pow2,
    record_bad_,
    use_triton,
)
from tfuture.kernels._field_layout import (
    as_words,
    block_cols,
    check_outs,
    check_pairs,
    check_slots,
    row_stride,
    row_width,
)

__all__ = [
    "as_words",
    "gather_fields",
    "gather_fields_ref",
    "launch_gather_fields",
    "launch_store_fields",
    "row_stride",
    "store_fields",
    "store_fields_ref",
]

# One tensor per field: the buffers, the payloads, the gathered outputs.
Fields: TypeAlias = Sequence[torch.Tensor]

# Tile budget per field and program: about 4K words keeps a tile in registers at 4 warps.
_TILE = 4096
_ROW_CAP = 64


# Sizes change every step: specializing on them (==1, %16) would recompile mid-step.
@triton.jit(do_not_specialize=["n_rows", "n_slots", "slot_start"])
def _fields_kernel(
    slots_ptr,
    src_ptrs,
    dst_ptrs,
    src_strides,
    dst_strides,
    err_ptr,
    n_rows,
    n_slots,
    slot_start,
    WIDTHS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GATHER: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    NEGATED: tl.constexpr,
    HAS_ERR: tl.constexpr,
):
    rows = block_rows(BLOCK_R)
    live = rows < n_rows
    slots = load_slots(slots_ptr, rows, live, slot_start, CONTIGUOUS=CONTIGUOUS, NEGATED=NEGATED)
    # A slot outside the map is never touched; gather writes zeros in its output row.
    ok = live & in_range(slots, n_slots)
    if GATHER:
        src_rows, dst_rows, src_ok, dst_ok = slots, rows, ok, live
    else:
        src_rows, dst_rows, src_ok, dst_ok = rows, slots, live, ok
    for f in tl.static_range(len(WIDTHS)):
        # triton 3.6 hands CHUNKS[f] back as a plain int: wrap it for static_range.
        for c in tl.static_range(tl.constexpr(CHUNKS[f])):
            cols = c * BLOCK_C[f] + tl.arange(0, BLOCK_C[f])
            in_row = cols[None, :] < WIDTHS[f]
            src = src_ptrs[f] + src_rows[:, None] * src_strides[f] + cols[None, :]
            words = tl.load(src, mask=src_ok[:, None] & in_row, other=0)
            dst = dst_ptrs[f] + dst_rows[:, None] * dst_strides[f] + cols[None, :]
            tl.store(dst, words, mask=dst_ok[:, None] & in_row)
    if HAS_ERR:
        flag_bad(err_ptr, live & ~ok, -slots, BLOCK=BLOCK_R)


def _launch_kernel(
    buffers: Fields, values: Fields, slots: Slots, negated: bool, err: torch.Tensor | None, gather: bool
) -> None:
    n = len(slots)
    live = [i for i, b in enumerate(buffers) if row_width(b) > 0]
    widths = tuple(row_width(buffers[i]) for i in live)
    bufs = tuple(as_words(buffers[i]) for i in live)
    vals = tuple(as_words(values[i]) for i in live)
    val_strides = tuple(row_stride(f"values[{i}]", values[i]) for i in live)
    if not live:
        if err is None:
            return
        # Nothing to copy, but bad slots are still flagged: one width-0 field whose pointers
        # (err, never dereferenced) stand in for the empty buffers.
        widths, bufs, vals, val_strides = (0,), (err,), (err,), (0,)
    block_c = tuple(block_cols(w) for w in widths)
    block_r = max(1, min(_ROW_CAP, _TILE // max(block_c), next_pow2(n)))
    src, dst = (bufs, vals) if gather else (vals, bufs)
    src_strides, dst_strides = (widths, val_strides) if gather else (val_strides, widths)
    contiguous = isinstance(slots, range)
    ref = buffers[0]
    _fields_kernel[(cdiv(n, block_r),)](
        ref if contiguous else slots,
        src,
        dst,
        src_strides,
        dst_strides,
        ref if err is None else err,
        n,
        ref.shape[0],
        slots.start if isinstance(slots, range) else 0,
        WIDTHS=widths,
        BLOCK_C=block_c,
        CHUNKS=tuple(cdiv(w, b) for w, b in zip(widths, block_c, strict=True)),
        BLOCK_R=block_r,
        GATHER=gather,
        CONTIGUOUS=contiguous,
        NEGATED=negated,
        HAS_ERR=err is not None,
    )


def store_fields(
    buffers: Fields, slots: Slots, values: Fields, *, negated: bool = False, err: torch.Tensor | None = None
) -> None:
    """``buffers[f][slots[i]] = values[f][i]`` for every field ``f`` and row ``i``, in one launch.

    Args:
        buffers: per field a contiguous ``[n_slots, *shape_f]`` tensor, any 1/2/4/8-byte dtype.
        slots: ``[n]`` int32/int64 slot numbers (``-slot`` placeholders with ``negated=True``),
            or a step-1 ``range`` for a contiguous run (no index tensor is read then).
        values: per field ``[n, *shape_f]`` of the buffer's dtype; rows may be strided, each
            row must be one contiguous block. Copied bit for bit.
        negated: ``slots`` holds placeholders ``-slot`` (as ``FutureIndices.placeholders()``).
        err: optional ``[2]`` int64 flag; slots outside ``[1, n_slots)`` are never written and,
            with ``err``, counted in ``err[0]`` with ``min(-slot)`` in ``err[1]``.

    Runs on the current stream, never syncs. ``n == 0`` is a no-op. Duplicate slots are the
    caller's bug (which row lands is unspecified).
    """
    ref = check_pairs(buffers, values, "values")
    n = check_slots(slots, ref.shape[0], ref)
    if values[0].shape[0] != n:
        raise ValueError(f"values must have one row per slot ({n}), got {values[0].shape[0]}")
    if err is not None:
        check_err(err, ref)
    if n and not use_triton(ref):
        # Not launch_store_fields: its CPU path trusts the caller's slots, and these may be bad.
        cpu.store_fields(buffers, slots, values, negated, err)
        return
    launch_store_fields(buffers, slots, values, negated, err)


def launch_store_fields(
    buffers: Fields, slots: Slots, values: Fields, negated: bool, err: torch.Tensor | None
) -> None:
    """:func:`store_fields` without its checks, for callers that made them already and name only
    slots in ``[1, n_slots)`` (the CPU path then skips its bounds check; the kernel keeps it)."""
    if len(slots) == 0:
        return
    if not use_triton(buffers[0]):
        cpu.store_fields(buffers, slots, values, negated, err, in_range=True)
        return
    _launch_kernel(buffers, values, slots, negated, err, gather=False)


def gather_fields(
    buffers: Fields,
    slots: Slots,
    *,
    out: Fields | None = None,
    negated: bool = False,
    err: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """``out[f][i] = buffers[f][slots[i]]`` for every field, in one launch; returns ``out``.

    Args:
        buffers: as in :func:`store_fields`.
        slots: as in :func:`store_fields`. Duplicates are fine.
        out: optional per-field ``[n, *shape_f]`` outputs of the buffer's dtype (for CUDA-graph
            capture); default: fresh contiguous tensors.
        negated, err: as in :func:`store_fields`. A slot outside ``[1, n_slots)`` is never read:
            its output row is all zero bits.

    Runs on the current stream, never syncs. ``n == 0`` returns empty outputs without a launch.
    """
    if not isinstance(buffers, Sequence) or not buffers:
        raise ValueError("buffers must be a non-empty sequence of tensors")
    if not isinstance(buffers[0], torch.Tensor):
        raise TypeError(f"buffers[0] must be a torch.Tensor, got {type(buffers[0]).__name__}")
    n = check_slots(slots, buffers[0].shape[0], buffers[0])
    if out is not None:
        check_outs(buffers, out, n)
    if err is not None:
        check_err(err, buffers[0])
    if n and not use_triton(buffers[0]):
        # Not launch_gather_fields: its CPU path trusts the caller's slots, and these may be bad.
        return cpu.gather_fields(buffers, slots, out, negated, err)
    return launch_gather_fields(buffers, slots, out, negated, err)


def launch_gather_fields(
    buffers: Fields, slots: Slots, out: Fields | None, negated: bool, err: torch.Tensor | None
) -> list[torch.Tensor]:
    """:func:`gather_fields` without its checks (``out=None`` allocates), for callers that name
    only slots in ``[1, n_slots)``, as :func:`launch_store_fields`."""
    n = len(slots)
    if n and not use_triton(buffers[0]):
        return cpu.gather_fields(buffers, slots, out, negated, err, in_range=True)
    if out is None:
        out = [torch.empty((n, *b.shape[1:]), dtype=b.dtype, device=b.device) for b in buffers]
    if n:
        _launch_kernel(buffers, out, slots, negated, err, gather=True)
    return list(out)


def _ref_index(
    slots: Slots, ref: torch.Tensor, negated: bool, err: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, ok)``: int64 slot numbers and which lie in ``[1, n_slots)``; flags the rest."""
    if isinstance(slots, range):
        slots = torch.arange(slots.start, slots.stop, device=ref.device)
    idx = -slots.to(torch.int64) if negated else slots.to(torch.int64)
    ok = (idx >= 1) & (idx < ref.shape[0])
    record_bad_(err, ~ok, -idx)
    return idx, ok


def store_fields_ref(
    buffers: Fields, slots: Slots, values: Fields, *, negated: bool = False, err: torch.Tensor | None = None
) -> None:
    """Torch reference of :func:`store_fields`, the tests' oracle."""
    idx, ok = _ref_index(slots, buffers[0], negated, err)
    for buf, val in zip(buffers, values, strict=True):
        as_words(buf)[idx[ok]] = as_words(val)[ok]


def gather_fields_ref(
    buffers: Fields, slots: Slots, *, negated: bool = False, err: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Torch reference of :func:`gather_fields`, the tests' oracle: fresh outputs."""
    idx, ok = _ref_index(slots, buffers[0], negated, err)
    res = []
    for buf in buffers:
        words = torch.zeros((len(idx), *buf.shape[1:]), dtype=as_words(buf).dtype, device=buf.device)
        words[ok] = as_words(buf)[idx[ok]]
        res.append(words.view(buf.dtype))
    return res
