"""Shared benchmark plumbing: device, results folder, meta/summary files, timers, plots.

Timers:
* :func:`device_us` is ``triton.testing.do_bench`` with quantiles, in us (GPU only).
* :func:`host_us` is the wall time of a Python call with ``time.perf_counter`` over a batch of
  calls, no sync inside a batch (sync only between batches, on CUDA, so that the launch queue
  never fills and blocks the host).

Benchmark modules build their plots from :func:`report_mark` (the ``perf_report`` mark) and
:func:`timed_line` (the function a mark calls per point, with :func:`guarded` so that one failing
line does not sink the others), or from a :class:`Sweep`, which ties both to one x axis and the
device/host timers; then they read the data frame back with :func:`column`, :func:`column_ratio`
and :func:`r2_list`.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")

# One intra-op thread on CPU: on a shared 2-core box an OpenMP region stalls for milliseconds
# when another process holds a core (searchsorted over 4K rows: 35 us alone, 3.4 ms contended).
# A scheduler thread runs its small ops on one thread anyway. PERF_CPU_THREADS overrides.
CPU_THREADS = int(os.environ.get("PERF_CPU_THREADS", "1"))
if not HAS_CUDA:
    torch.set_num_threads(CPU_THREADS)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = "no CUDA device: triton.testing.do_bench needs an active GPU driver ('0 active drivers')"
# Why an ``empty_launch`` line is left out of a host-cost plot without a GPU.
NO_LAUNCH = "no GPU: a Triton launch needs a driver"

# Plot titles and y labels shared by the device-time and host-cost plots.
DO_BENCH_BAND = "do_bench median, band p20-p80"
DEVICE_YLABEL = "device time per call (us)"
HOST_YLABEL = "host wall time per call (us)"
# What a host-cost plot times (its description in the results README).
HOST_TIMING = "time.perf_counter over batches of calls, no sync inside a batch"

# Line styles for perf_report: (color, linestyle), one per line, in line order.
STYLES = [
    ("blue", "-"),
    ("red", "--"),
    ("green", "-."),
    ("black", ":"),
    ("orange", "-"),
    ("purple", "--"),
    ("brown", "-."),
    ("gray", ":"),
    ("cyan", "-"),
    ("magenta", "--"),
    ("olive", "-."),
]

Timing = tuple[float, float, float]  # (median, p20, p80) in us
NAN3: Timing = (math.nan, math.nan, math.nan)
# Builds the zero-argument call one point of a sweep times, from the point's keyword arguments.
MakeFn = Callable[..., Callable[[], object]]


def pick(full: Sequence[Any], ci: Sequence[Any]) -> list[Any]:
    """The full sweep, or the small one when ``CI`` is set."""
    return list(ci if CI else full)


def device_name() -> str:
    if HAS_CUDA:
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_slug(name: str | None = None) -> str:
    """``cpu`` without CUDA; ``h200`` for any H200; else a lowercase slug of the GPU name."""
    if not HAS_CUDA and name is None:
        return "cpu"
    name = device_name() if name is None else name
    if "H200" in name.upper():
        return "h200"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def results_dir() -> str:
    path = os.path.join(REPO, "perf", "results", device_slug())
    os.makedirs(path, exist_ok=True)
    return path


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")


def write_meta(module: str, skipped: Sequence[str]) -> None:
    """Merge this module's run (and what it skipped) into ``meta.json``."""
    path = os.path.join(results_dir(), "meta.json")
    meta = _read_json(path)
    commit = _git("rev-parse", "HEAD") or os.environ.get("TFUTURE_COMMIT")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    meta.update(
        device=device_slug(),
        device_name=device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=sys.version.split()[0],
        commit=commit,
        dirty=None if dirty is None else bool(dirty),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017 - GPU images may run Python < 3.11
        ci=CI,
        cuda=torch.version.cuda if HAS_CUDA else None,
        torch_threads=torch.get_num_threads(),
    )
    meta.setdefault("skipped", {})[module] = list(skipped)
    meta["modules"] = sorted(set(meta.get("modules", [])) | {module})
    _write_json(path, meta)


def merge_summary(section: str, values: dict[str, Any]) -> None:
    """Merge headline numbers into ``summary.json`` under ``section``."""
    path = os.path.join(results_dir(), "summary.json")
    summary = _read_json(path)
    summary.setdefault(section, {}).update(values)
    _write_json(path, summary)


def skip(skipped: list[str], what: str, why: str) -> None:
    """Say plainly what is not run, and remember it for ``meta.json``."""
    print(f"SKIPPED {what}: {why}")
    skipped.append(f"{what}: {why}")


def sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


def device_us(fn: Callable[[], object]) -> Timing:
    """Device time of ``fn`` in us: ``do_bench`` (median, p20, p80). Raises without a GPU."""
    ms = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
    return (ms[0] * 1e3, ms[1] * 1e3, ms[2] * 1e3)


