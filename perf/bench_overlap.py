"""Overlapped and sync step time against the NOMINAL max(T_cpu, T_dev), and the runtime's own host time.

    python -m perf.bench_overlap          # CI=1: 1, 4 and 10 ms at batch 16, fewer steps

Per point (T_cpu = T_dev = T ms, ``bs`` requests decoding): ``ToyModel(work_s=T)`` does ``T`` of
stand-in device work per forward (``torch.cuda._sleep`` on a GPU, a sleep on the CPU worker)
plus its own ~28 small torch ops, and :class:`perf.decode.DecodeScheduler` spins ``T`` on the
host per processed step (Python holding the GIL). The runtime runs on the CPU worker backend
(``stream="worker"``; CUDA streams on a GPU) with ``trace=False``. Lines, per batch size:

* ``overlap``, ``sync``: ``OverlapRuntime(..., overlap=True / False)``.
* ``graphs`` (CUDA only): ``OverlapRuntime(..., overlap=True, buckets=Buckets((bs,), (bs,)),
  graphs=True)``: every step is the bucket's captured step graph (one H2D copy, one replay, one
  D2H copy). On a CPU map a step graph is only emulated (no speedup), so the line is not drawn.
* ``hand overlap``: :class:`perf.decode.HandLoop`, the same model and the same tensor work in a
  hand-written overlapped loop on a ``FutureMap``: no runtime, a bare worker thread (a side
  stream on a GPU) under the same GIL switch interval as the runtime's worker.
* ``nominal``: the floor max(T_cpu, T_dev), measured in the same run, per repeat. T_dev is the
  model's forward plus sample (its sleep and its own ops) timed on the stream in a sync hand
  loop with no host work (``perf_counter`` on the CPU worker, CUDA events on a GPU); T_cpu is
  the host spin timed alone. Neither holds any of the runtime's overhead. Both are wall time on
  this machine: on a loaded one the OS stretches them as it stretches them in the runs (with
  ~4 ms CFS slices, a 4 ms spin alone can take ~8 ms); ``t_cpu_ms`` and ``t_dev_ms`` in
  ``summary.json`` say what they were.

Step time is the steady-state period between processed steps (stamped as each step is
processed, from the 3rd to the last: pipeline fill and drain are left out). Every line of a
point is warmed up, then runs ``REPEATS`` times interleaved with the others and with the
T_dev and T_cpu measurements; ratios are medians of per-repeat ratios (bands: p20-p80).

The runtime's own host time per step is the host thread's CPU time per step (``thread_time``,
the host spin taken out) of the runtime line minus that of the hand loop in the same mode
(overlap: ``hand overlap``; sync: the sync hand loop that times T_dev), median of per-repeat
differences: the model's ops are billed to neither, and time the host thread spends blocked
(on the GIL, on the stream) is not CPU time.

One more point (batch 16, T_dev 4 ms, T_cpu 2 ms, overlap) measures the forward stream's idle
share; it needs the stream's op spans, so that run alone has ``trace=True``.

The ``graphs`` line needs a CUDA device (``tfuture.steps.graphs``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import triton

from perf import contract, harness
from perf.decode import DecodeScheduler, HandLoop, StepClock, spin
from perf.harness import DEVICE, HAS_CUDA
from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.steps.token import Buckets
from tfuture.testing import ToyModel

T_MS = harness.sweep([0.5, 1, 2, 4, 10], [1, 4, 10])
BATCHES = harness.sweep([16, 64], [16])
STEPS = harness.sweep([50], [30])[0]
REPEATS = harness.sweep([7], [5])[0]
SKIP = 2  # processed steps left out at the start of each run (pipeline fill)
STREAM = "auto" if HAS_CUDA else "worker"  # the runtime's backend: CUDA streams, or the CPU worker
HAND_STREAM = "cuda" if HAS_CUDA else "worker"
IDLE = (4.0, 2.0, 16)  # T_dev ms, T_cpu ms, batch of the idle-share run
MODES = ("overlap", "sync")
SYNC_BOUND = 2.0  # sync step / nominal at T_cpu = T_dev: one after the other
COLORS = {"overlap": "blue", "sync": "red", "hand_overlap": "green", "nominal": "black", "graphs": "purple"}
GRAPHS = ("graphs",) if HAS_CUDA else ()  # step graphs: CUDA only
RATIO_LINES = ("overlap", "sync", *GRAPHS, "hand_overlap")


def key(t_ms: float) -> str:
    return f"{t_ms:g}"


def runtime_run(
    bs: int, t_s: float, overlap: bool, graphs: bool = False
) -> Callable[[int], tuple[float, float]]:
    """``run(steps)`` of an OverlapRuntime: (wall s, host CPU s without the spin) per step;
    ``graphs``: every (decode) step as its bucket's step graph."""
    model, fmap = ToyModel(work_s=t_s), FutureMap(4 * bs + 64, device=DEVICE)
    buckets = Buckets((bs,), (bs,)) if graphs else None
    rt = OverlapRuntime(
        model, fmap, overlap=overlap, stream=STREAM, trace=False, buckets=buckets, graphs=graphs
    )

    def run(steps: int) -> tuple[float, float]:
        clock = StepClock()
        rt.run(DecodeScheduler(bs, host_work_s=t_s, clock=clock), max_steps=steps)
        rt.close()
        return clock.per_step(SKIP)

    return run


