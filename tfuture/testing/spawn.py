"""Run a function on ``world`` local ranks (``torch.multiprocessing`` spawn), bounded in time.

For tests, benchmarks and smoke checks on one machine. :class:`RankPool` keeps its worker
processes between calls (importing torch costs seconds per process): each call sends
``fn(rank, world, port, *args)`` to every worker with a fresh free loopback ``port`` and
collects each rank's return value. A call that raises on a rank, a worker that dies, or a
call that outlives ``timeout_s`` raises :class:`RankProcessError`; after a death or a timeout
every worker is killed and the next call starts new ones. Workers run with one torch thread
(``OMP_NUM_THREADS=1``, set in their environment before they import anything) and inherit the
parent's environment otherwise: under the test suite (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` without CUDA) they run the kernels through the Triton interpreter too.
``interpret=True``/``False`` forces the interpreter on or off in the workers.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tfuture.distributed.context import free_port

__all__ = ["RankPool", "RankProcessError", "run_ranks"]

_STOP = None


class RankProcessError(RuntimeError):
    """A rank raised, died, or a call did not finish in time."""


def _worker(rank: int, world: int, inbox: Any, outbox: Any) -> None:
    torch.set_num_threads(1)
    while True:
        task = inbox.get()
        if task is _STOP:
            return
        fn, port, args = task
        try:
            outbox.put((rank, True, fn(rank, world, port, *args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
        finally:
            if dist.is_initialized():  # a task that left its group behind must not break the next
                try:
                    dist.destroy_process_group()
                except Exception:
                    pass


class RankPool:
    """``world`` worker processes that run one function on every rank per :meth:`run` call."""

    def __init__(self, world: int, *, interpret: bool | None = None) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world, self.interpret = world, interpret
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        env: dict[str, str | None] = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        if self.interpret is not None:
            env["TRITON_INTERPRET"] = "1" if self.interpret else None
        saved = {k: os.environ.get(k) for k in env}
        for k, v in env.items():  # spawned children copy the environment at start
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            self._outbox = ctx.Queue()
            self._inboxes = [ctx.Queue() for _ in range(self.world)]
            self._procs = [
                ctx.Process(target=_worker, args=(r, self.world, self._inboxes[r], self._outbox), daemon=True)
                for r in range(self.world)
            ]
            for p in self._procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> list[Any]:
        """``[fn(rank, world, port, *args) for each rank]``; ``fn`` must be importable (module level)."""
        if not self._procs:
            self._start()
        port = free_port()
        for inbox in self._inboxes:
            inbox.put((fn, port, args))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < self.world:
            left = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if left <= 0 or dead:
                self.close(kill=True)
                why = f"rank(s) {dead} died" if dead else f"not finished after {timeout_s:.0f} s"
                raise RankProcessError(
                    f"{getattr(fn, '__name__', fn)} on {self.world} ranks: {why} (workers killed)"
                )
            try:
                rank, ok, value = self._outbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            (results if ok else errors)[rank] = value
        if errors:
            first = min(errors)
            raise RankProcessError(f"rank(s) {sorted(errors)} raised; rank {first}:\n{errors[first]}")
        return [results[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        """Stop the workers (``kill``: at once, for a hung or broken pool)."""
        procs, self._procs = self._procs, []
        if not kill:
            for inbox in self._inboxes:
                inbox.put(_STOP)
            for p in procs:
                p.join(2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self._inboxes = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """One call of :meth:`RankPool.run` on a fresh pool."""
    with RankPool(world) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s)
