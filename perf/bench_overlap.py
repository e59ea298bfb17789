"""Step time of the sync and overlapped loops against T_cpu / T_dev, at a fixed T_dev.

``python -m perf.bench_overlap``. The toy model does ``T_dev`` of device work per step (a sleep
on the forward stream: the worker thread on CPU, ``torch.cuda._sleep`` on CUDA) and the
scheduler does ``T_cpu`` of host work per processed step (a sleep, which releases the GIL as
host work in C extensions does). Lines, ms per step:

* ``sync``: the same steps without overlap (T_dev + T_cpu plus overheads).
* ``overlap``: the overlapped loop.
* ``ideal``: max(T_dev, T_cpu) with T_dev the measured device busy time per step of the sync
  run (it includes prepare, sample and copy, not only the sleep).

A second plot gives the forward stream's idle fraction in both modes. The ``gil`` line of the
third plot repeats the overlap run with host work that holds the GIL (a Python spin).
"""

from __future__ import annotations

from collections.abc import Callable

from perf._common import (
    DEVICE,
    column,
    describe,
    merge_summary,
    pick,
    r2,
    report_mark,
    run_report,
    write_meta,
)
from tfuture.demo import measure
from tfuture.trace import RunStats

T_DEV = pick([4e-3], [2e-3])[0]
RATIOS = pick([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0], [0.0, 0.5, 1.0, 2.0])
STEPS = pick([80], [25])[0]
BATCH = 16

_cache: dict[tuple[float, bool], tuple[RunStats, RunStats]] = {}


def _runs(ratio: float, gil: bool = False) -> tuple[RunStats, RunStats]:
    key = (ratio, gil)
    if key not in _cache:
        _cache[key] = measure(T_DEV, ratio * T_DEV, batch=BATCH, steps=STEPS, device=DEVICE, gil=gil)
    return _cache[key]


def _ideal(sync: RunStats) -> float:
    t_dev = sync.device_busy / max(sync.steps, 1)
    return max(t_dev, sync.step_time - t_dev)


# Legend names: the ideal line says what it is, and the GIL variant says what differs.
NAMES = {"ideal": "ideal max(T_dev, T_cpu)", "gil": "overlap, host work holds the GIL"}


def _mark(plot_name: str, lines: list[str], ylabel: str, fn: Callable[..., float]) -> object:
    return report_mark(
        fn,
        plot_name=plot_name,
        x_name="ratio",
        x_vals=RATIOS,
        lines=lines,
        line_names=[NAMES.get(line, line) for line in lines],
        line_arg="mode",
        ylabel=ylabel,
        xlabel="T_cpu / T_dev",
        x_log=False,
        y_log=False,
    )


def step_ms(ratio: float, mode: str) -> float:
    sync, over = _runs(ratio)
    if mode == "gil":
        return _runs(ratio, gil=True)[1].step_time * 1e3
    return {"sync": sync.step_time, "overlap": over.step_time, "ideal": _ideal(sync)}[mode] * 1e3


def idle_pct(ratio: float, mode: str) -> float:
    sync, over = _runs(ratio)
    return 100 * (sync if mode == "sync" else over).idle_fraction


def main() -> None:
    print(f"overlap sweep on {DEVICE}: T_dev {T_DEV * 1e3:g} ms, batch {BATCH}, {STEPS} steps per point")
    title = f"Step time vs host work, T_dev = {T_DEV * 1e3:g} ms ({DEVICE}, batch {BATCH})"
    df = run_report(
        _mark("overlap_step_time", ["sync", "overlap", "ideal", "gil"], "ms per step", step_ms),
        title=title,
        ylabel="step time (ms)",
    )
    run_report(
        _mark("overlap_device_idle", ["sync", "overlap"], "% idle", idle_pct),
        title=f"Forward-stream idle fraction, T_dev = {T_DEV * 1e3:g} ms ({DEVICE})",
        ylabel="device idle (% of run)",
    )
    over, ideal, sync = (
        column(df, "overlap", "ms per step"),
        column(df, NAMES["ideal"], "ms per step"),
        column(df, "sync", "ms per step"),
    )
    ratio_to_ideal = [r2(o / i) for o, i in zip(over, ideal, strict=True)]
    speedup = [r2(s / o) for s, o in zip(sync, over, strict=True)]
    print("overlap / ideal per T_cpu/T_dev:", dict(zip(RATIOS, ratio_to_ideal, strict=True)))
    print("sync / overlap per T_cpu/T_dev:", dict(zip(RATIOS, speedup, strict=True)))
    merge_summary(
        "overlap",
        {
            "t_dev_ms": T_DEV * 1e3,
            "ratios": RATIOS,
            "overlap_over_ideal": ratio_to_ideal,
            "sync_over_overlap": speedup,
            "idle_pct_overlap_at_ratio_0.5": r2(idle_pct(0.5, "overlap")),
        },
    )
    describe("overlap_step_time", "ms per step of sync and overlapped loops vs T_cpu/T_dev; ideal max(Tc,Td)")
    describe("overlap_device_idle", "forward-stream idle % of the run, sync vs overlap")
    write_meta("bench_overlap", [])


if __name__ == "__main__":
    main()
