"""What every rank does when a run ends: agree that all ranks succeeded, or fail together.

The forward stream of a failing rank skips its later ops, so its peers would wait in their
next collective until the process group's timeout. Instead, a rank whose run raised (its
runtime already drained its stream and released every slot):

1. claims the run's *first failure* in the rendezvous store (``compare_set``: one winner), and
   posts its own status;
2. tears its process groups down (``destroy_process_group``; NCCL communicators are aborted
   first): a gloo peer blocked in a collective or a receive from it fails at once ("connection
   closed by peer") instead of timing out, and fails in turn. An NCCL peer's
   :class:`FailureWatcher` sees the claim in the store and aborts its own communicators, so
   its kernels blocked on the failed rank exit;
3. waits, bounded by the timeout, until every rank posted a status, reads them, and (rank 0,
   which may host the store) waits until every rank read them, then raises.

The first failing rank re-raises its own exception. A rank whose run failed because a peer's
groups went away raises :class:`RankFailure`, naming the first failing rank and its error,
chained from its local error; any other local error re-raises as it is. A rank whose run
succeeded posts ``ok`` and waits for everyone's status: if another rank failed it tears down
and raises :class:`RankFailure` too. The process group's timeout bounds every wait.
"""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist

from tfuture.distributed.context import ParallelContext, hold_store_until_read

__all__ = ["FailureWatcher", "RankFailure", "fail_run", "finish_run", "is_comm_error"]

_COMM_MARKERS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl",
    "gloo",
    "process group",
    "processgroup",
)


class RankFailure(RuntimeError):
    """Another rank of the run failed first; ``origin_rank`` and ``origin`` say which and how."""

    def __init__(self, message: str, origin_rank: int, origin: str) -> None:
        super().__init__(message)
        self.origin_rank, self.origin = origin_rank, origin


def is_comm_error(exc: BaseException) -> bool:
    """True for an error of a ``torch.distributed`` operation (a peer gone, a timeout)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(cur, dist_error):
            return True
        if isinstance(cur, RuntimeError) and any(m in str(cur).lower() for m in _COMM_MARKERS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _describe(ctx: ParallelContext, exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"rank {ctx.rank} (stage {ctx.pp_rank}, tp rank {ctx.tp_rank}): {type(exc).__name__}: {text}"[
        :1500
    ]


def _wait_statuses(ctx: ParallelContext, key: str) -> dict[int, str]:
    """Every rank's posted status (bounded by the timeout); a missing rank reads as 'no status'.
    Rank 0 returns only once every rank read them (its process may host the store)."""
    keys = [f"{key}/status/{r}" for r in range(ctx.world)]
    try:
        ctx.store.wait(keys, datetime.timedelta(seconds=ctx.timeout))
    except Exception:
        pass
    out = {}
    for r, k in enumerate(keys):
        try:
            out[r] = ctx.store.get(k).decode() if ctx.store.check([k]) else "no status"
        except Exception:
            out[r] = "no status (the store is gone)"
    first = f"{key}/first"
    try:
        out[-1] = ctx.store.get(first).decode() if ctx.store.check([first]) else ""
    except Exception:
        out[-1] = ""
    hold_store_until_read(ctx.store, key, ctx.rank, ctx.world, ctx.timeout)
    return out


def _origin(first: str) -> int:
    try:
        return int(first.split()[1])
    except (IndexError, ValueError):
        return -1


def fail_run(ctx: ParallelContext, key: str, exc: BaseException) -> BaseException:
    """Steps 1-3 above for a rank whose run raised ``exc``; returns what to raise."""
    mine = _describe(ctx, exc)
    try:
        first = ctx.store.compare_set(f"{key}/first", "", mine).decode()
    except Exception:
        first = mine  # the store is gone: report what this rank knows
    try:
        ctx.store.set(f"{key}/status/{ctx.rank}", "error: " + mine)
    except Exception:
        pass
    try:
        ctx.abort()
    finally:
        _wait_statuses(ctx, key)
    note = f"tfuture: the distributed run failed; first failure: {first}; process groups torn down"
    if first == mine:
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        return exc
    if is_comm_error(exc):
        err = RankFailure(
            f"rank {ctx.rank} stopped because another rank failed first: {first}", _origin(first), first
        )
        err.__cause__ = exc
        return err
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    return exc


def finish_run(ctx: ParallelContext, key: str) -> None:
    """After a clean run on this rank: post ``ok``, wait for every rank, raise if one failed."""
    ctx.store.set(f"{key}/status/{ctx.rank}", "ok")
    statuses = _wait_statuses(ctx, key)
    first = statuses.pop(-1)
    bad = {r: s for r, s in statuses.items() if s != "ok"}
    if not bad:
        return
    ctx.abort()
    r, status = next(iter(bad.items()))
    first = first or f"rank {r}: {status}"
    raise RankFailure(
        f"rank {ctx.rank} finished its run, but rank(s) {sorted(bad)} did not: first failure: {first}; "
        "process groups torn down",
        _origin(first),
        first,
    )


class FailureWatcher:
    """NCCL only: a thread that aborts this rank's communicators once another rank claimed the
    run's first failure, so that a kernel blocked on the failed peer exits (a gloo peer closes
    its connections instead, which needs no watcher). The aborted communicators make this
    rank's next collective raise, and its run then fails through :func:`fail_run`."""

    def __init__(self, ctx: ParallelContext, key: str, poll_s: float = 0.05) -> None:
        self.ctx, self.key, self.poll_s = ctx, key, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tfuture-failure-watcher", daemon=True)

    def __enter__(self) -> FailureWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        first = [f"{self.key}/first"]
        while not self._stop.wait(self.poll_s):
            try:
                if not self.ctx.store.check(first):
                    continue
            except Exception:
                return  # the store is gone: the run is ending anyway
            for g in (self.ctx.tp_group, self.ctx.hidden_group, self.ctx.token_group, self.ctx.check_group):
                try:
                    if g is not None:
                        g.abort()
                except Exception:
                    pass
            return
