"""Rows of per-request tables: one allocator for every table indexed by a request's row.

A request gets a row when it is admitted, keeps it every step, and gives it back when the
scheduler says it ended (:attr:`tfuture.core.batch.Batch.ended`). The sampler's parameter
table and device token history, and a model's KV cache, are such tables.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["RowAllocator", "RowsFull"]


class RowsFull(ValueError):
    """No free row for request ``rid``."""

    def __init__(self, message: str, rid: int) -> None:
        super().__init__(message)
        self.rid = rid


class RowAllocator:
    """Host bookkeeping of rows ``first .. first + n - 1`` for request ids.

    ``on_full(rid)`` builds the error message when no row is free for request ``rid``
    (the allocator raises ``ValueError`` with it).
    """

    def __init__(self, n: int, first: int = 0, on_full: Callable[[int], str] | None = None) -> None:
        self.n, self.first = n, first
        self.on_full = on_full
        self.held: dict[int, int] = {}
        self.free: list[int] = list(range(first + n - 1, first - 1, -1))  # pop() hands out `first`

    def __len__(self) -> int:
        return len(self.held)

    @property
    def n_free(self) -> int:
        return len(self.free)

    def get(self, rid: int, default: int = -1) -> int:
        """The row of ``rid``, or ``default`` when it holds none."""
        return self.held.get(rid, default)

    def rows(self, req_ids: np.ndarray, default: int = -1) -> np.ndarray:
        """``[n]`` int64 rows of ``req_ids`` (``default`` where a request holds none)."""
        held = self.held
        return np.array([held.get(r, default) for r in req_ids.tolist()], dtype=np.int64)

    def take(self, req_ids: list[int]) -> list[int]:
        """A fresh row for each of ``req_ids`` (none may hold one), all or nothing."""
        held, free = self.held, self.free
        if len(req_ids) > len(free):
            rid = req_ids[len(free)]
            raise RowsFull(self._full(rid), rid)
        rows: list[int] = []
        for rid in req_ids:
            if rid in held:
                for done in req_ids[: len(rows)]:  # undo this call
                    free.append(held.pop(done))
                raise ValueError(f"request id {rid} already holds row {held[rid]}: ids must be unique")
            row = held[rid] = free.pop()
            rows.append(row)
        return rows

    def rows_or_take(self, req_ids: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Each request's row, taking a fresh one for a request that holds none; and the fresh
        rows, in order. On exhaustion nothing is taken and ``ValueError`` names the request."""
        held = self.held
        ids = req_ids.tolist()
        rows = [held.get(rid, -1) for rid in ids]
        if -1 not in rows:  # steady state: every request holds its row already
            return np.array(rows, dtype=np.int64), []
        new_ids = list(dict.fromkeys(rid for rid, row in zip(ids, rows, strict=True) if row < 0))
        new = self.take(new_ids)
        return np.array([held[rid] for rid in ids], dtype=np.int64), new

    def grow(self, extra: int) -> None:
        """Add ``extra`` rows past the last one."""
        top = self.first + self.n
        self.free[:0] = range(top + extra - 1, top - 1, -1)  # handed out after the current ones
        self.n += extra

    def release(self, req_ids: np.ndarray) -> None:
        """Free the rows of requests that ended (ids without a row are ignored)."""
        held, free = self.held, self.free
        for rid in req_ids.tolist():
            row = held.pop(rid, None)
            if row is not None:
                free.append(row)

    def reset(self) -> None:
        """Free every row."""
        self.held = {}
        self.free = list(range(self.first + self.n - 1, self.first - 1, -1))

    def _full(self, rid: int) -> str:
        if self.on_full is not None:
            return self.on_full(rid)
        return f"no free row for request {rid}: all {self.n} rows are held by live requests"
