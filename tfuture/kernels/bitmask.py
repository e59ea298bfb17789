"""Packed token bitmasks (structured output): ``logits[r, j] = -inf`` where token ``j`` is not allowed.

The layout is the one xgrammar and llguidance fill: ``int32 [n, ceil(V / 32)]``, bit ``j % 32``
(little-endian within the word, bit 0 the least significant) of word ``j // 32`` is 1 when token
``j`` is allowed; bits past ``V`` are padding. One bit a token against a bool mask's byte: a
step moves 8x fewer bytes host to device (152k vocabulary, 256 requests: 4.9 MB instead of 39 MB).

* :func:`apply_token_bitmask_` applies it in place, one launch (grid: bitmask row x vocab
  block), only masked logits are written; :func:`launch_apply_token_bitmask_` is its unchecked
  twin and :func:`apply_token_bitmask_ref` the torch oracle.
* :func:`pack_bool_mask` / :func:`unpack_bitmask` convert from and to the bool mask (kept as a
  convenience), for numpy arrays and torch tensors on any device.
* :func:`empty_bitmask_rows` finds, on the host, the rows that allow no token: sampling such a
  row would silently pick token 0 (every logit -inf), so the caller raises instead.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch
import triton
import triton.language as tl

from tfuture.kernels import cpu_bitmask
from tfuture.kernels._common import INT_DTYPES, as_int, cdiv, check_same_device, check_vector, use_triton

__all__ = [
    "FLOAT_DTYPES",
    "apply_token_bitmask_",
    "apply_token_bitmask_ref",
    "bitmask_words",
    "check_apply_args",
    "empty_bitmask_rows",
    "launch_apply_token_bitmask_",
    "pack_bool_mask",
    "unpack_bitmask",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Tokens per program: 64 words of bitmask. One size only (one compile per logits dtype and rows
# mode); a 152k vocabulary is 75 programs a row, so two rows already cover an H200's 132 SMs.
_BLOCK = 2048
_NUM_WARPS = 4

Array = TypeVar("Array", np.ndarray, torch.Tensor)


# n_logits_rows changes every step: specializing on it (==1, %16) would recompile mid-step;
# vocab and n_words only bound masks (no gain from specializing them).
@triton.jit(do_not_specialize=["n_logits_rows", "vocab", "n_words"])
def _apply_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    n_logits_rows,
    vocab,
    n_words,
    logits_stride,
    bitmask_stride,
    BLOCK: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    """Program (i, b): bitmask row ``i``, tokens ``[b * BLOCK, (b + 1) * BLOCK)`` of its logits row."""
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i
    word_offs = b * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    # Words past the row read as all-allowed: nothing past the vocabulary is ever written.
    words = tl.load(bitmask_ptr + i * bitmask_stride + word_offs, mask=word_offs < n_words, other=-1)
    bits = tl.reshape((words[:, None] >> tl.arange(0, 32)[None, :]) & 1, [BLOCK])
    offs = b * BLOCK + tl.arange(0, BLOCK)
    # A row outside the logits (only the unchecked launcher can get one) is never written. (The
    # check is on the scalar limit: the interpreter turns a bool block & a scalar bool into int32.)
    limit = tl.where((row >= 0) & (row < n_logits_rows), vocab, 0)
    write = (bits == 0) & (offs < limit)
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + offs, neg_inf, mask=write)


def bitmask_words(vocab: int) -> int:
    """int32 words per bitmask row for ``vocab`` tokens: ``ceil(vocab / 32)``; ``vocab >= 1``."""
    vocab = as_int("vocab", vocab)
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    return cdiv(vocab, 32)


def _check_2d(name: str, x: object, dtype: str) -> None:
    """Raise unless ``x`` is a 2-D numpy array or torch tensor of ``dtype`` (``"bool"``, ``"int32"``)."""
    if isinstance(x, torch.Tensor):
        got, ndim, shape = str(x.dtype).removeprefix("torch."), x.dim(), tuple(x.shape)
    elif isinstance(x, np.ndarray):
        got, ndim, shape = str(x.dtype), x.ndim, x.shape
    else:
        raise TypeError(f"{name} must be a numpy array or a torch.Tensor, got {type(x).__name__}")
    if ndim != 2:
        raise ValueError(f"{name} must be 2-D [n, ...], got a {ndim}-D array of shape {shape}")
    if got != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {got}")


def _check_words(bitmask: torch.Tensor | np.ndarray, vocab: int) -> None:
    want = bitmask_words(vocab)
    if bitmask.shape[1] != want:
        raise ValueError(
            f"bitmask must have ceil({vocab} / 32) = {want} int32 words per row, "
            f"got {bitmask.shape[1]} (shape {tuple(bitmask.shape)})"
        )


def pack_bool_mask(mask: Array) -> Array:
    """Pack an allowed-token mask: ``bool [n, V]`` -> ``int32 [n, ceil(V / 32)]``, same kind.

    Bit ``j % 32`` of word ``j // 32`` is ``mask[:, j]``; padding bits past ``V`` are 0. A numpy
    array gives a numpy array, a torch tensor a tensor on its device (any device, no host sync).
    """
    _check_2d("mask", mask, "bool")
    n, vocab = mask.shape
    words = bitmask_words(vocab)
    if isinstance(mask, np.ndarray):
        out = np.zeros((n, 4 * words), dtype=np.uint8)
        out[:, : cdiv(vocab, 8)] = np.packbits(mask, axis=1, bitorder="little")
        return out.view("<i4").astype(np.int32, copy=False)
    bits = torch.zeros((n, 32 * words), dtype=torch.uint8, device=mask.device)
    bits[:, :vocab] = mask
    # Made on the device (a tensor from a host list would be a synchronizing copy on CUDA).
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    # Byte k of a word holds tokens 8k..8k+7: the int32 view of the bytes is the little-endian word.
    packed = (bits.view(n, 4 * words, 8) << shifts).sum(-1, dtype=torch.uint8)
    return packed.view(torch.int32)


def unpack_bitmask(bitmask: Array, vocab: int) -> Array:
    """Unpack ``int32 [n, ceil(vocab / 32)]`` into the allowed-token mask ``bool [n, vocab]``, same kind.

    Raises ``ValueError`` unless the bitmask has exactly ``ceil(vocab / 32)`` words per row. Any
    strides are taken (an empty or column-major bitmask included); the result is C-contiguous.
    """
    _check_2d("bitmask", bitmask, "int32")
    _check_words(bitmask, vocab)
    n = bitmask.shape[0]
    if isinstance(bitmask, np.ndarray):
        if n == 0:  # numpy keeps an empty array's odd strides through unpackbits
            return np.zeros((0, vocab), dtype=np.bool_)
        return cpu_bitmask.unpack_bits(bitmask, vocab)
    if n == 0:
        # An empty tensor counts as contiguous whatever its strides, and the int32 -> uint8 view
        # below needs stride(-1) == 1: there is nothing to unpack anyway.
        return torch.zeros((0, vocab), dtype=torch.bool, device=bitmask.device)
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    words = bitmask.contiguous()
    if words.stride(-1) != 1:  # a size-1 dim keeps any stride under contiguous()
        words = torch.empty(words.shape, dtype=words.dtype, device=words.device).copy_(words)
    bytes_ = words.view(torch.uint8)
    bits = (bytes_.unsqueeze(-1) >> shifts) & 1
    return bits.view(n, 32 * bitmask.shape[1])[:, :vocab].to(torch.bool).contiguous()


def empty_bitmask_rows(bitmask: np.ndarray | torch.Tensor, vocab: int | None = None) -> np.ndarray:
    """Host check: ``int64`` indices of the rows of ``bitmask`` (int32 ``[n, W]``) that allow no token.

    Only the first ``vocab`` bits of a row count when ``vocab`` is given (``1 <= vocab <= 32 * W``),
    else all of them. Vectorised (a few passes over ``n * W`` words). A CUDA tensor raises
    ``TypeError``: reading it would be a device sync, so the caller checks the host copy it filled.
    """
    if isinstance(bitmask, torch.Tensor) and bitmask.device.type != "cpu":
        raise TypeError(
            f"empty_bitmask_rows checks the host bitmask; got a tensor on {bitmask.device} "
            "(check the CPU copy that the grammar filled)"
        )
    _check_2d("bitmask", bitmask, "int32")
    words = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
    if vocab is None:
        full, tail = words.shape[1], 0
    else:
        vocab = as_int("vocab", vocab)
        if not 1 <= vocab <= 32 * words.shape[1]:
            raise ValueError(
                f"vocab must lie in [1, {32 * words.shape[1]}] for {words.shape[1]} words, got {vocab}"
            )
        full, tail = divmod(vocab, 32)
    # The OR of each row's words (0 for none): 256 rows x 152k tokens in 0.3-0.5 ms, 2-3x any().
    allows = np.bitwise_or.reduce(words[:, :full], axis=1)
    if tail:
        allows |= words[:, full] & np.int32((1 << tail) - 1)
    return np.flatnonzero(allows == 0).astype(np.int64)


def check_apply_args(logits: object, bitmask: object, rows: object = None) -> None:
    """Raise ``TypeError``/``ValueError`` unless the arguments fit :func:`apply_token_bitmask_`.

    With ``rows`` the range check reads them: on CUDA that is one host sync.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(bitmask, torch.Tensor):
        raise TypeError(f"bitmask must be a torch.Tensor, got {type(bitmask).__name__}")
    if logits.dim() != 2:
        raise ValueError(
            f"logits must be 2-D [n, V], got a {logits.dim()}-D tensor of shape {tuple(logits.shape)}"
        )
    if logits.dtype not in FLOAT_DTYPES:
        want = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise ValueError(f"logits must have dtype {want}, got {logits.dtype}")
    n, vocab = logits.shape
    if vocab > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits must have contiguous rows (stride(1) == 1), got strides {logits.stride()}")
    if bitmask.dim() != 2:
        raise ValueError(
            f"bitmask must be 2-D [m, ceil(V / 32)], got a {bitmask.dim()}-D tensor of shape "
            f"{tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must have dtype torch.int32, got {bitmask.dtype}")
    check_same_device("bitmask", bitmask, "logits", logits)
    if vocab:
        _check_words(bitmask, vocab)
    elif bitmask.shape[1]:
        raise ValueError(f"bitmask must have 0 words per row for 0 logits columns, got {bitmask.shape[1]}")
    if bitmask.shape[1] > 1 and bitmask.stride(1) != 1:
        raise ValueError(
            f"bitmask must have contiguous rows (stride(1) == 1), got strides {bitmask.stride()}"
        )
    m = bitmask.shape[0]
    if rows is None:
        if m != n:
            raise ValueError(f"bitmask must have one row per logits row ({n}) when rows is None, got {m}")
        return
    check_vector("rows", rows, INT_DTYPES)
    assert isinstance(rows, torch.Tensor)
    check_same_device("rows", rows, "logits", logits)
    if rows.numel() != m:
        raise ValueError(f"rows must have one entry per bitmask row ({m}), got {rows.numel()}")
    if m:
        lo, hi = (int(v) for v in rows.aminmax())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise ValueError(f"rows must lie in [0, {n - 1}] (logits rows), got {bad}")


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """In place, one launch: ``logits[r, j] = -inf`` where bit ``j`` of ``bitmask[i]`` is 0.

    Args:
        logits: ``[n, V]`` float32/float16/bfloat16/float64, rows contiguous (``stride(1) == 1``).
        bitmask: ``[m, ceil(V / 32)]`` int32 on the logits' device, the xgrammar/llguidance layout
            (bit ``j % 32`` of word ``j // 32`` set: token ``j`` allowed). Exactly that many words.
        rows: None (``m == n``, bitmask row ``i`` masks logits row ``i``) or int64/int32 ``[m]``
            logits rows in ``[0, n)``: bitmask row ``i`` masks logits row ``rows[i]``, the other
            rows are untouched (a batch mixing grammar and free requests). A row named twice is
            masked by the union of its bitmask rows.

    Allowed logits keep their bits. Every argument is checked before anything is written
    (``TypeError``/``ValueError`` naming what was expected and what came); with ``rows`` on
    CUDA the range check is one host sync (:func:`launch_apply_token_bitmask_` skips it). A row
    that allows nothing becomes all ``-inf``: check the host bitmask with :func:`empty_bitmask_rows`.
    """
    check_apply_args(logits, bitmask, rows)
    launch_apply_token_bitmask_(logits, bitmask, rows)


