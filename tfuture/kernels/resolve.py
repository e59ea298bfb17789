"""Resolve placeholders (``-slot``) into stored tokens, alone or fused into input preparation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tfuture.kernels import cpu
from tfuture.kernels._common import (
    INT32_MAX,
    INT32_MIN,
    block_for,
    block_rows,
    cdiv,
    check_err,
    check_same_device,
    check_vector,
    flag_bad,
    in_range,
    narrows,
    record_bad_,
    search_steps,
    use_triton,
)
from tfuture.kernels.prepared import PreparedInputs, check_prepare_args, check_segments

__all__ = [
    "PreparedInputs",
    "check_prepare_args",
    "check_segments",
    "launch_prepare",
    "launch_resolve_",
    "prepare_inputs",
    "prepare_inputs_ref",
    "resolve_futures_",
    "resolve_futures_ref",
]


@triton.jit
def _resolve_block(
    ids, live, map_ptr, err_ptr, n_slots, BLOCK: tl.constexpr, HAS_ERR: tl.constexpr, FIT32: tl.constexpr
):
    """Resolve one block of ids; out-of-range placeholders are never read.

    ``FIT32``: the output is int32 but the map (or ``ids``) is int64, so a value past int32 is
    bad like an out-of-range placeholder (flagged, never wrapped into the output).
    """
    # -(int64 min) wraps to itself and stays < 1, so the most negative id is caught as bad.
    slots = -(ids.to(tl.int64))
    future = live & (ids < 0)
    ok = future & in_range(slots, n_slots)
    tokens = tl.load(map_ptr + slots, mask=ok, other=0)
    if FIT32:
        ok = ok & (tokens >= -2147483648) & (tokens <= 2147483647)
    out = tl.where(ok, tokens.to(ids.dtype), ids)
    if HAS_ERR:
        bad = future & ~ok
        if FIT32:
            bad = bad | (live & (ids > 2147483647))
        # With an error channel a bad placeholder becomes token 0, so the forward never sees it.
        out = tl.where(bad, tl.zeros_like(ids), out)
        flag_bad(err_ptr, bad, ids, BLOCK=BLOCK)
    return out


# Sizes change every step: specializing on them (==1, %16) would recompile mid-step.
@triton.jit(do_not_specialize=["n_ids", "n_slots"])
def _resolve_kernel(
    ids_ptr,
    map_ptr,
    err_ptr,
    n_ids,
    n_slots,
    BLOCK: tl.constexpr,
    HAS_ERR: tl.constexpr,
):
    offs = block_rows(BLOCK)
    mask = offs < n_ids
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    # Read from the pointer types at compile time (no launch argument: no extra variant to pass).
    fit32: tl.constexpr = ids_ptr.dtype.element_ty == tl.int32 and map_ptr.dtype.element_ty == tl.int64
    out = _resolve_block(ids, mask, map_ptr, err_ptr, n_slots, BLOCK=BLOCK, HAS_ERR=HAS_ERR, FIT32=fit32)
    tl.store(ids_ptr + offs, out, mask=mask & (ids < 0))


def _check_resolve_args(ids: object, token_map: object, err: object) -> None:
    check_vector("token_map", token_map)
    check_vector("ids", ids)
    assert isinstance(ids, torch.Tensor) and isinstance(token_map, torch.Tensor)
    check_same_device("ids", ids, "token_map", token_map)
    if err is not None:
        check_err(err, token_map)


def resolve_futures_(
    ids: torch.Tensor, token_map: torch.Tensor, *, err: torch.Tensor | None = None
) -> torch.Tensor:
    """In place, replace every placeholder ``-s`` in ``ids`` by ``token_map[s]``; return ``ids``.

    Args:
        ids: ``[n]`` int32/int64, concrete tokens (``>= 0``, token 0 included) mixed with
            placeholders (``< 0``). Concrete tokens are never touched.
        token_map: ``[n_slots]`` int32/int64 on the same device; values are cast to ``ids.dtype``.
        err: optional ``[2]`` int64 error flag. A placeholder with ``s >= n_slots`` (or the most
            negative value), or whose token does not fit ``ids.dtype`` (int32 ids, int64 map), is
            bad. Without ``err`` it stays in ``ids`` as is; with ``err`` it becomes 0, ``err[0]``
            counts it and ``err[1]`` keeps the most negative bad id. Nothing is ever wrapped.

    Runs one launch on the current stream and never synchronizes with the host.
    """
    _check_resolve_args(ids, token_map, err)
    return launch_resolve_(ids, token_map, err)


def launch_resolve_(ids: torch.Tensor, token_map: torch.Tensor, err: torch.Tensor | None) -> torch.Tensor:
    """:func:`resolve_futures_` without its argument checks, for callers that made them already."""
    n = ids.numel()
    if n == 0:
        return ids
    if not use_triton(ids):
        return cpu.resolve_(ids, token_map, err)
    block = block_for(n)
    _resolve_kernel[(cdiv(n, block),)](
        ids,
        token_map,
        token_map if err is None else err,
        n,
        token_map.numel(),
        BLOCK=block,
        HAS_ERR=err is not None,
    )
    return ids


def resolve_futures_ref(
    ids: torch.Tensor, token_map: torch.Tensor, *, err: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of :func:`resolve_futures_`, the tests' oracle."""
    # In int64 the int32 minimum negates to 2**31 and the int64 minimum to itself: both bad.
    slots = -ids.to(torch.int64)
    ok = (ids < 0) & (slots >= 1) & (slots < token_map.numel())
    tokens = token_map[torch.where(ok, slots, 0)].to(torch.int64)
    if narrows(ids.dtype, token_map.dtype):
        ok &= (tokens >= INT32_MIN) & (tokens <= INT32_MAX)
    bad = (ids < 0) & ~ok
    record_bad_(err, bad, ids)
    ids[ok] = tokens[ok].to(ids.dtype)
    if err is not None:
        ids[bad] = 0
    return ids