def hand_run(bs: int, t_s: float, overlap: bool) -> Callable[[int], tuple[float, float]]:
    """``run(steps)`` of the overlapped hand loop: (wall s, host CPU s without the spin) per step."""

    def run(steps: int) -> tuple[float, float]:
        hand.clock = StepClock()
        hand.run(steps)
        return hand.clock.per_step(SKIP)

    hand = HandLoop(ToyModel(work_s=t_s), bs, overlap, HAND_STREAM, DEVICE, host_work_s=t_s)
    return run


def t_dev_run(bs: int, t_s: float) -> Callable[[int], tuple[float, float]]:
    """``run(steps)`` of a sync hand loop with no host work: (T_dev s, host CPU s per step)."""
    hand = HandLoop(ToyModel(work_s=t_s), bs, False, HAND_STREAM, DEVICE, time_model=True)

    def run(steps: int) -> tuple[float, float]:
        hand.model_s, hand.clock = [], StepClock()
        hand.run(steps)
        return float(np.mean(hand.model_s[SKIP:])), hand.clock.per_step(SKIP)[1]

    return run


def t_cpu_run(t_s: float) -> Callable[[int], tuple[float, float]]:
    """``run(calls)``: the host spin alone, (median wall s of a call, nan)."""

    def run(calls: int) -> tuple[float, float]:
        took = []
        for _ in range(calls):
            t0 = time.perf_counter()
            spin(t_s)
            took.append(time.perf_counter() - t0)
        return float(np.median(took)), float("nan")

    return run