def launch_apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """:func:`apply_token_bitmask_` without its argument checks, for callers that made them already.

    A row outside ``[0, n)`` in ``rows`` is skipped, never written (both paths).
    """
    m, vocab = bitmask.shape[0], logits.shape[1]
    if m == 0 or vocab == 0:
        return
    if not use_triton(logits):
        cpu_bitmask.apply_token_bitmask(logits, bitmask, rows)
        return
    _apply_bitmask_kernel[(m, cdiv(vocab, _BLOCK))](
        logits,
        bitmask,
        bitmask if rows is None else rows,
        logits.shape[0],
        vocab,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        BLOCK=_BLOCK,
        HAS_ROWS=rows is not None,
        num_warps=_NUM_WARPS,
    )


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of :func:`apply_token_bitmask_`, out of place: the tests' oracle.

    The layout written out: token ``j`` is allowed iff ``(bitmask[i, j // 32] >> (j % 32)) & 1``.
    """
    n, vocab = logits.shape
    j = torch.arange(vocab, device=logits.device)
    banned = ((bitmask[:, j // 32] >> (j % 32).to(torch.int32)) & 1) == 0
    if rows is not None:
        rows = rows.to(torch.int64)
        ok = (rows >= 0) & (rows < n)
        hits = torch.zeros((n, vocab), dtype=torch.int32, device=logits.device)
        banned = hits.index_add_(0, rows[ok], banned[ok].to(torch.int32)) > 0
    return logits.masked_fill(banned, float("-inf"))
