"""Named future fields: one fused launch for every field vs one torch indexing op per field.

    python -m perf.bench_fields           # CI=1: the small sweep

A 16384-slot map with the fields of a speculative step, taken in this order (``n_fields``
takes the first ones): ``tokens [5] int64``, ``accept_len [] int32``, ``new_seq_len [] int64``,
``draft_tokens [4] int64``, ``topk_ids [4] int32``, ``topk_probs [4] float32``, ``hidden [256]
bf16``, ``logprob [] fp16``. 256 rows of a filtered (non-contiguous) handle. Lines, per op
(gather, store):

* ``tfuture``: ``FutureFields.gather(handle, names)`` / ``.store(handle, payload)``, checks included.
* ``tfuture_kernel``: the bare ``gather_fields`` / ``store_fields`` on a slot tensor.
* ``torch``: ``[buf[slots] for buf in buffers]`` / ``buf[slots] = value`` per field.
* ``empty_launch``: a Triton kernel that does nothing, the floor (GPU only).

On CPU (no ``TRITON_INTERPRET``) the tfuture lines run their torch reference, so the host cost
there is tfuture's checks and dispatch on top of the same per-field torch ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import triton

from perf import baselines, harness
from perf.harness import DEVICE, HAS_CUDA
from tfuture import FutureMap
from tfuture.core.future_fields import FutureFields
from tfuture.kernels.fields import as_words, gather_fields, store_fields

N_SLOTS, ROWS = 16384, 256
CATALOG = {
    "tokens": ((5,), torch.int64),
    "accept_len": ((), torch.int32),
    "new_seq_len": ((), torch.int64),
    "draft_tokens": ((4,), torch.int64),
    "topk_ids": ((4,), torch.int32),
    "topk_probs": ((4,), torch.float32),
    "hidden": ((256,), torch.bfloat16),
    "logprob": ((), torch.float16),
}
N_FIELDS = harness.sweep(list(range(1, len(CATALOG) + 1)), [1, 4, 8])
LINES = [(op, p) for op in ("gather", "store") for p in ("tfuture", "tfuture_kernel", "torch")]
LINES += [("launch", "empty_launch")] if HAS_CUDA else []
NAMES = [f"{p} {op}" if op != "launch" else p for op, p in LINES]
COLORS = {"tfuture": "blue", "tfuture_kernel": "green", "torch": "red", "empty_launch": "black"}
STYLES = [(COLORS[p], {"gather": "-", "store": "--", "launch": ":"}[op]) for op, p in LINES]


@functools.cache
def make_inputs(nf: int) -> tuple[FutureFields, object, list[str], torch.Tensor, dict[str, torch.Tensor]]:
    """``(fields, handle, names, slots, payload)``: ``ROWS`` shuffled slots, the first ``nf`` fields."""
    g = torch.Generator().manual_seed(nf)
    fmap = FutureMap(N_SLOTS, device=DEVICE)
    ff = FutureFields(fmap, CATALOG)
    for name in ff.names:
        words = as_words(ff.buffer(name))
        words.copy_(torch.randint(-100, 100, words.shape, generator=g).to(words.dtype))
    handle = fmap.alloc(N_SLOTS).filter(torch.randperm(N_SLOTS, generator=g)[:ROWS].numpy())
    handle.placeholders()  # cached on the handle, as after the step that made it
    slots = torch.from_numpy(np.array(handle.slots)).to(DEVICE)
    names = list(CATALOG)[:nf]
    return ff, handle, names, slots, ff.gather(handle, names)


def make_fn(op: str, provider: str, nf: int) -> Callable[[], object]:
    ff, handle, names, slots, payload = make_inputs(nf)
    bufs, values = [ff.buffer(n) for n in names], [payload[n] for n in names]
    fns: dict[tuple[str, str], Callable[[], object]] = {
        ("gather", "tfuture"): lambda: ff.gather(handle, names),
        ("gather", "tfuture_kernel"): lambda: gather_fields(bufs, slots),
        ("gather", "torch"): lambda: [b[slots] for b in bufs],
        ("store", "tfuture"): lambda: ff.store(handle, payload),
        ("store", "tfuture_kernel"): lambda: store_fields(bufs, slots, values),
        ("store", "torch"): lambda: [b.__setitem__(slots, v) for b, v in zip(bufs, values, strict=True)],
        ("launch", "empty_launch"): lambda: baselines.empty_launch(slots),
    }
    return fns[op, provider]


@triton.testing.perf_report(
    [
        triton.testing.Benchmark(
            x_names=["n_fields"],
            x_vals=N_FIELDS,
            line_arg="provider",
            line_vals=LINES,
            line_names=NAMES,
            styles=STYLES,
            xlabel=f"fields per call ({ROWS} rows of a filtered handle)",
            ylabel="us",
            plot_name=f"fields_{timer}",
            args={"timer": timer},
        )
        for timer in harness.TIMERS
    ]
)
def fields(n_fields: int, provider: tuple[str, str], timer: str) -> harness.Timing:
    """One gather or store of every field: device time (do_bench) or host wall time (no sync).

    Median, band p20-p80.
    """
    return harness.timed(make_fn(*provider, n_fields), timer)


def look(bench: triton.testing.Benchmark) -> harness.Look:
    timer = bench.args["timer"]
    return harness.Look(
        what=f"future fields gather / store, {ROWS} rows: {harness.time_label(timer, unit=False)}",
        ylabel=harness.time_label(timer),
        xlabel=f"fields per call ({ROWS} rows of a filtered handle)",
    )


def check_same(nf: int) -> None:
    """Every gather line returns the same bits; a store rewrites what is there (not timed)."""
    want = make_fn("gather", "torch", nf)()
    for provider in ("tfuture", "tfuture_kernel"):
        got = make_fn("gather", provider, nf)()
        got = list(got.values()) if isinstance(got, dict) else got
        if not all(torch.equal(as_words(a), as_words(b)) for a, b in zip(got, want, strict=True)):
            raise AssertionError(f"fields gather: {provider} differs from torch at n_fields={nf}")
        make_fn("store", provider, nf)()
    again = make_fn("gather", "torch", nf)()
    if not all(torch.equal(as_words(a), as_words(b)) for a, b in zip(again, want, strict=True)):
        raise AssertionError(f"fields store changed the stored bits at n_fields={nf}")


def main() -> None:
    for nf in N_FIELDS:
        check_same(nf)
    if not HAS_CUDA:
        harness.skip("fields_device_time (all lines)", harness.NO_GPU)
        harness.skip("fields_host_cost: empty_launch line", harness.NO_GPU)
    harness.save(fields, look)


if __name__ == "__main__":
    main()
