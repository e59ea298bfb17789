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

from perf._common import (
    DEVICE,
    DO_BENCH_BAND,
    HAS_CUDA,
    HOST_TIMING,
    NO_GPU,
    Sweep,
    column,
    column_ratio,
    empty_launch,
    host_where,
    merge_summary,
    pick,
    r2,
    r2_list,
    skip,
    verdict,
    with_empty_launch,
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


SWEEP = Sweep(
    "store",
    make_fn,
    x_name="bs",
    x_vals=BATCH,
    xlabel="tokens stored per call (int64, 16384-slot map)",
    point="{provider} bs={bs}",
)


def main() -> None:
    skipped: list[str] = []
    for bs in BATCH:
        check_same(bs)
    lines = ["tfuture_range", "tfuture_slots", "torch_index", "torch_slice"]
    summary: dict[str, object] = {"batch_sizes": BATCH}
    if HAS_CUDA:
        df = SWEEP.plot(
            "device",
            "store_device_time",
            [*lines, "empty_launch"],
            title=f"store: device time per call ({DO_BENCH_BAND})",
            about="do_bench device time of one store of bs token ids",
        )
        summary |= {
            "torch_index_over_tfuture_slots_device_min": r2(
                np.nanmin(column_ratio(df, "torch_index", "tfuture_slots"))
            ),
            "tfuture_range_over_empty_launch_max": r2(
                np.nanmax(column_ratio(df, "tfuture_range", "empty_launch"))
            ),
        }
    else:
        skip(skipped, "store_device_time (all lines)", NO_GPU)
    skip(
        skipped,
        "store of wide rows ([n_slots, width] map)",
        "tfuture's store_futures takes a 1-D token map only; token ids benchmarked",
    )

    host_lines = with_empty_launch(lines, skipped, "store_host_cost")
    df = SWEEP.plot(
        "host",
        "store_host_cost",
        host_lines,
        title=f"store: host cost per call ({host_where()})",
        about=HOST_TIMING,
    )
    slots_vs_torch = column_ratio(df, "tfuture_slots", "torch_index")
    range_vs_torch = column_ratio(df, "tfuture_range", "torch_slice")
    summary |= {
        "tfuture_slots_host_over_torch_index_max": r2(np.nanmax(slots_vs_torch)),
        "tfuture_range_host_over_torch_slice_max": r2(np.nanmax(range_vs_torch)),
        "tfuture_slots_host_us": r2_list(column(df, "tfuture_slots")),
        "torch_index_host_us": r2_list(column(df, "torch_index")),
    }
    worst = np.nanmax(slots_vs_torch)
    verdict(summary, "host: tfuture_slots / torch index_put <= 1", worst, worst <= 1, contract=HAS_CUDA)
    merge_summary("store", summary)
    write_meta("bench_store", skipped)


if __name__ == "__main__":
    main()
