"""Store sampled tokens into future slots: tfuture vs torch indexed assignment.

``python -m perf.bench_store``. A 16384-slot int64 map, ``bs`` int64 tokens per call. Lines:

* ``tfuture_range``: ``store_futures(token_map, range(a, a + bs), values)``, the path of a fresh
  handle (``FutureMap.store`` on a contiguous run: no index tensor is read).
* ``tfuture_slots``: ``store_futures(token_map, slots, values)`` with ``bs`` random distinct
  slots, the path of a filtered or merged handle.
* ``torch_index``: ``token_map[slots] = values`` (index_put), the engines' store.
* ``torch_slice``: ``token_map[a:a + bs] = values``, torch's best case for a contiguous run.
* ``empty_launch``: a Triton kernel that does nothing, the floor (GPU only).

A store is idempotent, so repeating it does the full work every call. Token ids only:
tfuture's store takes a 1-D map (no ``[n_slots, width]`` rows yet), so wider rows are skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import triton

from perf._common import (
    DEVICE,
    HAS_CUDA,
    NAN3,
    NO_GPU,
    STYLES,
    Timing,
    column,
    describe,
    device_us,
    empty_launch,
    host_us,
    merge_summary,
    pick,
    r2,
    run_report,
    skip,
    verdict,
    write_meta,
)
from tfuture.kernels.store import store_futures

N_SLOTS = 16384
VOCAB = 32000
BATCH = pick([1, 4, 16, 64, 256, 1024, 4096], [1, 64, 1024])


@functools.cache
def make_inputs(bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, range]:
    """``(token_map, slots, values, run)``: random distinct slots and a contiguous run."""
    g = torch.Generator().manual_seed(bs)
    token_map = torch.zeros(N_SLOTS + 1, dtype=torch.int64, device=DEVICE)
    slots = (torch.randperm(N_SLOTS, generator=g)[:bs] + 1).to(DEVICE)
    values = torch.randint(0, VOCAB, (bs,), generator=g).to(DEVICE)
    start = 1 + (N_SLOTS - bs) // 3
    return token_map, slots, values, range(start, start + bs)


def make_fn(provider: str, bs: int) -> Callable[[], object]:
    token_map, slots, values, run = make_inputs(bs)
    a, b = run.start, run.stop
    fns: dict[str, Callable[[], object]] = {
        "tfuture_range": lambda: store_futures(token_map, run, values),
        "tfuture_slots": lambda: store_futures(token_map, slots, values),
        "torch_index": lambda: token_map.__setitem__(slots, values),
        "torch_slice": lambda: token_map.__setitem__(slice(a, b), values),
        "empty_launch": lambda: empty_launch(token_map),
    }
    return fns[provider]


def check_same(bs: int) -> None:
    """tfuture and torch leave the same map for the same slots (not timed)."""
    token_map = make_inputs(bs)[0]
    for ours, theirs in (("tfuture_slots", "torch_index"), ("tfuture_range", "torch_slice")):
        token_map.zero_()
        make_fn(ours, bs)()
        got = token_map.clone()
        token_map.zero_()
        make_fn(theirs, bs)()
        if not torch.equal(got, token_map):
            raise AssertionError(f"store: {ours} differs from {theirs} at bs={bs}")


def _guarded(what: str, timer: Callable[[], Timing]) -> Timing:
    try:
        return timer()
    except Exception as exc:
        print(f"FAILED {what}: {type(exc).__name__}: {exc}")
        return NAN3


def bench_device(bs: int, provider: str) -> Timing:
    fn = make_fn(provider, bs)
    return _guarded(f"store device {provider} bs={bs}", lambda: device_us(fn))


def bench_host(bs: int, provider: str) -> Timing:
    fn = make_fn(provider, bs)
    return _guarded(f"store host {provider} bs={bs}", lambda: host_us(fn))


def _report(fn: Callable[..., Timing], name: str, lines: list[str], y_log: bool) -> object:
    bench = triton.testing.Benchmark(
        x_names=["bs"],
        x_vals=BATCH,
        x_log=True,
        y_log=y_log,
        line_arg="provider",
        line_vals=lines,
        line_names=lines,
        styles=STYLES[: len(lines)],
        ylabel="us",
        xlabel="tokens stored per call (int64, 16384-slot map)",
        plot_name=name,
        args={},
    )
    return triton.testing.perf_report(bench)(fn)


def _ratio(df: object, num: str, den: str) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return column(df, num) / column(df, den)


def main() -> None:
    skipped: list[str] = []
    for bs in BATCH:
        check_same(bs)
    lines = ["tfuture_range", "tfuture_slots", "torch_index", "torch_slice"]
    summary: dict[str, object] = {"batch_sizes": BATCH}
    if HAS_CUDA:
        df = run_report(
            _report(bench_device, "store_device_time", [*lines, "empty_launch"], y_log=True),
            title="store: device time per call (do_bench median, band p20-p80)",
            ylabel="device time per call (us)",
        )
        describe("store_device_time", "do_bench device time of one store of bs token ids")
        summary |= {
            "torch_index_over_tfuture_slots_device_min": r2(
                np.nanmin(_ratio(df, "torch_index", "tfuture_slots"))
            ),
            "tfuture_range_over_empty_launch_max": r2(np.nanmax(_ratio(df, "tfuture_range", "empty_launch"))),
        }
    else:
        skip(skipped, "store_device_time (all lines)", NO_GPU)
    skip(
        skipped,
        "store of wide rows ([n_slots, width] map)",
        "tfuture's store_futures takes a 1-D token map only; token ids benchmarked",
    )

    host_lines = [*lines, "empty_launch"] if HAS_CUDA else lines
    if not HAS_CUDA:
        skip(skipped, "store_host_cost: empty_launch line", "no GPU: a Triton launch needs a driver")
    where = "GPU launch, no sync" if HAS_CUDA else "CPU: tfuture runs its torch reference path"
    df = run_report(
        _report(bench_host, "store_host_cost", host_lines, y_log=True),
        title=f"store: host cost per call ({where})",
        ylabel="host wall time per call (us)",
    )
    describe("store_host_cost", "time.perf_counter over batches of calls, no sync inside a batch")
    slots_vs_torch = _ratio(df, "tfuture_slots", "torch_index")
    range_vs_torch = _ratio(df, "tfuture_range", "torch_slice")
    summary |= {
        "tfuture_slots_host_over_torch_index_max": r2(np.nanmax(slots_vs_torch)),
        "tfuture_range_host_over_torch_slice_max": r2(np.nanmax(range_vs_torch)),
        "tfuture_slots_host_us": [r2(v) for v in column(df, "tfuture_slots")],
        "torch_index_host_us": [r2(v) for v in column(df, "torch_index")],
    }
    worst = np.nanmax(slots_vs_torch)
    verdict(summary, "host: tfuture_slots / torch index_put <= 1", worst, worst <= 1, contract=HAS_CUDA)
    merge_summary("store", summary)
    write_meta("bench_store", skipped)


if __name__ == "__main__":
    main()
