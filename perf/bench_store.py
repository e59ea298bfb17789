"""Store sampled tokens into future slots: tfuture vs torch indexed assignment.

    python -m perf.bench_store            # CI=1: the small sweep

A 16384-slot int64 map, ``bs`` int64 tokens per call. Lines:

* ``tfuture_range``: ``store_futures(token_map, range(a, a + bs), values)``, the path of a fresh
  handle (``FutureMap.store`` on a contiguous run: no index tensor is read).
* ``tfuture_slots``: ``store_futures(token_map, slots, values)`` with ``bs`` random distinct
  slots, the path of a filtered or merged handle.
* ``torch_index``: ``token_map[slots] = values`` (index_put), the engines' store.
* ``torch_slice``: ``token_map[a:a + bs] = values``, torch's best case for a contiguous run.
* ``empty_launch``: a Triton kernel that does nothing, the floor (GPU only).

A store is idempotent, so repeating it does the full work every call. ``store_gbps``: achieved
bandwidth (8 B value read and 8 B map write per token, plus the 8 B slot index when scattered)
against the GPU's peak; on CPU that of the host path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton

from perf import baselines, harness
from perf.harness import DEVICE, HAS_CUDA
from tfuture.kernels.store import store_futures

N_SLOTS = 16384
BATCH = harness.sweep([1, 4, 16, 64, 256, 1024, 4096], [1, 64, 1024])
LINES = ["tfuture_range", "tfuture_slots", "torch_index", "torch_slice"] + (
    ["empty_launch"] if HAS_CUDA else []
)
STYLES = [("blue", "-"), ("blue", "--"), ("red", "--"), ("red", "-"), ("black", ":")][: len(LINES)]


@functools.cache
def make_inputs(bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, range]:
    """``(token_map, slots, values, run)``: random distinct slots and a contiguous run."""
    g = torch.Generator().manual_seed(bs)
    token_map = torch.zeros(N_SLOTS + 1, dtype=torch.int64, device=DEVICE)
    slots = (torch.randperm(N_SLOTS, generator=g)[:bs] + 1).to(DEVICE)
    values = torch.randint(0, 32000, (bs,), generator=g).to(DEVICE)
    start = 1 + (N_SLOTS - bs) // 3
    return token_map, slots, values, range(start, start + bs)


def make_fn(provider: str, bs: int) -> Callable[[], object]:
    token_map, slots, values, run = make_inputs(bs)
    fns: dict[str, Callable[[], object]] = {
        "tfuture_range": lambda: store_futures(token_map, run, values),
        "tfuture_slots": lambda: store_futures(token_map, slots, values),
        "torch_index": lambda: token_map.__setitem__(slots, values),
        "torch_slice": lambda: token_map.__setitem__(slice(run.start, run.stop), values),
        "empty_launch": lambda: baselines.empty_launch(token_map),
    }
    return fns[provider]


@triton.testing.perf_report(
    [
        triton.testing.Benchmark(
            x_names=["bs"],
            x_vals=BATCH,
            x_log=True,
            y_log=True,
            line_arg="provider",
            line_vals=LINES,
            line_names=LINES,
            styles=STYLES,
            xlabel="tokens stored per call (int64, 16384-slot map)",
            ylabel="us",
            plot_name=f"store_{timer}",
            args={"timer": timer},
        )
        for timer in harness.TIMERS
    ]
)
def store(bs: int, provider: str, timer: str) -> harness.Timing:
    """One store of bs token ids: device time (do_bench) or host wall time (no sync), median, p20-p80.

    On CPU the whole store runs on the host, so its host cost is its full cost.
    """
    return harness.timed(make_fn(provider, bs), timer)


def moved(bs: int, provider: str) -> float | None:
    """Bytes one store must move: read the ``bs`` values, write ``bs`` map entries, and read the
    ``bs`` slot indices on the scattered lines; None for the empty launch."""
    if provider == "empty_launch":
        return None
    return 8 * bs * (3 if provider in ("tfuture_slots", "torch_index") else 2)


def look(bench: triton.testing.Benchmark) -> harness.Look:
    timer = bench.args["timer"]
    return harness.Look(
        what=f"store_futures: {harness.time_label(timer, unit=False)}, {N_SLOTS}-slot map",
        ylabel=harness.time_label(timer),
        xlabel="tokens stored per call (int64)",
        bandwidth=harness.Bandwidth(
            "store_gbps",
            f"store_futures, {N_SLOTS}-slot map",
            moved,
            "8 B value read + 8 B map write per token (+ 8 B slot index if scattered)",
        )
        if timer == harness.FULL_TIMER
        else None,
    )


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


def main() -> None:
    for bs in BATCH:
        check_same(bs)
    if not HAS_CUDA:
        harness.skip("store_device_time (all lines)", harness.NO_GPU)
        harness.skip("store_host_cost: empty_launch line", harness.NO_GPU)
    harness.save(store, look)


if __name__ == "__main__":
    main()
