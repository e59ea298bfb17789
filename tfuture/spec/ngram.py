"""Prompt-lookup drafting on the device: :class:`NGramDrafter`.

Each request's tokens (prompt and committed output) live in a device history row, written in
stream order: a step's inputs at their positions after its prepare, its committed tokens after
its verification. The drafts of a request are the ``k`` tokens that followed the latest
earlier occurrence of its last ``n`` tokens, ``n`` from ``max_ngram`` down to ``min_ngram``
(the first ``n`` that matches wins). When fewer than ``k`` tokens follow it before the end (the
request repeats itself with period ``P``: the match ends ``P`` positions before the suffix), the
drafts go on repeating those ``P`` tokens, which is what the tokens that follow the match would be
if the repetition goes on. The match runs on the device over every request at once,
so it reads step N's accepted tokens without the host (a host-side lookup would be one step
stale under overlap). A request with no match proposes its last token ``k`` times: cheap to
verify, and any proposal is exact under verification.

On the CPU the match is not a scan: :class:`tfuture.spec.ngram_cpu.NGramIndex` keeps each request's
committed tokens and an index of its n-grams, updated by the tokens each step commits. The history
then holds only what the index reads: each request's prompt, at its first draft; ``observe`` writes
a step's inputs while some request of the step has not drafted yet, and skips the steps where every
one has (their tokens come with their drafts). Same drafts (tested against the torch path step
after step).
"""

from __future__ import annotations

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch
from tfuture.core.rows import RowAllocator, RowsFull
from tfuture.spec.drafter import DraftContext
from tfuture.spec.ngram_cpu import NGramIndex

__all__ = ["NGramDrafter"]


