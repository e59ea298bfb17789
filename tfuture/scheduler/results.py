"""What :class:`tfuture.scheduler.ContinuousBatcher` does with a processed step: :class:`TokenResults`.

Each sampled token of a live request goes through its grammar's matcher (a token the mask allowed
but the matcher rejects stops the run: the mask path is broken), into its output, and may finish
it: a stop token (``"stop"``), its matcher terminated on another token (``"grammar"``), its length
limit (``"length"``), or an output its matcher accepted and then found invalid (``"invalid"``, with
a ``RuntimeWarning``: xgrammar #800). A token for a request that already finished (the extra step
of overlap) is counted in ``extra_tokens`` and dropped. A speculative step's committed runs go to
:meth:`tfuture.scheduler.drafting.DraftScheduling._process_drafts`. The masks of a step's delayed
requests come from :meth:`TokenResults.build_mask`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from tfuture.core.batch import Batch, StepResult
from tfuture.core.future_map import FutureMap
from tfuture.grammars.base import Matcher, build_bitmask, invalid_output, mask_requests
from tfuture.scheduler.request_state import _Req
from tfuture.spec.batch import DraftBatch, DraftResult

__all__ = ["TokenResults"]


class TokenResults:
    """Mixed into :class:`tfuture.scheduler.ContinuousBatcher`, which sets these attributes (see
    the module docstring)."""

    fmap: FutureMap
    vocab: int | None
    mask: str
    stop: frozenset[int]
    host_work_s: float
    _host_work: Callable[[float], object]
    extra_tokens: int
    outputs: dict[int, list[int]]
    finish_reasons: dict[int, str]
    _process_drafts: Callable[[DraftResult], None]
    _draft_mask: Callable[[DraftBatch, int, str], np.ndarray]

    def process(self, result: StepResult) -> None:
        if self.host_work_s > 0:
            self._host_work(self.host_work_s)
        if isinstance(result, DraftResult):
            self._process_drafts(result)
            return
        for r, tok in zip(result.batch.tag, result.tokens.tolist(), strict=True):
            r.n_pending -= 1
            if r.pending is not None and r.pending[0] is result.batch:
                r.pending = None
            if r.finished:
                self.extra_tokens += 1
                continue
            r.steps += 1
            self._take(r, tok, result.step)

    def _take(self, r: _Req, tok: int, step: int) -> None:
        """One sampled token of a live request: its grammar, its output, its finish."""
        m = r.matcher
        if m is not None and not m.accept(tok):
            # The mask allowed it, so the sampler or the mask path is broken: never go on.
            raise RuntimeError(
                f"request {r.spec.rid}: its grammar rejects token {tok} sampled at step {step} "
                f"(after {len(r.out)} generated token(s)): the mask was not applied"
            )
        r.out.append(tok)
        stop = self.stop if r.spec.stop is None else r.spec.stop
        if tok in stop:
            self._finish(r, "stop" if m is None else self._checked(r, m, "stop"))
        elif m is not None and m.is_terminated():
            self._finish(r, self._checked(r, m, "grammar"))
        elif len(r.out) >= r.spec.max_new:
            self._finish(r, "length")

    @staticmethod
    def _checked(r: _Req, m: Matcher, reason: str) -> str:
        """``reason``, or ``"invalid"`` (with a warning) when the matcher says that the output it
        accepted is not in its grammar's language after all (xgrammar #800)."""
        why = invalid_output(m)
        if why is None:
            return reason
        warnings.warn(f"request {r.spec.rid}: {why}; finish reason 'invalid'", RuntimeWarning, stacklevel=2)
        return "invalid"

    def _finish(self, r: _Req, reason: str) -> None:
        """``r`` finished (``reason``: one of :data:`FINISH_REASONS`): it leaves the running set at
        the next :meth:`schedule`, which reports it in ``Batch.ended``; a token still in flight
        for it is discarded (the extra step)."""
        r.finished, r.reason = True, reason
        if r.kept is not None:
            self.fmap.release(r.kept)
            r.kept = None
        self.outputs[r.spec.rid] = r.out
        self.finish_reasons[r.spec.rid] = reason

    def build_mask(self, batch: Batch) -> np.ndarray:
        """The mask of the batch's delayed sampling requests (all of them for ``delayed=True``), in
        batch order: int32 ``[m, ceil(vocab / 32)]`` (``mask="bitmask"``) or bool ``[m, vocab]``.
        A request without a grammar, or one that already finished (the extra step), allows all."""
        if self.vocab is None:
            raise RuntimeError("build_mask called on a ContinuousBatcher without grammar requests")
        if isinstance(batch, DraftBatch) and batch.n_verify.any():
            return self._draft_mask(batch, self.vocab, self.mask)
        tag = batch.tag
        matchers = [None if tag[i].finished else tag[i].matcher for i in mask_requests(batch).tolist()]
        return build_bitmask(matchers, self.vocab, self.mask)
