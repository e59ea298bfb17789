"""The speculative half of :class:`tfuture.scheduler.ContinuousBatcher` (``speculative=k``).

A request's step makes ``1 + k`` slots (its last committed token, then ``k`` drafts) and its next
step verifies those drafts; the host learns each step's committed tokens one step late. This mixin
keeps what only speculation needs: how many drafts a request makes, the slots of a request that
waits a step (held in a handle of the batcher's own), the :class:`tfuture.spec.DraftBatch` fields,
the processing of committed runs, cut at a finish the host learned late, and when the next step
waits for the one in flight (every request of it may end there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tfuture.core.batch import Batch
from tfuture.grammars.base import full_bitmask, mask_requests
from tfuture.kernels.bitmask import unpack_bitmask
from tfuture.scheduler.request_state import _Req
from tfuture.spec.batch import DraftBatch, DraftResult

__all__ = ["DraftScheduling"]


class DraftScheduling:
    """Mixed into :class:`tfuture.scheduler.ContinuousBatcher`, which sets these attributes."""

    speculative: int
    multi_step: int
    running: list[_Req]
    extra_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    stop: frozenset[int]  # the batcher's stop tokens (a request's own replace them)
    _take: Callable[[_Req, int, int], None]  # one committed token of a live request

    def _keep(self, r: _Req) -> None:
        """Hold ``r``'s pending slots (its last committed token and drafts) in a handle of the
        batcher's own while ``r`` waits: its step's slots go back once a later step launched."""
        if r.kept is None and r.pending is not None and self.speculative:
            b, row, n = r.pending
            assert b.out is not None
            r.kept = b.out.filter(np.arange(row, row + n, dtype=np.int64))

    def hold_slots(self, batch: Batch) -> None:
        """For a driver that may ask for this scheduler's next batch only after the runtime
        released ``batch.out`` (a pipeline's micro-batch groups, which take turns): every request
        whose latest step is ``batch`` (just processed) holds its slots in a handle of its own."""
        if self.speculative:
            for r in self.running:
                if not r.finished and r.pending is not None and r.pending[0] is batch:
                    self._keep(r)

    @staticmethod
    def _wait_for_flight(rows: list[tuple[_Req, int, bool]]) -> bool:
        """Whether ``schedule`` should return None (the runtime then processes the step in flight
        and asks again) instead of launching ``rows``: every one of them may be the last of its
        request. A request's launched, unprocessed steps (``n_pending``) may already give it its
        last token when, every draft accepted, it would reach its length limit; launching now, a
        run whose every request ends there pays a whole step for tokens past a finish. A stop
        token is never foreseen; without a step in flight nothing waits."""
        return all(
            r.n_pending and len(r.out) + r.n_pending + r.pending_extra >= r.spec.max_new for r, _, _ in rows
        )

    def _drafts(self, r: _Req) -> int:
        """Drafts ``r`` makes per step: none for a request that opted out
        (``RequestSpec.drafts``) or whose grammar matcher cannot roll back (its mask rows walk
        the matcher through the drafts, then undo them)."""
        if not r.spec.drafts or (
            r.matcher is not None and not callable(getattr(r.matcher, "rollback", None))
        ):
            return 0
        return self.speculative

    def _any_drafts(self, rows: list[tuple[_Req, int, bool]]) -> bool:
        """Whether a request of a step of ``rows`` makes drafts (then the step cannot be a
        window). Whether a request drafts never changes, so one that does not has no drafts to
        verify either."""
        return any(self._drafts(r) for r, _, _ in rows)

    def _draft_mask(self, batch: DraftBatch, vocab: int, kind: str) -> np.ndarray:
        """``build_mask`` of a step where waiting requests verify drafts: per waiting request
        (``mask_requests`` order) ``1 + n_verify`` rows, the allowed tokens after its committed
        tokens and after each draft it verifies. A draft its grammar rejects ends the walk (the
        rows after it repeat the one that rejects it, so verification stops there); after the
        grammar's end every token is allowed (tokens past a finish are dropped). The matcher is
        rolled back to where it was: the tokens verification commits are fed to it later."""
        waiting = mask_requests(batch)
        n_verify = batch.n_verify[np.flatnonzero(batch.sample)[waiting]]
        bitmask = full_bitmask(int((1 + n_verify).sum()), vocab)
        at = 0
        for i, v in zip(waiting.tolist(), n_verify.tolist(), strict=True):
            r: _Req = batch.tag[i]
            m = None if r.finished else r.matcher
            if m is not None:
                m.fill_bitmask(bitmask, at)
                if len(r.drafts) < v:
                    raise RuntimeError(
                        f"request {r.spec.rid} verifies {v} drafts but its last step stored {len(r.drafts)}"
                    )
                took, live = 0, True
                for j, d in enumerate(r.drafts[:v]):
                    row = at + 1 + j
                    if not live or not m.accept(d):
                        live = False
                        bitmask[row] = bitmask[row - 1]
                        continue
                    took += 1
                    if m.is_terminated():
                        live = False  # the row stays full: what follows the end is dropped
                        continue
                    m.fill_bitmask(bitmask, row)
                if took:
                    m.rollback(took)  # type: ignore[attr-defined]  # it drafted: _drafts checked
            at += 1 + v
        return bitmask if kind == "bitmask" else unpack_bitmask(bitmask, vocab)

    def _draft_batch(
        self,
        rows: list[tuple[_Req, int, bool]],
        arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        sample_mask: np.ndarray,
        common: dict[str, Any],
        decodes: set[int],
    ) -> tuple[Batch, np.ndarray]:
        """The step's :class:`DraftBatch` (``arrays``: tokens, seg_lens, prefix_lens, req_ids)
        and its ``n_verify``."""
        # A decode verifies the drafts of its last step: every token of its segment but the first.
        tokens, seg_lens, prefix, rids = arrays
        if len(decodes) == len(rows):  # every request decodes (the usual step)
            verify = seg_lens - 1
        else:
            decode = np.fromiter((i in decodes for i in range(len(rows))), dtype=bool, count=len(rows))
            verify = np.where(decode, seg_lens - 1, 0)
        drafts = np.fromiter((self._drafts(r) for r, _, _ in rows), dtype=np.int64, count=len(rows))
        n_draft = np.where(sample_mask, drafts, 0)
        batch = DraftBatch(
            tokens, seg_lens, prefix, rids, sample_mask, **common, n_verify=verify, n_draft=n_draft
        )
        return batch, verify

    def _window_batch(
        self,
        rows: list[tuple[_Req, int, bool]],
        arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        sample_mask: np.ndarray,
        common: dict[str, Any],
    ) -> DraftBatch:
        """A multi-step window: ``multi_step`` decode steps, fewer when no sampling request has
        that many tokens left (the rest would be dropped), one when a sampling request waits for
        a grammar mask (its mask is for one position)."""
        k, delayed = 1, common["delayed"]
        if delayed is False or not np.any(delayed & sample_mask):
            left = [r.spec.max_new - len(r.out) - r.n_pending - r.sure_extra for r, _, s in rows if s]
            k = max(1, min(self.multi_step, max(left, default=1)))
        return DraftBatch(*arrays, sample_mask, **common, n_steps=k)

    def _process_drafts(self, result: DraftResult) -> None:
        """A speculative step or a multi-step window: each request's committed tokens in order,
        up to its finish (the rest were launched past a finish the host learned late: dropped,
        counted)."""
        stored = result.stored
        if stored.size:
            # A waiting request drafted: its next step's mask rows walk its grammar through them.
            kd = 1 + result.batch.n_draft[np.flatnonzero(result.batch.sample)]  # type: ignore[attr-defined]
            for r, first, n in zip(result.batch.tag, (np.cumsum(kd) - kd).tolist(), kd.tolist(), strict=True):
                if r.matcher is not None:
                    r.drafts = tuple(stored[first + 1 : first + n].tolist())
        steps = int(getattr(result.batch, "n_steps", 1))  # a multi-step window's decode steps
        for r, toks, v in zip(result.batch.tag, result.per_request(), result.n_drafted.tolist(), strict=True):
            r.n_pending -= 1
            r.pending_extra -= v + steps - 1
            r.sure_extra -= steps - 1
            if not self.speculative and r.pending is not None and r.pending[0] is result.batch:
                r.pending = None  # a window's: its next one takes the last token from the host
            live = not r.finished
            if live:
                r.drafted += v
                r.accepted += toks.size - steps
                self.drafted_tokens += v
                self.accepted_tokens += toks.size - steps
            got = toks.tolist()
            stop = self.stop if r.spec.stop is None else r.spec.stop
            if live and r.matcher is None and len(r.out) + len(got) < r.spec.max_new and stop.isdisjoint(got):
                # No grammar, no stop token and no length limit among them: of _take's work,
                # only the append is left (a window's tokens in one call).
                r.out.extend(got)
                taken = len(got)
            else:
                taken = 0
                for tok in got:
                    if r.finished:
                        self.extra_tokens += 1
                    else:
                        self._take(r, tok, result.step)
                        taken += 1
            if live:
                # A speculative step is one model step; a window's steps count up to the finish
                # (the ones past it gave this request nothing).
                r.steps += 1 if steps == 1 else taken
