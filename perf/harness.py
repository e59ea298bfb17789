"""What every benchmark shares: device, results folder, ``meta.json``, timers, sweep size, and
how a plot is drawn (:func:`save` with a :class:`Look`: title, units, reference lines, legend,
ticks, and an achieved-bandwidth plot for the memory-bound kernels).

Results go to ``perf/results/<device>-local/`` (untracked); ``PERF_REFRESH=1`` (``python -m perf
--refresh``) writes the committed ``perf/results/<device>/``. ``CI`` set picks the small sweeps.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import pathlib
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
CI = os.environ.get("CI", "0").lower() not in ("", "0", "false")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = "no GPU: triton.testing.do_bench raises '0 active drivers' and a Triton launch needs a driver"
# One intra-op thread on CPU: on a shared 2-core box an OpenMP region stalls for milliseconds
# when another process holds a core (searchsorted over 4K rows: 35 us alone, 3.4 ms contended).
if not HAS_CUDA:
    torch.set_num_threads(int(os.environ.get("PERF_CPU_THREADS", "1")))

Timing = tuple[float, float, float]  # (median, p20, p80), us
NAN3: Timing = (float("nan"),) * 3


def sweep(full: Sequence[Any], ci: Sequence[Any]) -> list[Any]:
    """The full sweep, or the small one when ``CI`` is set."""
    return list(ci if CI else full)


def device_name() -> str:
    if HAS_CUDA:
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_slug() -> str:
    """``cpu`` without a GPU, ``h200`` for any H200, else a slug of the GPU's name."""
    name = device_name().lower() if HAS_CUDA else "cpu"
    return "h200" if "h200" in name else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def results_dir() -> str:
    refresh = os.environ.get("PERF_REFRESH", "0").lower() not in ("", "0", "false")
    path = os.path.join(REPO, "perf", "results", device_slug() + ("" if refresh else "-local"))
    os.makedirs(path, exist_ok=True)
    return path


def read_json(name: str) -> dict[str, Any]:
    path = os.path.join(results_dir(), name)
    return json.loads(pathlib.Path(path).read_text()) if os.path.exists(path) else {}


def write_json(name: str, data: dict[str, Any]) -> None:
    pathlib.Path(results_dir(), name).write_text(json.dumps(data, indent=2, default=str) + "\n")


def record(section: str, values: dict[str, Any]) -> None:
    """Merge measured numbers (never verdicts) into ``summary.json`` under ``section``."""
    summary = read_json("summary.json")
    summary.setdefault(section, {}).update(values)
    write_json("summary.json", summary)


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def write_meta(skipped: tuple[str, str] | None = None) -> None:
    """Write the machine into ``meta.json``; ``skipped``: (benchmark, what did not run and why)."""
    meta = read_json("meta.json")
    head, diff = (
        _git("rev-parse", "HEAD"),
        _git("status", "--porcelain", "-uno", "--", "tfuture", "perf", ":(exclude)perf/results"),
    )  # the results being written are not the code that measured them
    meta.update(device=device_slug(), device_name=device_name(), ci=CI, torch_threads=torch.get_num_threads())
    meta.update(torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0])
    meta.update(cuda=torch.version.cuda, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    meta.update(commit=head or os.environ.get("TFUTURE_COMMIT"), dirty=None if diff is None else bool(diff))
    if skipped:
        lines = meta.setdefault("skipped", {}).setdefault(skipped[0], [])
        lines += [] if skipped[1] in lines else [skipped[1]]
    write_json("meta.json", meta)


def skip(what: str, why: str) -> None:
    """Say plainly what does not run here, and list it in ``meta.json`` under the caller's module."""
    print(f"SKIPPED {what}: {why}")
    caller = sys._getframe(1).f_globals
    write_meta((getattr(caller.get("__spec__"), "name", caller["__name__"]), f"{what}: {why}"))


# What a kernel sweep plots: device time (needs a GPU) and host cost (runs everywhere).
TIMERS = ["device_time", "host_cost"] if HAS_CUDA else ["host_cost"]
# The timer that sees a kernel's whole cost: device time on a GPU; on CPU the host runs it all.
FULL_TIMER = TIMERS[0]


def time_label(timer: str, per: str = "call", unit: bool = True) -> str:
    """What ``timer`` measures, for a plot: "device time per call (µs)", "host time per call (µs)"."""
    return f"{'device' if timer == 'device_time' else 'host'} time per {per}" + (" (µs)" if unit else "")


def timed(fn: Callable[[], object] | None, timer: str) -> Timing:
    """``fn`` timed by :func:`device_us` (``"device_time"``) or :func:`host_us`; NaNs for None."""
    if fn is None:
        return NAN3
    return device_us(fn) if timer == "device_time" else host_us(fn)


def device_us(fn: Callable[[], object]) -> Timing:
    """Device time of one call of ``fn`` in us: ``do_bench`` median, p20, p80 (GPU only)."""
    return tuple(ms * 1e3 for ms in triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8]))  # type: ignore[return-value]


