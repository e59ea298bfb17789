"""Host cost of the runtime's slot bookkeeping per call, against batch size.

``python -m perf.bench_bookkeeping``. Runs everywhere, on a CPU-device :class:`FutureMap` (plus a
CUDA map for the device-touching lines when a GPU is present). Lines, us per call:

* ``alloc``: ``fmap.alloc(bs)``, a fresh contiguous run.
* ``release``: ``fmap.release(h)`` of a fresh handle.
* ``filter``: ``h.filter(mask)`` with a host bool mask keeping ~95% of rows.
* ``release_filtered``: ``fmap.release`` of a filtered (non-contiguous) handle.
* ``cat``: ``FutureIndices.cat([kept, new])``, a filtered handle plus a small fresh one.
* ``placeholders``: ``h.placeholders()`` of a fresh handle (an arange).
* ``placeholders_filtered``: ``placeholders()`` of a filtered handle (a host -> device copy).
* ``host_placeholders``: ``h.host_placeholders()`` (a numpy negation).
* ``step``: one scheduler step: filter the last outputs (~95% kept), alloc the new requests'
  slots, cat, placeholders of the merged handle, alloc this step's outputs, release the old
  handles. Batch size stays ``bs``.
* ``*_cuda`` (GPU only): ``placeholders_filtered`` and ``step`` on a CUDA map.

On a GPU, :func:`busy_stream_check` also asks whether the calls that copy host slot arrays to
the device (``placeholders()`` and ``FutureMap.store`` of a filtered handle, both from pageable
numpy memory) return while the stream is still busy, or wait for it (which would serialize the
scheduler behind the forward).

Each line times a batch of calls with ``time.perf_counter``; set-up and clean-up (the allocs a
release needs, the releases an alloc leaves) run outside the timed region.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from perf._common import (
    HAS_CUDA,
    HOST_YLABEL,
    STYLES,
    Timing,
    column,
    describe,
    host_us_batched,
    merge_summary,
    pick,
    r2,
    report_mark,
    run_report,
    skip,
    time_calls,
    write_meta,
)
from tfuture import FutureIndices, FutureMap

BATCH = pick([1, 4, 16, 64, 256, 1024], [1, 64, 1024])
KEEP = 0.95
# host_us_batched runs at most 200 calls per batch; room for them all plus the step's churn.
MAX_CALLS = 200
OPS = [
    "alloc",
    "release",
    "filter",
    "release_filtered",
    "cat",
    "placeholders",
    "placeholders_filtered",
    "host_placeholders",
    "step",
]
CUDA_OPS = ["placeholders_filtered_cuda", "step_cuda"]


def _masks(bs: int, n: int = 64, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + bs)
    return [rng.random(bs) < KEEP for _ in range(n)]


def _new_map(bs: int, device: str = "cpu") -> FutureMap:
    return FutureMap(2 * MAX_CALLS * bs + 64, device=device)


def batch_fn(op: str, bs: int) -> Callable[[int], float]:
    """``batch(n)``: run ``n`` calls of ``op``, return the seconds of the calls alone."""
    device = "cuda" if op.endswith("_cuda") else "cpu"
    op = op.removesuffix("_cuda")
    if op == "step":
        return _step_batch(device, bs)
    fmap = _new_map(bs, device)
    mask = _masks(bs)[0]
    # Only ops that read a live handle get one: a handle pinned at slot 1 would push the
    # allocs that wrap around the ring onto the fragmented path (a scan of the whole map).
    fresh = op in ("alloc", "release", "placeholders")
    base = fmap.alloc(0 if fresh else bs)

    def batch(n: int) -> float:
        if op == "host_placeholders":
            return time_calls(base.host_placeholders, n)
        if op == "alloc":
            t0 = time.perf_counter()
            made = [fmap.alloc(bs) for _ in range(n)]
            dt = time.perf_counter() - t0
        elif op == "filter":
            t0 = time.perf_counter()
            made = [base.filter(mask) for _ in range(n)]
            dt = time.perf_counter() - t0
        elif op == "cat":
            kept, new = base.filter(mask), fmap.alloc(max(1, bs // 20))
            t0 = time.perf_counter()
            made = [FutureIndices.cat([kept, new]) for _ in range(n)]
            dt = time.perf_counter() - t0
            made += [kept, new]
        elif op in ("release", "release_filtered"):
            made = [fmap.alloc(bs) if op == "release" else base.filter(mask) for _ in range(n)]
            t0 = time.perf_counter()
            for h in made:
                fmap.release(h)
            return time.perf_counter() - t0
        elif op in ("placeholders", "placeholders_filtered"):
            made = [fmap.alloc(bs) if op == "placeholders" else base.filter(mask) for _ in range(n)]
            t0 = time.perf_counter()
            for h in made:
                h.placeholders()
            dt = time.perf_counter() - t0
        else:
            raise ValueError(f"unknown op {op!r}")
        for h in made:
            fmap.release(h)
        return dt

    return batch


def _step_batch(device: str, bs: int) -> Callable[[int], float]:
    # A ring of 4 steps' worth of slots, as engines size theirs (a few x max running).
    fmap = FutureMap(4 * bs + 64, device=device)
    masks = _masks(bs)
    out = fmap.alloc(bs)
    i = 0

    def step() -> None:
        nonlocal out, i
        kept = out.filter(masks[i % len(masks)])
        i += 1
        new = fmap.alloc(bs - len(kept))
        merged = FutureIndices.cat([kept, new])
        merged.placeholders()
        old, out = out, fmap.alloc(len(merged))
        for h in (old, kept, new, merged):
            fmap.release(h)

    return lambda n: time_calls(step, n)


def bench(bs: int, op: str) -> Timing:
    return host_us_batched(batch_fn(op, bs), cuda=op.endswith("_cuda"))


def busy_stream_check(bs: int = 1024, sleep_cycles: int = 4_000_000) -> dict[str, object]:
    """GPU only: do host -> device slot copies return while the current stream is busy?"""
    fmap = FutureMap(4 * bs, device="cuda")
    fresh = fmap.alloc(bs)
    filtered = fresh.filter(_masks(bs)[0])
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
        host = time.perf_counter() - t0
        still_busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        out[f"{name}_host_us_behind_busy_stream"] = r2(host * 1e6)
        out[f"{name}_returned_while_stream_busy"] = still_busy
        verdict_ = "returns at once" if still_busy else "WAITED for the stream (a hidden sync)"
        print(f"busy stream: {name} {verdict_}, {host * 1e6:.1f} us on the host")
    return out


def main() -> None:
    ops = OPS + (CUDA_OPS if HAS_CUDA else [])
    mark = report_mark(
        bench,
        plot_name="bookkeeping_host_cost",
        x_name="bs",
        x_vals=BATCH,
        lines=ops,
        line_arg="op",
        styles=[("black", "-") if op == "step" else s for op, s in zip(ops, STYLES, strict=False)],
        xlabel="batch size (handle rows)",
    )
    df = run_report(
        mark,
        title="FutureMap / FutureIndices bookkeeping: host cost per call (CPU map"
        + ("; *_cuda lines: CUDA map)" if HAS_CUDA else ")"),
        ylabel=HOST_YLABEL,
    )
    describe(
        "bookkeeping_host_cost",
        "time.perf_counter over batches of calls; set-up and clean-up outside the timed region",
    )
    head = {}
    for bs in (1, 64, 1024):
        if bs in BATCH:
            row = BATCH.index(bs)
            head[f"bs{bs}"] = {op: r2(column(df, op)[row]) for op in ops}
    merge_summary("bookkeeping", {"batch_sizes": BATCH, "us_per_call": head})
    skipped: list[str] = []
    if HAS_CUDA:
        try:
            merge_summary("bookkeeping", busy_stream_check())
        except Exception as exc:
            skip(skipped, "bookkeeping busy-stream check", f"failed: {type(exc).__name__}: {exc}")
    else:
        skip(skipped, f"bookkeeping lines {', '.join(CUDA_OPS)}", "no CUDA device")
        skip(skipped, "bookkeeping busy-stream check (H2D copies behind a busy stream)", "no CUDA device")
    write_meta("bench_bookkeeping", skipped)


if __name__ == "__main__":
    main()
