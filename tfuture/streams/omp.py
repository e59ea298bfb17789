"""The host thread's OpenMP team, parked while a :class:`~tfuture.streams.backends.CpuStream` runs.

Torch's CPU ops parallelise with OpenMP, and GNU OpenMP (``libgomp``, the runtime of the Linux
torch wheels) keeps one pool of helper threads per thread that ever ran a parallel region. When
the pools' threads together outnumber the cores, every pool falls back to "throttled" waits:
a helper sleeps on a futex after about a thousand spins, so each parallel region pays a wake-up.
A program that ran anything parallel on its main thread (building the model is enough) owns such
a pool; the forward stream's worker thread then gets a second one, and with two intra-op
threads on a 2-core machine each ``linear`` of a small model took 4-6x its time on the main
thread (``perf/bench_generate.py``'s 2-thread cells: the worker backend at 2.5x the inline one).

:class:`HostTeamParked` releases the host thread's pool (``omp_pause_resource_all``, which in
libgomp frees the calling thread's pool) and sets the host thread's own team size to 1
(``omp_set_num_threads`` is per thread), so that the host's small ops stay serial and do not
build the pool again while the worker runs the forward. The worker keeps torch's intra-op
thread count (``torch.set_num_threads``). The last stream on a thread to close restores the
team size; the pool comes back by itself at the next parallel op. Torch ops that a callback
runs on the host thread during a run are serial. Only the host thread's own pool can be
released: where another thread that ran parallel ops lives on (the main thread, while an
``Engine`` drives its runtime from its background thread), its pool still counts.

Nothing happens where libgomp is not loaded (LLVM or Intel OpenMP, other platforms): those
runtimes do not throttle this way.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch

__all__ = ["HostTeamParked", "libgomp"]

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t
_NEEDED = ("omp_pause_resource_all", "omp_get_max_threads", "omp_set_num_threads")


def libgomp() -> Any | None:
    """The GNU OpenMP library already loaded in this process (by torch), or None."""
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:
        return None
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=noload)
    except OSError:
        return None
    if not all(hasattr(lib, f) for f in _NEEDED):
        return None
    return lib


class HostTeamParked:
    """Per thread and reference-counted: the first :meth:`acquire` on a thread saves its team size,
    parks its pool and sets the size to 1; the matching last :meth:`release` on that thread
    restores the size. A release on another thread than its acquire is ignored (the setting is
    the acquiring thread's own)."""

    def __init__(self) -> None:
        self._lib = libgomp()
        self._local = threading.local()

    def acquire(self) -> threading.Thread:
        """Park the calling thread's team; returns the thread, for :meth:`release`."""
        me = threading.current_thread()
        lib, loc = self._lib, self._local
        if lib is not None:
            users = getattr(loc, "users", 0)
            if users == 0:
                # Torch sets a thread's team size at the thread's first parallel op (its lazy
                # per-thread init): done now, so that it cannot undo the park later.
                torch.get_num_threads()
                loc.saved = int(lib.omp_get_max_threads())
                try:
                    lib.omp_set_num_threads(1)
                    lib.omp_pause_resource_all(_OMP_PAUSE_SOFT)
                except BaseException:  # a Ctrl-C here: the thread keeps its team size
                    lib.omp_set_num_threads(loc.saved)
                    raise
            loc.users = users + 1
        return me

    def release(self, owner: threading.Thread) -> None:
        """Undo one :meth:`acquire` made on ``owner`` (a no-op on any other thread)."""
        lib, loc = self._lib, self._local
        if lib is None or threading.current_thread() is not owner:
            return
        users = getattr(loc, "users", 0)
        if users <= 0:
            return
        loc.users = users - 1
        if loc.users == 0:
            lib.omp_set_num_threads(loc.saved)


HOST_TEAM = HostTeamParked()
