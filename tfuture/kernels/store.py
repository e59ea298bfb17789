"""Store sampled tokens into future slots: ``token_map[slots[i]] = values[i]``."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tfuture.kernels._common import (
    block_for,
    cdiv,
    check_err,
    check_same_device,
    check_vector,
    record_bad_,
    use_triton,
)


# Sizes change every step: specializing on them (==1, %16) would recompile mid-step.
@triton.jit(do_not_specialize=["n_values", "n_slots", "slot_start"])
def _store_kernel(
    map_ptr,
    slots_ptr,
    values_ptr,
    err_ptr,
    n_values,
    n_slots,
    slot_start,
    BLOCK: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    HAS_ERR: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_values
    if CONTIGUOUS:
        slots = slot_start + offs
    else:
        slots = tl.load(slots_ptr + offs, mask=mask, other=0).to(tl.int64)
    # Slot 0 is the padding row and never a target; anything outside [1, n_slots) is dropped.
    ok = mask & (slots >= 1) & (slots < n_slots)
    values = tl.load(values_ptr + offs, mask=mask, other=0)
    if HAS_ERR:
        # A negative token would resolve into a placeholder-like id: store 0 and flag it.
        negative = ok & (values < 0)
        values = tl.where(negative, tl.zeros_like(values), values)
        bad = (mask & ~ok) | negative
        zero = tl.zeros([BLOCK], dtype=tl.int64)
        tl.atomic_add(err_ptr + zero, tl.full([BLOCK], 1, tl.int64), mask=bad)
        worst = tl.where(negative, tl.load(values_ptr + offs, mask=mask, other=0).to(tl.int64), -slots)
        tl.atomic_min(err_ptr + 1 + zero, worst, mask=bad)
    tl.store(map_ptr + slots, values.to(map_ptr.dtype.element_ty), mask=ok)


def _check_store_args(token_map: torch.Tensor, slots: torch.Tensor | range, values: torch.Tensor) -> None:
    check_vector("token_map", token_map)
    check_vector("values", values)
    check_same_device("values", values, "token_map", token_map)
    if isinstance(slots, range):
        if slots.step != 1:
            raise ValueError(f"slots as a range must have step 1, got step {slots.step}")
        n = len(slots)
        if n and (slots.start < 1 or slots.stop > token_map.numel()):
            raise ValueError(
                f"slots must lie in [1, {token_map.numel() - 1}], got {slots.start}..{slots.stop - 1}"
            )
    else:
        check_vector("slots", slots)
        check_same_device("slots", slots, "token_map", token_map)
        n = slots.numel()
    if values.numel() != n:
        raise ValueError(f"values must have one entry per slot ({n}), got {values.numel()}")


def store_futures(
    token_map: torch.Tensor,
    slots: torch.Tensor | range,
    values: torch.Tensor,
    *,
    err: torch.Tensor | None = None,
) -> None:
    """Scatter ``values`` into ``token_map`` at ``slots`` in one launch on the current stream.

    Args:
        token_map: ``[n_slots]`` int32/int64, slot ``s`` lives at ``token_map[s]``; row 0 is padding.
        slots: ``[n]`` int32/int64 slot numbers (any set, contiguous or not), or a ``range`` with
            step 1 for a contiguous run (no index tensor is read then).
        values: ``[n]`` int32/int64, cast to ``token_map.dtype``.
        err: optional ``[2]`` int64 error flag. Slots outside ``[1, n_slots)`` are never written;
            with ``err`` they are counted in ``err[0]`` and ``err[1]`` keeps ``min(-slot)``, and a
            negative value is stored as 0 and counted (``err[1]`` keeps the value).

    Duplicate slots are the caller's bug: which value lands is unspecified. n == 0 is a no-op.
    """
    _check_store_args(token_map, slots, values)
    if err is not None:
        check_err(err, token_map)
    launch_store(token_map, slots, values, err)


def launch_store(
    token_map: torch.Tensor, slots: torch.Tensor | range, values: torch.Tensor, err: torch.Tensor | None
) -> None:
    """:func:`store_futures` without its argument checks, for callers that made them already."""
    n = values.numel()
    if n == 0:
        return
    if not use_triton(token_map):
        store_futures_ref(token_map, slots, values, err=err)
        return
    block = block_for(n)
    contiguous = isinstance(slots, range)
    _store_kernel[(cdiv(n, block),)](
        token_map,
        values if contiguous else slots,
        values,
        token_map if err is None else err,
        n,
        token_map.numel(),
        slots.start if isinstance(slots, range) else 0,
        BLOCK=block,
        CONTIGUOUS=contiguous,
        HAS_ERR=err is not None,
    )


def store_futures_ref(
    token_map: torch.Tensor,
    slots: torch.Tensor | range,
    values: torch.Tensor,
    *,
    err: torch.Tensor | None = None,
) -> None:
    """Torch reference of :func:`store_futures` (also its CPU path without the interpreter)."""
    if token_map.device.type == "cpu":
        _store_host(token_map.numpy(), slots, values.numpy(), err)
        return
    if err is not None:
        negative = values < 0
        record_bad_(err, negative, values)
        values = torch.where(negative, torch.zeros_like(values), values)
    if isinstance(slots, range):
        token_map[slots.start : slots.stop] = values.to(token_map.dtype)
        return
    idx = slots.to(torch.int64)
    ok = (idx >= 1) & (idx < token_map.numel())
    token_map[idx[ok]] = values[ok].to(token_map.dtype)
    if err is not None:
        record_bad_(err, ~ok, -idx)


def _store_host(
    token_map: np.ndarray, slots: torch.Tensor | range, values: np.ndarray, err: torch.Tensor | None
) -> None:
    """The CPU path in numpy on the tensors' memory: on the host a check costs no sync."""
    bad_count, worst = 0, 0
    if err is not None and (values < 0).any():
        negative = values < 0
        bad_count, worst = int(negative.sum()), int(values.min())
        values = np.where(negative, 0, values)
    if isinstance(slots, range):
        token_map[slots.start : slots.stop] = values
    else:
        idx = slots.numpy().astype(np.int64, copy=False)
        ok = (idx >= 1) & (idx < token_map.size)
        if ok.all():
            token_map[idx] = values
        else:
            token_map[idx[ok]] = values[ok]
            bad_count += int((~ok).sum())
            worst = min(worst, int((-idx[~ok]).min()))
    if err is not None and bad_count:
        err[0] += bad_count
        err[1] = min(int(err[1]), worst)
