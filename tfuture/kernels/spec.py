"""Speculative-decoding input preparation from stored futures: accepted length on the device.

With overlap, step N+1 of a speculative decoder is launched before the host knows how many
tokens step N accepted. Each request's next input row is ``[last accepted token, k drafts]``
at positions ``new_seq_len - 1 + j``: all of it lives in step N's slots (fields ``tokens``,
``accept_len``, ``new_seq_len``, ``draft_tokens``). One launch reads them and writes fixed-width
rows, so the host never syncs and the shapes stay fixed (CUDA-graph friendly).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tfuture.kernels import cpu
from tfuture.kernels._common import (
    INT_DTYPES,
    as_int,
    block_rows,
    cdiv,
    check_err,
    check_same_device,
    check_vector,
    flag_bad,
    in_range,
    next_pow2,
    record_bad_,
    use_triton,
)

_ROW_CAP = 64


class SpecInputs(NamedTuple):
    """Outputs of :func:`prepare_spec_inputs`, ``n_rows`` rows of width ``k + 1``."""

    input_ids: torch.Tensor  # [n_rows, k+1] int64: last accepted token, then k drafts (0 if none)
    positions: torch.Tensor  # [n_rows, k+1] int64: seq_len - 1 + j; padding rows 0
    n_draft: torch.Tensor  # [n_rows] int64: valid drafts per row (k from a slot, 0 for a fresh one)


# Sizes change every step: specializing on them (==1, %16) would recompile mid-step.
@triton.jit(do_not_specialize=["n_reqs", "n_rows", "n_slots"])
def _spec_prepare_kernel(
    last_ptr,
    lens_ptr,
    tokens_ptr,
    accept_ptr,
    seq_ptr,
    draft_ptr,
    ids_out_ptr,
    pos_out_ptr,
    ndraft_out_ptr,
    err_ptr,
    n_reqs,
    n_rows,
    n_slots,
    N_TOK: tl.constexpr,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_ERR: tl.constexpr,
):
    rows = block_rows(BLOCK_R)
    live = rows < n_reqs
    src = tl.load(last_ptr + rows, mask=live, other=0).to(tl.int64)
    future = live & (src < 0)
    # -(int64 min) wraps to itself and stays < 1, so the most negative value is caught as bad.
    slots = -src
    ok = future & in_range(slots, n_slots)
    # A stored accept_len outside [1, N_TOK] is clamped: the token read stays inside the row.
    acc = tl.load(accept_ptr + slots, mask=ok, other=1).to(tl.int64)
    acc = tl.minimum(tl.maximum(acc, 1), N_TOK)
    tok = tl.load(tokens_ptr + slots * N_TOK + acc - 1, mask=ok, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + slots, mask=ok, other=1).to(tl.int64)
    host_len = tl.load(lens_ptr + rows, mask=live & ~future, other=1).to(tl.int64)
    # A bad placeholder becomes token 0 at position 0 with no drafts; it is flagged below.
    tok = tl.where(ok, tok, tl.where(future, 0, src))
    first = tl.maximum(tl.where(ok, seq, tl.where(future, 1, host_len)) - 1, 0)
    cols = tl.arange(0, BLOCK_W)
    is_draft = (cols[None, :] >= 1) & (cols[None, :] <= K)
    drafts = tl.load(
        draft_ptr + slots[:, None] * K + cols[None, :] - 1, mask=ok[:, None] & is_draft, other=0
    ).to(tl.int64)
    ids = tl.where(cols[None, :] == 0, tok[:, None], drafts)
    pos = first[:, None] + cols[None, :]
    live2 = live[:, None] & (cols[None, :] <= K)
    out = (rows[:, None] < n_rows) & (cols[None, :] <= K)
    offs = rows[:, None] * (K + 1) + cols[None, :]
    tl.store(ids_out_ptr + offs, tl.where(live2, ids, 0), mask=out)
    tl.store(pos_out_ptr + offs, tl.where(live2, pos, 0), mask=out)
    tl.store(ndraft_out_ptr + rows, tl.where(ok, K, 0).to(tl.int64), mask=rows < n_rows)
    if HAS_ERR:
        flag_bad(err_ptr, future & ~ok, src, BLOCK=BLOCK_R)


_FIELD_DIMS = {"tokens": 2, "accept_len": 1, "new_seq_len": 1, "draft_tokens": 2}


def _check_spec_args(
    last: torch.Tensor,
    seq_lens: torch.Tensor,
    fields: tuple[torch.Tensor, ...],
    n_rows: object,
    out: SpecInputs | None,
) -> int:
    """``fields``: the slot fields ``(tokens, accept_len, new_seq_len, draft_tokens)``; returns
    ``n_rows`` as an int (default ``len(last)``)."""
    check_vector("last", last)
    check_vector("seq_lens", seq_lens)
    if seq_lens.numel() != last.numel():
        raise ValueError(f"seq_lens must have one entry per request ({last.numel()}), got {seq_lens.numel()}")
    tokens, accept_len, _, draft_tokens = fields
    n_slots = accept_len.shape[0] if isinstance(accept_len, torch.Tensor) and accept_len.dim() == 1 else -1
    for (name, dim), t in zip(_FIELD_DIMS.items(), fields, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dim or t.shape[0] != n_slots or not t.is_contiguous():
            want = f"a contiguous [{n_slots}{', width' if dim == 2 else ''}] tensor"
            raise ValueError(f"{name} must be {want} (one row per slot), got shape {tuple(t.shape)}")
        if t.dtype not in INT_DTYPES:
            raise ValueError(f"{name} must have dtype torch.int32 or torch.int64, got {t.dtype}")
    for name, t in (("last", last), ("seq_lens", seq_lens), *zip(_FIELD_DIMS, fields, strict=True)):
        check_same_device(name, t, "accept_len", accept_len)
    if tokens.shape[1] < 1:
        raise ValueError(f"tokens must hold at least one token per slot, got width {tokens.shape[1]}")
    n_rows = last.numel() if n_rows is None else as_int("n_rows", n_rows)
    if n_rows < last.numel():
        raise ValueError(f"n_rows must be >= len(last) = {last.numel()}, got {n_rows}")
    if out is None:
        return n_rows
    width = draft_tokens.shape[1] + 1
    for name, t, shape in zip(
        SpecInputs._fields, out, ((n_rows, width), (n_rows, width), (n_rows,)), strict=True
    ):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or not t.is_contiguous():
            got = f"{t.dtype} with strides {t.stride()}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"out.{name} must be a contiguous int64 tensor, got {got}")
        if tuple(t.shape) != shape:
            raise ValueError(f"out.{name} must have shape {shape}, got {tuple(t.shape)}")
        check_same_device(f"out.{name}", t, "accept_len", accept_len)
    return n_rows


def prepare_spec_inputs(
    last: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens: torch.Tensor,
    accept_len: torch.Tensor,
    new_seq_len: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    n_rows: int | None = None,
    out: SpecInputs | None = None,
    err: torch.Tensor | None = None,
) -> SpecInputs:
    """Build each request's verify row ``[last token, drafts]`` and positions, in one launch.

    Args:
        last: ``[n_reqs]`` int32/int64. ``-slot``: the request continues from that slot's
            fields (its last accepted token, its new length, its drafts). ``>= 0``: a concrete
            last token (a fresh request, say the prompt's last token), with no drafts.
        seq_lens: ``[n_reqs]`` int32/int64, the sequence length (last token included) of each
            concrete entry; ignored where ``last`` is a placeholder.
        tokens: ``[n_slots, n_tok]`` int field: accepted tokens of the slot's step, the first
            ``accept_len`` valid.
        accept_len: ``[n_slots]`` int field, clamped to ``[1, n_tok]``.
        new_seq_len: ``[n_slots]`` int field, the length after the slot's step.
        draft_tokens: ``[n_slots, k]`` int field (``k`` may be 0), the drafts for the next step.
        n_rows: output rows ``>= n_reqs`` (default ``n_reqs``); padding rows are 0.
        out: optional preallocated :class:`SpecInputs` (CUDA-graph capture).
        err: optional ``[2]`` int64 flag: a placeholder outside the map is never read; its row
            becomes token 0 at position 0 with no drafts, and it is counted as in resolve.

    Returns:
        :class:`SpecInputs`: ``input_ids [n_rows, k+1]`` and ``positions [n_rows, k+1]`` int64
        (``positions[i, j] = seq_len_i - 1 + j``) and ``n_draft [n_rows]`` int64. No host sync.
    """
    n_rows = _check_spec_args(last, seq_lens, (tokens, accept_len, new_seq_len, draft_tokens), n_rows, out)
    if err is not None:
        check_err(err, accept_len)
    return launch_prepare_spec(
        last, seq_lens, tokens, accept_len, new_seq_len, draft_tokens, n_rows, out, err
    )


def launch_prepare_spec(
    last: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens: torch.Tensor,
    accept_len: torch.Tensor,
    new_seq_len: torch.Tensor,
    draft_tokens: torch.Tensor,
    n_rows: int,
    out: SpecInputs | None,
    err: torch.Tensor | None,
) -> SpecInputs:
    """:func:`prepare_spec_inputs` without its argument checks (``out=None`` allocates)."""
    k = draft_tokens.shape[1]
    if out is None:
        dev = accept_len.device
        out = SpecInputs(
            torch.empty((n_rows, k + 1), dtype=torch.int64, device=dev),
            torch.empty((n_rows, k + 1), dtype=torch.int64, device=dev),
            torch.empty(n_rows, dtype=torch.int64, device=dev),
        )
    if n_rows == 0:
        return out
    if not use_triton(accept_len):
        cpu.prepare_spec(last, seq_lens, (tokens, accept_len, new_seq_len, draft_tokens), out, err)
        return out
    block_w = next_pow2(k + 1)
    block_r = max(1, min(_ROW_CAP, 4096 // block_w, next_pow2(n_rows)))
    _spec_prepare_kernel[(cdiv(n_rows, block_r),)](
        last,
        seq_lens,
        tokens,
        accept_len,
        new_seq_len,
        draft_tokens,
        *out,
        accept_len if err is None else err,
        last.numel(),
        n_rows,
        accept_len.shape[0],
        N_TOK=tokens.shape[1],
        K=k,
        BLOCK_R=block_r,
        BLOCK_W=block_w,
        HAS_ERR=err is not None,
    )
    return out


def prepare_spec_inputs_ref(
    last: torch.Tensor,
    seq_lens: torch.Tensor,
    *fields: torch.Tensor,
    n_rows: int | None = None,
    err: torch.Tensor | None = None,
) -> SpecInputs:
    """Torch reference of :func:`prepare_spec_inputs`, the tests' oracle: one request at a time."""
    tokens, accept_len, new_seq_len, draft_tokens = fields
    n_rows = last.numel() if n_rows is None else n_rows
    k, dev = draft_tokens.shape[1], accept_len.device
    ids = torch.zeros((n_rows, k + 1), dtype=torch.int64, device=dev)
    positions = torch.zeros((n_rows, k + 1), dtype=torch.int64, device=dev)
    n_draft = torch.zeros(n_rows, dtype=torch.int64, device=dev)
    bad = torch.zeros(last.numel(), dtype=torch.bool, device=dev)
    for i, x in enumerate(last.tolist()):
        if x >= 0:
            ids[i, 0], seq = x, int(seq_lens[i])
        elif 1 <= -x < accept_len.shape[0]:
            acc = min(max(int(accept_len[-x]), 1), tokens.shape[1])
            ids[i, 0], seq = tokens[-x, acc - 1], int(new_seq_len[-x])
            ids[i, 1:], n_draft[i] = draft_tokens[-x], k
        else:
            # A placeholder past the map: token 0 at position 0, no drafts, flagged.
            bad[i], seq = True, 1
        positions[i] = max(seq - 1, 0) + torch.arange(k + 1, device=dev)
    record_bad_(err, bad, last)
    return SpecInputs(ids, positions, n_draft)