@functools.cache
def measure(t_ms: float, bs: int) -> dict[str, np.ndarray]:
    """``{line: [REPEATS, 2]}``: (seconds per step, host CPU s per step) of every line of a point;
    ``t_dev``: (T_dev s, the sync hand loop's host CPU s per step); ``t_cpu``: (T_cpu s, nan)."""
    t_s = t_ms / 1e3
    makers: dict[str, tuple[Callable[[int], tuple[float, float]], int]] = {
        "overlap": (runtime_run(bs, t_s, True), STEPS),
        "sync": (runtime_run(bs, t_s, False), STEPS),
        "hand_overlap": (hand_run(bs, t_s, True), STEPS),
        **{name: (runtime_run(bs, t_s, True, graphs=True), STEPS) for name in GRAPHS},
        "t_dev": (t_dev_run(bs, t_s), max(STEPS // 2, SKIP + 8)),
        "t_cpu": (t_cpu_run(t_s), 5),
    }
    for run, _ in makers.values():
        run(SKIP + 4)  # warm-up
    runs: dict[str, Callable[[], object]] = {
        name: functools.partial(run, n) for name, (run, n) in makers.items()
    }
    return harness.interleaved(runs, REPEATS)


def nominal(t_ms: float, bs: int) -> np.ndarray:
    """Per repeat: the nominal max(T_cpu, T_dev), seconds."""
    m = measure(t_ms, bs)
    return np.maximum(m["t_dev"][:, 0], m["t_cpu"][:, 0])


def over_nominal(t_ms: float, bs: int, line: str) -> np.ndarray:
    """Per repeat: step time of ``line`` / nominal max(T_cpu, T_dev)."""
    return measure(t_ms, bs)[line][:, 0] / nominal(t_ms, bs)


def runtime_host_us(t_ms: float, bs: int, mode: str) -> np.ndarray:
    """Per repeat: the runtime's host CPU us per step minus the hand loop's, same mode."""
    m = measure(t_ms, bs)
    hand = m["hand_overlap"][:, 1] if mode == "overlap" else m["t_dev"][:, 1]
    return (m[mode][:, 1] - hand) * 1e6


def measured_ms(t_ms: float, bs: int, what: str) -> np.ndarray:
    """Per repeat: T_dev (``what="t_dev"``) or T_cpu (``"t_cpu"``) in ms."""
    return measure(t_ms, bs)[what][:, 0] * 1e3


@functools.cache
def idle_pct() -> float:
    """Forward-stream idle share (%), overlap, batch 16, T_dev 4 ms, T_cpu 2 ms: median of
    ``REPEATS`` traced runs after a warm-up."""
    t_dev, t_cpu, bs = IDLE
    rt = OverlapRuntime(
        ToyModel(work_s=t_dev / 1e3), FutureMap(4 * bs + 64, device=DEVICE), stream=STREAM, trace=True
    )

    def run(steps: int) -> float:
        stats = rt.run(DecodeScheduler(bs, host_work_s=t_cpu / 1e3), max_steps=steps)
        rt.close()
        return 100 * stats.idle_fraction

    run(SKIP + 4)
    return float(np.median([run(STEPS) for _ in range(REPEATS)]))


def lines(
    names: tuple[str, ...], one_floor: bool
) -> tuple[list[tuple[str, int]], list[str], list[tuple[str, str]]]:
    """perf_report's line values, names and styles: ``names`` for every batch size (``nominal``
    once when ``one_floor``: the floor of a ratio is 1 at every batch size)."""
    vals = [
        (name, bs)
        for bs in BATCHES
        for name in names
        if not (one_floor and name == "nominal" and bs != BATCHES[0])
    ]
    labels = [
        "nominal max(T_cpu, T_dev)" + ("" if one_floor else f", batch {bs}")
        if name == "nominal"
        else f"{name.replace('_', ' ')}, batch {bs}"
        for name, bs in vals
    ]
    styles = [(COLORS[name], "-" if bs == BATCHES[0] else "--") for name, bs in vals]
    return vals, labels, styles


def benchmark(plot_name: str, ylabel: str, names: tuple[str, ...], y_log: bool) -> triton.testing.Benchmark:
    vals, labels, styles = lines(names, one_floor=not y_log and "nominal" in names)
    return triton.testing.Benchmark(
        x_names=["t_ms"],
        x_vals=T_MS,
        x_log=True,
        y_log=y_log,
        line_arg="line",
        line_vals=vals,
        line_names=labels,
        styles=styles,
        xlabel=f"T_cpu = T_dev, ms ({DEVICE}, {STREAM} stream, trace off)",
        ylabel=ylabel,
        plot_name=plot_name,
        args={"plot": plot_name},
    )


@triton.testing.perf_report(
    [
        benchmark(
            "overlap_step_over_nominal",
            "step / nominal",
            (*RATIO_LINES, "nominal"),
            False,
        ),
        benchmark("overlap_step_ms", "ms per step", ("overlap", "sync", *GRAPHS, "nominal"), True),
        benchmark("overlap_runtime_host_us", "us (runtime - hand loop)", MODES, False),
    ]
)
def overlap_step(t_ms: float, line: tuple[str, int], plot: str) -> harness.Timing:
    """Step time against the nominal max(T_cpu, T_dev) (ratio, and ms with the nominal floor), and
    the runtime's own host CPU us per step (runtime minus hand loop): median, p20-p80 of repeats."""
    name, bs = line
    if plot == "overlap_runtime_host_us":
        return harness.band(runtime_host_us(t_ms, bs, name))
    if plot == "overlap_step_ms":
        samples = nominal(t_ms, bs) if name == "nominal" else measure(t_ms, bs)[name][:, 0]
        return harness.band(samples * 1e3)
    if name == "nominal":
        return (1.0, 1.0, 1.0)
    return harness.band(over_nominal(t_ms, bs, name))


def look(bench: triton.testing.Benchmark) -> harness.Look:
    """Titles and units; on the ratio plot, the contract's limits on the overlap lines."""
    xlabel = f"T_cpu = T_dev (ms; {DEVICE}, {STREAM} stream, trace off)"
    if bench.plot_name == "overlap_runtime_host_us":
        return harness.Look(
            what="the runtime's own host CPU time per step, over the hand-written loop",
            ylabel="runtime host CPU per step - hand loop's (µs)",
            xlabel=xlabel,
            refs=(harness.Ref("ideal: no host CPU over the hand loop", 0.0, color="gray", ls="-"),),
        )
    if bench.plot_name == "overlap_step_ms":
        return harness.Look(
            what="decode step time against the nominal max(T_cpu, T_dev)",
            ylabel="ms per step",
            xlabel=xlabel,
        )
    limits = {
        float(where.rsplit(".", 1)[1]): limit
        for _, _, limit, where in contract.TARGETS
        if where.startswith(f"overlap.step_over_nominal.overlap_batch{BATCHES[0]}.")
    }
    ts = sorted(t for t in limits if min(T_MS) <= t <= max(T_MS))
    target = harness.Ref(
        "contract: overlap \u2264 limit (every batch)",
        [limits[t] for t in ts],
        x=ts,
        color="blue",
        ls=":",
        marker="v",
    )
    # Sync runs host work and device work one after the other: T_cpu + T_dev = 2x the nominal
    # max(T_cpu, T_dev) at T_cpu = T_dev, the line sync cannot beat and overlap should stay under.
    sync_bound = harness.Ref(
        "sync bound: T_cpu + T_dev = 2\u00d7 nominal", SYNC_BOUND, color=COLORS["sync"], ls=(0, (1, 1))
    )
    return harness.Look(
        what="decode step time over the nominal max(T_cpu, T_dev)",
        ylabel="ratio to nominal max(T_cpu, T_dev)",
        xlabel=xlabel,
        refs=(target, sync_bound),
    )


def main() -> None:
    harness.save(overlap_step, look)

    def per_t(fn: Callable[..., np.ndarray], bs: int, *args: str) -> dict[str, float]:
        """``{T ms: median over repeats of fn(T, bs, *args)}``."""
        return {key(t): round(float(np.median(fn(t, bs, *args))), 3) for t in T_MS}

    ratios: dict[str, dict[str, float]] = {}
    host_us: dict[str, dict[str, float]] = {}
    t_dev: dict[str, dict[str, float]] = {}
    t_cpu: dict[str, dict[str, float]] = {}
    for bs in BATCHES:
        for line in RATIO_LINES:
            ratios[f"{line}_batch{bs}"] = per_t(over_nominal, bs, line)
        for mode in MODES:
            host_us[f"{mode}_batch{bs}"] = per_t(runtime_host_us, bs, mode)
        t_dev[f"batch{bs}"] = per_t(measured_ms, bs, "t_dev")
        t_cpu[f"batch{bs}"] = per_t(measured_ms, bs, "t_cpu")
    idle = round(idle_pct(), 3)
    harness.record(
        "overlap",
        {
            "stream": STREAM,
            "steps": STEPS,
            "repeats": REPEATS,
            "step_over_nominal": ratios,
            "t_dev_ms": t_dev,
            "t_cpu_ms": t_cpu,
            "runtime_host_us_per_step": host_us,
            "idle_pct_t_dev4_t_cpu2": idle,
        },
    )
    print(f"overlap ({STREAM} stream, trace off, {STEPS} steps x {REPEATS} interleaved repeats, medians):")
    for bs in BATCHES:
        print(f"  batch {bs}: T_dev ms {t_dev[f'batch{bs}']}, T_cpu ms {t_cpu[f'batch{bs}']}")
        for line in RATIO_LINES:
            print(f"    {line:12s} step / nominal max(T_cpu, T_dev), per T ms: {ratios[f'{line}_batch{bs}']}")
        for mode in MODES:
            print(f"    runtime {mode:7s} host CPU us per step - hand loop's: {host_us[f'{mode}_batch{bs}']}")
    print(f"forward-stream idle, overlap, batch 16, T_dev 4 ms, T_cpu 2 ms (traced): {idle:.2f}%")


if __name__ == "__main__":
    main()