# CUDA's launch queue holds about 1024 launches; a torch reference issues up to ~16 per call.
_CUDA_CALLS_CAP = 32
_REPEATS = 5 if CI else 31
_BATCH_S = 0.5e-3 if CI else 5e-3


def host_us_batched(batch: Callable[[int], float], *, cuda: bool = HAS_CUDA) -> Timing:
    """Host us per call from ``batch(n)``, which runs ``n`` calls and returns their seconds.

    Warms up, sizes the batch to about 5 ms (0.5 ms under CI), then reports the median and
    the 20th/80th percentiles over repeated batches. Syncs only between batches.
    """
    sync_ = torch.cuda.synchronize if cuda else (lambda: None)
    batch(3)
    sync_()
    est = max(batch(5) / 5, 1e-7)
    cap = _CUDA_CALLS_CAP if cuda else 200
    calls = int(min(cap, max(3, _BATCH_S / est)))
    per_call = []
    for _ in range(_REPEATS):
        sync_()
        per_call.append(batch(calls) / calls * 1e6)
    sync_()
    med, lo, hi = np.quantile(per_call, [0.5, 0.2, 0.8])
    return (float(med), float(lo), float(hi))


def time_calls(fn: Callable[[], object], n: int) -> float:
    """Seconds that ``n`` back-to-back calls of ``fn`` take (``time.perf_counter``, no sync)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def host_us(fn: Callable[[], object], *, cuda: bool = HAS_CUDA) -> Timing:
    """Wall time in us of one Python call of ``fn`` (no sync inside a batch of calls)."""
    return host_us_batched(lambda n: time_calls(fn, n), cuda=cuda)


def guarded(what: str, timer: Callable[[], Timing]) -> Timing:
    """``timer()``, or NaNs after printing ``FAILED <what>: ...`` if it raises.

    A failing line (say torch.compile) must not sink the other lines of the same plot.
    """
    try:
        return timer()
    except Exception as exc:
        print(f"FAILED {what}: {type(exc).__name__}: {exc}")
        return NAN3


def timed_line(
    make_fn: MakeFn,
    timer: Callable[[Callable[[], object]], Timing],
    what: str,
    **fixed: Any,
) -> Callable[..., Timing]:
    """The function a ``perf_report`` mark calls per point: build the call, time it, guarded.

    The mark passes its x and line arguments by keyword (``bs=64, provider="torch"``); ``fixed``
    adds the ones the sweep holds still. ``make_fn(**args)`` builds the zero-argument call (not
    guarded: a broken input is a bug, not a failing line), ``timer`` times it, and
    ``what.format(**args)`` names the point in the FAILED line of :func:`guarded`.
    """

    def run(**point: Any) -> Timing:
        args = {**fixed, **point}
        fn = make_fn(**args)
        return guarded(what.format(**args), lambda: timer(fn))

    return run


def host_where(launch: str = "GPU launch, no sync") -> str:
    """What a host-cost plot's title says it measures: ``launch`` on a GPU, the torch path on CPU."""
    return launch if HAS_CUDA else "CPU: tfuture runs its CPU reference path"


def with_empty_launch(lines: Sequence[str], skipped: list[str], plot: str) -> list[str]:
    """``lines`` plus ``empty_launch`` on a GPU; without one, :func:`skip` that line of ``plot``."""
    if HAS_CUDA:
        return [*lines, "empty_launch"]
    skip(skipped, f"{plot}: empty_launch line", NO_LAUNCH)
    return list(lines)


@triton.jit
def _empty_kernel(x_ptr):
    pass


def empty_launch(x: torch.Tensor) -> None:
    """The floor: one launch of a Triton kernel that does nothing (GPU only)."""
    _empty_kernel[(1,)](x)


def report_mark(
    fn: Callable[..., Any],
    *,
    plot_name: str,
    x_name: str,
    x_vals: Sequence[Any],
    lines: Sequence[Any],
    xlabel: str,
    line_arg: str = "provider",
    line_names: Sequence[str] | None = None,
    styles: Sequence[tuple[str, str]] | None = None,
    ylabel: str = "us",
    x_log: bool = True,
    y_log: bool = True,
) -> Any:
    """A one-benchmark ``triton.testing.perf_report`` mark of ``fn``, for :func:`run_report`.

    One x axis (``x_name`` over ``x_vals``), one line per value of ``lines`` passed to ``fn`` as
    ``line_arg``; lines are named by ``line_names`` (default: the values) and drawn in ``styles``
    (default: the first :data:`STYLES`). Log axes unless told otherwise.
    """
    bench = triton.testing.Benchmark(
        x_names=[x_name],
        x_vals=list(x_vals),
        x_log=x_log,
        y_log=y_log,
        line_arg=line_arg,
        line_vals=list(lines),
        line_names=list(lines if line_names is None else line_names),
        styles=list(STYLES[: len(lines)] if styles is None else styles),
        ylabel=ylabel,
        xlabel=xlabel,
        plot_name=plot_name,
        args={},
    )
    return triton.testing.perf_report(bench)(fn)


