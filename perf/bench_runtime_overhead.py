"""The runtime's own host cost per step: OverlapRuntime against a hand-written loop and a minimal one.

    python -m perf.bench_runtime_overhead     # CI=1: batch 16 and 64, fewer steps and repeats

A zero-work model (``forward`` returns a view of a zero ``[n, 2]`` logits buffer, ``sample`` its
argmax) and ``max_running`` requests that decode forever, every request one token per step.
Lines, each in sync and overlap mode (under overlap a step's tokens are read after the next
step was launched):

* ``runtime_<mode>_<backend>``: ``OverlapRuntime(model, fmap, overlap=..., stream=backend,
  trace=False).run(DecodeScheduler(n), max_steps=STEPS)`` for backend ``inline`` (every
  forward-stream op at once on the host thread: the host path a GPU would see), ``worker``
  (the CPU worker thread) and, on a GPU, ``auto`` (CUDA streams).
* ``hand_<mode>``: :class:`perf.decode.HandLoop`, the same tensor work on a ``FutureMap`` with
  no runtime: alloc, the step's index data in a reusable staging buffer, one H2D copy (on a
  CPU map a fresh array and no copy, split on the stream), the decode prepare, forward,
  sample, store, the D2H copy of tokens and error flag, release.
  Inline on CPU (a side stream on a GPU).
* ``floor_<mode>``: the hand loop that also builds, per step, the checked ``Batch`` a scheduler
  hands the runtime and the ``StepResult`` that ``process`` gets (``HandLoop(batches=True)``):
  the floor of any runtime whose steps come as checked batches. ``floor / hand`` is what
  checking a batch costs; ``runtime / floor`` is the runtime's own loop.
* ``traced_overlap_<backend>``: the judged runtime line overlapped with ``trace=True`` (opt-in;
  the runtime's default is off): ``summary.json`` ``trace_cost`` is its ratio to the untraced line.
* ``minimal_<mode>``: :class:`perf.decode.MinimalLoop`, a minimal decode loop in plain torch, no
  ``FutureMap``: a token buffer indexed by request row; per step one H2D copy of the step's
  index data (rows, positions, lengths), gather of the last tokens, forward, sample, scatter
  into the buffer, one D2H copy of the tokens.

The contract's metric is the host thread's CPU time per step (``time.thread_time`` around a
run of ``STEPS`` steps): ``runtime_<mode>_inline`` (``_auto`` on a GPU) over ``hand_<mode>``
and over ``minimal_<mode>``, and ``hand`` over ``minimal``, at batch 16 and 64. Plots: that
metric, the process CPU time (``time.process_time``: with the worker backend, the worker
thread too) and wall time per step. All lines of a size are warmed up, then run interleaved,
``REPEATS`` times each (the CPU worker lines as a second group, after the others: their threads
slow whatever runs interleaved with them); ratios are medians of per-repeat ratios.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import torch
import triton

from perf import contract, harness
from perf.decode import DecodeScheduler, HandLoop, MinimalLoop, ZeroModel
from perf.harness import DEVICE, HAS_CUDA
from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime

MAX_RUNNING = harness.sweep([1, 16, 64, 256], [16, 64])
TARGET_BATCHES = [16, 64]  # where the contract judges the ratios
STEPS = harness.sweep([200], [60])[0]
REPEATS = harness.sweep([15], [7])[0]
BACKENDS = (["auto"] if HAS_CUDA else []) + ["worker", "inline"]
JUDGED = "auto" if HAS_CUDA else "inline"  # the backend the contract reads: the host path a GPU sees
MODES = ("sync", "overlap")
LINES = [f"runtime_{m}_{b}" for b in BACKENDS for m in MODES]
# The judged backend overlapped with tracing on (trace=True, opt-in): its cost.
TRACED = f"traced_overlap_{JUDGED}"
LINES += [TRACED]
LINES += [f"{kind}_{m}" for kind in ("hand", "floor", "minimal") for m in MODES]
COLORS = {
    "traced": "orange",
    "auto": "green",
    "worker": "blue",
    "inline": "red",
    "hand": "black",
    "floor": "purple",
    "minimal": "gray",
}
# Runtime lines colored by backend, the loops by kind; sync dashed.
STYLES = [
    (
        COLORS[line.split("_")[-1] if line.startswith("runtime") else line.split("_")[0]],
        "--" if "sync" in line else "-",
    )
    for line in LINES
]
METRICS = {"thread_cpu": 0, "cpu": 1, "wall": 2}  # column of measure()'s arrays


def make_runtime(n: int, overlap: bool, backend: str, trace: bool = False) -> Callable[[int], object]:
    """``run(steps)`` of an OverlapRuntime, tracing off unless ``trace``. The CPU backends
    (``worker``, ``inline``) run on a CPU map and model on a GPU host too."""
    dev = DEVICE if backend == "auto" else "cpu"
    rt = OverlapRuntime(
        ZeroModel(n, dev), FutureMap(4 * n + 64, device=dev), overlap=overlap, stream=backend, trace=trace
    )

    def run(steps: int) -> None:
        rt.run(DecodeScheduler(n), max_steps=steps)
        rt.close()

    return run


def make_run(line: str, n: int) -> Callable[[int], object]:
    kind, mode, *backend = line.split("_")
    overlap = mode == "overlap"
    if kind in ("runtime", "traced"):
        return make_runtime(n, overlap, backend[0], trace=kind == "traced")
    if kind in ("hand", "floor"):
        stream = "cuda" if HAS_CUDA else "inline"
        return HandLoop(ZeroModel(n, DEVICE), n, overlap, stream, DEVICE, batches=kind == "floor").run
    return MinimalLoop(n, overlap, DEVICE).run


def per_step(run: Callable[[int], object]) -> Callable[[], tuple[float, float, float]]:
    """One timed run of ``STEPS`` steps: (host thread CPU, process CPU, wall) us per step."""

    def once() -> tuple[float, float, float]:
        if HAS_CUDA:
            torch.cuda.synchronize()
        thread, cpu, wall = time.thread_time(), time.process_time(), time.perf_counter()
        run(STEPS)
        thread, cpu, wall = time.thread_time() - thread, time.process_time() - cpu, time.perf_counter() - wall
        return thread / STEPS * 1e6, cpu / STEPS * 1e6, wall / STEPS * 1e6

    return once


# Lines that cannot run here, and why.
CANNOT_RUN: dict[str, str] = {}


@functools.cache
def measure(n: int) -> dict[str, np.ndarray]:
    """``{line: [REPEATS, 3]}`` thread CPU, process CPU and wall us per step; lines that cannot
    run are left out."""
    # The CPU worker lines run as their own interleaved group, after the others: interleaved
    # with them, the worker threads' glibc malloc arenas slowed the single-threaded lines (the
    # judged ones), the runtime more than the loops (not so under MALLOC_ARENA_MAX=1): a cost
    # of sharing this process, not of those lines.
    out: dict[str, np.ndarray] = {}
    for threaded in (False, True):
        runs: dict[str, Callable[[], tuple[float, float, float]]] = {}
        for line in LINES:
            if line in CANNOT_RUN or line.endswith("_worker") != threaded:
                continue
            try:
                run = make_run(line, n)
                run(10)  # warm-up
            except Exception as exc:
                CANNOT_RUN[line] = f"{type(exc).__name__}: {exc}"
                print(f"runtime overhead: {line} cannot run: {CANNOT_RUN[line]}")
                continue
            runs[line] = per_step(run)
        out.update(harness.interleaved(runs, REPEATS))
    return out


@triton.testing.perf_report(
    [
        triton.testing.Benchmark(
            x_names=["max_running"],
            x_vals=MAX_RUNNING,
            x_log=True,
            y_log=True,
            line_arg="impl",
            line_vals=LINES,
            line_names=LINES,
            styles=STYLES,
            xlabel=f"requests decoding per step (zero-work model, {DEVICE}; {about})",
            ylabel="us",
            plot_name=f"runtime_{metric}_per_step",
            args={"metric": metric},
        )
        for metric, about in (
            ("thread_cpu", "host thread CPU time"),
            ("cpu", "process CPU time"),
            ("wall", "wall time"),
        )
    ]
)
def runtime_per_step(max_running: int, impl: str, metric: str) -> harness.Timing:
    """Host thread CPU time (the contract's metric), process CPU time (host thread plus worker) or
    wall time per decode step: median, p20-p80 over repeats."""
    samples = measure(max_running).get(impl)
    return harness.NAN3 if samples is None else harness.band(samples[:, METRICS[metric]])


def look(bench: triton.testing.Benchmark) -> harness.Look:
    """Per metric: its unit; on the contract's metric, the bounds of the judged runtime lines
    against the checked floor of their mode (the contract judges batch 16 and 64)."""
    metric = bench.args["metric"]
    what = {"thread_cpu": "host thread CPU time", "cpu": "process CPU time", "wall": "wall time"}[metric]
    refs = []
    if metric == "thread_cpu":
        for mode in MODES:
            path = f"runtime_overhead.thread_cpu_over_floor.runtime_{mode}_{JUDGED}"
            limit = next(t[2] for t in contract.TARGETS if t[3] == path)
            refs.append(
                harness.Ref(
                    f"contract: runtime_{mode}_{JUDGED} \u2264 {limit:g}{harness.TIMES}floor_{mode}",
                    functools.partial(lambda lim, line, m: lim * m[line], limit, f"floor_{mode}"),
                    color="black",
                    ls=(0, (3, 1, 1, 1, 1, 1)) if mode == "overlap" else (0, (1, 1)),
                )
            )
    return harness.Look(
        what=f"the runtime's own cost, zero-work model: {what} per step",
        ylabel=f"{what} per step (µs)",
        xlabel=f"requests decoding per step (zero-work model, {DEVICE})",
        refs=tuple(refs),
    )


def ratio(n: int, num: str, den: str, metric: str = "thread_cpu") -> float | None:
    """Median over repeats of ``num / den`` (``metric``), or None if a line did not run."""
    m = measure(n)
    if num not in m or den not in m:
        return None
    col = METRICS[metric]
    return round(float(np.median(m[num][:, col] / m[den][:, col])), 3)


def main() -> None:
    harness.save(runtime_per_step, look)
    for line, why in CANNOT_RUN.items():
        harness.skip(f"runtime overhead line {line}", why)
    sizes = [n for n in TARGET_BATCHES if n in MAX_RUNNING]
    over_hand: dict[str, dict[str, float | None]] = {}
    over_minimal: dict[str, dict[str, float | None]] = {}
    over_floor: dict[str, dict[str, float | None]] = {}
    for mode in MODES:
        judged = f"runtime_{mode}_{JUDGED}"
        over_hand[judged] = {str(n): ratio(n, judged, f"hand_{mode}") for n in sizes}
        over_hand[f"floor_{mode}"] = {str(n): ratio(n, f"floor_{mode}", f"hand_{mode}") for n in sizes}
        over_floor[judged] = {str(n): ratio(n, judged, f"floor_{mode}") for n in sizes}
        for num in (judged, f"hand_{mode}", f"floor_{mode}"):
            over_minimal[num] = {str(n): ratio(n, num, f"minimal_{mode}") for n in sizes}
    # Every runtime line at every size, process CPU over the hand loop of its mode (information).
    cpu_over_hand = {
        line: {str(n): ratio(n, line, f"hand_{line.split('_')[1]}", "cpu") for n in MAX_RUNNING}
        for line in LINES
        if line.startswith("runtime") and line not in CANNOT_RUN
    }
    us = {
        line: {str(n): round(float(np.median(measure(n)[line][:, 0])), 2) for n in MAX_RUNNING}
        for line in LINES
        if line not in CANNOT_RUN
    }
    harness.record(
        "runtime_overhead",
        {
            "max_running": MAX_RUNNING,
            "steps": STEPS,
            "repeats": REPEATS,
            "judged_backend": JUDGED,
            "thread_cpu_us_per_step": us,
            "thread_cpu_over_hand": over_hand,
            "thread_cpu_over_minimal": over_minimal,
            "thread_cpu_over_floor": over_floor,
            # trace=True over trace=False, the judged backend overlapped: what tracing costs.
            "trace_cost": {str(n): ratio(n, TRACED, f"runtime_overlap_{JUDGED}") for n in sizes},
            "cpu_over_hand": cpu_over_hand,
        },
    )
    print(f"host thread CPU us per step (median of {REPEATS} interleaved repeats, {STEPS} steps each):")
    for line, values in us.items():
        print(f"  {line:24s} {values}")
    print(f"host thread CPU per step, {JUDGED} stream, trace off (median of per-repeat ratios):")
    for name, table in (("/ hand", over_hand), ("/ floor", over_floor), ("/ minimal", over_minimal)):
        for line, got in table.items():
            print(f"  {line:24s} {name:10s} {got}")
    print(
        f"tracing on / off, {JUDGED} stream overlapped:",
        {str(n): ratio(n, TRACED, f"runtime_overlap_{JUDGED}") for n in sizes},
    )
    print("process CPU per step / hand loop of the same mode (information):")
    for line, got in cpu_over_hand.items():
        print(f"  {line:24s} {got}")


if __name__ == "__main__":
    main()
