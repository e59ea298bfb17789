"""Resolve placeholders (``-slot``) into stored tokens, alone or fused into input preparation."""

from __future__ import annotations

from typing import NamedTuple

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
    search_steps,
    use_triton,
)
from tfuture.kernels._resolve_host import prepare_cpu_into, resolve_host_


@triton.jit
def _resolve_block(ids, live, map_ptr, err_ptr, n_slots, BLOCK: tl.constexpr, HAS_ERR: tl.constexpr):
    """Resolve one block of ids; out-of-range placeholders are never read."""
    # -(int64 min) wraps to itself and stays < 1, so the most negative id is caught as bad.
    slots = -(ids.to(tl.int64))
    future = live & (ids < 0)
    ok = future & (slots >= 1) & (slots < n_slots)
    tokens = tl.load(map_ptr + slots, mask=ok, other=0).to(ids.dtype)
    out = tl.where(ok, tokens, ids)
    if HAS_ERR:
        bad = future & ~ok
        # With an error channel a bad placeholder becomes token 0, so the forward never sees it.
        out = tl.where(bad, tl.zeros_like(ids), out)
        zero = tl.zeros([BLOCK], dtype=tl.int64)
        tl.atomic_add(err_ptr + zero, tl.full([BLOCK], 1, tl.int64), mask=bad)
        tl.atomic_min(err_ptr + 1 + zero, ids.to(tl.int64), mask=bad)
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
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_ids
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    out = _resolve_block(ids, mask, map_ptr, err_ptr, n_slots, BLOCK=BLOCK, HAS_ERR=HAS_ERR)
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
            negative value) is never read. Without ``err`` it stays in ``ids`` as is; with ``err``
            it becomes 0, ``err[0]`` counts it and ``err[1]`` keeps the most negative bad id.

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
        return resolve_futures_ref(ids, token_map, err=err)
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
    """Torch reference of :func:`resolve_futures_` (also its CPU path without the interpreter)."""
    if ids.device.type == "cpu":
        resolve_host_(ids.numpy(), token_map.numpy(), err)
    else:
        ids.copy_(_resolved(ids, token_map, err))
    return ids


def _resolved(ids: torch.Tensor, token_map: torch.Tensor, err: torch.Tensor | None) -> torch.Tensor:
    """Out-of-place torch resolution of ``ids`` with the kernel's error semantics."""
    n_slots = token_map.numel()
    # A clamped gather keeps every read in bounds; out-of-range placeholders are fixed up below.
    gathered = token_map[(-ids.to(torch.int64)).clamp_(0, n_slots - 1)]
    out = torch.where(ids < 0, gathered.to(ids.dtype), ids)
    # -s with s >= n_slots, and the dtype minimum (whose negation wraps), are bad placeholders.
    bad = ids < 1 - n_slots
    # The reference runs on CPU tensors only, where asking the host costs no device sync.
    if ids.device.type == "cpu" and not bool(bad.any()):
        return out
    if err is None:
        return torch.where(bad, ids, out)
    record_bad_(err, bad, ids)
    return torch.where(bad, torch.zeros_like(ids), out)


class PreparedInputs(NamedTuple):
    """Outputs of :func:`prepare_inputs`, padded to fixed shapes."""

    input_ids: torch.Tensor  # [n_rows], resolved tokens; padding rows hold 0
    positions: torch.Tensor  # [n_rows] int64, prefix_len + offset in segment; padding rows 0
    last_rows: torch.Tensor  # [n_reqs] int64, row of each request's last token (sampler rows)


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
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    # The real token count lives on the device (seg_starts[n_reqs]) so a CUDA graph can replay.
    total = tl.minimum(tl.load(seg_ptr + n_reqs).to(tl.int64), n_tokens)
    live = offs < total
    ids = tl.load(tokens_ptr + offs, mask=live, other=0)
    ids = _resolve_block(ids, live, map_ptr, err_ptr, n_slots, BLOCK=BLOCK, HAS_ERR=HAS_ERR)
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
    start = tl.load(seg_ptr + lo, mask=live, other=0).to(tl.int64)
    prefix = tl.load(prefix_ptr + lo, mask=live, other=0).to(tl.int64)
    rows = offs < n_rows
    tl.store(ids_out_ptr + offs, tl.where(live, ids, 0).to(ids_out_ptr.dtype.element_ty), mask=rows)
    positions = tl.where(live, prefix + offs - start, 0)
    tl.store(pos_out_ptr + offs, positions.to(pos_out_ptr.dtype.element_ty), mask=rows)
    reqs = offs < n_reqs
    seg_end = tl.load(seg_ptr + offs + 1, mask=reqs, other=1).to(tl.int64)
    last = tl.maximum(tl.minimum(seg_end, total) - 1, 0)
    tl.store(last_out_ptr + offs, last.to(last_out_ptr.dtype.element_ty), mask=reqs)


