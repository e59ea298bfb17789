"""Store sampled tokens into future slots: ``token_map[slots[i]] = values[i]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfuture.kernels import cpu
from tfuture.kernels._common import (
    INT32_MAX,
    Slots,
    block_for,
    block_rows,
    cdiv,
    check_err,
    check_same_device,
    check_vector,
    flag_bad,
    in_range,
    load_slots,
    narrows,
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
    offs = block_rows(BLOCK)
    mask = offs < n_values
    slots = load_slots(slots_ptr, offs, mask, slot_start, CONTIGUOUS=CONTIGUOUS, NEGATED=False)
    ok = mask & in_range(slots, n_slots)
    values = tl.load(values_ptr + offs, mask=mask, other=0)
    if HAS_ERR:
        # A negative token would resolve into a placeholder-like id, and one past an int32 map
        # would wrap into one: store 0 and flag it.
        unfit = values < 0
        if map_ptr.dtype.element_ty == tl.int32 and values.dtype == tl.int64:
            unfit = unfit | (values > 2147483647)
        unfit = ok & unfit
        worst = tl.where(unfit, values.to(tl.int64), -slots)
        flag_bad(err_ptr, (mask & ~ok) | unfit, worst, BLOCK=BLOCK)
        values = tl.where(unfit, tl.zeros_like(values), values)
    tl.store(map_ptr + slots, values.to(map_ptr.dtype.element_ty), mask=ok)


def _check_store_args(token_map: torch.Tensor, slots: Slots, values: torch.Tensor) -> None:
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
    token_map: torch.Tensor, slots: Slots, values: torch.Tensor, *, err: torch.Tensor | None = None
) -> None:
    """Scatter ``values`` into ``token_map`` at ``slots`` in one launch on the current stream.

    Args:
        token_map: ``[n_slots]`` int32/int64, slot ``s`` lives at ``token_map[s]``; row 0 is padding.
        slots: ``[n]`` int32/int64 slot numbers (any set, contiguous or not), or a ``range`` with
            step 1 for a contiguous run (no index tensor is read then).
        values: ``[n]`` int32/int64, cast to ``token_map.dtype``.
        err: optional ``[2]`` int64 error flag. Slots outside ``[1, n_slots)`` are never written;
            with ``err`` they are counted in ``err[0]`` and ``err[1]`` keeps ``min(-slot)``, and a
            value that is negative or does not fit the map (past int32 in an int32 map) is
            stored as 0 and counted (``err[1]`` keeps the most negative value). Without ``err``
            values are only cast.

    Duplicate slots are the caller's bug: which value lands is unspecified. n == 0 is a no-op.
    """
    _check_store_args(token_map, slots, values)
    if err is not None:
        check_err(err, token_map)
    launch_store(token_map, slots, values, err)


def launch_store(
    token_map: torch.Tensor, slots: Slots, values: torch.Tensor, err: torch.Tensor | None
) -> None:
    """:func:`store_futures` without its argument checks, for callers that made them already."""
    n = values.numel()
    if n == 0:
        return
    if not use_triton(token_map):
        cpu.store(token_map, slots, values, err)
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
    token_map: torch.Tensor, slots: Slots, values: torch.Tensor, *, err: torch.Tensor | None = None
) -> None:
    """Torch reference of :func:`store_futures`, the tests' oracle."""
    if isinstance(slots, range):
        slots = torch.arange(slots.start, slots.stop, device=token_map.device)
    slots = slots.to(torch.int64)
    ok = (slots >= 1) & (slots < token_map.numel())
    if err is not None:
        unfit = values < 0
        if narrows(token_map.dtype, values.dtype):
            unfit |= values > INT32_MAX
        unfit &= ok
        record_bad_(err, ~ok | unfit, torch.where(unfit, values.to(torch.int64), -slots))
        values = torch.where(unfit, 0, values)
    token_map[slots[ok]] = values[ok].to(token_map.dtype)
