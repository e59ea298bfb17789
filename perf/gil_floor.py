"""How much host Python a CPU forward can hide: the floor under overlap on the CPU backend.

    python -m perf.gil_floor            # about a minute; one torch thread

On the CPU backend the forward runs on a worker thread while the host thread schedules the next
step. Both are Python, and one GIL serialises them: overlap hides host work only while the
forward is inside a torch kernel (which releases the GIL). This measures that share directly,
without tfuture: a thread runs ``N`` forwards of ``bench_generate``'s random-weight Llama
(decode-shaped, ``batch`` tokens of one position each, no cache) while the main thread runs a
pure-Python loop sized to about 30% of the forwards' time, as a host's per-step work is.

Second table: what one hand-off to the worker and back costs on this machine, without torch: a
thread answers each request from a queue after ``busy`` microseconds of Python, and the round
trip beyond ``busy`` is the cost of two thread wake-ups. On a virtual machine whose idle CPUs
halt (Linux ``cpuidle`` ``haltpoll``), a thread that waited longer than the halt-poll window is
woken through the hypervisor, and each wake-up then costs tens to hundreds of microseconds: the
CPU worker pays it at least once per step, where inline ops pay nothing.

Per cell, medians of ``REPEATS``: ``forward`` alone, ``host`` alone, ``together`` (both
started at once, until both ended), and ``hidden = (forward + host - together) / host``: 1 when
the host's work fits entirely into the forward's GIL-free time, 0 when the two run one after the
other (sync mode's cost), below 0 when contention costs more than running them in turn. Two GIL
switch intervals: the 30 us the CPU worker sets while it runs (so that a device op never waits
5 ms for the GIL) and Python's default 5 ms.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import numpy as np
import torch

from perf import bench_generate

CELLS = [("3M", 1, 60), ("3M", 8, 60), ("80M", 8, 12)]  # model, batch, forwards per run
INTERVALS = [3e-5, 5e-3]
REPEATS = 5
HOST_SHARE = 0.3


def _spin(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def _cell(model: object, batch: int, n_fwd: int) -> tuple[float, float, float]:
    ids = torch.randint(3, 1000, (batch, 1))

    def forwards() -> None:
        with torch.inference_mode():
            for _ in range(n_fwd):
                model(input_ids=ids, use_cache=False)  # type: ignore[operator]

    forwards()  # warm-up
    t0 = time.perf_counter()
    forwards()
    fwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    _spin(100_000)
    per = (time.perf_counter() - t0) / 100_000
    n = int(HOST_SHARE * fwd / per)
    t0 = time.perf_counter()
    _spin(n)
    host = time.perf_counter() - t0
    worker = threading.Thread(target=forwards)
    t0 = time.perf_counter()
    worker.start()
    _spin(n)
    worker.join()
    together = time.perf_counter() - t0
    return fwd, host, together


def _handoff(busy_us: float, n: int = 400) -> float:
    """Microseconds one request/answer round trip through two queues costs beyond ``busy_us``
    of work on the answering thread (the median over ``n`` round trips)."""
    ask: queue.SimpleQueue[float | None] = queue.SimpleQueue()
    answer: queue.SimpleQueue[float] = queue.SimpleQueue()

    def serve() -> None:
        while (work := ask.get()) is not None:
            end = time.perf_counter() + work
            while time.perf_counter() < end:
                pass
            answer.put(work)

    thread = threading.Thread(target=serve)
    thread.start()
    trips = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            ask.put(busy_us * 1e-6)
            answer.get()
            trips.append(time.perf_counter() - t0)
    finally:
        ask.put(None)
        thread.join()
    return float(np.median(trips)) * 1e6 - busy_us


def _cpuidle() -> str:
    try:
        with open("/sys/devices/system/cpu/cpuidle/current_driver") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def main() -> None:
    torch.set_num_threads(1)
    saved = sys.getswitchinterval()
    head = ("model", "batch", "interval", "forward ms", "host ms", "together ms", "hidden")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 5, 9, 11, 8, 12, 7), strict=True)))
    try:
        for size, batch, n_fwd in CELLS:
            model = bench_generate.build(size)
            for interval in INTERVALS:
                sys.setswitchinterval(interval)
                runs = np.array([_cell(model, batch, n_fwd) for _ in range(REPEATS)])
                fwd, host, together = np.median(runs, axis=0)
                hidden = np.median((runs[:, 0] + runs[:, 1] - runs[:, 2]) / runs[:, 1])
                print(
                    f"{size:>5} {batch:>5} {interval * 1e6:>7.0f}us {fwd * 1e3:>11.1f} {host * 1e3:>8.1f} "
                    f"{together * 1e3:>12.1f} {hidden:>7.2f}"
                )
    finally:
        sys.setswitchinterval(saved)
    print(f"\nhand-off to a thread and back (cpuidle driver: {_cpuidle()})")
    print(f"{'busy us':>8} {'round trip beyond busy, us':>27}")
    for busy in (0, 50, 200, 500, 2000):
        print(f"{busy:>8} {_handoff(busy):>27.1f}")


if __name__ == "__main__":
    main()
