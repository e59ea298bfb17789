"""Planted defects for mutation tests, applied from the test side by patching (never in tfuture/).

Each name reproduces one known bug class of overlap schedulers (README.md, "Fault injection and
the soak"), so a test can show that debug mode or the sync-vs-overlap equivalence check catches
it, and that the same scenario passes without the patch (``tests/reliability/test_defects.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import numpy as np
import torch

import tfuture.core.future_map
import tfuture.steps.launch
from tfuture.core.slots import FutureIndices
from tfuture.runtime import OverlapRuntime
from tfuture.streams.staging import Staging, StagingRing


def _drop_ignoring_refcount(self: FutureIndices, want_freed: bool = False) -> np.ndarray | None:
    """release frees every slot the handle names, whatever other handles still name them."""
    pool = self.pool
    slots = np.unique(self.slots)
    refs = pool._refs
    freed = slots[refs[slots] > 0]
    refs[freed] = 0
    pool._in_use -= int(freed.size)
    self._released = True
    return freed if want_freed else None


def _store_as_interval(real: Callable[..., None]) -> Callable[..., None]:
    """store through any handle as if its slots were ``[slots[0], slots[0] + n)``."""

    def launch(token_map: torch.Tensor, slots: Any, values: torch.Tensor, err: Any) -> None:
        if isinstance(slots, torch.Tensor) and slots.numel():
            first = int(slots[0])
            stop = min(first + slots.numel(), token_map.numel())
            slots, values = range(first, stop), values[: stop - first]
        real(token_map, slots, values, err)

    return launch


def _prepare_without_resolve(real: Callable[..., Any]) -> Callable[..., Any]:
    """prepare inputs against an empty map with no error flag: placeholders stay negative."""

    def prepare(tokens, seg_starts, prefix_lens, token_map, *, n_rows=None, out=None, err=None):  # type: ignore[no-untyped-def]
        return real(tokens, seg_starts, prefix_lens, token_map[:1], n_rows=n_rows, out=out)

    return prepare


def _launch_without_resolve(real: Callable[..., Any]) -> Callable[..., Any]:
    """The unchecked prepare against an empty map with no error flag (see above)."""

    def launch(tokens, seg_starts, prefix_lens, token_map, n_rows, out, err, **kw):  # type: ignore[no-untyped-def]
        return real(tokens, seg_starts, prefix_lens, token_map[:1], n_rows, out, None, **kw)

    return launch


def _ring_without_wait(ring_name: str, real: Callable[..., Staging]) -> Callable[..., Staging]:
    """The ring named ``ring_name`` always hands out its first buffer, never waiting for it."""

    def acquire(self: StagingRing, n: int, stream: Any) -> Staging:
        if self.name != ring_name:
            return real(self, n, stream)
        buf = self._bufs[0]
        if buf.data.numel() < n:
            buf.replace(torch.zeros(max(n, 2 * buf.data.numel()), dtype=torch.int64, pin_memory=self.pin))
        return buf

    return acquire


class _SharedStagedParts:
    """``tfuture.steps.launch.fresh_parts``, but a CPU map's staged parts land in one array shared by
    every step (each part a view of it): the host overwrites a step's inputs before the stream
    read them (the CPU twin of an input staging buffer reused before its copy ran)."""

    def __init__(self) -> None:
        self._shared = np.zeros(64, dtype=np.int64)

    def __call__(self, parts: Any) -> tuple[np.ndarray, ...]:
        total = sum(p.size for p in parts)
        if self._shared.size < total:
            self._shared = np.zeros(2 * total, dtype=np.int64)
        views, at = [], 0
        for p in parts:
            view = self._shared[at : at + p.size]
            view[:] = p
            views.append(view)
            at += p.size
        return tuple(views)


class _SharedResultWords:
    """``tfuture.steps.launch.fresh_words``, but a CPU map's step results land in one array shared by
    every step: a later step's copy overwrites a step's results before the host read them (the
    CPU twin of an output staging buffer reused before the host read it)."""

    def __init__(self) -> None:
        self._shared = np.zeros(64, dtype=np.int64)

    def __call__(self, words: np.ndarray, err: np.ndarray) -> tuple[np.ndarray, list[int]]:
        n = words.size
        if self._shared.size < n:
            self._shared = np.zeros(2 * n, dtype=np.int64)
        view = self._shared[:n]
        view[:] = words
        return view, err.tolist()


def _late_delayed_sample(stack: ExitStack) -> None:
    """A delayed sample is launched one step late: after the next step's resolve."""
    real_sample, real_finish = OverlapRuntime._delayed_sample, OverlapRuntime._finish

    def delayed_sample(self: OverlapRuntime, scheduler: Any, rec: Any) -> None:
        late = self.__dict__.get("_late")
        self.__dict__["_late"] = rec
        if late is not None:
            real_sample(self, scheduler, late)

    def finish(self: OverlapRuntime, rec: Any, scheduler: Any, stats: Any, start: Any = None) -> None:
        if self.__dict__.get("_late") is rec:
            self.__dict__["_late"] = None
            real_sample(self, scheduler, rec)
            start = None  # the wait no longer follows the launch
        real_finish(self, rec, scheduler, stats, start)

    stack.enter_context(mock.patch.object(OverlapRuntime, "_delayed_sample", delayed_sample))
    stack.enter_context(mock.patch.object(OverlapRuntime, "_finish", finish))


DEFECTS = (
    "ignore_refcount",
    "store_as_interval",
    "skip_resolve",
    "no_input_keepalive",
    "staging_no_wait",
    "late_delayed_sample",
)


@contextmanager
def plant(*names: str) -> Iterator[None]:
    """Patch the named defects in for the duration of a ``with`` block."""
    unknown = set(names) - set(DEFECTS)
    if unknown:
        raise ValueError(f"unknown defect(s) {sorted(unknown)}; known: {sorted(DEFECTS)}")
    with ExitStack() as stack:
        patch = stack.enter_context
        for name in names:
            if name == "ignore_refcount":
                patch(mock.patch.object(FutureIndices, "drop_references", _drop_ignoring_refcount))
            elif name == "store_as_interval":
                real = tfuture.core.future_map.launch_store
                patch(mock.patch.object(tfuture.core.future_map, "launch_store", _store_as_interval(real)))
            elif name == "skip_resolve":
                real = tfuture.core.future_map.prepare_inputs
                patch(
                    mock.patch.object(
                        tfuture.core.future_map, "prepare_inputs", _prepare_without_resolve(real)
                    )
                )
                real_launch = tfuture.core.future_map.launch_prepare
                patch(
                    mock.patch.object(
                        tfuture.core.future_map, "launch_prepare", _launch_without_resolve(real_launch)
                    )
                )
                patch(
                    mock.patch.object(
                        tfuture.core.future_map, "launch_resolve_", lambda ids, token_map, err: ids
                    )
                )
            elif name in ("no_input_keepalive", "staging_no_wait"):
                ring = "inputs" if name == "no_input_keepalive" else "outputs"
                real_acquire = StagingRing.acquire
                patch(mock.patch.object(StagingRing, "acquire", _ring_without_wait(ring, real_acquire)))
                if name == "no_input_keepalive":
                    # A CPU map stages no input buffer: its steps' fresh arrays become one.
                    patch(mock.patch.object(tfuture.steps.launch, "fresh_parts", _SharedStagedParts()))
                else:
                    # Nor an output buffer: its steps' fresh result arrays become one.
                    patch(mock.patch.object(tfuture.steps.launch, "fresh_words", _SharedResultWords()))
            else:
                _late_delayed_sample(stack)
        yield
