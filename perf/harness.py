"""What every benchmark shares: device, results folder, ``meta.json``, timers, sweep size.

Results go to ``perf/results/<device>-local/`` (untracked); ``PERF_REFRESH=1`` (``python -m perf
--refresh``) writes the committed ``perf/results/<device>/``. ``CI`` set picks the small sweeps.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
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
    head, diff = _git("rev-parse", "HEAD"), _git("status", "--porcelain", "-uno", "--", "tfuture", "perf")
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


def save(mark: Any) -> None:
    """``mark.run`` into the results folder: ``<plot_name>.csv`` and ``.png`` per benchmark."""
    import matplotlib.pyplot as plt

    mark.run(save_path=results_dir(), print_data=True)
    plt.close("all")
    about = (mark.fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    benches = mark.benchmarks if isinstance(mark.benchmarks, list) else [mark.benchmarks]
    record("plots", {b.plot_name: about for b in benches})
    write_meta()


# What a kernel sweep plots: device time (needs a GPU) and host cost (runs everywhere).
TIMERS = ["device_time", "host_cost"] if HAS_CUDA else ["host_cost"]


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


def band(samples: Sequence[float] | np.ndarray) -> Timing:
    """(median, p20, p80) of ``samples``."""
    return tuple(float(q) for q in np.quantile(np.asarray(samples, dtype=float), [0.5, 0.2, 0.8]))  # type: ignore[return-value]


def interleaved(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, np.ndarray]:
    """Call every run once per repeat, in turn, so that a slow spell of a shared machine hits
    them all; ``{name: [repeats, ...] array of what each call returned}``."""
    out: dict[str, list[Any]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            out[name].append(run())
    return {name: np.asarray(v, dtype=float) for name, v in out.items()}
