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

import torch
import triton
import triton.language as tl

from tfuture.kernels._common import cdiv, check_err, next_pow2, record_bad_, use_triton
from tfuture.kernels._fields_common import (
    as_words,
    block_cols,
    check_outs,
    check_pairs,
    check_slots,
    row_stride,
    row_width,
)

__all__ = ["as_words", "gather_fields", "gather_fields_ref", "row_stride", "store_fields", "store_fields_ref"]

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
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    if CONTIGUOUS:
        slots = slot_start + rows
    else:
        slots = tl.load(slots_ptr + rows, mask=live, other=0).to(tl.int64)
        if NEGATED:
            slots = -slots
    # Slot 0 is padding and anything past the map is never touched; gather writes zeros there.
    ok = live & (slots >= 1) & (slots < n_slots)
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
        bad = live & ~ok
        zero = tl.zeros([BLOCK_R], dtype=tl.int64)
        tl.atomic_add(err_ptr + zero, tl.full([BLOCK_R], 1, tl.int64), mask=bad)
        tl.atomic_min(err_ptr + 1 + zero, -slots, mask=bad)


def _launch(
    buffers: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    slots: torch.Tensor | range,
    n: int,
    *,
    gather: bool,
    negated: bool,
    err: torch.Tensor | None,
) -> None:
    live = [i for i, b in enumerate(buffers) if row_width(b) > 0]
    widths = tuple(row_width(buffers[i]) for i in live)
    bufs = tuple(as_words(buffers[i]) for i in live)
    vals = tuple(as_words(values[i]) for i in live)
    val_strides = tuple(row_stride(f"values[{i}]", values[i]) for i in live)
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
    buffers: Sequence[torch.Tensor],
    slots: torch.Tensor | range,
    values: Sequence[torch.Tensor],
    *,
    negated: bool = False,
    err: torch.Tensor | None = None,
    validate: bool = True,
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
        validate: False skips the host checks, for a caller that made them already and
            guarantees in-range slots (:class:`tfuture.fields.FutureFields`, whose handles name
            live slots); the CPU path then skips its bounds check too. A bad call is undefined.

    Runs on the current stream, never syncs. ``n == 0`` is a no-op. Duplicate slots are the
    caller's bug (which row lands is unspecified).
    """
    n = len(slots)
    if validate:
        ref = check_pairs(buffers, values, "values")
        n = check_slots(slots, ref.shape[0], ref)
        if values[0].shape[0] != n:
            raise ValueError(f"values must have one row per slot ({n}), got {values[0].shape[0]}")
        if err is not None:
            check_err(err, ref)
    if n == 0:
        return
    if not use_triton(buffers[0]) or not any(row_width(b) for b in buffers):
        store_fields_ref(buffers, slots, values, negated=negated, err=err, in_range=not validate)
        return
    _launch(buffers, values, slots, n, gather=False, negated=negated, err=err)


def gather_fields(
    buffers: Sequence[torch.Tensor],
    slots: torch.Tensor | range,
    *,
    out: Sequence[torch.Tensor] | None = None,
    negated: bool = False,
    err: torch.Tensor | None = None,
    validate: bool = True,
) -> list[torch.Tensor]:
    """``out[f][i] = buffers[f][slots[i]]`` for every field, in one launch; returns ``out``.

    Args:
        buffers: as in :func:`store_fields`.
        slots: as in :func:`store_fields`. Duplicates are fine.
        out: optional per-field ``[n, *shape_f]`` outputs of the buffer's dtype (for CUDA-graph
            capture); default: fresh contiguous tensors.
        negated, err: as in :func:`store_fields`. A slot outside ``[1, n_slots)`` is never read:
            its output row is all zero bits.
        validate: as in :func:`store_fields`.

    Runs on the current stream, never syncs. ``n == 0`` returns empty outputs without a launch.
    """
    n = len(slots)
    if validate:
        if not isinstance(buffers, Sequence) or not buffers:
            raise ValueError("buffers must be a non-empty sequence of tensors")
        if not isinstance(buffers[0], torch.Tensor):
            raise TypeError(f"buffers[0] must be a torch.Tensor, got {type(buffers[0]).__name__}")
        n = check_slots(slots, buffers[0].shape[0], buffers[0])
        if out is not None:
            check_outs(buffers, out, n)
        if err is not None:
            check_err(err, buffers[0])
    kernel = use_triton(buffers[0]) and any(row_width(b) for b in buffers)
    if not kernel and n:
        return gather_fields_ref(buffers, slots, out=out, negated=negated, err=err, in_range=not validate)
    if out is None:
        out = [torch.empty((n, *b.shape[1:]), dtype=b.dtype, device=b.device) for b in buffers]
    if n:
        _launch(buffers, out, slots, n, gather=True, negated=negated, err=err)
    return list(out)


def _ref_slots(
    slots: torch.Tensor | range, n_slots: int, device: torch.device, negated: bool, in_range: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(index, ok)``; ``ok`` is None when every slot is known to be in range."""
    if isinstance(slots, range):
        return torch.arange(slots.start, slots.stop, device=device), None
    idx = -slots.to(torch.int64) if negated else slots
    if in_range:
        return idx, None
    if not idx.is_cuda and idx.numel():
        # On the host a bounds check is one reduction, and the common all-good case then
        # needs no mask: 2-3 small ops fewer per call, each a few us on CPU.
        lo, hi = idx.aminmax()
        if int(lo) >= 1 and int(hi) < n_slots:
            return idx, None
    idx = idx.to(torch.int64)
    return idx, (idx >= 1) & (idx < n_slots)