def _count(name: str, v: object, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < low:
        raise ValueError(f"NGramDrafter({name}=) must be an int >= {low}, got {v!r}")
    return int(v)


class NGramDrafter:
    """Prompt lookup (see the module docstring): ``k`` drafts per request and step.

    Args:
        k: drafts per step (>= 1).
        max_ngram, min_ngram: the longest and shortest suffix matched (``1 <= min <= max``).

    The history (``[max_requests, max_len]`` int64 on the model's device) is allocated by
    :meth:`bind`, which :func:`tfuture.generate` and :class:`tfuture.Engine` call.
    """

    def __init__(self, k: int = 4, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.k = _count("k", k, 1)
        self.max_ngram = _count("max_ngram", max_ngram, 1)
        self.min_ngram = _count("min_ngram", min_ngram, 1)
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"NGramDrafter(min_ngram=) must be <= max_ngram={self.max_ngram}, got {self.min_ngram}"
            )
        self.history: torch.Tensor | None = None
        self._rows = RowAllocator(1)
        self._index = NGramIndex(self.k, self.max_ngram, self.min_ngram)  # a CPU history's lookup

    def __repr__(self) -> str:
        return f"NGramDrafter(k={self.k}, max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    def bind(self, max_requests: int, max_len: int, device: torch.device) -> None:
        if (
            self.history is None
            or self.history.shape != (max_requests, max_len)
            or self.history.device != device
        ):
            with torch.inference_mode(False):
                self.history = torch.zeros(max_requests, max_len, dtype=torch.int64, device=device)
        self._rows = RowAllocator(max_requests)
        self._index.clear()

    def _rows_of(self, req_ids: np.ndarray) -> torch.Tensor:
        assert self.history is not None
        return torch.from_numpy(self._host_rows(req_ids)).to(self.history.device, non_blocking=True)

    def _host_rows(self, req_ids: np.ndarray) -> np.ndarray:
        try:
            rows, _ = self._rows.rows_or_take(req_ids)
        except RowsFull as full:
            raise RuntimeError(
                f"NGramDrafter: request {full.rid} needs a history row and all {self._rows.n} are held "
                "by live requests (bind with max_requests >= the scheduler's max_running)"
            ) from None
        return rows

    def observe(self, fwd: ForwardBatch) -> None:
        hist = self.history
        if hist is None:
            raise RuntimeError("NGramDrafter.bind was not called: the history has no rows yet")
        host = fwd.host
        assert host is not None
        n_tok = host.n_tokens
        if not n_tok:
            return
        if hist.device.type == "cpu":  # numpy: a few microseconds an op instead of several
            if self._index.indexed(host.req_ids):
                return  # the index reads no position of this step from the history (see draft)
            # Not np.clip: its Python wrapper costs more than the two ufuncs.
            pos = np.minimum(np.maximum(fwd.positions[:n_tok].numpy(), 0), hist.shape[1] - 1)
            rows = np.repeat(self._host_rows(host.req_ids), host.seg_lens)
            hist.numpy()[rows, pos] = fwd.input_ids[:n_tok].numpy()
        else:
            self._observe_torch(fwd, n_tok)

    def _observe_torch(self, fwd: ForwardBatch, n_tok: int) -> None:
        """:meth:`observe` in torch ops (a device history)."""
        hist, host = self.history, fwd.host
        assert hist is not None and host is not None
        rows = self._rows_of(host.req_ids)
        lens = torch.from_numpy(host.seg_lens).to(hist.device, non_blocking=True)
        tok_rows = torch.repeat_interleave(rows, lens, output_size=n_tok)
        pos = fwd.positions[:n_tok].clamp(0, hist.shape[1] - 1)
        hist.index_put_((tok_rows, pos), fwd.input_ids[:n_tok].to(torch.int64))

    def draft(self, ctx: DraftContext) -> torch.Tensor:
        hist = self.history
        assert hist is not None
        n = ctx.committed.shape[0]
        dev = hist.device
        if not n:
            return torch.zeros(0, self.k, dtype=torch.int64, device=dev)
        # The CPU index reads no bound: every new length is <= ctx.max_len (the step's plan).
        if dev.type == "cpu":  # an incremental index: a few dict operations a request
            drafts = self._index.draft(
                hist.numpy(),
                ctx.req_ids,
                self._host_rows(ctx.req_ids),
                ctx.committed.numpy(),
                ctx.n_commit.numpy(),
                ctx.seq_lens.numpy(),
            )
            return torch.from_numpy(drafts)
        return self._draft_torch(ctx, min(max(int(ctx.max_len), 1), hist.shape[1]))

    def _draft_torch(self, ctx: DraftContext, bound: int) -> torch.Tensor:
        """:meth:`draft` in torch ops (a device history), ``bound`` positions searched."""
        hist = self.history
        assert hist is not None
        n, width = ctx.committed.shape
        dev, max_len = hist.device, hist.shape[1]
        rows = self._rows_of(ctx.req_ids)
        lens = ctx.seq_lens.clamp(1, max_len)
        # The committed tokens at their positions (entries past n_commit write nothing new:
        # they go to the last committed position again, with its own token).
        j = torch.arange(width, device=dev).unsqueeze(0)
        take = torch.minimum(j, (ctx.n_commit - 1).unsqueeze(1))
        pos = (lens - ctx.n_commit).unsqueeze(1) + take
        toks = ctx.committed.gather(1, take)
        hist.index_put_((rows.unsqueeze(1).expand(n, width), pos.clamp(0, max_len - 1)), toks)
        h = hist.index_select(0, rows)[:, :bound]
        lens = lens.clamp_max(bound)
        last = h.gather(1, (lens - 1).unsqueeze(1))
        cont = torch.full((n,), -1, dtype=torch.int64, device=dev)
        for size in range(self.max_ngram, self.min_ngram - 1, -1):
            if size >= bound:
                continue
            suffix = h.gather(1, (lens.unsqueeze(1) - size + torch.arange(size, device=dev)).clamp_min(0))
            windows = h.unfold(1, size, 1)  # [n, bound - size + 1, size]
            starts = torch.arange(windows.shape[1], device=dev).unsqueeze(0)
            # An earlier occurrence whose continuation starts before the end (not the suffix itself).
            hit = (windows == suffix.unsqueeze(1)).all(dim=2) & (starts + size < lens.unsqueeze(1))
            latest = torch.where(hit, starts, -1).amax(dim=1)
            cont = torch.where((cont < 0) & (latest >= 0), latest + size, cont)
        # The continuation's P = lens - cont tokens, repeated (see the module docstring).
        period = (lens - cont).clamp_min(1).unsqueeze(1)
        at = cont.unsqueeze(1) + torch.remainder(torch.arange(self.k, device=dev).unsqueeze(0), period)
        found = (cont >= 0).unsqueeze(1)
        return torch.where(found, h.gather(1, at.clamp_min(0)), last.expand(n, self.k))

    def release(self, req_ids: np.ndarray) -> None:
        self._rows.release(req_ids)
        self._index.release(req_ids)

    def close(self) -> None:
        self._rows.reset()
        self._index.clear()
