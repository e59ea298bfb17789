"""A speculative step's record and the host's reading of its results.

:class:`SpecState` is what :class:`tfuture.spec.SpecTokenStep` keeps of a step between its plan and
its result: the token step's record plus the verification's host plan. :class:`SpecResults` is the
step's host side after its copy is done: the words it copies back (each sampling request's
committed tokens, their count, and the stored drafts where a waiting request drafted) and the
checked :class:`tfuture.spec.DraftResult` made from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tfuture.core.batch import Batch, StepResult
from tfuture.spec.batch import DraftResult, check_committed
from tfuture.spec.penalties import PenaltyPlan
from tfuture.spec.verify import RowParams
from tfuture.steps.base import InFlight
from tfuture.steps.token_state import TokenState, _arange

__all__ = ["SpecResults", "SpecState"]

_NONE = np.empty(0, dtype=np.int64)


class SpecState(TokenState):
    """A speculative step's record: the token step's, plus the verification's host plan."""

    inputs: Any = None  # the step's DraftInputs (device views), set by prepare
    rp: RowParams | None = None
    width: int = 1
    n_verify: np.ndarray = _NONE  # [n_sample] drafts each sampling request verifies
    pen: PenaltyPlan | None = None
    max_len: int = 0
    n_out: int = 0  # the step's fresh slots: a last committed token and k drafts a request
    n_stored: int = 0  # of those, read back to the host (a waiting request drafted): 0 or n_out
    mask_vrows: np.ndarray = _NONE  # the verification row of each mask row
    verified: Any = None
    new_len: torch.Tensor | None = None
    store_tokens: torch.Tensor | None = None


class SpecResults:
    """The result half of :class:`tfuture.spec.SpecTokenStep` (its base): what a step copies back
    and the :class:`DraftResult` the host makes of it. ``_vocab`` is the step's vocab, once known."""

    _vocab: int | None

    def n_result(self, rec: InFlight) -> int:
        state: SpecState = rec.state
        return state.n_sample * (state.width + 1) + state.n_stored

    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        state: SpecState = rec.state
        v = state.verified
        if v is None:
            return
        n, w = state.n_sample, state.width
        dst[: n * w].view(n, w).copy_(v.committed, non_blocking=True)
        dst[n * w : n * (w + 1)].copy_(v.n_commit, non_blocking=True)
        if state.n_stored:
            assert state.store_tokens is not None
            dst[n * (w + 1) :].copy_(state.store_tokens, non_blocking=True)

    def result_array(self, rec: InFlight) -> np.ndarray | None:
        return None

    def result(self, rec: InFlight, words: np.ndarray) -> DraftResult:
        return self.draft_result(rec.step, rec.batch, rec.state, words)

    def draft_result(self, step: int, batch: Batch, state: SpecState, words: np.ndarray) -> DraftResult:
        """HOST: step ``step``'s committed tokens and counts (``words``), checked."""
        n, w = state.n_sample, state.width
        committed = words[: n * w].reshape(n, w)
        counts = words[n * w : n * (w + 1)].astype(np.int64, copy=False)
        tokens = committed[_arange(w) < counts[:, None]]
        check_committed(
            step,
            batch,
            state.sample_reqs,
            tokens,
            self._vocab,
            lambda t: int(np.searchsorted(np.cumsum(counts), t, "right")),
        )
        stored = words[n * (w + 1) :].astype(np.int64) if state.n_stored else _NONE
        return DraftResult(step, batch, tokens, counts, state.n_verify, stored)

    def n_tokens(self, result: StepResult) -> int:
        return int(result.tokens.size)
