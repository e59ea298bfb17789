"""A speculative step's host plan: its verification rows, slots and parameters, staged.

:func:`stage_drafts` turns a checked batch (a :class:`tfuture.spec.DraftBatch`, or a plain one:
no drafts) and the token step's own staged arrays into :data:`DraftInputs`, the step's one
staging (the runtime copies it to the device in one go), plus the host state the stream ops
need. Host numpy only; nothing here reads a device value.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from tfuture.core.batch import Batch
from tfuture.sampling.plan import SamplerPlan
from tfuture.spec.penalties import PenaltyPlan, drop_observations, plan_penalties
from tfuture.spec.verify import GREEDY_ROWS, RowParams, row_params
from tfuture.steps.token_state import TokenInputs

__all__ = ["DRAFT_FIELDS", "DraftInputs", "DraftPlan", "stage_drafts"]

_NONE = np.empty(0, dtype=np.int64)

#: The speculative step's staged arrays, after the token step's own (:class:`TokenInputs`):
#: ``vrows [R]`` the verification rows (token rows), request by request; ``draft_src [R]`` the
#: token row of the draft each row checks (itself at a last row); ``is_draft [R]`` 1 at rows
#: that check a draft; ``pad_pos [R]`` ``i * width + j``; ``spec_reqs [S]`` the requests that
#: verify, ``spec_slots [S]`` the slot of each one's first input (its ``seq_len`` field),
#: ``spec_prefix [S]`` the host's prefix bound of each, ``spec_tok [T]`` their segments' token
#: rows and ``spec_tok_of [T]`` which of the S each belongs to; per sampling request
#: ``n_verify`` and ``sample_idx`` (its index in the batch); ``out_req [n_out]`` the sampling
#: request of each out slot, ``out_first [n_sample]`` each one's first slot (its last committed
#: token), ``out_draft [D]`` the slots that take drafts and ``draft_at [D]`` their index into
#: the drafter's flat ``[n_sample * k]`` drafts; ``params`` (``[3 * R]`` float64 bits, ``[R]``
#: top_k, ``[R]`` seeds, when a row samples), ``penalties`` (:class:`PenaltyPlan` words) and
#: ``hist_req [n_sample]`` (history rows, with penalties).
DRAFT_FIELDS = (
    "vrows", "draft_src", "is_draft", "pad_pos", "spec_reqs", "spec_slots", "spec_prefix", "spec_tok",
    "spec_tok_of", "n_verify", "sample_idx", "out_req", "out_first", "out_draft", "draft_at", "params",
    "penalties", "hist_req",
)  # fmt: skip
DraftInputs = NamedTuple(  # type: ignore[misc]  # the field list is TokenInputs' plus ours
    "DraftInputs", [(name, Any) for name in (*TokenInputs._fields, *DRAFT_FIELDS)]
)


class DraftPlan(NamedTuple):
    """What :func:`stage_drafts` plans: the staged arrays, the step's fresh slots, the rows'
    parameters (None without sampling requests), the most rows of a request, each sampling
    request's verified drafts, its penalties (None without), and the sampler plan (without the
    observations of drafts when some request has penalties)."""

    staged: Any
    n_out: int
    rp: RowParams | None
    width: int
    n_verify: np.ndarray
    pen: PenaltyPlan | None
    splan: SamplerPlan


def _ranges(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, owner)``: ``starts[i] + 0..lens[i]-1`` back to back, and each one's ``i``."""
    total = int(lens.sum())
    owner = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return starts[owner] + offsets, owner


def _row_plans(
    packed: np.ndarray,
    owner: np.ndarray,
    hist_req: np.ndarray,
    first_row: np.ndarray,
    j: np.ndarray,
    splan: SamplerPlan,
) -> tuple[RowParams, PenaltyPlan | None]:
    """The verification rows' parameters and penalties (row ``r`` of request ``owner[r]``),
    skipped when the sampler plan says no request samples, or none has penalties."""
    rp = row_params(packed[owner]) if splan.sampled else GREEDY_ROWS
    pen = plan_penalties(packed[owner], hist_req[owner], first_row, j) if splan.penalized else None
    return rp, pen


def stage_drafts(
    batch: Batch,
    sreq: np.ndarray,
    n_verify: np.ndarray,
    n_draft: np.ndarray,
    packed: np.ndarray,
    hist_req: np.ndarray,
    inputs: TokenInputs,
    splan: SamplerPlan,
    k: int,
) -> DraftPlan:
    """The host plan of a speculative step (see the module docstring).

    Args:
        batch: the checked batch; ``sreq [n]`` its sampling requests (ascending indices).
        n_verify, n_draft: ``[n_reqs]`` drafts each request verifies and makes.
        packed: ``[n, PARAM_WORDS]`` the sampling requests' packed parameters; ``hist_req [n]``
            their device history rows (0: none).
        inputs, splan: the token step's staged arrays and sampler plan of the batch.
        k: the drafter's drafts per step.
    """
    n = sreq.size
    if not n_verify.any() and not n_draft.any():
        return _stage_plain(batch, sreq, packed, hist_req, inputs, splan)
    v, kd = n_verify[sreq], n_draft[sreq]
    rows = _draft_rows(batch.seg_lens, sreq, n_verify, v, kd, k)
    rp, pen = _row_plans(packed, rows.owner, hist_req, rows.first_row, rows.j, splan) if n else (None, None)
    spec, starts, spec_tok = rows.spec, rows.starts, rows.spec_tok
    if pen is not None:
        # Only committed tokens enter the history: the drafts a step verifies are not inputs.
        splan = drop_observations(splan, spec_tok[spec_tok != starts[spec][rows.spec_of]])
        inputs = inputs._replace(sampler_words=splan.words)
    params = _NONE
    if rp is not None and rp.sampled:
        params = np.concatenate([rp.floats.reshape(-1).view(np.int64), rp.top_k, rp.seeds])
    staged = DraftInputs(  # type: ignore[call-arg]
        *inputs,
        rows.vrows,
        rows.draft_src,
        rows.is_draft,
        rows.pad_pos,
        spec,
        -batch.tokens[starts[spec]],
        batch.prefix_lens[spec],
        spec_tok,
        rows.spec_of,
        v,
        sreq,
        rows.out_req,
        rows.first,
        rows.draft_slot,
        rows.draft_at,
        params,
        _NONE if pen is None else pen.words,
        _NONE if pen is None else hist_req,
    )
    return DraftPlan(staged, rows.n_out, rp, rows.width, v, pen, splan)


