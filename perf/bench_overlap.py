"""Overlapped and sync step time against the NOMINAL ideal max(T_cpu, T_dev), T_cpu = T_dev.

    python -m perf.bench_overlap          # CI=1: fewer steps

``ToyModel(work_s=T_dev)`` does ``T_dev`` of device work per forward (``torch.cuda._sleep`` on a
GPU, a sleep on the CPU worker) and :class:`perf.decode.DecodeScheduler` spins ``T_cpu`` on
the host per processed step (Python holding the GIL). The denominator is the nominal
``max(T_cpu, T_dev)``: the work they were asked to do, never a time measured with the runtime's
own overhead in it. Lines, per batch size: ``overlap`` and ``sync`` (about 2 by design).
Two plots: step time / nominal max, and the runtime's host us per step: the host thread's wall
time outside the scheduler's ``schedule``, ``process`` and ``build_mask`` and outside the
waits on the forward stream, from the trace spans (so GIL waits of the host thread count).
One more run (batch 16, T_dev 4 ms, T_cpu 2 ms) measures the forward stream's idle share.
"""

from __future__ import annotations

import functools

import triton

from perf import harness
from perf.decode import DecodeScheduler
from perf.harness import DEVICE
from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ToyModel

T_MS = [1, 4, 10]
BATCHES = [16, 64]
STEPS = harness.sweep([80], [25])[0]
LINES = [(mode, bs) for bs in BATCHES for mode in ("overlap", "sync")]
NAMES = [f"{mode}, batch {bs}" for mode, bs in LINES]
STYLES = [("blue" if mode == "overlap" else "red", "-" if bs == 16 else "--") for mode, bs in LINES]
# Host spans of the scheduler's own work and of waiting on the device; the rest is the runtime.
NOT_RUNTIME = ("schedule", "process", "build_mask", "wait")


@functools.cache
def run(t_dev_ms: float, t_cpu_ms: float, bs: int, overlap: bool) -> dict[str, float]:
    """One traced run: step / nominal max, runtime host us per step, forward-stream idle share."""
    fmap = FutureMap(4 * bs + 64, device=DEVICE)
    runtime = OverlapRuntime(ToyModel(work_s=t_dev_ms / 1e3), fmap, overlap=overlap, trace=True)
    stats = runtime.run(DecodeScheduler(bs, host_work_s=t_cpu_ms / 1e3), max_steps=STEPS)
    not_runtime = sum(s.end - s.start for s in stats.host_spans if s.name in NOT_RUNTIME)
    return {
        "over_nominal": stats.wall / stats.steps / (max(t_dev_ms, t_cpu_ms) / 1e3),
        "runtime_host_us": (stats.wall - not_runtime) / stats.steps * 1e6,
        "idle_pct": 100 * stats.idle_fraction,
    }


@triton.testing.perf_report(
    [
        triton.testing.Benchmark(
            x_names=["t_ms"],
            x_vals=T_MS,
            x_log=True,
            y_log=False,
            line_arg="line",
            line_vals=LINES,
            line_names=NAMES,
            styles=STYLES,
            xlabel=f"T_cpu = T_dev, ms ({DEVICE}, {STEPS} steps; y: {about})",
            ylabel=ylabel,
            plot_name=plot_name,
            args={"key": key},
        )
        for key, plot_name, ylabel, about in (
            ("over_nominal", "overlap_step_over_nominal", "ratio", "step time / nominal max(T_cpu, T_dev)"),
            ("runtime_host_us", "overlap_runtime_host_us", "us", "runtime host us per step"),
        )
    ]
)
def overlap_step(t_ms: float, line: tuple[str, int], key: str) -> float:
    """Step time over the nominal max(T_cpu, T_dev), and the runtime's own host us per step."""
    mode, bs = line
    return run(t_ms, t_ms, bs, mode == "overlap")[key]


def main() -> None:
    harness.save(overlap_step)
    # Keyed by T in ms: {"overlap_batch16": {"1": 1.2, "4": ...}}.
    per_t = {
        key: {
            f"{m}_batch{bs}": {str(t): round(run(t, t, bs, m == "overlap")[key], 3) for t in T_MS}
            for m, bs in LINES
        }
        for key in ("over_nominal", "runtime_host_us")
    }
    idle = round(run(4, 2, 16, True)["idle_pct"], 3)
    harness.record(
        "overlap",
        {
            "steps": STEPS,
            "step_over_nominal": per_t["over_nominal"],
            "runtime_host_us_per_step": per_t["runtime_host_us"],
            "idle_pct_t_dev4_t_cpu2": idle,
        },
    )
    for name, values in per_t["over_nominal"].items():
        print(f"{name}: step / nominal max(T_cpu, T_dev), per T in ms: {values}")
    print(f"forward-stream idle, overlap, batch 16, T_dev 4 ms, T_cpu 2 ms: {idle:.2f}%")


if __name__ == "__main__":
    main()
