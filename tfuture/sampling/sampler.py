"""The device side of sampling: :class:`Sampler` (plan on the host, the rest on the stream).

Per step: ``plan`` (host) -> ``prepare`` -> ``observe`` -> ``sample`` (once or in parts) ->
``record``, the last four on the forward stream in that order. The penalties read a device
token history (:class:`tfuture.sampling.history.TokenHistory`) that ``record`` updates right
after a step's sample, on the stream, so the next step's sample sees the token even though the
host has not.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
import torch

from tfuture.core.checks import as_count
from tfuture.core.params import PARAM_WORDS, SamplingParams
from tfuture.core.rows import RowAllocator
from tfuture.kernels.bitmask import launch_apply_token_bitmask_
from tfuture.sampling.filters import greedy_tokens, inverse_cdf, sorted_probs
from tfuture.sampling.history import TokenHistory
from tfuture.sampling.plan import (
    R_DRAW,
    R_HIST,
    R_MIN_P,
    R_TEMP,
    R_TOP_K,
    R_TOP_P,
    ROW_FLOATS,
    ROW_WORDS,
    SamplerPlan,
    build_plan,
    largest_input,
    past_vocab,
    request_of,
)

__all__ = ["Sampler", "SamplerState"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_CLAIM_LOCK = threading.Lock()
_PARAM_ROWS = 64  # initial rows of the admitted-parameter table (it doubles when full)


class SamplerState(NamedTuple):
    """One step's device views of ``plan.words`` (made in ``prepare``; no host reads)."""

    plan: SamplerPlan
    block: torch.Tensor | None  # [ROW_WORDS, n_sample] int64, or None (greedy, no penalties)
    rec_idx: torch.Tensor
    rec_rows: torch.Tensor
    obs_idx: torch.Tensor
    obs_rows: torch.Tensor


