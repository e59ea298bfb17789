"""Deliberate defects for mutation tests (private; never reachable from the public API).

Each name switches on one known bug class of overlap schedulers, so a test can show that
debug mode or the sync-vs-overlap equivalence check catches it. Production code only reads
``ACTIVE``, an empty frozenset unless a test uses :func:`plant`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

DEFECTS = frozenset(
    {
        "no_input_keepalive",  # reuse a step's host input buffer before the stream read it
        "staging_no_wait",  # reuse the D2H staging buffer before its copy_done
        "ignore_refcount",  # release frees slots that other handles still name
        "store_as_interval",  # store through any handle as if it were [slots[0], slots[0] + n)
        "skip_resolve",  # prepare inputs without resolving placeholders
        "late_delayed_sample",  # launch a delayed sample after the next step's resolve
    }
)

ACTIVE: frozenset[str] = frozenset()


@contextmanager
def plant(*names: str) -> Iterator[None]:
    """Switch on the named defects for the duration of a ``with`` block (tests only)."""
    global ACTIVE
    unknown = set(names) - DEFECTS
    if unknown:
        raise ValueError(f"unknown defect(s) {sorted(unknown)}; known: {sorted(DEFECTS)}")
    old, ACTIVE = ACTIVE, frozenset(names)
    try:
        yield
    finally:
        ACTIVE = old