class _Rows(NamedTuple):
    """The index arrays of a speculative step's plan (:data:`DRAFT_FIELDS`), which depend only on
    the batch's segments, its sampling requests and their drafts: read-only, kept by
    :func:`_draft_rows` for the layouts that recur (every request verifying and making ``k``)."""

    width: int
    n_out: int
    vrows: np.ndarray
    owner: np.ndarray
    j: np.ndarray
    first_row: np.ndarray  # [R] the first verification row of each row's request
    is_draft: np.ndarray
    draft_src: np.ndarray
    pad_pos: np.ndarray
    spec: np.ndarray
    starts: np.ndarray
    spec_tok: np.ndarray
    spec_of: np.ndarray
    out_req: np.ndarray
    first: np.ndarray
    draft_slot: np.ndarray
    draft_at: np.ndarray


_ROWS: dict[tuple[bytes, bytes, bytes, bytes, int], _Rows] = {}
_MAX_ROWS = 256


def _draft_rows(
    seg_lens: np.ndarray, sreq: np.ndarray, n_verify: np.ndarray, v: np.ndarray, kd: np.ndarray, k: int
) -> _Rows:
    """The step's :class:`_Rows` (``v``, ``kd``: ``n_verify`` and ``n_draft`` of ``sreq``), from
    the cache when these arrays were seen before: a handful of byte strings to hash instead of
    about twenty numpy calls a step."""
    key = (seg_lens.tobytes(), sreq.tobytes(), n_verify.tobytes(), kd.tobytes(), k)
    got = _ROWS.get(key)
    if got is not None:
        return got
    n = sreq.size
    ends = np.cumsum(seg_lens)[sreq] if n else _NONE
    width = int(v.max(initial=0)) + 1
    vrows, owner = _ranges(ends - 1 - v, v + 1)
    first_row = (ends - 1 - v)[owner]
    j = vrows - first_row
    is_draft = (j < v[owner]).astype(np.int64)
    spec = np.flatnonzero(n_verify)
    starts = np.cumsum(seg_lens) - seg_lens
    spec_tok, spec_of = _ranges(starts[spec], seg_lens[spec])
    first = np.cumsum(1 + kd) - 1 - kd
    draft_slot, draft_of = _ranges(first + 1, kd)
    rows = _Rows(
        width,
        int((1 + kd).sum()),
        vrows,
        owner,
        j,
        first_row,
        is_draft,
        vrows + is_draft,
        owner * width + j,
        spec,
        starts,
        spec_tok,
        spec_of,
        np.repeat(np.arange(n, dtype=np.int64), 1 + kd),
        first,
        draft_slot,
        draft_of * k + (draft_slot - first[draft_of] - 1),
    )
    for a in rows[2:]:
        a.flags.writeable = False  # shared by every step of this layout
    if len(_ROWS) >= _MAX_ROWS:
        _ROWS.clear()
    _ROWS[key] = rows
    return rows


def _stage_plain(
    batch: Batch,
    sreq: np.ndarray,
    packed: np.ndarray,
    hist_req: np.ndarray,
    inputs: TokenInputs,
    splan: SamplerPlan,
) -> DraftPlan:
    """:func:`stage_drafts` of a step where no request verifies or makes drafts (a multi-step
    window, a speculative step of plain requests): one verification row per sampling request,
    its last token row; every input is a committed token, so the sampler plan keeps them all."""
    n = sreq.size
    rows, zeros = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    vrows = np.cumsum(batch.seg_lens)[sreq] - 1 if n else _NONE
    rp, pen = _row_plans(packed, rows, hist_req, vrows, zeros, splan) if n else (None, None)
    params = _NONE
    if rp is not None and rp.sampled:
        params = np.concatenate([rp.floats.reshape(-1).view(np.int64), rp.top_k, rp.seeds])
    staged = DraftInputs(  # type: ignore[call-arg]
        *inputs,
        vrows,
        vrows,
        zeros,
        rows,
        _NONE,
        _NONE,
        _NONE,
        _NONE,
        _NONE,
        zeros,
        sreq,
        rows,
        rows,
        _NONE,
        _NONE,
        params,
        _NONE if pen is None else pen.words,
        _NONE if pen is None else hist_req,
    )
    return DraftPlan(staged, n, rp, 1, zeros, pen, splan)
