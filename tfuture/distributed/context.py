"""Process groups of a tensor- and pipeline-parallel run: :class:`ParallelContext`.

Ranks are laid out stage-major: global rank ``pp_rank * tp + tp_rank``, so the ranks of one
tensor-parallel group are neighbours (one node). Every rank creates every group in the same
order, as ``torch.distributed.new_group`` requires:

* ``tp_group``: the ranks of this rank's stage (all-reduces of the model, the token broadcast);
* ``hidden_group`` / ``token_group``: the ranks with this rank's ``tp_rank`` across stages. Hidden
  states go stage to stage on the first, sampled tokens from the last stage back on the second:
  two communicators, so that a token send never queues behind a hidden-state send (with NCCL,
  point-to-point ops of one communicator run in order on one stream);
* ``host_group``: gloo over all ranks, for host-side agreement checks (configuration, the debug
  digest of every step's batch), issued only by the host thread;
* ``check_group``: the device backend over all ranks, for debug checks issued on the forward
  stream (the digest of the stored tokens).

Each group is used from one thread only, so its collectives are issued in the same order on
every rank. The rendezvous store (``store``) carries the failure protocol of
:mod:`tfuture.distributed.failure`.
"""

from __future__ import annotations

import datetime
import gc
import numbers
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tfuture.core.checks import as_count

