"""Host staging buffers for the runtime's copies, reused only after the copy that used them.

A step packs its index data into an input buffer that the forward stream copies to the
device, and gets its sampled tokens back into an output buffer (a CPU map's step gets fresh
arrays instead, :func:`fresh_parts` and :func:`fresh_words`: no buffer to reuse). On CUDA both
are pinned, so the copies are truly asynchronous, and that makes reuse dangerous: a buffer is
handed out again only after the stream passed the marker recorded after the copy that last used it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import torch

from tfuture.streams.backends import ForwardStream, Marker

_I64 = np.dtype(np.int64)


@dataclass(slots=True, eq=False)
class Staging:
    """One host buffer ``data`` (int64), its numpy view ``array`` (same memory), and the marker
    of the copy that last used it."""

    data: torch.Tensor
    marker: Marker | None = None
    array: np.ndarray = field(init=False)
    _head: torch.Tensor | None = field(init=False, default=None)
    _head_n: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        self.array = self.data.numpy()

    def head(self, n: int) -> torch.Tensor:
        """``data[:n]``, the view kept while ``n`` repeats (a view costs about a microsecond)."""
        head = self._head
        if head is None or n != self._head_n:
            head = self._head = self.data[:n]
            self._head_n = n
        return head

    def replace(self, data: torch.Tensor) -> None:
        """Take ``data`` as the buffer (a larger one): ``array`` and the kept view follow."""
        self.data, self.array, self._head, self._head_n = data, data.numpy(), None, -1


class StagingRing:
    """``size`` int64 host buffers handed out in turn; pinned when ``pin`` (CUDA).

    ``name`` says what the ring stages (``"inputs"``, ``"outputs"``), for traces and errors.
    """

    def __init__(self, size: int, pin: bool, name: str) -> None:
        self.pin, self.name = pin, name
        self._bufs = [Staging(torch.zeros(64, dtype=torch.int64, pin_memory=pin)) for _ in range(size)]
        self._next = 0

    def reset(self) -> None:
        """Forget every marker: a new stream starts, and the old one was drained."""
        for buf in self._bufs:
            buf.marker = None

    def acquire(self, n: int, stream: ForwardStream) -> Staging:
        """A buffer of at least ``n`` elements whose previous copy has completed."""
        buf = self._bufs[self._next]
        self._next = (self._next + 1) % len(self._bufs)
        marker = buf.marker
        if marker is not None and not marker.done:
            stream.wait(marker)
        if buf.data.numel() < n:
            buf.replace(torch.zeros(max(n, 2 * buf.data.numel()), dtype=torch.int64, pin_memory=self.pin))
        return buf


def fresh_parts(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """A CPU map's staged parts, each copied into a fresh int64 array the step owns (nothing to
    reuse, so nothing to wait for): one copy per part costs less than packing them into one
    array and slicing it again."""
    return tuple(map(np.array, parts, repeat(_I64)))


def fresh_words(words: np.ndarray, err: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """A CPU map's step results ``[n]`` (int) as a fresh int64 array the step owns (nothing to
    reuse, so nothing to wait for), and its error flag ``[2]`` as two ints ``[count, worst]``."""
    return words.astype(np.int64), err.tolist()


#: A staging layout: total words, ``cuts`` (the end of each non-empty part but the last),
#: the number of non-empty parts, and how many empty parts follow them all (-1: an empty part
#: lies between non-empty ones).
Layout = tuple[int, tuple[int, ...], int, int]
_MAX_LAYOUTS = 256


def staging_layout(sizes: tuple[int, ...], cache: dict[tuple[int, ...], Layout]) -> Layout:
    """The layout of staged parts of ``sizes`` (words each), packed back to back with the empty
    ones left out and split again on the stream (``torch.tensor_split`` at ``cuts``); kept in
    ``cache``, since a few shapes recur."""
    cut, cuts = 0, []
    for size in sizes:
        if size:
            cut += size
            cuts.append(cut)
    n_live = len(cuts)
    # Empty parts get the shared empty tensor (a view costs about a microsecond each); when
    # they all come last (the usual case) the views are the split and a tuple of them.
    trailing = len(sizes) - n_live if not any(sizes[n_live:]) else -1
    layout = (cut, tuple(cuts[:-1]), n_live, trailing)
    if len(cache) >= _MAX_LAYOUTS:
        cache.clear()
    cache[sizes] = layout
    return layout
