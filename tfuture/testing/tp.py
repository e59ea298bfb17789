"""A tensor- and pipeline-parallel toy transformer (torch only, seeded, float64, with a KV cache).

Every rank draws the full weights from ``seed`` and keeps its part, so every layout (one rank,
``tp`` ranks, ``pp`` stages, both) computes the same function, and a parallel run can be
compared token for token with a single-rank run:

* pipeline: stage ``s`` holds a contiguous share of the layers; the first stage embeds, the
  last one normalizes and projects to the vocabulary; the hidden state ``[n_tokens, d_model]``
  float64 goes from stage to stage;
* tensor: attention is split by heads and the MLP by hidden columns: the query, key, value
  and up projections are column-parallel, the attention output and down projections are
  row-parallel and end in an ``all_reduce`` over the stage's tensor group; the vocabulary
  projection is column-parallel, its logits are gathered with ``all_gather``.

The keys and values of every processed token stay in a per-layer cache
``[max_requests, max_len, local_heads, head_dim]`` (the request id indexes it), so a decode step
feeds one token per request and a later stage never needs the token ids.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from tfuture.core.batch import ForwardBatch

__all__ = ["ParallelTransformer", "split_round_robin"]

T = TypeVar("T")


def split_round_robin(items: Sequence[T], n: int) -> list[list[T]]:
    """``items`` dealt into ``n`` lists in turn (item ``i`` into list ``i % n``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return [list(items[i::n]) for i in range(n)]


class ParallelTransformer:
    """This rank's part of a pre-norm transformer: ``n_layers`` attention + MLP blocks.

    Args:
        vocab: vocabulary size; a multiple of the tensor-parallel size.
        d_model, n_heads: width and heads (``n_heads`` a multiple of the tensor-parallel size).
        max_requests, max_len: the KV cache; request ids lie in ``[0, max_requests)`` and
            positions in ``[0, max_len)``.
        seed: the weights; equal seeds give equal functions in every layout.
        ctx: a :class:`tfuture.distributed.ParallelContext` (its ``tp``/``pp`` split the model),
            or None for the whole model on one rank.
        work_s: seconds of stand-in device work per forward (a sleep on the CPU worker,
            ``torch.cuda._sleep`` on a GPU), for benchmarks.
    """

    def __init__(
        self,
        vocab: int = 64,
        *,
        d_model: int = 32,
        n_heads: int = 4,
        n_layers: int = 2,
        max_requests: int = 64,
        max_len: int = 128,
        seed: int = 0,
        device: torch.device | str = "cpu",
        ctx: Any = None,
        work_s: float = 0.0,
    ) -> None:
        tp, pp = (1, 1) if ctx is None else (ctx.tp, ctx.pp)
        tp_rank, stage = (0, 0) if ctx is None else (ctx.tp_rank, ctx.pp_rank)
        for name, value, of in (
            ("n_heads", n_heads, tp),
            ("vocab", vocab, tp),
            ("d_model", d_model, n_heads),
        ):
            if value % of:
                raise ValueError(f"{name} must be a multiple of {of}, got {value}")
        if n_layers < pp:
            raise ValueError(f"n_layers must be >= the number of stages ({pp}), got {n_layers}")
        self.vocab, self.max_len, self.work_s = vocab, max_len, work_s
        self.device = torch.device(device)
        self.ctx = ctx  # the group is read at each call: no reference of our own keeps it open
        self.tp, self.first, self.last = tp, stage == 0, stage == pp - 1
        self.hidden_size, self.hidden_dtype = d_model, torch.float64
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[0])

        # Every rank draws every weight in one order, then keeps its share.
        embed, pos = w(vocab, d_model) * math.sqrt(vocab), w(max_len, d_model) * math.sqrt(max_len)
        full = [
            [w(d_model, d_model) for _ in range(4)] + [w(d_model, 4 * d_model), w(4 * d_model, d_model)]
            for _ in range(n_layers)
        ]
        head = w(d_model, vocab)
        self.heads, self.head_dim = n_heads // tp, d_model // n_heads
        cols = slice(tp_rank * self.heads * self.head_dim, (tp_rank + 1) * self.heads * self.head_dim)
        mlp = slice(tp_rank * 4 * d_model // tp, (tp_rank + 1) * 4 * d_model // tp)
        mine = np.array_split(np.arange(n_layers), pp)[stage]
        dev = self.device
        self.layers = []
        for i in mine:
            wq, wk, wv, wo, up, down = full[int(i)]
            parts = (wq[:, cols], wk[:, cols], wv[:, cols], wo[cols], up[:, mlp], down[mlp])
            self.layers.append(tuple(t.contiguous().to(dev) for t in parts))
        vcols = slice(tp_rank * vocab // tp, (tp_rank + 1) * vocab // tp)
        self.embed, self.pos = embed.to(dev), pos.to(dev)
        self.head = head[:, vcols].contiguous().to(dev)
        shape = (max_requests, max_len, self.heads, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=torch.float64, device=dev) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=torch.float64, device=dev) for _ in self.layers]

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: ``hidden`` None, embeds ``batch.input_ids``. Returns the hidden state
        ``[rows, d_model]`` float64 (``rows``: the step's token rows, a bucket's padding rows
        zero), or on the last stage the logits ``[n_sample, vocab]``."""
        if self.work_s > 0:
            if self.device.type == "cuda":
                torch.cuda._sleep(int(self.work_s * 1.9e9))
            else:
                time.sleep(self.work_s)
        n = batch.host.n_tokens if batch.host is not None else batch.input_ids.numel()
        n_reqs = batch.req_ids.numel()
        ends = batch.last_rows + 1
        seg_lens = torch.diff(ends, prepend=ends.new_zeros(1))
        row_req = torch.repeat_interleave(torch.arange(n_reqs, device=self.device), seg_lens, output_size=n)
        rid, pos = batch.req_ids.index_select(0, row_req), batch.positions[:n]
        if hidden is None:
            x = self.embed[batch.input_ids[:n].to(torch.int64)] + self.pos[pos]
        else:
            x = hidden[:n]  # a padded step's hidden state has a row per padded token row
        visible = torch.arange(self.max_len, device=self.device)[None, :] <= pos[:, None]  # [n, L]
        for (wq, wk, wv, wo, up, down), kc, vc in zip(self.layers, self.k_cache, self.v_cache, strict=True):
            h = _norm(x)
            q, k, v = ((h @ m).view(n, self.heads, self.head_dim) for m in (wq, wk, wv))
            kc[rid, pos], vc[rid, pos] = k, v
            scores = torch.einsum("nhd,nlhd->nhl", q, kc[rid]) / math.sqrt(self.head_dim)
            probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
            attn = torch.einsum("nhl,nlhd->nhd", probs, vc[rid]).reshape(n, -1)
            x = x + self._all_reduce(attn @ wo)
            x = x + self._all_reduce(torch.relu(_norm(x) @ up) @ down)
        if not self.last:
            rows = batch.input_ids.numel()  # padded to a bucket: zero rows after the real ones
            return x if rows == n else torch.cat([x, x.new_zeros(rows - n, x.shape[1])])
        if batch.sample_rows.numel() == 0:  # the same on every rank of the stage: no all_gather
            return torch.zeros(0, self.vocab, dtype=torch.float64, device=self.device)
        local = _norm(x.index_select(0, batch.sample_rows)) @ self.head
        if self.tp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local.contiguous(), group=self.ctx.tp_group)
        return torch.cat(parts, dim=1)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(partial, group=self.ctx.tp_group)
        return partial

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        """Greedy: the argmax of each sampling row (``[n_sample]`` int64), after a bool mask."""
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        return logits.argmax(dim=-1)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6)
