"""The fast CPU path of every kernel family, in numpy on the tensors' own memory.

CPU tensors run these functions unless ``TRITON_INTERPRET=1`` (see ``_common.use_triton``). A
torch op costs a few microseconds of dispatch on the host; numpy on a ``t.numpy()`` view of the
same memory costs far less, and on the host reading a count (to skip work) costs no device sync.
Results, the error flag included, equal the kernels'; the launchers check arguments first.
Outputs are passed in explicitly, so this module imports no kernel family (no cycle).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch
from torch import Tensor

from tfuture.core.checks import count_nonzero as _count_nonzero
from tfuture.kernels._common import INT32_MAX, INT32_MIN, Slots, narrows, search_steps
from tfuture.kernels._field_layout import as_words

# 0-d operands: a comparison with one skips the Python scalar's conversion (about half the cost).
_ZERO64, _ZERO32 = np.zeros((), dtype=np.int64), np.zeros((), dtype=np.int32)

Tensors: TypeAlias = Sequence[Tensor]
Err: TypeAlias = Tensor | None


# Host views of buffers whose owner never resizes them (a FutureMap's token map and error
# flag): ``t.numpy()`` costs about 0.5 us a call, a look-up here a fifth of that. Keyed by id,
# checked by identity (an id is reused only after its tensor died, and its entry dies with it).
# Each entry keeps the view and its reverse without row 0, ``view[:0:-1]``: there index ``-s``
# is row ``s`` (see :func:`resolve_`).
_VIEWS: dict[int, tuple[weakref.ref[Tensor], np.ndarray, np.ndarray]] = {}


def pin_host_view(t: Tensor) -> None:
    """Keep ``t.numpy()`` for the numpy path (CPU ``t`` only); the caller promises never to
    resize ``t`` or swap its storage. The view is dropped when ``t`` dies."""
    key = id(t)

    def forget(ref: weakref.ref[Tensor], key: int = key) -> None:
        entry = _VIEWS.get(key)
        if entry is not None and entry[0] is ref:
            del _VIEWS[key]

    view = t.numpy()
    _VIEWS[key] = (weakref.ref(t, forget), view, view[:0:-1])


def host_view(t: Tensor) -> np.ndarray:
    """``t.numpy()``, from the pinned views when ``t`` has one."""
    entry = _VIEWS.get(id(t))
    if entry is not None and entry[0]() is t:
        return entry[1]
    return t.numpy()


def _flag(err: Err, bad: np.ndarray, values: np.ndarray) -> None:
    """The kernels' error flag: ``err[0] += count(bad)``, ``err[1] = min(err[1], values[bad])``."""
    if err is not None and bad.any():
        e = host_view(err)
        e[0] += int(bad.sum())
        e[1] = min(int(e[1]), int(values[bad].min()))


def _resolve_np(ids: np.ndarray, token_map: np.ndarray, err: Err, fit32: bool = False) -> None:
    """In place, as the kernels' ``_resolve_block``; ``fit32``: the output is int32 (values past
    int32, resolved or concrete, are bad)."""
    neg = ids < 0
    big = fit32 and ids.dtype == np.int64 and bool((ids > INT32_MAX).any())
    if not neg.any() and not big:
        return
    # -id in the ids' dtype: the dtype minimum wraps to itself and stays negative, so it fails
    # the bounds check below like any slot past the map (never read).
    slots = -ids[neg]
    if not big and slots.size and slots.min() >= 1 and slots.max() < token_map.size:
        tokens = token_map[slots]
        if not fit32 or (tokens.min() >= INT32_MIN and tokens.max() <= INT32_MAX):
            ids[neg] = tokens
            return
    where = np.flatnonzero(neg)
    slots = slots.astype(np.int64)
    ok = (slots >= 1) & (slots < token_map.size)
    tokens = token_map[np.where(ok, slots, 0)]
    if fit32:
        ok &= (tokens >= INT32_MIN) & (tokens <= INT32_MAX)
    ids[where[ok]] = tokens[ok]
    if err is not None:
        bad = where[~ok]
        if big:
            bad = np.concatenate([bad, np.flatnonzero(ids > INT32_MAX)])
        _flag(err, np.ones(bad.size, dtype=bool), ids[bad])
        ids[bad] = 0