class Sampler:
    """Per-request sampling on the device: temperature, top-k, top-p, min-p, seeded draws, and
    frequency/presence/repetition penalties from a device-side token history.

    Args:
        history_rows: requests with penalties that may be live at once (device history rows);
            0 refuses penalties with a ``ValueError`` naming the request.
        vocab_size: allocate the history at the first ``prepare`` instead of the first
            ``sample`` (else the vocab is ``logits.shape[1]`` of the first ``sample``). The
            input ids of requests with penalties are checked against the vocab on the host
            (:meth:`check_inputs`; the runtime also takes the model's ``vocab`` attribute).

    Guarantees: a greedy row returns exactly ``argmax`` (lowest index on ties) of its penalised,
    masked logits; a sampled row's token is a function of its logits, its parameters and its
    draw ``uniform_draws(seed, position)`` only, never of the other rows in the step (on CPU
    bit for bit; on CUDA for the same step shapes); penalties count every token sampled before
    the step on the stream, so they are exact under overlap. Nothing here reads a device value
    on the host.
    """

    def __init__(self, *, history_rows: int = 0, vocab_size: int | None = None) -> None:
        self.history_rows = as_count("Sampler(history_rows=)", history_rows)
        if vocab_size is not None and as_count("Sampler(vocab_size=)", vocab_size) < 1:
            raise ValueError(f"Sampler(vocab_size=) must be >= 1, got {vocab_size}")
        self._rows = RowAllocator(self.history_rows, first=1)  # history rows (host bookkeeping)
        # Admitted requests' packed parameters, by row (host); row 0: the defaults (greedy).
        self._param_rows = RowAllocator(_PARAM_ROWS, first=1)
        self._params = np.zeros((_PARAM_ROWS + 1, PARAM_WORDS), dtype=np.int64)
        self._params[0] = SamplingParams().pack()
        # Forward-stream state from here on.
        self.vocab: int | None = vocab_size
        self.history = TokenHistory(self.history_rows)
        self._arange: torch.Tensor | None = None
        self._zeros: dict[torch.dtype, torch.Tensor] = {}
        self._owner: object | None = None
        # (request id, token id): the largest input id of a request with penalties planned
        # before the vocab was known, checked when the first logits give it (check_inputs).
        self._vocab_lock = threading.Lock()
        self._unchecked: tuple[int, int] | None = None

    @property
    def counts(self) -> torch.Tensor | None:
        """The device history's output counts, ``[history_rows + 2, vocab]`` int32 (None
        before the vocab is known)."""
        return self.history.counts

    @property
    def seen(self) -> torch.Tensor | None:
        """The device history's seen flags, ``[history_rows + 2, vocab]`` bool."""
        return self.history.seen

    # ----------------------------------------------------------------------------- host
    def claim(self, owner: object) -> None:
        """HOST: ``owner`` (a runtime's step) samples with this Sampler until :meth:`unclaim`.

        The device history belongs to one run at a time: a second owner while the first one
        runs raises ``RuntimeError`` (its rows would be freed and zeroed under the first one)."""
        if self._owner is owner:
            return
        with _CLAIM_LOCK:
            if self._owner is not None:
                raise RuntimeError(
                    "this Sampler is in use by another running runtime: a Sampler's device history "
                    "serves one run at a time (give each runtime its own Sampler)"
                )
            self._owner = owner

    def unclaim(self, owner: object) -> bool:
        """HOST, after ``owner``'s run ended (the stream drained): free every history row and
        give the Sampler back. False (nothing done) if ``owner`` does not hold it."""
        with _CLAIM_LOCK:
            if self._owner is not owner:
                return False
            self.reset()
            self._owner = None
            return True

    def plan(
        self,
        params: np.ndarray | None,
        req_ids: np.ndarray,
        seg_lens: np.ndarray,
        prefix_lens: np.ndarray,
        sample_reqs: np.ndarray,
        ended: np.ndarray,
        step: int,
    ) -> SamplerPlan:
        """HOST, once per step: decide the stages, assign history rows, pack ``words``.

        Args:
            params: ``[n_reqs, PARAM_WORDS]`` int64 packed rows of every request in the batch
                (checked ones: :func:`check_packed_params`), or None (all greedy, no penalties).
                A request's parameters must stay the same over its life.
            req_ids, seg_lens, prefix_lens: ``[n_reqs]`` int64, the batch's.
            sample_reqs: ``[n_sample]`` int64, ascending indices of the requests that sample.
            ended: request ids that appear in no step from this one on: their rows are freed
                first and may be reused (and zeroed on the stream) in this very step.
            step: the step number (for messages).

        The draw of a sampling request is ``uniform_draws(seed, prefix_len + seg_len)``. If a
        plan's step is never launched (its ``prepare`` never runs), call :meth:`reset` before
        planning again: rows it assigned would otherwise not be zeroed.
        """
        return build_plan(self._rows, params, req_ids, seg_lens, prefix_lens, sample_reqs, ended, step)

    def admit(self, params: dict[int, SamplingParams]) -> None:
        """HOST: requests that start now, with their parameters, packed once into the request's
        row of the parameter table (requests never admitted sample greedily, without
        penalties). A request keeps its parameters until it ends (``ended`` of a later plan).
        An id that is already live raises ``ValueError`` (request ids are unique while live)."""
        if not params:
            return
        rows = self._param_rows
        if rows.n_free < len(params):
            extra = max(rows.n, len(params))
            rows.grow(extra)
            self._params = np.concatenate([self._params, np.zeros((extra, PARAM_WORDS), dtype=np.int64)])
        ids = list(params)
        for rid, row in zip(ids, rows.take(ids), strict=True):
            self._params[row] = params[rid].pack()

    def plan_step(
        self,
        admitted: dict[int, SamplingParams] | None,
        req_ids: np.ndarray,
        seg_lens: np.ndarray,
        prefix_lens: np.ndarray,
        sample_reqs: np.ndarray,
        ended: np.ndarray,
        step: int,
    ) -> SamplerPlan:
        """HOST: :meth:`plan` with the parameters of the requests admitted now (``admitted``,
        see :meth:`admit`) or earlier; ``ended`` requests give their rows back first."""
        rows = self._param_rows
        if ended.size and rows.held:
            rows.release(ended)
        if admitted:
            self.admit(admitted)
        params = self._params[rows.rows(req_ids, default=0)] if rows.held else None
        return build_plan(self._rows, params, req_ids, seg_lens, prefix_lens, sample_reqs, ended, step)

    def check_inputs(
        self,
        plan: SamplerPlan,
        tokens: np.ndarray,
        req_ids: np.ndarray,
        seg_lens: np.ndarray,
        vocab: int | None = None,
    ) -> None:
        """HOST, after :meth:`plan_step`: refuse (``ValueError`` naming the request, the id and
        the vocab) a concrete input id (``>= 0``; placeholders are sampled ids) of a request
        with penalties that is past the vocab: its seen mark would index past the history.

        ``tokens`` ``[n_tokens]``, ``req_ids``, ``seg_lens`` ``[n_reqs]`` int64: the batch's.
        The vocab: this Sampler's (``vocab_size``, or the first logits'), else ``vocab`` (the
        model's, when it says). While neither is known the largest such id is kept and checked
        when the first logits give the vocab (then the run fails on the forward stream, with
        the same message). Costs nothing in a step without penalties."""
        if not plan.sizes[3]:
            return
        row, top = largest_input(plan, tokens)
        limit = self.vocab if self.vocab is not None else vocab
        if limit is not None and top < limit:
            return
        rid = request_of(row, req_ids, seg_lens)
        if limit is None:
            with self._vocab_lock:  # the forward stream sets the vocab under it
                if self.vocab is None:
                    if self._unchecked is None or top > self._unchecked[1]:
                        self._unchecked = (rid, top)
                    return
                limit = self.vocab
        if top >= limit:
            raise ValueError(past_vocab(rid, top, limit, plan.step))

    def packed_params(self, req_ids: np.ndarray) -> np.ndarray:
        """HOST: ``[n, PARAM_WORDS]`` int64, the packed parameters of live ``req_ids`` (admitted
        ones; the greedy defaults for the others), as :meth:`plan_step` reads them."""
        rows = self._param_rows
        return self._params[rows.rows(req_ids, default=0) if rows.held else np.zeros(req_ids.size, np.int64)]

    def history_rows_of(self, req_ids: np.ndarray) -> np.ndarray:
        """HOST: ``[n]`` int64 device history rows of ``req_ids`` (0: none), as assigned by the
        last :meth:`plan_step`."""
        return self._rows.rows(req_ids, default=0)

    def reset(self) -> None:
        """HOST, after a run (the stream drained): free every history and parameter row. The
        tables stay allocated; a history row is zeroed when it is assigned again."""
        self._rows.reset()
        self._param_rows.reset()
        self.history.forget_pending()
        self._unchecked = None

    @property
    def live_rows(self) -> int:
        """History rows held by live requests (host bookkeeping)."""
        return len(self._rows.held)

    # ------------------------------------------------------------------- forward stream
    def prepare(self, plan: SamplerPlan, words: torch.Tensor) -> SamplerState:
        """FORWARD STREAM: views of ``words`` (the device copy of ``plan.words``, int64) and the
        zeroing of this step's newly assigned history rows."""
        if not isinstance(plan, SamplerPlan):
            raise TypeError(f"plan must be a SamplerPlan, got {type(plan).__name__}")
        if not isinstance(words, torch.Tensor) or words.dtype != torch.int64 or words.dim() != 1:
            got = f"{words.dtype} {tuple(words.shape)}" if isinstance(words, torch.Tensor) else type(words)
            raise ValueError(f"words must be the 1-D int64 device copy of plan.words, got {got}")
        if words.numel() != plan.words.size:
            raise ValueError(
                f"words must hold plan.words.size = {plan.words.size} words, got {words.numel()}"
            )
        blk, rec_idx, rec_rows, obs_idx, obs_rows, new = words.split(plan.sizes)
        block = blk.view(ROW_WORDS, plan.n_sample) if plan.sizes[0] else None
        if plan.sizes[5]:
            self.history.ensure(self.vocab, words.device)
            self.history.zero(plan.new_rows, new)
        return SamplerState(plan, block, rec_idx, rec_rows, obs_idx, obs_rows)

    def observe(self, state: SamplerState, input_ids: torch.Tensor) -> None:
        """FORWARD STREAM, after ``prepare``: mark the step's input tokens of requests with
        history rows as seen. ``input_ids [n_rows]`` int, resolved; rows past the real tokens
        are never read. Launches nothing when no request of the step has penalties."""
        if not state.plan.sizes[3]:
            return
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
            raise ValueError(f"input_ids must be a 1-D tensor, got {type(input_ids).__name__}")
        tokens = input_ids.index_select(0, state.obs_idx)
        if tokens.dtype != torch.int64:
            tokens = tokens.long()
        if self.vocab is not None and not tokens.is_cuda and int(tokens.max()) >= self.vocab:
            raise ValueError(
                f"step {state.plan.step}: an input token id {int(tokens.max())} of a request with "
                f"penalties is past the vocab of {self.vocab} (a prompt id the model does not have)"
            )
        self.history.ensure(self.vocab, input_ids.device)
        self.history.mark_seen(state.plan.obs_rows, state.obs_rows, tokens)

    def sample(
        self,
        state: SamplerState,
        logits: torch.Tensor,
        rows: torch.Tensor | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """FORWARD STREAM: int64 ``[m]`` tokens for ``m`` of the step's sampling rows.

        Args:
            logits: ``[m, V]`` float16/bfloat16/float32/float64; never modified.
            rows: int64 ``[m]`` device indices into ``0..n_sample-1`` (None: all rows, in order).
            bitmask: None or int32 ``[m, ceil(V/32)]``, bit ``j`` of word ``w`` allows token
                ``32*w + j``.

        Order: penalties (repetition, frequency, presence), the bitmask, then greedy rows take
        the argmax and the others: ``/ temperature``, top-k, top-p, min-p, inverse CDF with the
        row's draw over the kept tokens (stable sort: same inputs, same token). Math runs in
        float64 for float64 logits, else float32.
        """
        plan = state.plan
        m, vocab = self._check_logits(logits, plan, rows)
        if not (plan.sampled or plan.penalized or bitmask is not None):
            return greedy_tokens(logits)
        if m == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        block = state.block
        if block is not None and rows is not None:
            block = block.index_select(1, rows)
        work = torch.float64 if logits.dtype == torch.float64 else torch.float32
        floats = None
        if block is not None:
            floats = block[:ROW_FLOATS].view(torch.float64)
            if work != torch.float64:
                floats = floats.to(work)
        x = logits
        if plan.penalized:
            assert block is not None and floats is not None
            x = self.history.penalise(x.to(work), floats, block[R_HIST], plan)
        if bitmask is not None:
            _check_bitmask(bitmask, m, vocab, logits.device)
            if x is logits:
                x = logits.to(work, copy=True)
            # x is a copy of our own, with rows made contiguous here (a copy keeps the caller's
            # strides): the bitmask was checked above, so the unchecked launch.
            x = x.contiguous()
            launch_apply_token_bitmask_(x, bitmask)
        if not plan.sampled:
            return greedy_tokens(x)
        assert block is not None and floats is not None
        return self._draw(x, floats, block[R_TOP_K], plan, vocab)

    def record(self, state: SamplerState, tokens: torch.Tensor) -> None:
        """FORWARD STREAM, after the step's last ``sample``: count ``tokens`` (int64
        ``[n_sample]``, in ``sample_reqs`` order) in the outputs of requests with history rows.
        Launches nothing when no sampling row has penalties."""
        n = state.plan.sizes[1]
        if not n:
            return
        if not isinstance(tokens, torch.Tensor) or tokens.shape != (state.plan.n_sample,):
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"record expects [{state.plan.n_sample}] tokens, got {got}")
        picked = tokens.index_select(0, state.rec_idx)
        if picked.dtype != torch.int64:
            picked = picked.long()
        self.history.count(state.rec_rows, picked)

    # ------------------------------------------------------------------------ internals
    def _check_logits(self, logits: object, plan: SamplerPlan, rows: object) -> tuple[int, int]:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in _FLOATS:
            got = (
                f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else type(logits)
            )
            raise ValueError(f"logits must be a 2-D float tensor [m, vocab], got {got}")
        m, vocab = logits.shape
        if rows is None:
            if m != plan.n_sample:
                raise ValueError(f"logits must have n_sample = {plan.n_sample} rows (rows=None), got {m}")
        elif not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.shape != (m,):
            got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows)
            raise ValueError(f"rows must be an int64 [{m}] tensor (one per logits row), got {got}")
        if self.vocab is None:
            with self._vocab_lock:
                self.vocab, unchecked, self._unchecked = vocab, self._unchecked, None
            if unchecked is not None and unchecked[1] >= vocab:
                raise ValueError(past_vocab(*unchecked, vocab, plan.step))
        elif vocab != self.vocab:
            raise ValueError(
                f"logits have vocab {vocab} but this Sampler's history was made for {self.vocab}"
            )
        if self.history_rows:
            self.history.ensure(vocab, logits.device)
        return m, vocab

    def _draw(
        self, x: torch.Tensor, floats: torch.Tensor, top_k: torch.Tensor, plan: SamplerPlan, vocab: int
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then inverse-CDF sampling with each row's draw."""
        x = x / floats[R_TEMP].unsqueeze(1)
        p, order = sorted_probs(
            x,
            top_k if plan.top_k else None,
            floats[R_TOP_P] if plan.top_p else None,
            floats[R_MIN_P] if plan.min_p else None,
            self._columns(vocab, x.device),
        )
        # A row whose filtered probabilities are not a distribution (a NaN or +inf logit, or -inf
        # on every allowed token) has no token to give: -1 marks it (no sync; the host raises).
        return inverse_cdf(p, order, floats[R_DRAW], self._zero(p))

    def _zero(self, like: torch.Tensor) -> torch.Tensor:
        """A cached 0-dim zero of ``like``'s dtype and device (no fill launched per step)."""
        zero = self._zeros.get(like.dtype)
        if zero is None or zero.device != like.device:
            zero = self._zeros[like.dtype] = like.new_zeros(())
        return zero

    def _columns(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._arange is None or self._arange.numel() != vocab or self._arange.device != device:
            self._arange = torch.arange(vocab, device=device)
        return self._arange


def _check_bitmask(bitmask: object, m: int, vocab: int, device: torch.device) -> None:
    words = -(-vocab // 32)
    ok = isinstance(bitmask, torch.Tensor) and bitmask.dtype == torch.int32 and bitmask.shape == (m, words)
    if not ok:
        got = (
            f"{bitmask.dtype} {tuple(bitmask.shape)}" if isinstance(bitmask, torch.Tensor) else type(bitmask)
        )
        raise ValueError(f"bitmask must be int32 [{m}, {words}] (ceil(vocab / 32) words a row), got {got}")
    assert isinstance(bitmask, torch.Tensor)
    if bitmask.device != device:
        raise ValueError(f"bitmask is on {bitmask.device} but logits are on {device}")
    if words > 1 and bitmask.stride(1) != 1:
        raise ValueError(
            f"bitmask must have contiguous rows (stride(1) == 1), got strides {bitmask.stride()}"
        )
