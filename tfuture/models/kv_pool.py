"""A pooled KV cache for the runtime: one cache row per live request, written and read on the device.

The pool is framework-free: :class:`KVPool` maps the scheduler's request ids to rows (on the
host, in stream order: rows are taken in ``forward`` and given back in ``release``, both on the
forward stream), and :class:`StepLayout` turns one step's packed rows into a padded attention
over the cache, with device index math only (sizes come from the step's host mirrors).

A layer may attend within a sliding window: its query at position ``i`` sees keys ``j`` with
``i - window < j <= i`` (``window`` keys, its own included), transformers' semantics
(``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``). Rows keep
every position; older keys are masked, not dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch
from tfuture.core.rows import RowAllocator, RowsFull

# (q [n_reqs, heads, width, head_dim], k, v [n_reqs, kv_heads, kv_len, head_dim], mask)
#   -> [n_reqs, width, heads, head_dim]
AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class KVPool:
    """``k``: ``[n_layers, n_rows, max_len, n_kv_heads, head_dim]``; ``v``: the same with
    ``value_shape`` ``(heads, head_dim)`` (default the keys' ``(n_kv_heads, head_dim)``; latent
    attention's values are narrower than its keys), allocated once.

    ``windows``: per layer, its sliding window (``int >= 1``) or ``None`` for full attention
    (default: all full); a window of at least ``max_len`` never binds and is stored as ``None``.

    ``rows_of`` gives each request its row (taken on its first step, which starts at position
    0), ``release`` gives rows back, ``clear`` gives all back. The tensors never grow: a step
    with more requests than rows, or one that needs a row when none is free, raises
    ``RuntimeError`` ("KV pool full") naming both numbers, before it takes any row.
    """

    def __init__(
        self,
        n_layers: int,
        n_rows: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        value_shape: tuple[int, int] | None = None,
        windows: Sequence[int | None] | None = None,
    ) -> None:
        for name, v in (("n_layers", n_layers), ("n_rows", n_rows), ("max_len", max_len)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.windows = _windows(windows, n_layers, max_len)
        v_heads, v_dim = (n_kv_heads, head_dim) if value_shape is None else value_shape
        # Normal tensors even when built under inference mode: a later run may write them under no_grad.
        with torch.inference_mode(False):
            rows = (n_layers, n_rows, max_len)
            self.k = torch.zeros((*rows, n_kv_heads, head_dim), dtype=dtype, device=device)
            self.v = torch.zeros((*rows, v_heads, v_dim), dtype=dtype, device=device)
            # What every step reuses: each layer's cache flattened over rows and positions (one
            # index per token writes it), and the key positions 0..max_len-1 (the masks).
            self.k_flat = [layer.flatten(0, 1) for layer in self.k]
            self.v_flat = [layer.flatten(0, 1) for layer in self.v]
            self.key_pos = torch.arange(max_len, device=device)
        self.n_rows, self.max_len = n_rows, max_len
        self._alloc = RowAllocator(n_rows)

    @property
    def rows(self) -> dict[int, int]:
        """``{request id: row}`` of the live requests."""
        return self._alloc.held

    @property
    def n_free(self) -> int:
        return self._alloc.n_free

    def rows_of(self, req_ids: np.ndarray, prefix_lens: np.ndarray) -> np.ndarray:
        """``[n]`` int64 cache rows of ``req_ids``, taking a free row for each new id.

        ``prefix_lens [n]``: the tokens each request already has in its cache. A request without
        a row must start at position 0 (``prefix_len == 0``): one that claims cached tokens but
        holds no row (never run here, or released by ``Batch.ended`` too early) raises
        ``ValueError`` naming it, since a fresh row would give it an empty or foreign cache.
        On any error no row is taken.
        """
        held = self._alloc.held
        ids = req_ids.tolist()
        rows = [held.get(rid, -1) for rid in ids]
        if -1 not in rows:  # steady state: every request holds its row
            return np.array(rows, dtype=np.int64)
        n_req = len(set(ids))
        if n_req > self.n_rows:
            raise RuntimeError(
                f"KV pool full: a step runs {n_req} requests, the KV pool has max_requests={self.n_rows} "
                "rows (build the model with max_requests >= the scheduler's max_running)"
            )
        new = [i for i, row in enumerate(rows) if row < 0]
        for i in new:
            if prefix_lens[i]:
                raise ValueError(
                    f"request {ids[i]} comes with prefix_len={int(prefix_lens[i])} (tokens already in its "
                    "KV cache) but holds no KV row: its first step must start at position 0, and its "
                    "row is freed only once it ended (Batch.ended)"
                )
        try:
            self._alloc.take(list(dict.fromkeys(ids[i] for i in new)))
        except RowsFull as full:
            raise RuntimeError(
                f"KV pool full: request {full.rid} needs a row and all max_requests={self.n_rows} rows "
                f"hold live requests ({len(held)} live: {sorted(held)[:8]}...); build the model with "
                "max_requests >= the scheduler's max_running, and report ended requests in "
                "Batch.ended so that release frees their rows"
            ) from None
        return np.array([held[rid] for rid in ids], dtype=np.int64)

    def release(self, req_ids: np.ndarray) -> None:
        """Give back the rows of ``req_ids``; ids without a row (never run) are ignored."""
        self._alloc.release(req_ids)

    def clear(self) -> None:
        self._alloc.reset()


def _windows(windows: Sequence[int | None] | None, n_layers: int, max_len: int) -> tuple[int | None, ...]:
    """Per-layer windows, ``None`` where the window never binds (at least ``max_len``)."""
    if windows is None:
        return (None,) * n_layers
    out = tuple(windows)
    if len(out) != n_layers:
        raise ValueError(f"windows must give one entry per layer ({n_layers}), got {len(out)}")
    for w in out:
        if w is not None and (type(w) is not int or w < 1):
            raise ValueError(f"a layer's window must be None or an int >= 1, got {w!r}")
    return tuple(None if w is None or w >= max_len else w for w in out)


@dataclass(frozen=True, slots=True)
class StepLayout:
    """One step's indices. Token ``t`` (packed, ``[n_tok]``) of request ``q`` at offset ``i``
    is padded row ``pad_idx[t] = q * width + i``; it writes cache row ``tok_rows[t]`` at position
    ``tok_pos[t]``. ``mask [n_reqs, 1, width, kv_len]``: padded row ``(q, i)`` sees keys
    ``<= prefix[q] + i`` (padding rows see what the request's last token sees, so no softmax
    is empty); ``windowed[w]`` the same within window ``w`` (one per window of the pool's
    layers). Bool masks, or additive ones (0, else ``fill``: the dtype's minimum by default) when
    built with ``additive=dtype`` (eager attention adds its mask to the scores; SDPA turns a bool
    mask into one with ``-inf`` in every call, so a step built with ``fill=-inf`` saves that
    conversion per layer and rounds the same). ``tok_flat [n_tok]``:
    ``tok_rows * max_len + tok_pos``, the token's place in a layer's cache flattened over rows
    and positions (one index for the cache write). ``dense``: every request runs ``width``
    tokens (decode steps), so the padded rows are the packed ones in order and the attention
    needs no scatter into padding nor gather out of it. ``row_span``: ``(first, stop)`` when the
    requests' cache rows are consecutive and in order (a view of the cache then replaces the
    gather). Every step attends with its mask, even where every key is visible: a mask-free
    attention rounds differently, and a draft model's decode step would then disagree with the
    target's verification of the same tokens (an exact-copy drafter must have every draft accepted).
    """

    pool: KVPool
    n_reqs: int
    width: int
    kv_len: int
    req_rows: torch.Tensor
    tok_rows: torch.Tensor
    tok_pos: torch.Tensor
    pad_idx: torch.Tensor
    mask: torch.Tensor
    windowed: dict[int, torch.Tensor]
    tok_flat: torch.Tensor
    dense: bool
    row_span: tuple[int, int] | None

    @staticmethod
    def build(
        pool: KVPool, batch: ForwardBatch, *, additive: torch.dtype | None = None, fill: float | None = None
    ) -> StepLayout:
        """The layout of ``batch``'s real rows and requests (padding of bucketed steps dropped)."""
        host = batch.host
        if host is None or batch.seg_starts is None:
            raise ValueError("the KV pool needs ForwardBatch.host and seg_starts (set by TokenStep)")
        n_reqs, n_tok, width = host.seg_lens.size, host.n_tokens, host.max_seg_len
        kv_len = int((host.prefix_lens + host.seg_lens).max()) if n_reqs else 0
        if kv_len > pool.max_len:
            q = int(np.argmax(host.prefix_lens + host.seg_lens))
            raise ValueError(
                f"request {int(host.req_ids[q])} reaches {kv_len} positions, the KV pool holds max_len="
                f"{pool.max_len}"
            )
        dev = batch.input_ids.device
        row_ids = pool.rows_of(host.req_ids, host.prefix_lens)
        rows = torch.from_numpy(row_ids)
        # Pinned: an async H2D copy; from pageable memory the host would wait for the stream.
        req_rows = rows.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else rows
        dense = n_tok == n_reqs * width
        first = int(row_ids[0]) if n_reqs else 0
        consecutive = (
            n_reqs > 0 and int(row_ids[-1]) - first == n_reqs - 1 and bool((np.diff(row_ids) == 1).all())
        )
        tok_pos = batch.positions[:n_tok]
        if dense:
            # Token q * width + i stands at position prefix[q] + i: its last visible key.
            if width == 1:
                tok_rows = req_rows
            elif dev.type == "cpu":  # numpy: a fraction of repeat_interleave's dispatch
                tok_rows = torch.from_numpy(np.repeat(row_ids, width))
            else:
                tok_rows = req_rows.repeat_interleave(width, output_size=n_tok)
            pad_idx = torch.arange(n_tok, device=dev)  # read only by a ragged step's attend
            last_key = tok_pos.view(n_reqs, 1, width, 1)
        else:
            tok_rows, pad_idx, prefix, cols = _ragged_index(batch, req_rows, n_tok, width)
            last_key = (prefix[:, None] + cols)[:, None, :, None]  # [n_reqs, 1, width, 1]
        keys = pool.key_pos[:kv_len]
        causal = keys <= last_key
        windowed = {w: causal & (keys > last_key - w) for w in set(pool.windows) if w is not None}
        return StepLayout(
            pool,
            n_reqs,
            width,
            kv_len,
            req_rows,
            tok_rows,
            tok_pos,
            pad_idx,
            _as_mask(causal, additive, fill),
            {w: _as_mask(m, additive, fill) for w, m in windowed.items()},
            tok_rows * pool.max_len + tok_pos,
            dense,
            (first, first + n_reqs) if consecutive else None,
        )

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttnFn
    ) -> torch.Tensor:
        """Write this step's ``k``, ``v`` (``[1, kv_heads, n_tok, head_dim]`` and ``[1, v_heads, n_tok,
        v_head_dim]``, packed) into the cache, then attend with ``q [1, heads, n_tok, head_dim]``
        within the layer's window; returns ``[1, n_tok, heads, v_head_dim]``. The keys and
        values ``attn`` gets may be views of the cache itself (consecutive rows): it must not
        write them.
        """
        pool, n_reqs, width = self.pool, self.n_reqs, self.width
        # One flat index per token (rows x positions are contiguous in a layer's cache): an
        # index_copy_ instead of index_put_ with two index tensors.
        kflat, vflat = pool.k_flat[layer], pool.v_flat[layer]
        kflat.index_copy_(0, self.tok_flat, _packed(k, kflat.dtype))
        vflat.index_copy_(0, self.tok_flat, _packed(v, vflat.dtype))
        # Only the first kv_len positions of each live row: [n_reqs, kv_heads, kv_len, head_dim].
        if self.row_span is not None:
            keys = _rows_view(pool.k, layer, self.row_span, self.kv_len)
            values = _rows_view(pool.v, layer, self.row_span, self.kv_len)
        else:
            keys = pool.k[layer, :, : self.kv_len].index_select(0, self.req_rows).transpose(1, 2)
            values = pool.v[layer, :, : self.kv_len].index_select(0, self.req_rows).transpose(1, 2)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        n_heads, head_dim = q.shape[1], q.shape[3]
        if self.dense:  # padded row q * width + i is packed token q * width + i: a view
            padded = q[0].unflatten(1, (n_reqs, width)).transpose(0, 1)
        else:
            flat = q.new_zeros(n_reqs * width, n_heads, head_dim)
            flat.index_copy_(0, self.pad_idx, q[0].transpose(0, 1))
            padded = flat.view(n_reqs, width, n_heads, head_dim).transpose(1, 2)
        window = pool.windows[layer]
        mask = self.mask if window is None else self.windowed[window]
        out = attn(padded, keys, values, mask)  # [n_reqs, width, heads, v_head_dim]
        if self.dense:
            return out.reshape(1, n_reqs * width, n_heads, -1)
        return out.reshape(n_reqs * width, n_heads, -1).index_select(0, self.pad_idx).unsqueeze(0)


