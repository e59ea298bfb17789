"""Named future fields: one fused launch for every field vs one torch indexing op per field.

``python -m perf.bench_fields``. A 16384-slot map with the fields of a speculative step, taken in
this order (``n_fields`` takes the first ones): ``tokens [5] int64``, ``accept_len [] int32``,
``new_seq_len [] int64``, ``draft_tokens [4] int64``, ``topk_ids [4] int32``, ``topk_probs [4]
float32``, ``hidden [256] bf16``, ``logprob [] fp16``. Handles are filtered (non-contiguous), the
case after a batch changed. Lines:

* ``tfuture``: ``FutureFields.gather(handle, names)`` / ``.store(handle, payload)``, checks included.
* ``tfuture_kernel``: the bare ``gather_fields`` / ``store_fields`` on a slot tensor.
* ``torch``: ``[buf[slots] for buf in buffers]`` / ``buf[slots] = value`` per field.
* ``empty_launch``: a Triton kernel that does nothing, the floor (GPU only).

Sweeps: gather over batch size (first 4 fields), gather and store over field count (bs 256).
On CPU (no ``TRITON_INTERPRET``) the tfuture lines run their torch reference, so the host cost
there measures tfuture's checks and dispatch on top of the same per-field torch ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from perf._common import (
    DEVICE,
    DEVICE_YLABEL,
    DO_BENCH_BAND,
    HAS_CUDA,
    HOST_YLABEL,
    NO_GPU,
    Timing,
    column,
    column_ratio,
    describe,
    device_us,
    empty_launch,
    host_us,
    merge_summary,
    pick,
    r2_list,
    report_mark,
    run_report,
    skip,
    timed_line,
    verdict,
    with_empty_launch,
    write_meta,
)
from tfuture import FutureIndices, FutureMap
from tfuture.fields import FutureFields
from tfuture.kernels.fields import as_words, gather_fields, store_fields

N_SLOTS = 16384
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
BATCH = pick([1, 4, 16, 64, 256, 1024, 4096], [1, 64, 1024])
N_FIELDS = pick(list(range(1, len(CATALOG) + 1)), [1, 4, 8])
BS_FIXED, NF_FIXED = 256, 4


@functools.cache
def _state() -> tuple[FutureFields, FutureIndices]:
    """Every slot in use with random bits in every field; a handle on half of them, shuffled."""
    g = torch.Generator().manual_seed(0)
    fmap = FutureMap(N_SLOTS, device=DEVICE)
    ff = FutureFields(fmap, CATALOG)
    everything = fmap.alloc(N_SLOTS)
    for name in ff.names:
        words = as_words(ff.buffer(name))
        words.copy_(torch.randint(-100, 100, words.shape, generator=g).to(words.dtype))
    pick_rows = torch.randperm(N_SLOTS, generator=g)[: N_SLOTS // 2].numpy()
    return ff, everything.filter(pick_rows)


@functools.cache
def make_inputs(bs: int, nf: int) -> tuple[FutureFields, FutureIndices, list[str], torch.Tensor, dict]:
    """``(fields, handle, names, slots, payload)`` for ``bs`` rows and the first ``nf`` fields."""
    ff, half = _state()
    handle = half.filter(np.arange(bs))
    handle.placeholders()  # cached on the handle, as after the step that made it
    slots = torch.from_numpy(handle.slots.copy()).to(DEVICE)
    names = list(CATALOG)[:nf]
    payload = ff.gather(handle, names)
    return ff, handle, names, slots, payload


def make_fn(provider: str, op: str, bs: int, n_fields: int) -> Callable[[], object]:
    ff, handle, names, slots, payload = make_inputs(bs, n_fields)
    bufs = [ff.buffer(n) for n in names]
    values = [payload[n] for n in names]
    if provider == "empty_launch":
        return lambda: empty_launch(slots)
    if op == "gather":
        fns: dict[str, Callable[[], object]] = {
            "tfuture": lambda: ff.gather(handle, names),
            "tfuture_kernel": lambda: gather_fields(bufs, slots),
            "torch": lambda: [b[slots] for b in bufs],
        }
    else:

        def torch_store() -> None:
            for b, v in zip(bufs, values, strict=True):
                b[slots] = v

        fns = {
            "tfuture": lambda: ff.store(handle, payload),
            "tfuture_kernel": lambda: store_fields(bufs, slots, values),
            "torch": torch_store,
        }
    return fns[provider]


def check_same(bs: int, nf: int) -> None:
    """Every gather line returns the same bits; a store rewrites what is there (not timed)."""
    want = make_fn("torch", "gather", bs, nf)()
    for provider in ("tfuture", "tfuture_kernel"):
        got = make_fn(provider, "gather", bs, nf)()
        got = list(got.values()) if isinstance(got, dict) else got
        for a, b in zip(got, want, strict=True):  # type: ignore[call-overload]
            if not torch.equal(as_words(a), as_words(b)):
                raise AssertionError(f"fields gather: {provider} differs from torch at bs={bs}, nf={nf}")
    make_fn("tfuture", "store", bs, nf)()
    make_fn("tfuture_kernel", "store", bs, nf)()
    again = make_fn("torch", "gather", bs, nf)()
    if not all(torch.equal(as_words(a), as_words(b)) for a, b in zip(again, want, strict=True)):  # type: ignore[call-overload]
        raise AssertionError(f"fields store changed the stored bits at bs={bs}, nf={nf}")


def _bench(op: str, timer: Callable[[Callable[[], object]], Timing]) -> Callable[..., Timing]:
    """The line function of an ``op`` sweep: over ``bs`` or ``n_fields``, the other one fixed."""
    what = f"fields {op} {{provider}} bs={{bs}} nf={{n_fields}}"
    return timed_line(make_fn, timer, what, op=op, bs=BS_FIXED, n_fields=NF_FIXED)


def _report(fn: Callable[..., Timing], name: str, x: str, lines: list[str]) -> object:
    by_bs = x == "bs"
    return report_mark(
        fn,
        plot_name=name,
        x_name=x,
        x_vals=BATCH if by_bs else N_FIELDS,
        lines=lines,
        xlabel=f"requests per call ({NF_FIXED} fields)" if by_bs else f"fields per call (bs {BS_FIXED})",
        x_log=by_bs,
    )


def main() -> None:
    skipped: list[str] = []
    for bs in BATCH:
        check_same(bs, NF_FIXED)
    for nf in N_FIELDS:
        check_same(BS_FIXED, nf)
    summary: dict[str, object] = {"batch_sizes": BATCH, "n_fields": N_FIELDS}
    lines = ["tfuture", "tfuture_kernel", "torch"]
    sweeps = [("gather", "bs"), ("gather", "n_fields"), ("store", "n_fields")]
    timers = [("device_time", device_us)] if HAS_CUDA else []
    timers.append(("host_cost", host_us))
    if not HAS_CUDA:
        skip(skipped, "fields_*_device_time (all lines)", NO_GPU)
    plotted = with_empty_launch(lines, skipped, "fields_*_host_cost")
    for kind, timer in timers:
        for op, x in sweeps:
            name = f"fields_{op}_{'bs' if x == 'bs' else 'nfields'}_{kind}"
            what = f"device time ({DO_BENCH_BAND})" if kind == "device_time" else "host cost"
            where = "" if HAS_CUDA or kind == "device_time" else " (CPU: tfuture runs its torch reference)"
            df = run_report(
                _report(_bench(op, timer), name, x, plotted),
                title=f"fields {op}: {what} per call{where}",
                ylabel=DEVICE_YLABEL if kind == "device_time" else HOST_YLABEL,
            )
            describe(name, f"one fused {op} of every field vs one torch indexing op per field; {what}")
            ratio = column_ratio(df, "torch", "tfuture")
            summary[f"{name}_tfuture_us"] = r2_list(column(df, "tfuture"))
            summary[f"{name}_torch_us"] = r2_list(column(df, "torch"))
            summary[f"{name}_torch_over_tfuture"] = r2_list(ratio)
            if kind == "host_cost":
                worst = float(np.nanmax(1 / ratio))
                ok = worst <= 1
                verdict(
                    summary, f"host: fields {op} ({x}) tfuture / torch <= 1", worst, ok, contract=HAS_CUDA
                )
    merge_summary("fields", summary)
    write_meta("bench_fields", skipped)


if __name__ == "__main__":
    main()