__all__ = ["ParallelContext", "free_port", "init_parallel"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(eq=False)
class ParallelContext:
    """Where this rank sits in a ``tp x pp`` run, and the process groups it talks through.

    ``device`` is ``cuda:<local_rank>`` with NCCL, else the CPU (gloo). ``timeout`` (seconds) is
    the process groups' timeout: a collective that waits longer raises on that rank.
    """

    tp: int
    pp: int
    rank: int
    world: int
    backend: str
    device: torch.device
    timeout: float
    store: Any
    tp_group: Any = None
    hidden_group: Any = None
    token_group: Any = None
    host_group: Any = None
    check_group: Any = None
    runs: int = 0
    closed: bool = False
    _own_pg: bool = field(default=True, repr=False)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        """The global rank of stage ``pp_rank``'s tensor-parallel rank ``tp_rank``."""
        if not (0 <= pp_rank < self.pp and 0 <= tp_rank < self.tp):
            raise ValueError(
                f"no rank at stage {pp_rank}, tp rank {tp_rank} in a tp={self.tp} x pp={self.pp} run"
            )
        return pp_rank * self.tp + tp_rank

    def next_run(self) -> str:
        """A store key prefix for the next run (every rank counts its runs the same way)."""
        self.runs += 1
        return f"tfuture/run{self.runs}"

    def abort(self) -> None:
        """After a failure: abort NCCL communicators first (``ncclCommAbort`` makes kernels
        blocked on a failed peer exit, where a destroy could wait on them), then :meth:`close`.
        Gloo groups need no abort: closing their connections is what unblocks the peers."""
        if not self.closed and self.backend == "nccl":
            for g in (self.tp_group, self.hidden_group, self.token_group, self.check_group):
                try:
                    if g is not None:
                        g.abort()
                except Exception:
                    pass  # best effort: close() still tears everything down
        self.close()

    def close(self) -> None:
        """Tear the process groups down (``destroy_process_group``); idempotent.

        A gloo group closes its connections when its last reference goes: this drops the
        context's own and collects garbage, so that a peer blocked on this rank fails at once.
        A model that keeps its own reference to a group (rather than reading ``ctx.tp_group``)
        keeps that group open until it is collected; peers then wait for the timeout.
        """
        if self.closed:
            return
        self.closed = True
        try:
            if self._own_pg and dist.is_initialized():
                dist.destroy_process_group()
        finally:
            self.tp_group = self.hidden_group = self.token_group = self.host_group = self.check_group = None
            gc.collect()

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ParallelContext(rank={self.rank}/{self.world}, tp={self.tp_rank}/{self.tp}, "
            f"pp={self.pp_rank}/{self.pp}, backend={self.backend}, device={self.device})"
        )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    timeout_s: float = 60.0,
) -> ParallelContext:
    """Join (or start) a ``tp x pp`` run over ``torch.distributed`` and create its groups.

    Under ``torchrun`` every argument but ``tp``/``pp`` comes from the environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Without them and without
    ``world_size``, a single-process run (world size 1) starts on a free loopback port.
    ``backend``: by default ``"nccl"`` when every local rank has a GPU of its own (NCCL refuses
    two ranks on one device), else ``"gloo"`` on the CPU.

    Raises ``ValueError`` when ``tp * pp`` is not the world size, or when the ranks disagree on
    ``tp``, ``pp`` or the world size (checked through the rendezvous store before any group).
    """
    tp, pp = as_count("tp", tp), as_count("pp", pp)
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    timeout_s = _check_timeout(timeout_s)
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    if world_size is None:
        world_size, rank = 1, 0
    if rank is None:
        raise ValueError(f"world_size={world_size} given but no rank (pass rank= or set RANK)")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    if tp * pp != world_size:
        raise ValueError(
            f"tp x pp must equal the world size: tp={tp} x pp={pp} = {tp * pp}, world size {world_size}"
        )
    local_ranks = _env_int("LOCAL_WORLD_SIZE") or world_size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        backend = "nccl" if gpus >= local_ranks else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and gpus < local_ranks:
        raise ValueError(
            f"backend 'nccl' needs a GPU per local rank: {local_ranks} local rank(s), {gpus} GPU(s) "
            "(use backend='gloo')"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized; init_parallel creates its own process group"
        )
    if backend == "nccl":
        local = _env_int("LOCAL_RANK")
        device = torch.device("cuda", rank % torch.cuda.device_count() if local is None else local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = master_port if master_port is not None else _env_int("MASTER_PORT")
    if port is None:
        if world_size > 1:
            raise ValueError("a multi-rank run needs master_port= (or MASTER_PORT in the environment)")
        port = free_port(addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    url = "env://" if "TORCHELASTIC_RUN_ID" in os.environ else f"tcp://{addr}:{port}"
    store, _, _ = next(dist.rendezvous(url, rank=rank, world_size=world_size, timeout=timeout))
    _agree_on_layout(store, rank, world_size, tp, pp, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    ctx = ParallelContext(tp, pp, rank, world_size, backend, device, float(timeout_s), store)
    try:
        _make_groups(ctx, backend, timeout)
    except BaseException:
        ctx.close()
        raise
    return ctx


# The process groups take a timedelta (at most 999,999,999 days) that torch turns into int64
# milliseconds: a bound far past any real wait, named in the error instead of an OverflowError.
MAX_TIMEOUT_S = 10**9


def _check_timeout(timeout_s: object) -> float:
    """``timeout_s`` as a float in ``(0, MAX_TIMEOUT_S]``, else a ``TypeError``/``ValueError`` naming it."""
    if isinstance(timeout_s, bool | np.bool_) or not isinstance(timeout_s, numbers.Real):
        raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
    if not 0 < float(timeout_s) <= MAX_TIMEOUT_S:  # False for nan and inf too
        raise ValueError(
            f"timeout_s must be > 0 and at most {MAX_TIMEOUT_S} seconds (a process group needs a finite "
            f"timeout), got {timeout_s}"
        )
    return float(timeout_s)


def _agree_on_layout(store: Any, rank: int, world: int, tp: int, pp: int, timeout_s: float) -> None:
    """Every rank posts its (world size, tp, pp); all must match, or every rank raises."""
    mine = f"{world},{tp},{pp}"
    store.set(f"tfuture/layout/{rank}", mine)
    keys = [f"tfuture/layout/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise ValueError(
            f"rank {rank} expected {world} ranks (tp={tp} x pp={pp}) but not all of them joined within "
            f"{timeout_s:.0f} s: mismatched world sizes, or a rank did not start"
        ) from exc
    values = [store.get(key).decode() for key in keys]
    hold_store_until_read(store, "tfuture/layout", rank, world, timeout_s)
    for r, theirs in enumerate(values):
        if theirs != mine:
            w, t, p = theirs.split(",")
            raise ValueError(
                f"ranks disagree on the layout: rank {rank} has world size {world}, tp={tp}, pp={pp}; "
                f"rank {r} has world size {w}, tp={t}, pp={p}"
            )


def hold_store_until_read(store: Any, key: str, rank: int, world: int, timeout_s: float) -> None:
    """Say that this rank read what it needed under ``key``; rank 0 (which hosts the store when
    torchrun's agent does not) then waits until every rank did, so its server outlives their
    reads. Bounded by ``timeout_s``; a rank that never acknowledges only costs the wait."""
    try:
        store.set(f"{key}/read/{rank}", "1")
        if rank == 0:
            store.wait([f"{key}/read/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))
    except Exception:
        pass


def _make_groups(ctx: ParallelContext, backend: str, timeout: datetime.timedelta) -> None:
    """Create every group on every rank, in one order (``new_group`` is collective)."""
    tp, pp = ctx.tp, ctx.pp
    for s in range(pp):
        g = dist.new_group([s * tp + t for t in range(tp)], timeout=timeout, backend=backend)
        if s == ctx.pp_rank:
            ctx.tp_group = g
    for t in range(tp):
        ranks = [s * tp + t for s in range(pp)]
        hidden = dist.new_group(ranks, timeout=timeout, backend=backend)
        token = dist.new_group(ranks, timeout=timeout, backend=backend)
        if t == ctx.tp_rank:
            ctx.hidden_group, ctx.token_group = hidden, token
    everyone = list(range(ctx.world))
    ctx.host_group = dist.new_group(everyone, timeout=timeout, backend="gloo")
    ctx.check_group = dist.new_group(everyone, timeout=timeout, backend=backend)
