"""Resolve: placeholders -> stored tokens, tfuture vs eager torch, torch.compile, an empty launch.

``python -m perf.bench_resolve``. Sizes 16..32K tokens (powers of 2), int64, ~14% placeholders,
a map of 8192 slots. Lines:

* ``tfuture``: ``resolve_futures_(ids, token_map, err=err)``, the call ``FutureMap.resolve`` makes.
  On CPU (no ``TRITON_INTERPRET``) this is the launcher's checks plus its CPU path (numpy).
* ``torch``: the engines' eager reference, ``ids[:] = where(ids < 0, map[clamp(-ids, 0)], ids)``
  (no bounds check, no error flag: the cheapest correct-input torch version).
* ``torch_ref``: ``tfuture.kernels.resolve.resolve_futures_ref`` with the error flag (same
  semantics as ``tfuture``, eager torch).
* ``torch_compile``: ``torch.compile(dynamic=False)`` of ``torch``, compiled per size (GPU only).
* ``empty_launch``: a Triton kernel that does nothing, the floor (GPU only).

What is timed: the map holds placeholders, ``token_map[s] = -perm(s)`` for a random permutation
of the slots, so each call turns every placeholder into another placeholder. Every call then
does the full work of a fresh resolve (same loads, gathers and stores, 14% of the rows) with no
restore copy in the timed region, and no line pays for a copy.
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
    empty_launch,
    host_where,
    merge_summary,
    pick,
    r2,
    r2_list,
    safe_div,
    skip,
    verdict,
    with_empty_launch,
    write_meta,
)
from tfuture import FutureMap
from tfuture.kernels.resolve import resolve_futures_, resolve_futures_ref

N_SLOTS = 8192
PH_SHARE = 0.14
VOCAB = 32000
SIZES = pick([2**k for k in range(4, 16)], [16, 512, 32768])


def torch_resolve_(ids: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    """The engines' eager resolve, in place: where/gather, no bounds check."""
    ids.copy_(torch.where(ids < 0, token_map[(-ids).clamp(min=0)], ids))
    return ids


@functools.cache
def make_inputs(n: int) -> tuple[FutureMap, torch.Tensor]:
    """A full map whose values are placeholders again, and ``n`` int64 ids, 14% placeholders."""
    g = torch.Generator().manual_seed(n)
    fmap = FutureMap(N_SLOTS, device=DEVICE, dtype=torch.int64)
    fmap.alloc(N_SLOTS)
    # Written directly: a store refuses negative tokens (they would leak as placeholders), but
    # here they are the point, so each timed call resolves again without a restore copy.
    fmap.token_map[1:] = -(torch.randperm(N_SLOTS, generator=g) + 1).to(DEVICE)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    future = torch.rand(n, generator=g) < PH_SHARE
    ids[future] = -torch.randint(1, N_SLOTS + 1, (int(future.sum()),), generator=g)
    return fmap, ids.to(DEVICE)


def make_fn(provider: str, n_tokens: int) -> Callable[[], object]:
    fmap, ids = make_inputs(n_tokens)
    token_map, err = fmap.token_map, fmap.err
    if provider == "tfuture":
        return lambda: resolve_futures_(ids, token_map, err=err)
    if provider == "torch":
        return lambda: torch_resolve_(ids, token_map)
    if provider == "torch_ref":
        return lambda: resolve_futures_ref(ids, token_map, err=err)
    if provider == "torch_compile":
        # A fresh cache per size: past dynamo's recompile limit (8) it would fall back to eager.
        torch._dynamo.reset()
        return functools.partial(torch.compile(torch_resolve_, dynamic=False), ids, token_map)
    if provider == "empty_launch":
        return lambda: empty_launch(ids)
    raise ValueError(f"unknown provider {provider!r}")


def check_same(n: int) -> None:
    """Every real line computes the same ids from the same input (not timed)."""
    fmap, ids = make_inputs(n)
    want = torch_resolve_(ids.clone(), fmap.token_map)
    for name, fn in (
        ("tfuture", lambda x: resolve_futures_(x, fmap.token_map, err=fmap.err)),
        ("torch_ref", lambda x: resolve_futures_ref(x, fmap.token_map, err=fmap.err)),
    ):
        got = fn(ids.clone())
        if not torch.equal(got, want):
            raise AssertionError(f"resolve: {name} differs from the torch reference at n={n}")
    fmap.check()


SWEEP = Sweep(
    "resolve",
    make_fn,
    x_name="n_tokens",
    x_vals=SIZES,
    xlabel="tokens per call (int64, 14% placeholders, 8192-slot map)",
    point="{provider} n={n_tokens}",
)


def main() -> None:
    skipped: list[str] = []
    for n in SIZES:
        check_same(n)
    summary: dict[str, object] = {"sizes": SIZES}
    if HAS_CUDA:
        lines = ["tfuture", "torch", "torch_ref", "torch_compile", "empty_launch"]
        df = SWEEP.plot(
            "device",
            "resolve_device_time",
            lines,
            title=f"resolve: device time per call ({DO_BENCH_BAND})",
            about="do_bench device time of one resolve; the map holds placeholders so every call "
            "does a full resolve with no restore copy",
        )
        tf = column(df, "tfuture")
        vs_empty = safe_div(tf, column(df, "empty_launch"))
        vs_torch = safe_div(column(df, "torch"), tf)
        vs_compile = safe_div(column(df, "torch_compile"), tf)
        summary |= {
            "tfuture_device_us": r2_list(tf),
            "tfuture_over_empty_launch_max": r2(np.nanmax(vs_empty)),
            "torch_over_tfuture_min": r2(np.nanmin(vs_torch)),
            "torch_compile_over_tfuture_min": r2(np.nanmin(vs_compile)),
        }
        worst = np.nanmax(vs_empty)
        verdict(summary, "device: tfuture / empty launch <= 1.15", worst, worst <= 1.15)
        worst = np.nanmin(vs_torch)
        verdict(summary, "device: eager torch / tfuture >= 3.5", worst, worst >= 3.5)
        worst = np.nanmin(vs_compile)
        verdict(summary, "device: torch.compile / tfuture > 1", worst, worst > 1)
    else:
        skip(skipped, "resolve_device_time (all lines, torch_compile included)", NO_GPU)

    host_lines = with_empty_launch(["tfuture", "torch", "torch_ref"], skipped, "resolve_host_cost")
    df = SWEEP.plot(
        "host",
        "resolve_host_cost",
        host_lines,
        title=f"resolve: host cost per call ({host_where()})",
        about=f"{HOST_TIMING}; on CPU the whole resolve runs on the host, so this is its full cost",
    )
    host = safe_div(column(df, "tfuture"), column(df, "torch"))
    summary |= {
        "tfuture_host_us": r2_list(column(df, "tfuture")),
        "torch_host_us": r2_list(column(df, "torch")),
        "tfuture_host_over_torch_host_max": r2(np.nanmax(host)),
        "tfuture_host_over_torch_host_min": r2(np.nanmin(host)),
    }
    worst = np.nanmax(host)
    verdict(summary, "host: tfuture / eager torch <= 1", worst, worst <= 1, contract=HAS_CUDA)
    merge_summary("resolve", summary)
    write_meta("bench_resolve", skipped)


if __name__ == "__main__":
    main()
