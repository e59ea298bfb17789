"""The host side of a sampling step: history rows, and the one int64 word array for the device.

``build_plan`` runs on the host once per step. It decides every stage the step needs (so the
device never reads a value to decide), assigns device history rows to requests with penalties,
computes each sampling row's uniform draw, and packs all of it into ``SamplerPlan.words``, which
the runtime stages into the step's single host-to-device copy. Layout of ``words`` (int64):

``[ rows block ROW_WORDS x n_sample | rec_idx | rec_rows | obs_idx | obs_rows | new_rows ]``

* rows block (present when a row samples or has penalties), one column per sampling row:
  ``R_TEMP, R_TOP_P, R_MIN_P, R_FREQ, R_PRES, R_REP, R_DRAW`` as float64 bits, then ``R_TOP_K``
  and ``R_HIST`` as int64. A stage that is off for a row holds its exact no-op value (top_p
  ``inf``, min_p 0, top_k ``INT64_MAX``, history row 0), and a greedy row holds temperature 1 and
  top_k 1, so a row's token never depends on which other rows share the step.
* ``rec_idx``/``rec_rows``: sampling rows with a history row, and that row (``record``).
* ``obs_idx``/``obs_rows``: input token rows of requests with a history row, and that row
  (``observe``); only real tokens, never padding.
* ``new_rows``: history rows assigned this step, zeroed on the forward stream in ``prepare``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tfuture.core.params import (
    FREQUENCY,
    GREEDY_BELOW,
    N_FLOATS,
    PARAM_WORDS,
    PRESENCE,
    REPETITION,
    SEED,
    TEMPERATURE,
    TOP_K,
)
from tfuture.core.rows import RowAllocator, RowsFull
from tfuture.sampling.draws import draws_unchecked

R_TEMP, R_TOP_P, R_MIN_P, R_FREQ, R_PRES, R_REP, R_DRAW, R_TOP_K, R_HIST = range(9)
ROW_WORDS = 9
ROW_FLOATS = 7  # rows 0..6 of the block are float64 bit patterns
K_OFF = np.iinfo(np.int64).max
_NONE = np.empty(0, dtype=np.int64)
_NO_PENALTY = np.array([0.0, 0.0, 1.0])  # frequency, presence, repetition: off


class SamplerPlan(NamedTuple):
    """One step's sampling work, decided on the host.

    ``words``: 1-D int64, everything the device needs (layout in the module docstring);
    ``sizes``: words per part (rows block, rec_idx, rec_rows, obs_idx, obs_rows, new_rows);
    ``n_sample``: sampling rows this step. Stage flags (False: the stage launches nothing):
    ``sampled`` (some row is not greedy), ``top_k``, ``top_p``, ``min_p``, ``penalized`` (some
    sampling row has a history row), ``repetition``, ``counts`` (frequency or presence).
    """

    words: np.ndarray
    sizes: tuple[int, int, int, int, int, int]
    n_sample: int
    step: int
    sampled: bool = False
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    penalized: bool = False
    repetition: bool = False
    counts: bool = False

    @property
    def new_rows(self) -> np.ndarray:
        """History rows zeroed by this step's ``prepare`` (host copy)."""
        return self.words[self.words.size - self.sizes[5] :]

    @property
    def obs_idx(self) -> np.ndarray:
        """Input row (index into the batch's tokens) of each observed input token (host copy)."""
        start = self.sizes[0] + self.sizes[1] + self.sizes[2]
        return self.words[start : start + self.sizes[3]]

    @property
    def obs_rows(self) -> np.ndarray:
        """History row of each observed input token (host copy)."""
        end = self.words.size - self.sizes[5]
        return self.words[end - self.sizes[4] : end]


def _exhausted(n: int, rid: int, packed: np.ndarray) -> str:
    f = packed[:N_FLOATS].view(np.float64).tolist()
    asks = (
        f"frequency_penalty={f[FREQUENCY]!r}, presence_penalty={f[PRESENCE]!r}, "
        f"repetition_penalty={f[REPETITION]!r}"
    )
    if n == 0:
        return (
            f"request {rid} asks for penalties ({asks}) but the Sampler has history_rows=0: pass "
            "Sampler(history_rows=N), N = the most requests with penalties live at once"
        )
    return (
        f"request {rid} asks for penalties ({asks}) but all history_rows={n} device history rows "
        "are held by live requests with penalties (rows free when a request is listed in ended)"
    )


def largest_input(plan: SamplerPlan, tokens: np.ndarray) -> tuple[int, int]:
    """``(row in tokens, token id)`` of the largest input id the plan observes (it has some)."""
    obs = plan.obs_idx
    ids = tokens[obs]
    at = int(ids.argmax())
    return int(obs[at]), int(ids[at])


def request_of(row: int, req_ids: np.ndarray, seg_lens: np.ndarray) -> int:
    """The request id whose segment holds token ``row`` of the batch."""
    return int(req_ids[int(np.searchsorted(np.cumsum(seg_lens), row, side="right"))])


def past_vocab(rid: int, token: int, vocab: int, step: int) -> str:
    """The refusal of an input id past the vocab, for a request with penalties."""
    return (
        f"step {step}: request {rid} has input token id {token}, past the vocab of {vocab} (ids "
        f"0..{vocab - 1}); a request with penalties marks its inputs in a [*, {vocab}] history"
    )