def run_report(mark: Any, *, title: str, ylabel: str) -> Any:
    """Run a one-benchmark ``perf_report`` mark; write ``<plot_name>.csv`` and ``.png``.

    ``Mark.run`` plots without a title and labels lines ``name (ylabel)``; the PNG is redrawn
    from the same figure with a title, a full y label and a grid. Returns the data frame.
    """
    import matplotlib.pyplot as plt

    bench = mark.benchmarks
    out = results_dir()
    plt.close("all")
    df = mark.run(save_path=out, print_data=True, show_plots=False, return_df=True)
    nums = plt.get_fignums()
    if nums:
        fig = plt.figure(nums[-1])
        ax = fig.axes[0]
        for line in ax.get_lines():
            line.set_label(str(line.get_label()).removesuffix(f" ({bench.ylabel})"))
        ax.set_title(title, fontsize="medium")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if len(ax.get_lines()) > 5:
            # Many lines: keep the legend off the data.
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
            fig.set_size_inches(9.5, 5)
        else:
            ax.legend(fontsize="small")
            fig.set_size_inches(7.5, 5)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{bench.plot_name}.png"), dpi=110)
    plt.close("all")
    print(f"wrote {os.path.join(out, bench.plot_name)}.csv and .png")
    return df


def column(df: Any, line_name: str, ylabel: str = "us") -> np.ndarray:
    """The values of one line of a perf_report data frame.

    Triton 3.9 names the column ``name (ylabel)``; older releases (3.6 on the GPU box among
    them, possibly) name it ``name``.
    """
    key = f"{line_name} ({ylabel})"
    return df[key if key in df.columns else line_name].to_numpy(dtype=float)


@dataclass(frozen=True)
class Sweep:
    """One x axis of a benchmark module, each of its lines timed on the device or on the host.

    ``make_fn(**args)`` builds the call a point times from the mark's keyword arguments (the x
    and ``provider``; see :func:`timed_line`). ``point`` formats the same arguments to name the
    point in a FAILED line, after ``"<name> device"`` or ``"<name> host"``. ``line_names`` and
    ``styles`` go to :func:`report_mark` (defaults there).
    """

    name: str
    make_fn: MakeFn
    x_name: str
    x_vals: Sequence[Any]
    xlabel: str
    point: str
    line_names: Sequence[str] | None = None
    styles: Sequence[tuple[str, str]] | None = None

    def line(self, kind: str) -> Callable[..., Timing]:
        """The mark's function, timed by :func:`device_us` (``"device"``) or :func:`host_us` (``"host"``)."""
        timers = {"device": device_us, "host": host_us}
        if kind not in timers:
            raise ValueError(f"unknown timer kind {kind!r}")
        return timed_line(self.make_fn, timers[kind], f"{self.name} {kind} {self.point}")

    def plot(self, kind: str, plot_name: str, lines: Sequence[Any], *, title: str, about: str) -> Any:
        """Time ``lines`` over the sweep on ``kind``, write ``plot_name`` .csv/.png, describe it.

        ``about`` is what the plot times, for the results README. Returns the data frame.
        """
        mark = report_mark(
            self.line(kind),
            plot_name=plot_name,
            x_name=self.x_name,
            x_vals=self.x_vals,
            lines=lines,
            line_names=self.line_names,
            styles=self.styles,
            xlabel=self.xlabel,
        )
        df = run_report(mark, title=title, ylabel=DEVICE_YLABEL if kind == "device" else HOST_YLABEL)
        describe(plot_name, about)
        return df


def safe_div(num: Any, den: Any) -> np.ndarray:
    """``num / den`` elementwise, NaN or inf (no warning) where a side is NaN or zero."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(num, dtype=float) / np.asarray(den, dtype=float)


def column_ratio(df: Any, num: str, den: str, ylabel: str = "us") -> np.ndarray:
    """Line ``num`` over line ``den`` of a perf_report data frame, per x (see :func:`safe_div`)."""
    return safe_div(column(df, num, ylabel), column(df, den, ylabel))


def describe(plot_name: str, text: str) -> None:
    """Record what a plot times, for the results README."""
    merge_summary("plots", {plot_name: text})


def r2(x: float) -> float | None:
    """Four significant digits for summary.json; NaN becomes null."""
    return None if x is None or not math.isfinite(x) else float(f"{x:.4g}")


def r2_list(values: Any) -> list[float | None]:
    """:func:`r2` of each value, for a per-x list in summary.json."""
    return [r2(v) for v in values]


def verdict(summary: dict[str, Any], text: str, worst: float, ok: bool, contract: bool = True) -> None:
    """Print and record one line of DESIGN.md section 6 against this run's worst case.

    ``contract=False`` marks a CPU-only comparison (both sides torch), reported for information.
    """
    tag = ("meets" if ok else "MISSES") if contract else "CPU torch paths, not the GPU contract"
    line = f"{text}: worst {worst:.2f}x [{tag}]"
    print(f"contract: {line}" if contract else line)
    summary.setdefault("verdicts", []).append(line)