def time_calls(fn: Callable[[], object], n: int) -> float:
    """Seconds that ``n`` back-to-back calls of ``fn`` take (``time.perf_counter``, no sync)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def host_us(fn: Callable[[], object], batch: Callable[[int], float] | None = None) -> Timing:
    """Host wall time of one call of ``fn`` in us: median, p20, p80 over ~5 ms batches of calls.

    ``batch(n)``, if given, runs ``n`` calls and returns the seconds of the calls alone. On CUDA a
    batch is at most 32 calls (the launch queue holds ~1024 launches), synced between, not inside.
    """
    batch = batch or (lambda n: time_calls(fn, n))
    sync = torch.cuda.synchronize if HAS_CUDA else (lambda: None)
    batch(3)
    est = max(batch(5) / 5, 1e-7)
    calls = int(min(32 if HAS_CUDA else 200, max(3, (5e-4 if CI else 5e-3) / est)))
    per_call = []
    for _ in range(5 if CI else 31):
        sync()
        per_call.append(batch(calls) / calls * 1e6)
    sync()
    return band(per_call)


def batch_sweep(
    x_vals: Sequence[int],
    lines: Sequence[str],
    styles: Sequence[tuple[str, str]],
    xlabel: str,
    ylabel: str,
    plot_name: str,
    args: dict[str, Any] | None = None,
) -> Any:
    """A ``triton.testing.Benchmark`` over ``batch`` (linear axes), one line per name in ``lines``."""
    import triton

    return triton.testing.Benchmark(
        x_names=["batch"],
        x_vals=list(x_vals),
        x_log=False,
        y_log=False,
        line_arg="line",
        line_vals=list(lines),
        line_names=list(lines),
        styles=list(styles),
        xlabel=xlabel,
        ylabel=ylabel,
        plot_name=plot_name,
        args=args or {},
    )


def band(samples: Sequence[float] | np.ndarray) -> Timing:
    """(median, p20, p80) of ``samples``."""
    return tuple(float(q) for q in np.quantile(np.asarray(samples, dtype=float), [0.5, 0.2, 0.8]))  # type: ignore[return-value]


def interleaved(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, np.ndarray]:
    """Call every run once per repeat, in turn, so that a slow spell of a shared machine hits
    them all; ``{name: [repeats, ...] array of what each call returned}``.

    The turn order reverses every other repeat, so that each run follows its neighbour on one
    side as often as on the other: on the CPU machine the run after a change of configuration
    (another engine or drafter, Hugging Face's ``generate``) ran several percent slower than the
    next one, and a fixed order (or a rotated one, which keeps each run's predecessor) put that
    cost on the same lines every repeat: of a listed (overlap, sync) pair, overlap always came
    after another configuration and sync after its overlap run (in one A/B, overlap listed
    before sync lost 6-12% to it, and listed after it won by as much: an ad hoc run; ``python -m
    perf.stream_ab 1 plain --fixed`` against the same without ``--fixed`` measures the effect)."""
    out: dict[str, list[Any]] = {name: [] for name in runs}
    items = list(runs.items())
    for r in range(repeats):
        for name, run in items if r % 2 == 0 else items[::-1]:
            out[name].append(run())
    return {name: np.asarray(v, dtype=float) for name, v in out.items()}


# ---- Plots -------------------------------------------------------------------------------------
# perf_report draws each Benchmark (lines, p20-p80 bands) and writes its CSV; :func:`save` then
# titles the figure, labels its axes with units, draws the reference lines (floors, ideals and the
# contract's targets), moves the legend off the data and puts a tick on every x value of the sweep.
# The CSV is perf_report's, untouched: its column names carry the Benchmark's ylabel, which
# perf/contract.py reads, so the units live on the figure only.

# Peak DRAM bandwidth in bytes/s by the GPU's name (lower case): every listed part must occur;
# the first matching row wins. A GPU not listed gets no peak line, and the plot says so.
PEAK_BANDWIDTH: list[tuple[tuple[str, ...], float]] = [
    (("h200",), 4.8e12),
    (("h100", "pcie"), 2.0e12),
    (("h100",), 3.35e12),
    (("a100", "80gb"), 2.039e12),
    (("a100",), 1.555e12),
    (("b200",), 8.0e12),
    (("l40",), 0.864e12),
    (("l4",), 0.3e12),
    (("a10g",), 0.6e12),
    (("mi300x",), 5.3e12),
]


def peak_bandwidth() -> tuple[float | None, str]:
    """(peak bytes/s or None, what a bandwidth plot says about it)."""
    if not HAS_CUDA:
        return None, "CPU: the host path, host-bound (no device peak line)"
    name = device_name().lower()
    for parts, peak in PEAK_BANDWIDTH:
        if all(part in name for part in parts):
            return peak, f"peak DRAM bandwidth, {peak / 1e12:g} TB/s ({device_name()})"
    return None, f"unknown device {device_name()!r}: no peak line (add it to harness.PEAK_BANDWIDTH)"


@dataclass(frozen=True)
class Ref:
    """A reference line: a floor, an ideal or a target. ``y``: a constant (a horizontal line), the
    values at ``x`` (default: the sweep's x values), or ``y(medians)`` of the plot's median lines
    by line name (arrays over the sweep's x values)."""

    label: str
    y: float | Sequence[float] | Callable[[dict[str, np.ndarray]], Any]
    x: Sequence[float] | None = None
    color: str = "black"
    ls: Any = "-."
    marker: str | None = None


@dataclass(frozen=True)
class Bandwidth:
    """An achieved-bandwidth plot from a timing plot: bytes moved per call over its time.

    ``what``: the call (the title); ``moved(x, line value)``: bytes one call moves (None leaves
    that line out); ``counted``: what those bytes are, printed under the plot."""

    plot_name: str
    what: str
    moved: Callable[[Any, Any], float | None]
    counted: str


@dataclass(frozen=True)
class Look:
    """What one plot says beyond perf_report's lines: ``what`` is measured (the title, with the
    device), the y label with its unit, an x label (default: the Benchmark's), reference lines, and
    an achieved-bandwidth plot drawn beside it."""

    what: str
    ylabel: str
    xlabel: str | None = None
    refs: tuple[Ref, ...] = ()
    bandwidth: Bandwidth | None = None


TIMES = " \u00d7 "  # a multiplication sign in plot labels


def title(what: str) -> str:
    return f"{what}\n{device_name()}{', small (CI) sweep' if CI else ''}"


def contract_refs(bench: Any) -> list[Ref]:
    """The contract's targets on a ratio of two lines of this plot, as a bound on the tfuture line
    (a ratio limit of 1 is the other line itself: nothing to add)."""
    from perf.contract import TARGETS

    colors = dict(zip(bench.line_names, [s[0] for s in bench.styles or []], strict=False))
    refs = []
    for _, op, limit, where in TARGETS:
        plot, _, ratio = where.partition(": ")
        if plot != bench.plot_name or limit == 1:
            continue
        num, den = ratio.split(" / ")
        if op in ("<=", "<"):  # num <= limit x den
            bound, label = num, f"contract: {num} {op.replace('<=', '≤')} {limit:g}{TIMES}{den}"
            y = functools.partial(lambda lim, d, m: lim * m[d], limit, den)
        else:  # num / den >= limit: den <= num / limit
            bound, label = den, f"contract: {den} {'≤' if op == '>=' else '<'} {num} / {limit:g}"
            y = functools.partial(lambda lim, n, m: m[n] / lim, limit, num)
        refs.append(Ref(label, y, color=colors.get(bound, "gray"), ls=(0, (3, 1, 1, 1, 1, 1))))
    return refs


def _x_ticks(ax: Any, xs: Sequence[Any], log: bool) -> bool:
    """A tick on every x value of the sweep, integers written as integers, slanted when crowded
    (a log axis, or a linear one of integers); False where it left the axis as it was."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    vals = [float(v) for v in xs]
    if len(vals) < 2 or (not log and not all(v.is_integer() for v in vals)):
        return False
    labels = [str(int(v)) if v.is_integer() else f"{v:g}" for v in vals]
    ax.xaxis.set_major_locator(FixedLocator(vals))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FixedFormatter(labels))
    pos = np.log(vals) if log else np.asarray(vals)
    frac = np.diff(np.sort(pos)) / max(float(np.ptp(pos)), 1e-12)
    widths = [len(a) + len(b) for a, b in itertools.pairwise(labels)]
    # About 5 inches of axis, 0.08 inch a character, half of each neighbouring label.
    if any(f * 5.0 < 0.04 * w + 0.1 for f, w in zip(frac, widths, strict=False)):
        for label in ax.get_xticklabels():
            label.set(rotation=40, ha="right", rotation_mode="anchor")
    return True


def _plain_log_labels(axis: Any) -> None:
    """Plain numbers (20, 0.5, 1000) on a log axis, minor ticks labelled when it spans under a
    decade, instead of matplotlib's 2x10^1."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return f"{x:g}"

    axis.set_major_formatter(Plain(labelOnlyBase=False))
    axis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def _finish(ax: Any, what: str, xlabel: str, ylabel: str, xs: Sequence[Any], x_log: bool) -> None:
    ax.set_title(title(what), fontsize="medium")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ax.get_yscale() == "log":
        _plain_log_labels(ax.yaxis)
    if not _x_ticks(ax, xs, x_log) and x_log:
        _plain_log_labels(ax.xaxis)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(
        loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize="small", framealpha=0.9
    )


def _medians(bench: Any, points: list[Timing]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(medians, bands)`` by line name from perf_report's calls (x-major order); bands [2, n]."""
    n_lines = len(bench.line_vals)
    arr = np.asarray(points, dtype=float).reshape(len(bench.x_vals), n_lines, 3)
    med = {name: arr[:, i, 0] for i, name in enumerate(bench.line_names)}
    band_ = {name: arr[:, i, 1:].T for i, name in enumerate(bench.line_names)}
    return med, band_


def _restyle(fig: Any, bench: Any, look: Look, points: list[Timing]) -> None:
    """perf_report's figure of ``bench``: line names as labels, lines that did not run out of the
    legend (named in it), reference lines, title, units, ticks, legend outside; saved again."""
    ax = fig.axes[0]
    med, _ = _medians(bench, points)
    missing = []
    for line, name in zip(ax.get_lines(), bench.line_names, strict=False):
        line.set_label(name)
        if not np.isfinite(med[name]).any():
            line.remove()
            missing.append(name)
    xs = np.asarray(bench.x_vals, dtype=float)
    for ref in (*look.refs, *contract_refs(bench)):
        style = {"color": ref.color, "ls": ref.ls, "lw": 1.3, "marker": ref.marker, "label": ref.label}
        if isinstance(ref.y, int | float):
            ax.axhline(float(ref.y), **style)
            continue
        y = np.asarray(ref.y(med) if callable(ref.y) else ref.y, dtype=float)
        if np.isfinite(y).any():
            ax.plot(xs if ref.x is None else np.asarray(ref.x, dtype=float), y, **style)
    if missing:
        ax.plot([], [], " ", label=f"not run here: {', '.join(missing)}")
    _finish(ax, look.what, look.xlabel or bench.xlabel, look.ylabel, bench.x_vals, bench.x_log)
    fig.savefig(os.path.join(results_dir(), f"{bench.plot_name}.png"), bbox_inches="tight")


def _bandwidth_plot(bench: Any, look: Look, points: list[Timing]) -> str:
    """The achieved-bandwidth plot of ``bench`` (GB/s: bytes moved / median time; band: p20-p80),
    the device's peak as a line; writes ``<plot_name>.csv`` and ``.png``; returns what it shows."""
    import matplotlib.pyplot as plt
    import pandas as pd

    bw = look.bandwidth
    assert bw is not None
    med, band_ = _medians(bench, points)
    x_name = bench.x_names[0]
    table: dict[str, Any] = {x_name: list(bench.x_vals)}
    fig, ax = plt.subplots()
    styles = bench.styles or [(None, "-")] * len(bench.line_vals)
    for val, name, (color, ls) in zip(bench.line_vals, bench.line_names, styles, strict=True):
        moved = [bw.moved(x, val) for x in bench.x_vals]
        if any(m is None for m in moved) or not np.isfinite(med[name]).any():
            continue
        nbytes = np.asarray(moved, dtype=float)
        gbps = nbytes / med[name] / 1e3  # bytes / us -> GB/s
        table[f"{name} (GB/s)"] = gbps
        ax.plot(bench.x_vals, gbps, label=name, color=color, ls=ls)
        lo, hi = nbytes / band_[name][1] / 1e3, nbytes / band_[name][0] / 1e3
        if np.isfinite(lo).any():
            ax.fill_between(bench.x_vals, lo, hi, alpha=0.15, color=color)
    peak, about_peak = peak_bandwidth()
    if peak is not None:
        ax.axhline(peak / 1e9, color="black", lw=1.5, label=about_peak)
    else:
        ax.plot([], [], " ", label=about_peak)
    ax.set_xscale("log" if bench.x_log else "linear")
    ax.set_yscale("log")
    on_device = HAS_CUDA and bench.args.get("timer", "device_time") == "device_time"
    where = "device" if on_device else "host path, host-bound"
    _finish(
        ax,
        f"{bw.what}: achieved bandwidth ({where})",
        f"{look.xlabel or bench.xlabel}\nbytes per call: {bw.counted}",
        "achieved bandwidth (GB/s)",
        bench.x_vals,
        bench.x_log,
    )
    folder = results_dir()
    pd.DataFrame(table).to_csv(os.path.join(folder, f"{bw.plot_name}.csv"), float_format="%.6f", index=False)
    fig.savefig(os.path.join(folder, f"{bw.plot_name}.png"), bbox_inches="tight")
    print(f"{bw.plot_name}:\n{pd.DataFrame(table).to_string(index=False)}")
    return (
        f"Achieved bandwidth of {bench.plot_name} ({where}): bytes per call ({bw.counted}) over the "
        f"median time, band p20-p80; {about_peak}."
    )


def save(mark: Any, look: Callable[[Any], Look]) -> None:
    """``mark.run`` into the results folder: ``<plot_name>.csv`` and ``.png`` per benchmark, the
    figure drawn as ``look(benchmark)`` says, and the achieved-bandwidth plot it asks for."""
    import matplotlib.pyplot as plt

    benches = mark.benchmarks if isinstance(mark.benchmarks, list) else [mark.benchmarks]
    looks = [look(b) for b in benches]
    fn, points = mark.fn, []

    def recording(**kwargs: Any) -> Any:
        ret = fn(**kwargs)
        got = tuple(ret) if isinstance(ret, tuple | list) else (ret, None, None)
        points.append(tuple(float("nan") if v is None else float(v) for v in got))
        return ret

    before = set(plt.get_fignums())
    mark.fn = recording
    try:
        mark.run(save_path=results_dir(), print_data=True)
    finally:
        mark.fn = fn
    about = (fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    plots = {b.plot_name: " ".join(about.split()) for b in benches}
    try:
        start = 0
        drawn = [num for num in plt.get_fignums() if num not in before]  # one per Benchmark, in order
        for num, bench, bench_look in zip(drawn, benches, looks, strict=True):
            n = len(bench.x_vals) * len(bench.line_vals)
            bench_points, start = points[start : start + n], start + n
            _restyle(plt.figure(num), bench, bench_look, bench_points)
            if bench_look.bandwidth is not None:
                plots[bench_look.bandwidth.plot_name] = _bandwidth_plot(bench, bench_look, bench_points)
    finally:
        plt.close("all")
    record("plots", plots)
    write_meta()
