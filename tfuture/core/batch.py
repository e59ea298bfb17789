"""Plain data exchanged between a scheduler, the runtime and a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from tfuture.core.params import SamplingParams
from tfuture.core.slots import FutureIndices

_INT64_MAX = np.iinfo(np.int64).max
# The ufunc reduction itself: ndarray.sum() goes through a Python wrapper (about 1 us more),
# on every step's host path.
_SUM = np.add.reduce
_FALSE = np.zeros(4096, dtype=np.bool_)
_FALSE.flags.writeable = False
#: The read-only array whose views are the ``Batch.delayed`` of batches where nothing waits
#: (``delayed.base is NOTHING_WAITS``: no count needed).
NOTHING_WAITS = _FALSE
_NO_IDS = np.empty(0, dtype=np.int64)


_I64 = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)
_FIVE_ARRAYS = (np.ndarray,) * 5
_FIVE_I64 = (_I64,) * 5
_THREE_VECTORS = (1, 1, 1)


def _int_vector(name: str, a: object, n: int | None = None) -> np.ndarray:
    # The common case first, in one test: an int64 vector of the right size is used as it is.
    if type(a) is np.ndarray and a.dtype == _I64 and a.ndim == 1 and (n is None or a.size == n):
        return a
    # dtype.kind, not np.issubdtype: about 1 us less per array, on every step's host path.
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
        got = type(a).__name__ if not isinstance(a, np.ndarray) else f"{a.dtype} array of shape {a.shape}"
        raise TypeError(f"Batch.{name} must be a 1-D integer numpy array, got {got}")
    if n is not None and a.size != n:
        raise ValueError(f"Batch.{name} must have {n} entries (one per request), got {a.size}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > _INT64_MAX:
        # Cast to int64 it would wrap to a negative id: a placeholder nobody made.
        raise ValueError(f"Batch.{name} must fit in int64, got a uint64 value {int(a.max())}")
    return a.astype(np.int64, copy=False)


def _has_repeat(ids: np.ndarray) -> bool:
    s = np.sort(ids)
    return bool(np.count_nonzero(s[1:] == s[:-1]))


def check_delayed(d: object, n: int) -> np.ndarray:
    """``Batch.delayed`` as its one type, a ``[n]`` bool array (a bool applies to every request)."""
    if isinstance(d, bool | np.bool_):
        if d:
            return np.ones(n, dtype=np.bool_)
        # A shared read-only view: nothing waits (assign a new array to change it).
        return _FALSE[:n] if n <= _FALSE.size else np.zeros(n, dtype=np.bool_)
    if not isinstance(d, np.ndarray) or d.dtype != np.bool_ or d.shape != (n,):
        got = f"{d.dtype} array of shape {d.shape}" if isinstance(d, np.ndarray) else type(d).__name__
        raise TypeError(f"Batch.delayed must be a bool or a bool numpy array of {n} entries, got {got}")
    return d


def check_admitted(params: object, req_ids: np.ndarray) -> None:
    """Raise unless ``params`` maps request ids of ``req_ids`` to :class:`SamplingParams`."""
    if not isinstance(params, dict):
        raise TypeError(
            f"Batch.params must be a dict of request id -> SamplingParams, got {type(params).__name__}"
        )
    for rid, p in params.items():
        if not isinstance(p, SamplingParams):
            raise TypeError(f"Batch.params[{rid!r}] must be a SamplingParams, got {type(p).__name__}")
        if isinstance(rid, bool) or not isinstance(rid, int | np.integer):
            raise TypeError(f"Batch.params keys must be int request ids, got {type(rid).__name__} {rid!r}")
    missing = np.setdiff1d(np.fromiter(params, dtype=np.int64, count=len(params)), req_ids)
    if missing.size:
        raise ValueError(
            f"Batch.params names request {int(missing[0])}, which is not in this batch's req_ids: a "
            "request's parameters come with its first step"
        )


def check_consumes(owner: str, consumes: object) -> None:
    """Raise unless ``consumes`` is a list of ``FutureIndices``."""
    if not isinstance(consumes, list) or not all(isinstance(h, FutureIndices) for h in consumes):
        got = type(consumes).__name__
        if isinstance(consumes, list):
            got = "a list holding " + ", ".join(sorted({type(h).__name__ for h in consumes}))
        raise TypeError(f"{owner}.consumes must be a list of FutureIndices, got {got}")


@dataclass(slots=True, eq=False)
class Batch:
    """One step's work, built by the scheduler on the host.

    Attributes:
        tokens: ``[n_tokens]`` int host array, every request's new tokens back to back:
            concrete ids (``>= 0``) and placeholders (``-slot``, from ``host_placeholders()``).
        seg_lens: ``[n_reqs]`` tokens per request this step, each ``>= 1``.
        prefix_lens: ``[n_reqs]`` tokens of each request already processed (its first position).
        req_ids: ``[n_reqs]`` the scheduler's request ids (the model may use them).
        sample: ``[n_reqs]`` bool, True where the request samples a token this step (a decode,
            or the last chunk of a prefill). ``out`` gets one slot per sampling request, in order.
        consumes: handles whose placeholders appear in ``tokens``. The runtime takes them over
            and releases them once the step's resolve is enqueued.
        delayed: ``[n_reqs]`` bool, True where the request's token waits for a mask built after
            the previous step's results were processed (a grammar); a single bool given at
            construction applies to every request and is stored as such an array. Entries of
            requests that do not sample are ignored. To change it, assign a bool or a ``[n_reqs]``
            bool array: the runtime takes it at launch as the constructor does (anything else
            is refused there with a ``TypeError`` naming ``Batch.delayed``).
        params: ``{req_id: SamplingParams}`` of the requests admitted in this step (their first
            step), or None. A request keeps its parameters until it ends (:attr:`ended`); a
            request never given any samples greedily. Needs tfuture's sampler.
        ended: request ids that appear in no step from this one on (finished or aborted); the
            model's optional ``release`` hears them on the forward stream before this step.
        tag: anything the scheduler wants back in the :class:`StepResult`.
        out: set by the runtime at launch: the handle of this step's sampled tokens.
        step: set by the runtime at launch: the step number in the run.
    """

    tokens: np.ndarray
    seg_lens: np.ndarray
    prefix_lens: np.ndarray
    req_ids: np.ndarray
    sample: np.ndarray
    consumes: list[FutureIndices] = field(default_factory=list)
    delayed: Any = False  # np.ndarray [n_reqs] bool after construction (check_delayed)
    tag: Any = None
    out: FutureIndices | None = None
    step: int = -1
    ended: np.ndarray = field(default_factory=lambda: _NO_IDS)
    params: dict[int, SamplingParams] | None = None

    def __post_init__(self) -> None:
        consumes = self.consumes
        if type(consumes) is not list or (
            consumes
            and not (len(consumes) == 1 and type(consumes[0]) is FutureIndices)
            and not all(type(h) is FutureIndices for h in consumes)
        ):
            check_consumes("Batch", consumes)
        ended, tokens, seg_lens, prefix, rids = (
            self.ended,
            self.tokens,
            self.seg_lens,
            self.prefix_lens,
            self.req_ids,
        )
        # Every array an int64 vector already (the usual case): a few tuple comparisons, no call
        # (a tuple compares its items by identity first: the dtypes are numpy's own objects).
        if (
            (type(tokens), type(seg_lens), type(prefix), type(rids), type(ended)) != _FIVE_ARRAYS
            or (tokens.dtype, seg_lens.dtype, prefix.dtype, rids.dtype, ended.dtype) != _FIVE_I64
            or (tokens.ndim, seg_lens.ndim, ended.ndim) != _THREE_VECTORS
            or prefix.shape != seg_lens.shape
            or rids.shape != seg_lens.shape
        ):
            self.ended = ended = _int_vector("ended", ended)
            self.tokens = tokens = _int_vector("tokens", tokens)
            self.seg_lens = seg_lens = _int_vector("seg_lens", seg_lens)
            n = seg_lens.size
            self.prefix_lens = prefix = _int_vector("prefix_lens", prefix, n)
            self.req_ids = rids = _int_vector("req_ids", rids, n)
        n = seg_lens.size
        sample = self.sample
        if type(sample) is not np.ndarray or sample.dtype != _BOOL or sample.shape != seg_lens.shape:
            raise TypeError(f"Batch.sample must be a bool numpy array of {n} entries, got {sample!r}")
        if n:
            # An extreme by its index: argmin costs about a third of a ufunc reduction.
            if seg_lens[seg_lens.argmin()] < 1:
                raise ValueError(f"Batch.seg_lens must be >= 1, got min {seg_lens.min()}")
            if prefix[prefix.argmin()] < 0:
                raise ValueError(f"Batch.prefix_lens must be >= 0, got min {prefix.min()}")
        # KV rows, penalty history and parameters are keyed by request id: ids are unique. A set
        # is cheaper than a sort up to a few hundred requests.
        if n > 1 and (len(set(rids.tolist())) < n if n <= 256 else _has_repeat(rids)):
            ids = np.sort(rids)
            same = int(ids[np.flatnonzero(ids[1:] == ids[:-1])[0]])
            raise ValueError(f"Batch.req_ids must be unique, got request {same} twice")
        delayed = self.delayed
        if delayed is not False or n > _FALSE.size:
            self.delayed = check_delayed(delayed, n)
        else:
            self.delayed = _FALSE[:n]  # nothing waits: a shared read-only view
        if self.params is not None:
            check_admitted(self.params, rids)
        if ended.size and n:
            # An ended request's state (KV rows, penalty history) is freed before this step runs.
            live = np.flatnonzero(np.isin(ended, rids))
            if live.size:
                raise ValueError(
                    f"Batch.ended names request {int(ended[live[0]])}, which is in this batch's "
                    "req_ids: an ended request appears in no step from this one on"
                )
        # A decode step (every segment 1 long, seg_lens >= 1 above) needs no sum.
        if tokens.size != n or (n and seg_lens[seg_lens.argmax()] != 1):
            want = int(_SUM(seg_lens))
            if want != tokens.size:
                raise ValueError(f"Batch.tokens must hold sum(seg_lens) = {want} ids, got {tokens.size}")

    @property
    def n_reqs(self) -> int:
        return int(self.seg_lens.size)


# NamedTuples, not frozen dataclasses: built every step, about 1 us each instead of 3-4.
class HostMeta(NamedTuple):
    """Host (numpy) mirrors of a step's small metadata, for decisions a model makes on the host.

    On CUDA ``forward`` runs on the host thread: a ``.tolist()`` or ``int()`` of a device value
    there waits for the device and ends the overlap. Read these instead; never read device
    values on the host. ``seg_lens``, ``prefix_lens``, ``req_ids`` ``[n_reqs]`` and
    ``sample_reqs [n_sample]`` int64 (do not modify them), ``n_tokens`` the real token count,
    ``max_seg_len`` the longest segment (0 without requests).
    """

    seg_lens: np.ndarray
    prefix_lens: np.ndarray
    req_ids: np.ndarray
    sample_reqs: np.ndarray
    n_tokens: int
    max_seg_len: int


class ForwardBatch(NamedTuple):
    """A step's device inputs, built on the forward stream by the fused input preparation.

    ``input_ids [n_rows]``, ``positions [n_rows]`` int64 (``n_rows >= n_tokens``: padded
    steps add zero rows past the real tokens), ``last_rows [n_reqs]`` int64 (the row of each
    request's last token), ``req_ids`` and ``seq_lens`` (prefix + new) ``[n_reqs]`` int64,
    ``sample_reqs [n_sample]`` int64 (requests that sample, ascending), ``sample_rows
    [n_sample]`` int64 (their last rows: the only rows whose logits the sampler needs),
    ``seg_starts [n_reqs + 1]`` int64 (request ``q`` owns rows ``seg_starts[q]:seg_starts[q+1]``)
    and ``host``, the :class:`HostMeta` mirrors.

    The tensors may share memory: in a decode step ``last_rows``, ``sample_rows`` and
    ``sample_reqs`` are one view of ``seg_starts``, and ``positions`` a view of the staged
    prefix lengths. Read them; never write them in place.
    """

    step: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    last_rows: torch.Tensor
    req_ids: torch.Tensor
    seq_lens: torch.Tensor
    sample_reqs: torch.Tensor
    sample_rows: torch.Tensor
    seg_starts: torch.Tensor | None = None
    host: HostMeta | None = None


@dataclass(slots=True, eq=False)
class StepResult:
    """A finished step on the host: ``tokens [n_sample]`` int64, one per sampling request."""

    step: int
    batch: Batch
    tokens: np.ndarray


class Model(Protocol):
    """What the runtime drives. Both methods run on the forward stream.

    ``sample`` is optional: without it (or with ``OverlapRuntime(..., sampler=...)``) the runtime
    samples with :class:`tfuture.sampling.Sampler` (per-request parameters from
    :attr:`Batch.params`, packed bitmasks applied on the device).

    Optional, called when present: ``release(req_ids: np.ndarray)`` on the forward stream after
    the last forward of those requests (the extra step included), when the scheduler says they
    ended (:attr:`Batch.ended`), so the model can free their KV cache; ``close()`` on the host
    once a run ends or fails, after the stream was drained: free what is left.
    """

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (or anything ``sample`` takes) for ``batch.sample_rows`` only: ``[n_sample, ...]``."""
        ...

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        """``[n_sample]`` int token ids for ``batch.sample_reqs``; ``mask [n_sample, vocab]`` bool."""
        ...


class Scheduler(Protocol):
    """The host side. ``schedule`` returns ``None`` when it has nothing to launch right now."""

    def schedule(self) -> Batch | None: ...

    def process(self, result: StepResult) -> None: ...

    def build_mask(self, batch: Batch) -> np.ndarray | torch.Tensor | None:
        """The allowed tokens of a delayed step's waiting rows, on the host.

        Rows: every sampling request when ``batch.delayed`` is ``True``; else the requests
        ``np.flatnonzero(batch.sample & batch.delayed)``, in batch order. Either a bool
        ``[rows, vocab]`` mask or a packed int32 ``[rows, ceil(vocab / 32)]`` bitmask (bit ``j``
        of word ``w`` allows token ``32 * w + j``: the xgrammar / llguidance layout), numpy or a
        torch tensor. A row that allows no token raises ``ValueError``.
        """
        ...