def _packed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [1, heads, n_tok, head_dim]`` as ``[n_tok, heads, head_dim]`` (a view) in ``dtype``."""
    x = x[0].transpose(0, 1)
    return x if x.dtype == dtype else x.to(dtype)


def _rows_view(cache: torch.Tensor, layer: int, span: tuple[int, int], kv_len: int) -> torch.Tensor:
    """``cache[layer, lo:hi, :kv_len].transpose(1, 2)`` in one op: ``[hi - lo, heads, kv_len,
    head_dim]``, a view of ``cache [n_layers, n_rows, max_len, heads, head_dim]`` (contiguous)."""
    lo, hi = span
    _, n_rows, max_len, heads, dim = cache.shape
    row, pos = max_len * heads * dim, heads * dim
    return cache.as_strided((hi - lo, heads, kv_len, dim), (row, dim, pos, 1), (layer * n_rows + lo) * row)


# (batch, req_rows [n_reqs], n_tok, width) -> (tok_rows [n_tok], pad_idx [n_tok], prefix [n_reqs],
# cols [n_reqs or 1, width]): each token's cache row and padded row, each request's cached
# tokens, and the offset within its segment that each padded column stands at.
def _ragged_index(
    batch: ForwardBatch, req_rows: torch.Tensor, n_tok: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dev, n_reqs = req_rows.device, req_rows.numel()
    assert batch.seg_starts is not None
    starts = batch.seg_starts[: n_reqs + 1]
    seg_lens = starts[1:] - starts[:-1]
    tok_req = torch.repeat_interleave(torch.arange(n_reqs, device=dev), seg_lens, output_size=n_tok)
    offset = torch.arange(n_tok, device=dev) - starts.index_select(0, tok_req)
    prefix = batch.seq_lens[:n_reqs] - seg_lens
    # Padding rows (offset >= seg_len) stand at the request's last token.
    cols = torch.minimum(torch.arange(width, device=dev)[None, :], (seg_lens - 1).clamp(min=0)[:, None])
    return req_rows.index_select(0, tok_req), tok_req * width + offset, prefix, cols


def _as_mask(visible: torch.Tensor, additive: torch.dtype | None, fill: float | None) -> torch.Tensor:
    """``visible`` (bool), or as an additive mask of dtype ``additive``: 0 where visible, else
    ``fill`` (default: the dtype's minimum)."""
    if additive is None:
        return visible
    zeros = torch.zeros(visible.shape, dtype=additive, device=visible.device)
    return zeros.masked_fill_(~visible, torch.finfo(additive).min if fill is None else fill)
