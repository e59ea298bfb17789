"""Resolve: every placeholder ``-s`` becomes ``token_map[s]``, in place.

    python -m perf.bench_resolve          # CI=1: the small sweep

int64 ids, 14% placeholders, an 8192-slot map. Lines:

* ``tfuture``: ``resolve_futures_(ids, token_map, err=err)``, what ``FutureMap.resolve`` runs.
  On CPU (no ``TRITON_INTERPRET``) that is the launcher's checks plus its host path.
* ``torch``: the engines' eager reference, ``ids[:] = where(ids < 0, map[clamp(-ids, 0)], ids)``
  (no bounds check, no error flag).
* ``torch_compile``: ``torch.compile(dynamic=False)`` of ``torch``, per size (device time only).
* ``empty_launch``: a Triton kernel that does nothing, the floor (GPU only).

The map holds placeholders (``token_map[s] = -perm(s)``), so each call turns every placeholder
into another one: every call does a full resolve, with no restore copy in the timed region.

``resolve_gbps``: achieved bandwidth (8 B per id read, 8 B map read and 8 B written per
placeholder, over the median time) against the GPU's peak; on CPU that of the host path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton

from perf import baselines, harness
from perf.harness import DEVICE, HAS_CUDA
from tfuture import FutureMap
from tfuture.kernels.resolve import resolve_futures_

N_SLOTS = 8192
SIZES = harness.sweep([2**k for k in range(4, 16)], [16, 512, 32768])
LINES = {"device_time": ["tfuture", "torch", "torch_compile", "empty_launch"]}
# Host cost: torch.compile's is not a target, and each size costs a compile.
LINES["host_cost"] = ["tfuture", "torch"] + (["empty_launch"] if HAS_CUDA else [])
STYLES = {"tfuture": ("blue", "-"), "torch": ("red", "--"), "torch_compile": ("green", "-.")}
STYLES["empty_launch"] = ("black", ":")


def torch_resolve_(ids: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    """The engines' eager resolve, in place: where/gather, no bounds check."""
    ids.copy_(torch.where(ids < 0, token_map[(-ids).clamp(min=0)], ids))
    return ids


@functools.cache
def make_inputs(n: int) -> tuple[FutureMap, torch.Tensor]:
    """A full map whose values are placeholders, and ``n`` int64 ids, 14% placeholders."""
    g = torch.Generator().manual_seed(n)
    fmap = FutureMap(N_SLOTS, device=DEVICE, dtype=torch.int64)
    fmap.alloc(N_SLOTS)
    # Written directly: a store refuses negative tokens, but here they are the point.
    fmap.token_map[1:] = -(torch.randperm(N_SLOTS, generator=g) + 1).to(DEVICE)
    ids = torch.randint(0, 32000, (n,), generator=g)
    future = torch.rand(n, generator=g) < 0.14
    ids[future] = -torch.randint(1, N_SLOTS + 1, (int(future.sum()),), generator=g)
    return fmap, ids.to(DEVICE)


def make_fn(provider: str, n: int) -> Callable[[], object] | None:
    """The call one point times; None where it cannot run (a failed torch.compile)."""
    fmap, ids = make_inputs(n)
    token_map, err = fmap.token_map, fmap.err
    if provider == "tfuture":
        return lambda: resolve_futures_(ids, token_map, err=err)
    if provider == "torch":
        return lambda: torch_resolve_(ids, token_map)
    if provider == "torch_compile":
        fn = baselines.compiled(torch_resolve_, ids, token_map)
        return None if fn is None else lambda: fn(ids, token_map)
    return lambda: baselines.empty_launch(ids)


@triton.testing.perf_report(
    [
        triton.testing.Benchmark(
            x_names=["n_tokens"],
            x_vals=SIZES,
            x_log=True,
            y_log=True,
            line_arg="provider",
            line_vals=LINES[timer],
            line_names=LINES[timer],
            styles=[STYLES[line] for line in LINES[timer]],
            xlabel="tokens per call (int64, 14% placeholders)",
            ylabel="us",
            plot_name=f"resolve_{timer}",
            args={"timer": timer},
        )
        for timer in harness.TIMERS
    ]
)
def resolve(n_tokens: int, provider: str, timer: str) -> harness.Timing:
    """One resolve call: device time (do_bench) or host wall time (no sync), median, band p20-p80.

    On CPU the whole resolve runs on the host, so its host cost is its full cost.
    """
    return harness.timed(make_fn(provider, n_tokens), timer)


def moved(n: int, provider: str) -> float | None:
    """Bytes one resolve must move: read the ``n`` ids, and per placeholder read its map entry and
    write the token back (the kernel stores placeholder rows only); None for the empty launch."""
    if provider == "empty_launch":
        return None
    n_placeholders = int((make_inputs(n)[1] < 0).sum())
    return 8 * n + 16 * n_placeholders


def look(bench: triton.testing.Benchmark) -> harness.Look:
    timer = bench.args["timer"]
    return harness.Look(
        what=f"resolve_futures_: {harness.time_label(timer, unit=False)}, {N_SLOTS}-slot map",
        ylabel=harness.time_label(timer),
        xlabel="tokens per call (int64 ids, 14% placeholders)",
        bandwidth=harness.Bandwidth(
            "resolve_gbps",
            f"resolve_futures_, {N_SLOTS}-slot map",
            moved,
            "8 B per id read + 8 B map read and 8 B write per placeholder",
        )
        if timer == harness.FULL_TIMER
        else None,
    )


def check_same(n: int) -> None:
    """tfuture and eager torch compute the same ids from the same input (not timed)."""
    fmap, ids = make_inputs(n)
    got = resolve_futures_(ids.clone(), fmap.token_map, err=fmap.err)
    if not torch.equal(got, torch_resolve_(ids.clone(), fmap.token_map)):
        raise AssertionError(f"resolve: tfuture differs from eager torch at n={n}")
    fmap.check()


def main() -> None:
    for n in SIZES:
        check_same(n)
    if not HAS_CUDA:
        harness.skip("resolve_device_time (all lines)", harness.NO_GPU)
        harness.skip("resolve_host_cost: empty_launch line", harness.NO_GPU)
    harness.save(resolve, look)


if __name__ == "__main__":
    main()