def _map_views(token_map: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(view, reversed view without row 0)`` of a token map: the pinned ones when it has them."""
    entry = _VIEWS.get(id(token_map))
    if entry is not None and entry[0]() is token_map:
        return entry[1], entry[2]
    m = token_map.numpy()
    return m, m[:0:-1]


def resolve_(ids: Tensor, token_map: Tensor, err: Err) -> Tensor:
    """In place: every placeholder ``-s`` in ``ids`` with ``1 <= s < n_slots`` -> ``token_map[s]``."""
    a = ids.numpy()
    m, back = _map_views(token_map)
    if not resolve_in_range_(a, back):
        _resolve_np(a, m, err, narrows(ids.dtype, token_map.dtype))
    return ids


def resolve_in_range_(a: np.ndarray, back: np.ndarray) -> bool:
    """The common case of :func:`resolve_` in a few numpy ops, in place; False (nothing
    written) when it does not apply: the output narrows, or a placeholder lies outside the map.

    ``back`` is the map reversed without row 0 (``view[:0:-1]``), so index ``-s`` (a
    placeholder as it is) reads row ``s`` for every slot 1 <= s < n_slots, and any other
    negative id (the dtype minimum included: it lies past any map this small) is out of range:
    numpy's gather then raises IndexError before anything is written, so a bad placeholder is
    never read. The checked path handles and flags it.
    """
    if a.itemsize < back.itemsize or back.size > INT32_MAX:
        return False
    neg = a < (_ZERO64 if a.itemsize == 8 else _ZERO32)
    try:
        if _count_nonzero(neg) == a.size:
            a[:] = back[a]  # every id a placeholder (a decode step): no masked gather or write
        else:
            a[neg] = back[a[neg]]
    except IndexError:
        return False
    return True


def malformed(seg: np.ndarray, prefix: np.ndarray) -> bool:
    """True unless ``seg_starts[0] == 0``, ``seg_starts`` is non-decreasing and ``prefix_lens >= 0``."""
    # np.count_nonzero: a C call, several times cheaper than ndarray.any() on small arrays.
    return bool(seg[0] != 0 or (prefix.size and (prefix.min() < 0 or np.count_nonzero(seg[1:] < seg[:-1]))))


_ARANGE = np.arange(1025, dtype=np.int64)


def segment_error(seg: np.ndarray, prefix: np.ndarray) -> str | None:
    """The first defect of malformed segments, as an error message (None when well formed)."""
    if not malformed(seg, prefix):
        return None
    if seg[0] != 0:
        return f"seg_starts[0] must be 0, got {int(seg[0])}"
    back = np.flatnonzero(seg[1:] < seg[:-1])
    if back.size:
        q = int(back[0])
        return (
            f"seg_starts must be non-decreasing, got seg_starts[{q + 1}] = {int(seg[q + 1])} "
            f"< seg_starts[{q}] = {int(seg[q])}"
        )
    q = int(np.flatnonzero(prefix < 0)[0])
    return f"prefix_lens must be >= 0, got prefix_lens[{q}] = {int(prefix[q])}"


def _search(seg: np.ndarray, rows: np.ndarray, n_reqs: int) -> np.ndarray:
    """The kernel's binary search, step for step: on malformed segments it alone defines the
    request of each row, so both paths agree there too."""
    lo = np.zeros(rows.size, dtype=np.int64)
    hi = np.full(rows.size, n_reqs - 1, dtype=np.int64)
    for _ in range(search_steps(n_reqs)):
        active = lo < hi
        mid = (lo + hi + 1) // 2
        go = seg[np.where(active, mid, 0)] <= rows
        lo = np.where(active & go, mid, lo)
        hi = np.where(active & ~go, mid - 1, hi)
    return lo


def prepare(
    tokens: Tensor,
    seg_starts: Tensor,
    prefix_lens: Tensor,
    token_map: Tensor,
    out: Tensors,
    err: Err,
    strict: bool = False,
) -> None:
    """Fused input preparation into ``out = (input_ids, positions, last_rows)``.

    Malformed segments are flagged in ``err`` as the kernel flags them, or with ``strict`` raise
    ``ValueError`` before anything is written.
    """
    seg = seg_starts.numpy().astype(np.int64, copy=False)
    prefix = prefix_lens.numpy().astype(np.int64, copy=False)
    bad = malformed(seg, prefix)
    if bad and strict:
        raise ValueError(segment_error(seg, prefix))
    total = max(min(int(seg[-1]), tokens.numel()), 0)
    ids, pos, last = (t.numpy() for t in out)
    # Resolved in int64, as the kernel does: an int32 stream over an int64 map must not wrap.
    live = tokens.numpy()[:total].astype(np.int64)
    fit32 = narrows(out[0].dtype, tokens.dtype, token_map.dtype)
    m, back = _map_views(token_map)
    if fit32 or not resolve_in_range_(live, back):
        _resolve_np(live, m, err, fit32)
    ids[:total] = live
    ids[total:] = 0
    pos[total:] = 0
    if seg.size == 1:
        # No request owns a row: seg_starts == [0] leaves none live (a bad seg_starts[0] too).
        pos[:] = 0
    elif not bad and total == seg.size - 1 <= 1024 and np.array_equal(seg, _ARANGE[: total + 1]):
        # A decode step: one row a request, at its prefix length; each row is its request's last.
        pos[:total] = prefix
        last[:] = _ARANGE[:total]
        return
    elif not bad:
        req, offset, last_rows = _segments(seg, total)
        pos[:total] = prefix[req] + offset
        last[:] = last_rows
        return
    else:
        rows = np.arange(total)
        req = _search(seg, rows, prefix.size)
        pos[:total] = np.maximum(prefix[req] + rows - seg[req], 0)
    last[:] = _last_rows(seg, total)
    if bad and err is not None:
        # As the kernel: one count per malformed request, one more for seg_starts[0] != 0.
        seg_len = seg[1:] - seg[:-1]
        _flag(err, (seg_len < 0) | (prefix < 0), np.minimum(seg_len, prefix))
        _flag(err, seg[:1] != 0, -np.abs(seg[:1]))


def _last_rows(seg: np.ndarray, total: int) -> np.ndarray:
    """Each request's last row of ``total`` rows: 0 for an empty segment at row 0, as the kernel."""
    return np.maximum(np.minimum(seg[1:], total) - 1, 0)


# Well-formed segments seen before (a speculative step's, every request k + 1 rows): their
# rows' requests, offsets and last rows, read-only. Keyed by the segments' bytes and the rows.
_SEGMENTS: dict[tuple[bytes, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
_MAX_SEGMENTS = 256


def _segments(seg: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(req, offset, last)`` of well-formed ``seg`` (int64) over ``total`` rows: row ``r``'s
    request, ``r - seg[req]``, and each request's last row (0 for an empty first one)."""
    key = (seg.tobytes(), total)
    got = _SEGMENTS.get(key)
    if got is not None:
        return got
    rows = np.arange(total)
    # The request of row r is the largest q with seg_starts[q] <= r (0 if none), as the
    # kernel's binary search: one searchsorted, about 2x cheaper than repeat+diff at 256.
    req = np.searchsorted(seg[1:-1], rows, side="right")
    got = (req, rows - seg[req], _last_rows(seg, total))
    for a in got:
        a.flags.writeable = False
    if len(_SEGMENTS) >= _MAX_SEGMENTS:
        _SEGMENTS.clear()
    _SEGMENTS[key] = got
    return got


def _slot_rows(
    slots: Slots, n_slots: int, negated: bool, err: Err, in_range: bool = False
) -> tuple[np.ndarray | slice, np.ndarray | None]:
    """``(rows, ok)``: the buffer rows named, and which are in range (None: all). Flags the rest.

    ``in_range``: the caller guarantees every slot lies in ``[1, n_slots)``; no check then.
    """
    if isinstance(slots, range):
        if not slots or (slots.start >= 1 and slots.stop <= n_slots):
            return slice(slots.start, slots.stop), None
        idx = np.arange(slots.start, slots.stop)
    else:
        idx = slots.numpy()
        if in_range or not idx.size:
            return -idx if negated else idx, None
        # Negate in int64: the int32 minimum then lands out of range instead of wrapping.
        idx = -idx.astype(np.int64) if negated else idx
    # On the host a bounds check is two reductions, and the common all-good case needs no mask.
    if idx.min() >= 1 and idx.max() < n_slots:
        return idx, None
    idx = idx.astype(np.int64, copy=False)
    ok = (idx >= 1) & (idx < n_slots)
    _flag(err, ~ok, -idx)
    return idx, ok


def store(token_map: Tensor, slots: Slots, values: Tensor, err: Err) -> None:
    """``token_map[slots[i]] = values[i]`` where ``1 <= slots[i] < n_slots``; the rest is flagged."""
    entry = _VIEWS.get(id(token_map))
    dst = entry[1] if entry is not None and entry[0]() is token_map else token_map.numpy()
    vals = values.numpy()
    if type(slots) is range and store_run(dst, slots.start, vals):
        return
    rows, ok = _slot_rows(slots, dst.size, False, err)
    if err is not None:
        # A negative token would resolve into a placeholder-like id, and one past an int32 map
        # would wrap into one: store 0 and flag it.
        unfit = vals < 0
        if narrows(token_map.dtype, values.dtype):
            unfit |= vals > INT32_MAX
        if ok is not None:
            unfit &= ok
        if unfit.any():
            _flag(err, unfit, vals)
            vals = np.where(unfit, 0, vals)
    if ok is None:
        dst[rows] = vals
    else:
        assert isinstance(rows, np.ndarray)
        dst[rows[ok]] = vals[ok]


def store_run(dst: np.ndarray, start: int, vals: np.ndarray) -> bool:
    """``dst[start:start + n] = vals`` when that is all a store does: a non-empty run inside the
    map, no token narrowed, every token >= 0 (the minimum, by argmin: a third of a ufunc
    reduction's cost). False (nothing written) otherwise, for the checked path."""
    stop = start + vals.size
    if vals.size and dst.itemsize >= vals.itemsize and start >= 1 and stop <= dst.size:
        if vals[int(vals.argmin())] >= 0:
            dst[start:stop] = vals
            return True
    return False


def store_fields(
    buffers: Tensors, slots: Slots, values: Tensors, negated: bool, err: Err, in_range: bool = False
) -> None:
    """``buffers[f][slots[i]] = values[f][i]`` bit for bit; slots out of range are flagged, not written.

    ``in_range``: the caller guarantees every slot lies in ``[1, n_slots)`` (no bounds check).
    """
    rows, ok = _slot_rows(slots, buffers[0].shape[0], negated, err, in_range)
    for buf, val in zip(buffers, values, strict=True):
        words = as_words(val).numpy()
        if ok is None:
            as_words(buf).numpy()[rows] = words
        else:
            assert isinstance(rows, np.ndarray)
            as_words(buf).numpy()[rows[ok]] = words[ok]


def gather_fields(
    buffers: Tensors, slots: Slots, out: Tensors | None, negated: bool, err: Err, in_range: bool = False
) -> list[Tensor]:
    """``out[f][i] = buffers[f][slots[i]]`` bit for bit; rows of slots out of range are zero bits.

    ``out=None`` returns fresh tensors made by numpy's gather (no separate allocation).
    ``in_range``: as in :func:`store_fields`.
    """
    rows, ok = _slot_rows(slots, buffers[0].shape[0], negated, err, in_range)
    if ok is not None:
        # Rare (a bad slot): gather row 0 in their place, then zero those rows.
        assert isinstance(rows, np.ndarray)
        rows = np.where(ok, rows, 0)
    res = []
    for i, buf in enumerate(buffers):
        src = as_words(buf).numpy()
        if out is None:
            words = src[rows].copy() if isinstance(rows, slice) else np.take(src, rows, axis=0)
            t = torch.from_numpy(words)
            res.append(t if t.dtype == buf.dtype else t.view(buf.dtype))
        else:
            words = as_words(out[i]).numpy()
            if isinstance(rows, slice):
                words[...] = src[rows]
            else:
                np.take(src, rows, axis=0, out=words)
            res.append(out[i])
        if ok is not None:
            words[~ok] = 0
    return res


def prepare_spec(last: Tensor, seq_lens: Tensor, fields: Tensors, out: Tensors, err: Err) -> None:
    """Speculative verify rows into ``out = (input_ids, positions, n_draft)``; ``fields`` are the
    slot fields ``(tokens, accept_len, new_seq_len, draft_tokens)``."""
    tokens, accept_len, new_seq_len, draft_tokens = fields
    n, n_tok, k = last.numel(), tokens.shape[1], draft_tokens.shape[1]
    src = last.numpy().astype(np.int64)
    future = src < 0
    slots = -src
    ok = future & (slots >= 1) & (slots < accept_len.shape[0])
    _flag(err, future & ~ok, src)
    safe = np.where(ok, slots, 0)
    acc = np.clip(accept_len.numpy()[safe], 1, n_tok)
    tok = np.where(ok, tokens.numpy()[safe, acc - 1], np.where(future, 0, src))
    seq = np.where(ok, new_seq_len.numpy()[safe], np.where(future, 1, seq_lens.numpy()))
    ids, pos, n_draft = (t.numpy() for t in out)
    ids[:n, 0] = tok
    ids[:n, 1:] = np.where(ok[:, None], draft_tokens.numpy()[safe], 0)
    pos[:n] = np.maximum(seq - 1, 0)[:, None] + np.arange(k + 1)
    n_draft[:n] = np.where(ok, k, 0)
    for t in (ids, pos, n_draft):
        t[n:] = 0
