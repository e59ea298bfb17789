"""A speculative token step's batch and result: :class:`DraftBatch`, :class:`DraftResult`.

A request in a token step carries ``k >= 0`` drafts: ``k = 0`` is plain decoding. Per request
the scheduler says how many drafts the step verifies (``n_verify``: its segment is the last
committed token then those drafts, all placeholders of one earlier step's slots) and how many
drafts the step makes for the next one (``n_draft``). A sampling request gets ``1 + n_draft``
slots in ``Batch.out``, in order: its last committed token, then its drafts; the next step names
them as its inputs. Every slot also holds the request's sequence length after the step (the
``seq_len`` field), from which the next step takes its positions: the host does not know how
many drafts were accepted when it schedules the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tfuture.core.batch import Batch, StepResult
from tfuture.core.checks import count_nonzero

__all__ = ["DraftBatch", "DraftResult", "check_committed"]

_NONE = np.empty(0, dtype=np.int64)


_WINDOW_WAITS = (
    "DraftBatch.n_steps={k} runs several decode steps at once: no request may verify or make drafts, "
    "or wait for a mask (its mask is for one position), in such a step"
)


def _counts(name: str, a: object, n: int) -> np.ndarray:
    """``a`` as ``[n]`` int64 counts >= 0 (an empty array: zeros), else a clear error."""
    if isinstance(a, np.ndarray) and a.size == 0 and a.ndim == 1:
        return np.zeros(n, dtype=np.int64)
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
        got = f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise TypeError(f"DraftBatch.{name} must be a 1-D integer numpy array, got {got}")
    if a.size != n:
        raise ValueError(f"DraftBatch.{name} must have {n} entries (one per request), got {a.size}")
    a = a.astype(np.int64, copy=False)
    if a.size and a[a.argmin()] < 0:  # an extreme by its index: cheaper than a reduction
        raise ValueError(f"DraftBatch.{name} must be >= 0, got {int(a.min())}")
    return a


@dataclass(slots=True, eq=False)
class DraftBatch(Batch):
    """A :class:`tfuture.core.batch.Batch` whose requests may verify and make drafts.

    Attributes (besides :class:`Batch`'s):
        n_verify: ``[n_reqs]`` drafts each request verifies this step. A request with
            ``n_verify > 0`` samples, and its segment is exactly ``1 + n_verify`` tokens whose
            first is a placeholder of an earlier speculative step (its position comes from that
            slot's ``seq_len`` field; its ``prefix_lens`` entry is only a host upper bound,
            used to size the step). Empty: none verifies.
        n_draft: ``[n_reqs]`` drafts each sampling request makes for its next step (0 where it
            does not sample). Empty: none drafts.
        n_steps: decode steps the step runs (multi-step decode,
            :class:`tfuture.spec.MultiStepTokenStep`): each sampling request gets ``n_steps``
            tokens, each step's input the previous one's output on the device, and its slot
            the last of them. More than 1 only without drafts and without waiting requests.

    A request whose sample waits for a mask (``delayed``) gets ``1 + n_verify`` mask rows from
    ``build_mask``, one per verification row: the allowed tokens after its committed tokens and
    after each of the drafts it verifies (a draft the mask rejects is never accepted).
    """

    n_verify: np.ndarray = field(default_factory=lambda: _NONE)
    n_draft: np.ndarray = field(default_factory=lambda: _NONE)
    n_steps: int = 1

    def __post_init__(self) -> None:
        Batch.__post_init__(self)
        n, k = self.seg_lens.size, self.n_steps
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"DraftBatch.n_steps must be an int >= 1, got {k!r}")
        self.n_steps = int(k)
        if self.n_verify is _NONE and self.n_draft is _NONE:
            # No drafts (a multi-step window, or plain requests): nothing of theirs to check.
            self.n_verify = self.n_draft = np.zeros(n, dtype=np.int64)
            if k > 1 and np.any(self.delayed & self.sample):
                raise ValueError(_WINDOW_WAITS.format(k=k))
            return
        v = self.n_verify = _counts("n_verify", self.n_verify, n)
        d = self.n_draft = _counts("n_draft", self.n_draft, n)
        if k > 1 and (v.any() or d.any() or np.any(self.delayed & self.sample)):
            raise ValueError(_WINDOW_WAITS.format(k=k))
        sample = self.sample
        if count_nonzero(sample) != n:  # every request samples (the usual step): nothing to check
            bad = np.flatnonzero(((v > 0) | (d > 0)) & ~sample)
            if bad.size:
                q = int(bad[0])
                raise ValueError(
                    f"DraftBatch: request {int(self.req_ids[q])} verifies or makes drafts (n_verify="
                    f"{int(v[q])}, n_draft={int(d[q])}) but does not sample this step"
                )
        verifies = v > 0
        n_spec = count_nonzero(verifies)
        if not n_spec:
            return
        seg_lens = self.seg_lens
        if n_spec == n:  # every request verifies: whole-array checks, no index arrays
            if count_nonzero(seg_lens - v != 1):
                self._wrong_segment(np.flatnonzero(seg_lens - v != 1))
            if count_nonzero(self.tokens[np.cumsum(seg_lens) - seg_lens] >= 0):
                self._concrete_first(np.arange(n))
            return
        spec = np.flatnonzero(verifies)
        wrong = spec[seg_lens[spec] != v[spec] + 1]
        if wrong.size:
            self._wrong_segment(wrong)
        self._concrete_first(spec)

    def _wrong_segment(self, wrong: np.ndarray) -> None:
        """Raise for the first request of ``wrong`` (a verifying request whose segment is not
        ``1 + n_verify`` tokens)."""
        q = int(wrong[0])
        v = int(self.n_verify[q])
        raise ValueError(
            f"DraftBatch: request {int(self.req_ids[q])} verifies {v} drafts, so its "
            f"segment must be 1 + {v} tokens, got seg_lens={int(self.seg_lens[q])}"
        )

    def _concrete_first(self, spec: np.ndarray) -> None:
        """Raise for the first request of ``spec`` (verifying requests) whose segment starts with
        a concrete id instead of a placeholder."""
        starts = np.cumsum(self.seg_lens) - self.seg_lens
        concrete = spec[self.tokens[starts[spec]] >= 0]
        if concrete.size:
            q = int(concrete[0])
            raise ValueError(
                f"DraftBatch: request {int(self.req_ids[q])} verifies drafts, so its first token "
                "must be a placeholder of its previous speculative step (its position lives "
                f"there), got the concrete id {int(self.tokens[starts[q]])}"
            )


@dataclass(slots=True, eq=False)
class DraftResult(StepResult):
    """A processed speculative step: ``tokens`` holds every sampling request's committed tokens
    back to back (``n_commit[i]`` for request ``i``, in ``sample_reqs`` order; 1 for a plain
    request); ``n_drafted [n_sample]`` the drafts each one verified; ``stored`` what the step
    stored into its fresh slots (each sampling request's last committed token, then its
    ``n_draft`` drafts), read back only when a request whose sample waits for a mask made
    drafts (its next masks follow them), else empty."""

    n_commit: np.ndarray = field(default_factory=lambda: _NONE)
    n_drafted: np.ndarray = field(default_factory=lambda: _NONE)
    stored: np.ndarray = field(default_factory=lambda: _NONE)

    def per_request(self) -> list[np.ndarray]:
        """Each sampling request's committed tokens, in order."""
        counts = self.n_commit
        if not counts.size:
            return []
        c = int(counts[0])
        if c * counts.size == self.tokens.size and not np.any(counts != c):
            return list(self.tokens.reshape(counts.size, c))  # the same count each (a window)
        # Slices in a comprehension: np.split's own loop costs about three times as much.
        ends = np.cumsum(counts).tolist()
        tokens = self.tokens
        return [tokens[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def check_committed(
    step: int,
    batch: Batch,
    sample_reqs: np.ndarray,
    tokens: np.ndarray,
    vocab: int | None,
    owner_of: Callable[[int], int],
) -> None:
    """HOST: raise unless every committed token of step ``step`` (``tokens``, flat, request by
    request) is a valid id: -1 marks a row with no valid token to sample, and ids must be below
    ``vocab`` (when known). ``owner_of(i)``: the sampling request (index into ``sample_reqs``)
    of ``tokens[i]``, asked only for the message."""
    if tokens.size and int(tokens.min()) < 0:
        i = owner_of(int(np.flatnonzero(tokens < 0)[0]))
        rid = int(batch.req_ids[sample_reqs[i]])
        raise ValueError(
            f"step {step}: request {rid} has no valid token to sample (its filtered "
            "probabilities are not a distribution: a NaN or infinite logit)"
        )
    if vocab is not None and tokens.size and int(tokens.max()) >= vocab:
        raise ValueError(f"step {step}: a committed token {int(tokens.max())} is past the vocab of {vocab}")
