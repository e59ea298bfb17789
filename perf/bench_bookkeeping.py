"""Host cost of each slot-bookkeeping call of :class:`FutureMap` / :class:`FutureIndices`.

    python -m perf.bench_bookkeeping      # CI=1: the small sweep

Runs everywhere on a map on ``DEVICE``. Lines, us per call, against the handle's rows:

* ``alloc``: ``fmap.alloc(bs)``, a fresh contiguous run; ``release``: ``fmap.release(h)`` of one.
* ``filter``: ``h.filter(mask)``, a host bool mask keeping ~95% of rows;
  ``release_filtered``: ``fmap.release`` of such a (non-contiguous) handle.
* ``cat``: ``FutureIndices.cat([kept, new])``, a filtered handle plus a small fresh one.
* ``placeholders``: ``h.placeholders()`` of a fresh handle (an arange); ``placeholders_filtered``:
  of a filtered handle (a host -> device copy); ``host_placeholders``: a numpy negation.

Set-up (the allocs a release needs) and clean-up run outside the timed region. The whole step
(alloc, store, filter, cat, resolve, release) against two baselines is ``bench_host_cycle``.
On a GPU, :func:`busy_stream_check` also asks whether the calls that copy host slot arrays to
the device return while the stream is busy, or wait for it (a hidden sync).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import triton

from perf import harness
from perf.harness import DEVICE, HAS_CUDA
from tfuture import FutureIndices, FutureMap

BATCH = harness.sweep([1, 4, 16, 64, 256, 1024], [1, 64, 1024])
OPS = ["alloc", "release", "filter", "release_filtered", "cat"]
OPS += ["placeholders", "placeholders_filtered", "host_placeholders"]
# host_us runs at most 200 calls per batch: room for them all.
MAX_CALLS = 200


def batch_fn(op: str, bs: int) -> Callable[[int], float]:
    """``batch(n)``: run ``n`` calls of ``op``; the seconds of the calls alone."""
    fmap = FutureMap(2 * MAX_CALLS * bs + 64, device=DEVICE)
    mask = np.random.default_rng(bs).random(bs) < 0.95
    # Only ops that read a live handle get one: a handle pinned at slot 1 would push the
    # allocs that wrap around the map onto the fragmented path (a scan of the whole map).
    base = fmap.alloc(0 if op in ("alloc", "release", "placeholders") else bs)
    fresh, filtered = (lambda: fmap.alloc(bs)), (lambda: base.filter(mask))
    # What each call gets, made before the clock starts.
    before = {"release": fresh, "placeholders": fresh, "release_filtered": filtered}
    before["placeholders_filtered"] = filtered

    def batch(n: int) -> float:
        if op == "host_placeholders":
            return harness.time_calls(base.host_placeholders, n)
        parts = [base.filter(mask), fmap.alloc(max(1, bs // 20))] if op == "cat" else []
        call: Callable[[FutureIndices | None], object] = {
            "alloc": lambda _: fmap.alloc(bs),
            "filter": lambda _: base.filter(mask),
            "cat": lambda _: FutureIndices.cat(parts),
            "release": fmap.release,
            "release_filtered": fmap.release,
            "placeholders": FutureIndices.placeholders,
            "placeholders_filtered": FutureIndices.placeholders,
        }[op]
        args = [before[op]() if op in before else None for _ in range(n)]
        t0 = time.perf_counter()
        made = [call(a) for a in args]
        dt = time.perf_counter() - t0
        for h in [*args, *made, *parts]:
            if isinstance(h, FutureIndices) and not h.released:
                fmap.release(h)
        return dt

    return batch


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=["bs"],
        x_vals=BATCH,
        x_log=True,
        y_log=True,
        line_arg="op",
        line_vals=OPS,
        line_names=OPS,
        styles=[(c, ls) for ls in ("-", "--") for c in ("blue", "red", "green", "black")][: len(OPS)],
        xlabel=f"rows of the handle (FutureMap on {DEVICE})",
        ylabel="us",
        plot_name="bookkeeping_host_cost",
        args={},
    )
)
def bookkeeping_host_cost(bs: int, op: str) -> harness.Timing:
    """Host wall time of one bookkeeping call; set-up and clean-up outside the timed region."""
    return harness.host_us(lambda: None, batch=batch_fn(op, bs))


LOOK = harness.Look(
    what="FutureMap / FutureIndices bookkeeping: host time per call",
    ylabel=harness.time_label("host_cost"),
    xlabel=f"rows of the handle (FutureMap on {DEVICE})",
)


def busy_stream_check(bs: int = 1024, sleep_cycles: int = 4_000_000) -> dict[str, object]:
    """GPU only: do host -> device slot copies return while the current stream is busy?"""
    fmap = FutureMap(4 * bs, device="cuda")
    filtered = fmap.alloc(bs).filter(np.random.default_rng(0).random(bs) < 0.95)
    tokens = torch.zeros(len(filtered), dtype=fmap.dtype, device="cuda")
    out: dict[str, object] = {}
    for name, call in (
        ("placeholders_filtered", filtered.placeholders),
        ("store_filtered", lambda: fmap.store(filtered, tokens)),
    ):
        call()
        torch.cuda.synchronize()
        # About 2 ms of device work queued ahead of the call (~1.9 GHz sleep clock).
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        call()
        out[f"{name}_host_us_behind_busy_stream"] = round((time.perf_counter() - t0) * 1e6, 1)
        out[f"{name}_returned_while_stream_busy"] = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
    print("busy stream:", out)
    return out


def main() -> None:
    harness.save(bookkeeping_host_cost, lambda _: LOOK)
    if HAS_CUDA:
        harness.record("bookkeeping", busy_stream_check())
    else:
        harness.skip("bookkeeping busy-stream check (H2D copies behind a busy stream)", "no GPU")


if __name__ == "__main__":
    main()
