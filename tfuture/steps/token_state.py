"""A token step's records: its padding :class:`Buckets`, its staged :class:`TokenInputs` and its
per-step :class:`TokenState` (see :mod:`tfuture.steps.token`, whose kind builds and reads them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch, HostMeta
from tfuture.sampling import SamplerPlan
from tfuture.steps.graphs import GraphBucket

__all__ = ["Buckets", "TokenInputs", "TokenState"]

_NO_ROWS = np.empty(0, dtype=np.int64)
_ARANGE = np.arange(1024, dtype=np.int64)
_ARANGE.flags.writeable = False


def _arange(n: int) -> np.ndarray:
    """``arange(n)`` int64, a read-only view of a cached array when it is short."""
    return _ARANGE[:n] if n <= _ARANGE.size else np.arange(n, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Buckets:
    """Padded step shapes: ``rows`` (token rows) and ``reqs`` (requests), each ascending."""

    rows: tuple[int, ...]
    reqs: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("rows", "reqs"):
            vals = getattr(self, name)
            ok = isinstance(vals, tuple) and vals and all(type(v) is int and v >= 1 for v in vals)
            if not ok or list(vals) != sorted(set(vals)):
                raise ValueError(
                    f"Buckets.{name} must be a non-empty ascending tuple of ints >= 1, got {vals!r}"
                )

    @staticmethod
    def fit(sizes: tuple[int, ...], n: int) -> int:
        """The smallest bucket >= ``n``, or ``n`` past the largest."""
        for b in sizes:
            if b >= n:
                return b
        return n


class TokenInputs(NamedTuple):
    """A token step's staged index data, named: host int64 arrays at plan time, their device
    views (one H2D copy, split) in :meth:`TokenStep.prepare`.

    ``tokens [n_tokens]``, ``seg_starts [n_pad + 1]``, ``prefix_lens``, ``req_ids``,
    ``seq_lens [n_pad]`` (padded to the bucket), ``sample_reqs [n_sample]``, ``late``/``now``
    (sampling rows that wait for the mask / sample at once, when a step splits them; else
    empty) and ``sampler_words`` (the sampler plan's words).
    """

    tokens: Any
    seg_starts: Any
    prefix_lens: Any
    req_ids: Any
    seq_lens: Any
    sample_reqs: Any
    late: Any
    now: Any
    sampler_words: Any
    store_slots: Any = _NO_ROWS  # a graphed step's slots to store into (padded); else empty


class TokenState:
    """One token step's record. ``late``: the sampling rows (indices into ``sample_reqs``) that
    sample after the mask, ``now`` the others; ``mask_rows`` the rows the scheduler's mask
    covers (``late``, unless a sample path that takes every row at once samples a step with a
    few waiting rows).

    The plan sets the first eight fields; the others keep their class defaults until the step
    sets them (a record built every step: its constructor assigns eight fields, not twenty)."""

    fwd: ForwardBatch | None = None
    logits: torch.Tensor | None = None
    sampled: torch.Tensor | None = None  # -1 where a row got no valid token (checked on the host)
    sampled_host: np.ndarray | None = None  # a CPU map: ``sampled`` as numpy, if the store made it
    clean: torch.Tensor | None = None  # what the map gets: -1 read as 0 when the path records history
    mask: torch.Tensor | None = None
    mask_ready: Any = None  # a CUDA event when the mask was built on the caller's stream
    unchecked: np.ndarray | None = None  # mask rows' request ids, checked once the vocab is known
    sstate: Any = None
    late_dev: torch.Tensor | None = None
    now_dev: torch.Tensor | None = None
    graph: GraphBucket | None = None  # the bucket whose graph runs this step (graphs=True)
    #: Whether some rows sample at once and others wait for the mask (``late`` and ``now`` both
    #: non-empty), set by the plan.
    split: bool = False

    def __init__(
        self,
        sample_reqs: np.ndarray,
        host: HostMeta,
        ended: np.ndarray,
        n_rows: int,
        late: np.ndarray,
        now: np.ndarray,
        mask_rows: np.ndarray,
        splan: SamplerPlan,
    ) -> None:
        self.sample_reqs = sample_reqs
        self.host = host
        self.ended = ended
        self.n_rows = n_rows
        self.late = late
        self.now = now
        self.mask_rows = mask_rows
        self.splan = splan

    @property
    def n_sample(self) -> int:
        return int(self.sample_reqs.size)