def store_fields_ref(
    buffers: Sequence[torch.Tensor],
    slots: torch.Tensor | range,
    values: Sequence[torch.Tensor],
    *,
    negated: bool = False,
    err: torch.Tensor | None = None,
    in_range: bool = False,
) -> None:
    """Torch reference of :func:`store_fields` (its CPU path too): one indexing op per field.

    ``in_range``: the caller guarantees every slot lies in ``[1, n_slots)`` (no bounds check).
    """
    if isinstance(slots, range):
        for buf, val in zip(buffers, values, strict=True):
            as_words(buf)[slots.start : slots.stop] = as_words(val)
        return
    idx, ok = _ref_slots(slots, buffers[0].shape[0], buffers[0].device, negated, in_range)
    dst = (idx if ok is None else idx[ok]).to(torch.int64)
    for buf, val in zip(buffers, values, strict=True):
        as_words(buf).index_copy_(0, dst, as_words(val) if ok is None else as_words(val)[ok])
    if err is not None and ok is not None:
        record_bad_(err, ~ok, -idx)


def gather_fields_ref(
    buffers: Sequence[torch.Tensor],
    slots: torch.Tensor | range,
    *,
    out: Sequence[torch.Tensor] | None = None,
    negated: bool = False,
    err: torch.Tensor | None = None,
    in_range: bool = False,
) -> list[torch.Tensor]:
    """Torch reference of :func:`gather_fields` (its CPU path too): one indexing op per field.

    ``in_range``: as in :func:`store_fields_ref`.
    """
    idx, ok = _ref_slots(slots, buffers[0].shape[0], buffers[0].device, negated, in_range)
    safe = idx if ok is None else torch.where(ok, idx, 0)
    res = []
    for i, buf in enumerate(buffers):
        if out is None:
            words = as_words(buf).index_select(0, safe)
            res.append(words.view(buf.dtype))
        else:
            words = torch.index_select(as_words(buf), 0, safe, out=as_words(out[i]))
            res.append(out[i])
        if ok is not None:
            words[~ok] = 0
    if err is not None and ok is not None:
        record_bad_(err, ~ok, -idx)
    return res