def _check_prepare_args(
    tokens: torch.Tensor,
    seg_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    token_map: torch.Tensor,
    n_rows: int,
    out: PreparedInputs | None,
) -> None:
    check_vector("token_map", token_map)
    for name, t in (("tokens", tokens), ("seg_starts", seg_starts), ("prefix_lens", prefix_lens)):
        check_vector(name, t)
        check_same_device(name, t, "token_map", token_map)
    if seg_starts.numel() != prefix_lens.numel() + 1:
        raise ValueError(
            f"seg_starts must have len(prefix_lens) + 1 = {prefix_lens.numel() + 1} entries, "
            f"got {seg_starts.numel()}"
        )
    if isinstance(n_rows, bool) or not isinstance(n_rows, int):
        raise TypeError(f"n_rows must be an int, got {type(n_rows).__name__}")
    if n_rows < tokens.numel():
        raise ValueError(f"n_rows must be >= len(tokens) = {tokens.numel()}, got {n_rows}")
    if out is None:
        return
    want = (n_rows, n_rows, prefix_lens.numel())
    for name, t, size in zip(PreparedInputs._fields, out, want, strict=True):
        check_vector(f"out.{name}", t)
        check_same_device(f"out.{name}", t, "token_map", token_map)
        if t.numel() != size:
            raise ValueError(f"out.{name} must have {size} entries, got {t.numel()}")


def prepare_inputs(
    tokens: torch.Tensor,
    seg_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    token_map: torch.Tensor,
    *,
    n_rows: int | None = None,
    out: PreparedInputs | None = None,
    err: torch.Tensor | None = None,
) -> PreparedInputs:
    """Build a forward's inputs from a mixed token stream in one launch (resolve fused in).

    Args:
        tokens: ``[n_tokens]`` int32/int64, every request's new tokens back to back: concrete
            ids (prefill chunks) and placeholders ``-slot`` (decodes) mixed freely.
        seg_starts: ``[n_reqs + 1]`` int32/int64 on the device, request ``q`` owns rows
            ``seg_starts[q]:seg_starts[q+1]``. Non-decreasing, ``seg_starts[0] == 0``.
            ``seg_starts[n_reqs]`` is the real token count: rows past it (and past
            ``n_tokens``) are padding, so a padded request is an empty segment.
        prefix_lens: ``[n_reqs]`` int32/int64, tokens already in the KV cache per request.
        token_map: ``[n_slots]`` the future map.
        n_rows: output rows, ``>= n_tokens`` (default ``n_tokens``); fixed shapes for CUDA graphs.
        out: optional preallocated outputs (for graph capture), shapes as returned.
        err: optional ``[2]`` int64 error flag, as in :func:`resolve_futures_`.

    Returns:
        :class:`PreparedInputs`: ``input_ids [n_rows]`` (``tokens.dtype`` unless ``out`` says
        otherwise), ``positions [n_rows]`` int64 and ``last_rows [n_reqs]`` int64, where
        ``last_rows[q] = max(min(seg_starts[q+1], total) - 1, 0)``. Padding rows are 0.
    """
    n_rows = tokens.numel() if n_rows is None else n_rows
    _check_prepare_args(tokens, seg_starts, prefix_lens, token_map, n_rows, out)
    if err is not None:
        check_err(err, token_map)
    n_reqs = prefix_lens.numel()
    if out is None:
        dev = token_map.device
        out = PreparedInputs(
            torch.empty(n_rows, dtype=tokens.dtype, device=dev),
            torch.empty(n_rows, dtype=torch.int64, device=dev),
            torch.empty(n_reqs, dtype=torch.int64, device=dev),
        )
    n_prog = max(n_rows, n_reqs)
    if n_prog == 0:
        return out
    if not use_triton(token_map):
        _prepare_ref_into(tokens, seg_starts, prefix_lens, token_map, out, err)
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
    """Torch reference of :func:`prepare_inputs`: the unfused sequence, several launches."""
    n_rows = tokens.numel() if n_rows is None else n_rows
    _check_prepare_args(tokens, seg_starts, prefix_lens, token_map, n_rows, None)
    dev = token_map.device
    out = PreparedInputs(
        torch.zeros(n_rows, dtype=tokens.dtype, device=dev),
        torch.zeros(n_rows, dtype=torch.int64, device=dev),
        torch.zeros(prefix_lens.numel(), dtype=torch.int64, device=dev),
    )
    _prepare_ref_into(tokens, seg_starts, prefix_lens, token_map, out, err)
    return out


def _prepare_ref_into(
    tokens: torch.Tensor,
    seg_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    token_map: torch.Tensor,
    out: PreparedInputs,
    err: torch.Tensor | None,
) -> None:
    n_rows, n_tok = out.input_ids.numel(), tokens.numel()
    seg = seg_starts.to(torch.int64)
    if tokens.device.type == "cpu" and prepare_cpu_into(tokens, seg, prefix_lens, token_map, out, err):
        return
    total = seg[-1].clamp(max=n_tok)
    rows = torch.arange(n_rows, device=tokens.device)
    live = rows < total
    padded = torch.zeros(n_rows, dtype=tokens.dtype, device=tokens.device)
    padded[:n_tok] = tokens
    padded = torch.where(live, padded, torch.zeros_like(padded))
    out.input_ids.copy_(_resolved(padded, token_map, err))
    if prefix_lens.numel():
        req = (torch.searchsorted(seg[1:-1], rows, right=True)).clamp(max=prefix_lens.numel() - 1)
        pos = prefix_lens.to(torch.int64)[req] + rows - seg[req]
        out.positions.copy_(torch.where(live, pos, torch.zeros_like(pos)))
        out.last_rows.copy_((torch.minimum(seg[1:], total) - 1).clamp(min=0))
    else:
        out.positions.zero_()