# Sizes change every step: specializing on them (==1, %16) would recompile mid-step.
@triton.jit(do_not_specialize=["n_tokens", "n_reqs", "n_rows", "n_slots"])
def _prepare_kernel(
    tokens_ptr,
    seg_ptr,
    prefix_ptr,
    map_ptr,
    ids_out_ptr,
    pos_out_ptr,
    last_out_ptr,
    err_ptr,
    n_tokens,
    n_reqs,
    n_rows,
    n_slots,
    BLOCK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    HAS_ERR: tl.constexpr,
):
    offs = block_rows(BLOCK)
    # The real token count lives on the device (seg_starts[n_reqs]) so a CUDA graph can replay.
    total = tl.minimum(tl.load(seg_ptr + n_reqs).to(tl.int64), n_tokens)
    live = offs < total
    # Resolved in int64: an int32 stream over an int64 map must not wrap before the output check.
    ids = tl.load(tokens_ptr + offs, mask=live, other=0).to(tl.int64)
    fit32: tl.constexpr = ids_out_ptr.dtype.element_ty == tl.int32 and (
        tokens_ptr.dtype.element_ty == tl.int64 or map_ptr.dtype.element_ty == tl.int64
    )
    ids = _resolve_block(ids, live, map_ptr, err_ptr, n_slots, BLOCK=BLOCK, HAS_ERR=HAS_ERR, FIT32=fit32)
    # Binary search: the request of row r is the largest q with seg_starts[q] <= r.
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + (n_reqs - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi + 1) // 2
        start = tl.load(seg_ptr + mid, mask=live & active, other=0).to(tl.int64)
        go = start <= offs
        lo = tl.where(active & go, mid, lo)
        hi = tl.where(active & ~go, mid - 1, hi)
    # With zero requests no row has an owner (lo = 0 names none) and prefix_lens has no entry.
    owned = live & (lo < n_reqs)
    start = tl.load(seg_ptr + lo, mask=owned, other=0).to(tl.int64)
    prefix = tl.load(prefix_ptr + lo, mask=owned, other=0).to(tl.int64)
    rows = offs < n_rows
    tl.store(ids_out_ptr + offs, tl.where(live, ids, 0).to(ids_out_ptr.dtype.element_ty), mask=rows)
    # Malformed segments (flagged below) would give negative positions: clamped, never written.
    positions = tl.where(owned, tl.maximum(prefix + offs - start, 0), 0)
    tl.store(pos_out_ptr + offs, positions, mask=rows)
    reqs = offs < n_reqs
    seg_end = tl.load(seg_ptr + offs + 1, mask=reqs, other=1).to(tl.int64)
    last = tl.maximum(tl.minimum(seg_end, total) - 1, 0)
    tl.store(last_out_ptr + offs, last, mask=reqs)
    if HAS_ERR:
        # Request q is malformed if its segment runs backwards or its prefix is negative;
        # seg_starts[0] != 0 counts once more (lane 0). err[1] keeps the negative value.
        seg_start = tl.load(seg_ptr + offs, mask=offs <= n_reqs, other=0).to(tl.int64)
        req_prefix = tl.load(prefix_ptr + offs, mask=reqs, other=0).to(tl.int64)
        seg_len = seg_end - seg_start
        flag_bad(
            err_ptr, reqs & ((seg_len < 0) | (req_prefix < 0)), tl.minimum(seg_len, req_prefix), BLOCK=BLOCK
        )
        flag_bad(err_ptr, (offs == 0) & (seg_start != 0), tl.minimum(seg_start, -seg_start), BLOCK=BLOCK)