def greedy_plan(n_sample: int, step: int) -> SamplerPlan:
    """The plan of a step without parameters: every row takes the argmax; no words."""
    return SamplerPlan(_NONE, (0, 0, 0, 0, 0, 0), n_sample, step)


def build_plan(
    rows: RowAllocator,
    params: np.ndarray | None,
    req_ids: np.ndarray,
    seg_lens: np.ndarray,
    prefix_lens: np.ndarray,
    sample_reqs: np.ndarray,
    ended: np.ndarray,
    step: int,
) -> SamplerPlan:
    """The host plan of one step (see :meth:`tfuture.sampling.Sampler.plan`)."""
    if ended.size:
        rows.release(ended)
    n_reqs, n_sample = req_ids.size, sample_reqs.size
    if params is None:
        return greedy_plan(n_sample, step)
    if (
        not isinstance(params, np.ndarray)
        or params.dtype != np.int64
        or params.shape != (n_reqs, PARAM_WORDS)
    ):
        got = f"{params.dtype} {params.shape}" if isinstance(params, np.ndarray) else type(params).__name__
        raise ValueError(
            f"step {step}: packed sampling params must be int64 of shape ({n_reqs}, {PARAM_WORDS}), got {got}"
        )
    floats = params[:, :N_FLOATS].view(np.float64)
    # Requests with penalties: any of frequency, presence, repetition off its no-op value.
    hist, pen = None, _NONE
    new: list[int] = []
    if np.count_nonzero(floats[:, FREQUENCY:] != _NO_PENALTY):  # one test for the common case
        pen = np.flatnonzero(
            (floats[:, FREQUENCY] != 0) | (floats[:, PRESENCE] != 0) | (floats[:, REPETITION] != 1)
        )
        hist = np.zeros(n_reqs, dtype=np.int64)
        try:
            hist[pen], new = rows.rows_or_take(req_ids[pen])
        except RowsFull as full:
            at = int(pen[int(np.flatnonzero(req_ids[pen] == full.rid)[0])])
            raise ValueError(_exhausted(rows.n, full.rid, params[at])) from None

    sp = params[sample_reqs]  # [n_sample, PARAM_WORDS], a copy
    fs, k = sp[:, :N_FLOATS].view(np.float64), sp[:, TOP_K]
    greedy = (fs[:, TEMPERATURE] < GREEDY_BELOW) | (k == 1)
    n_greedy = int(np.count_nonzero(greedy))
    hs = hist[sample_reqs] if hist is not None else None
    rec_idx = np.flatnonzero(hs) if hs is not None else _NONE
    sampled, penalized = n_greedy < n_sample, rec_idx.size > 0
    flags: dict[str, bool] = {"sampled": sampled, "penalized": penalized}
    block = _NONE
    if sampled or penalized:
        blk = np.empty((ROW_WORDS, n_sample), dtype=np.int64)
        bf = blk[:ROW_FLOATS].view(np.float64)
        # Rows R_TEMP..R_REP are the packed floats in the same order; then the no-op values.
        bf[:N_FLOATS] = fs.T
        blk[R_TOP_K] = k
        if n_greedy:
            bf[R_TEMP, greedy], bf[R_MIN_P, greedy], blk[R_TOP_K, greedy] = 1.0, 0.0, 1
        top_p, top_k = bf[R_TOP_P], blk[R_TOP_K]
        p_off = (top_p >= 1) | greedy
        top_p[p_off] = np.inf
        top_k[top_k == 0] = K_OFF
        if sampled:
            s = sample_reqs
            bf[R_DRAW] = draws_unchecked(sp[:, SEED], prefix_lens[s] + seg_lens[s])
        else:
            bf[R_DRAW] = 0.0
        blk[R_HIST] = 0 if hs is None else hs
        block = blk.reshape(-1)
        # np.count_nonzero: a C call, several times cheaper than ndarray.any() on small arrays.
        flags["top_p"] = int(np.count_nonzero(p_off)) < n_sample
        flags["min_p"] = int(np.count_nonzero(bf[R_MIN_P])) > 0
        flags["top_k"] = int(np.count_nonzero(top_k != K_OFF)) > 0  # greedy rows (top_k 1) need it too
        if penalized:
            on = fs[rec_idx]
            flags["repetition"] = int(np.count_nonzero(on[:, REPETITION] != 1)) > 0
            flags["counts"] = int(np.count_nonzero(on[:, FREQUENCY:REPETITION])) > 0

    obs_idx = obs_rows = _NONE
    if hist is not None:
        lens = seg_lens[pen]
        starts = np.cumsum(seg_lens)[pen] - lens
        if int(lens.max()) == 1:  # decodes only: one input row each
            obs_idx, obs_rows = starts, hist[pen]
        else:
            ends = np.cumsum(lens)
            obs_idx = np.repeat(starts - (ends - lens), lens) + np.arange(int(ends[-1]), dtype=np.int64)
            obs_rows = np.repeat(hist[pen], lens)
    rec_rows = hs[rec_idx] if hs is not None else _NONE
    parts = (block, rec_idx, rec_rows, obs_idx, obs_rows, np.array(new, dtype=np.int64) if new else _NONE)
    sizes = (block.size, rec_idx.size, rec_rows.size, obs_idx.size, obs_rows.size, len(new))
    words = np.concatenate(parts) if block.size or obs_idx.size else _NONE
    return SamplerPlan(words, sizes, n_sample, step, **flags)