def prepare_inputs(
    tokens: torch.Tensor,
    seg_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    token_map: torch.Tensor,
    *,
    n_rows: int | None = None,
    out: PreparedInputs | Sequence[torch.Tensor] | None = None,
    err: torch.Tensor | None = None,
) -> PreparedInputs:
    """Build a forward's inputs from a mixed token stream in one launch (resolve fused in).

    Args:
        tokens: ``[n_tokens]`` int32/int64, every request's new tokens back to back: concrete
            ids (prefill chunks) and placeholders ``-slot`` (decodes) mixed freely.
        seg_starts: ``[n_reqs + 1]`` int32/int64 on the device, request ``q`` owns rows
            ``seg_starts[q]:seg_starts[q+1]``. ``seg_starts[n_reqs]`` is the real token count:
            rows past it (and past ``n_tokens``) are padding, so a padded request is an empty
            segment. Well formed: ``seg_starts[0] == 0``, non-decreasing, ``prefix_lens >= 0``.
        prefix_lens: ``[n_reqs]`` int32/int64, tokens already in the KV cache per request.
        token_map: ``[n_slots]`` the future map.
        n_rows: output rows, ``>= n_tokens`` (default ``n_tokens``); fixed shapes for CUDA graphs.
        out: optional preallocated outputs (for graph capture): a :class:`PreparedInputs` or any
            sequence of three tensors, shapes as returned, ``positions``/``last_rows`` int64.
        err: optional ``[2]`` int64 error flag, as in :func:`resolve_futures_`.

    Malformed segments: CPU tensors are checked on the host (a ``ValueError`` naming the
    entry). CUDA tensors are not (that would sync): the kernel counts each malformed request
    (and a nonzero ``seg_starts[0]``) in ``err``, as it counts bad placeholders (a call with no
    rows and no requests launches nothing). Either way a position is never negative. An int32
    ``input_ids`` output over int64 tokens or map flags (with ``err``) each value past int32
    and writes 0 there: nothing wraps.

    Returns:
        :class:`PreparedInputs`: ``input_ids [n_rows]`` (``tokens.dtype`` unless ``out`` says
        otherwise), ``positions [n_rows]`` int64 and ``last_rows [n_reqs]`` int64, where
        ``last_rows[q] = max(min(seg_starts[q+1], total) - 1, 0)``. Padding rows are 0.
    """
    n_rows, out = check_prepare_args(tokens, seg_starts, prefix_lens, token_map, n_rows, out, err)
    return launch_prepare(tokens, seg_starts, prefix_lens, token_map, n_rows, out, err, strict=True)


def launch_prepare(
    tokens: torch.Tensor,
    seg_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    token_map: torch.Tensor,
    n_rows: int,
    out: PreparedInputs | None,
    err: torch.Tensor | None,
    *,
    strict: bool = False,
) -> PreparedInputs:
    """:func:`prepare_inputs` without its argument checks (``out=None`` allocates).

    ``strict``: malformed CPU segments raise ``ValueError`` (checked once, on the host) instead
    of being flagged in ``err``.
    """
    n_reqs = prefix_lens.numel()
    if out is None:
        dev = token_map.device
        out = PreparedInputs(
            torch.empty(n_rows, dtype=tokens.dtype, device=dev),
            torch.empty(n_rows, dtype=torch.int64, device=dev),
            torch.empty(n_reqs, dtype=torch.int64, device=dev),
        )
    n_prog = max(n_rows, n_reqs)
    numpy_path = not use_triton(token_map)
    if strict and not token_map.is_cuda and (n_prog == 0 or not numpy_path):
        check_segments(seg_starts, prefix_lens)
    if n_prog == 0:
        return out
    if numpy_path:
        cpu.prepare(tokens, seg_starts, prefix_lens, token_map, out, err, strict)
        return out
    block = block_for(n_prog)
    _prepare_kernel[(cdiv(n_prog, block),)](
        tokens,
        seg_starts,
        prefix_lens,
        token_map,
        *out,
        token_map if err is None else err,
        tokens.numel(),
        n_reqs,
        n_rows,
        token_map.numel(),
        BLOCK=block,
        SEARCH_STEPS=search_steps(n_reqs),
        HAS_ERR=err is not None,
    )
    return out


def prepare_inputs_ref(
    tokens: torch.Tensor,
    seg_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    token_map: torch.Tensor,
    *,
    n_rows: int | None = None,
    err: torch.Tensor | None = None,
) -> PreparedInputs:
    """Torch reference of :func:`prepare_inputs` on well-formed segments, the tests' oracle: the
    unfused sequence."""
    n_rows = tokens.numel() if n_rows is None else n_rows
    seg = seg_starts.to(torch.int64)
    total = max(min(int(seg[-1]), tokens.numel()), 0)
    input_ids = torch.zeros(n_rows, dtype=tokens.dtype, device=tokens.device)
    input_ids[:total] = resolve_futures_ref(tokens[:total].clone(), token_map, err=err)
    rows = torch.arange(total, device=tokens.device)
    positions = torch.zeros(n_rows, dtype=torch.int64, device=tokens.device)
    if prefix_lens.numel():
        # The request of row r: the last q with seg_starts[q] <= r.
        req = torch.searchsorted(seg[1:-1], rows, right=True)
        positions[:total] = prefix_lens.to(torch.int64)[req] + rows - seg[req]
    last_rows = (seg[1:].clamp(max=total) - 1).clamp(min=0)
    return PreparedInputs(input_ids, positions, last_rows)
