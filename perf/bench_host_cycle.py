"""Host cost of one decode cycle of future bookkeeping: tfuture against two engine designs.

    python -m perf.bench_host_cycle       # CI=1: fewer repeats

One cycle, at batch size ``n``: alloc ``n`` slots, store ``n`` sampled tokens into them, keep
~90% of the rows (the requests still running; a host numpy mask), cat 8 concrete prefill ids
with the kept rows' placeholders into the next step's token stream, resolve it, release.
Tensors on ``DEVICE`` (CPU without a GPU, one torch thread). Lines:

* ``tfuture``: the public API: ``alloc``, ``store``, ``filter(mask)``, ``cat`` with
  ``placeholders()``, ``resolve``, ``release`` of both handles (filter made its own).
* ``seed_ring``: the seed's ring map in eager torch: a ring of ``3 * n`` slots plus ``n`` of
  slack, an interval ``[start, start + n)`` per step, ``map[start:start + n] = tokens``,
  placeholders ``-arange(start, start + n)`` filtered by an index tensor, and the in-place
  resolve ``ids[:] = where(ids < 0, map[clamp(-ids, 0)], ids)``. Nothing to release.
* ``seed_ring_compile``: the same with ``torch.compile`` of the resolve, per size.
* ``pool_indexed``: a buffer indexed by request-pool slot, as SGLang does today:
  ``buf[req_pool_indices] = tokens``; next step ``ids = cat([prefill, buf[running]])``.
* ``checked_floor`` (CPU only): the same seven calls as ``tfuture`` on
  :class:`perf.floor_cycle.FloorMap`, the least a checked public API can do (each call's
  argument checks, then straight-line numpy on the map's arrays). ``tfuture_over_checked_floor``
  is tfuture's own layering; ``checked_floor_over_pool_indexed`` is the price of the calls and
  their checks against an unchecked buffer.

The lines of one batch size run interleaved, ``REPEATS`` timed batches each; ratios are the
median of the per-repeat ratios, so a slow spell of a shared machine hits both sides.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import numpy as np
import torch
import triton

import tfuture
from perf import baselines, contract, harness
from perf.floor_cycle import FloorMap
from perf.harness import DEVICE, HAS_CUDA

BATCH = [1, 4, 16, 64, 256, 1024]
REPEATS = harness.sweep([31], [7])[0]
N_PREFILL = 8
LINES = ["tfuture", "seed_ring", "seed_ring_compile", "pool_indexed", "checked_floor"]
STYLES = [("blue", "-"), ("red", "--"), ("green", "-."), ("black", ":"), ("purple", "--")]
RATIOS = {"seed_ring": "tfuture_over_seed_ring", "pool_indexed": "tfuture_over_pool_indexed"}
RATIOS["seed_ring_compile"] = "tfuture_over_seed_ring_compile"
RATIOS["checked_floor"] = "tfuture_over_checked_floor"


def seed_resolve_(ids: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    """The seed's resolve, in place: where/gather, no bounds check."""
    ids.copy_(torch.where(ids < 0, token_map[torch.clamp(-ids, min=0)], ids))
    return ids


class Inputs:
    """What every line gets for batch size ``n``: sampled tokens, prefill ids, keep masks."""

    def __init__(self, n: int, device: str = DEVICE) -> None:
        g = torch.Generator().manual_seed(n)
        self.n, self.n_keep, self.device = n, max(1, int(0.9 * n)), device
        self.tokens = torch.randint(0, 32000, (n,), generator=g).to(device)
        self.prefill = torch.randint(0, 32000, (N_PREFILL,), generator=g).to(device)
        rng = np.random.default_rng(n)
        # Exactly n_keep rows kept every cycle: one shape per size, so one compile per size.
        self.masks = [np.isin(np.arange(n), rng.permutation(n)[: self.n_keep]) for _ in range(16)]

    def expected(self, cycle: int) -> torch.Tensor:
        mask = torch.from_numpy(self.masks[cycle % len(self.masks)]).to(self.device)
        return torch.cat([self.prefill, self.tokens[mask]])


def tfuture_cycle(x: Inputs) -> Callable[[], torch.Tensor]:
    fmap, masks = tfuture.FutureMap(3 * x.n, device=DEVICE), itertools.cycle(x.masks)

    def cycle() -> torch.Tensor:
        fi = fmap.alloc(x.n)
        fmap.store(fi, x.tokens)
        keep = fi.filter(next(masks))
        ids = fmap.resolve(torch.cat([x.prefill, keep.placeholders()]))
        fmap.release(fi)
        fmap.release(keep)
        return ids

    return cycle


def checked_floor_cycle(x: Inputs) -> Callable[[], torch.Tensor]:
    fmap, masks = FloorMap(3 * x.n), itertools.cycle(x.masks)

    def cycle() -> torch.Tensor:
        fi = fmap.alloc(x.n)
        fmap.store(fi, x.tokens)
        keep = fmap.filter(fi, next(masks))
        ids = fmap.resolve(torch.cat([x.prefill, fmap.placeholders(keep)]))
        fmap.release(fi)
        fmap.release(keep)
        return ids

    return cycle


def seed_ring_cycle(
    x: Inputs, resolve_: Callable[..., torch.Tensor] = seed_resolve_
) -> Callable[[], torch.Tensor]:
    limit, masks = 3 * x.n, itertools.cycle(x.masks)
    # Slack past the ring's limit: an interval that starts near the end never wraps.
    token_map = torch.zeros(limit + x.n + 1, dtype=torch.int64, device=DEVICE)
    ct = 0

    def cycle() -> torch.Tensor:
        nonlocal ct
        start, ct = ct + 1, (ct + x.n) % limit
        placeholders = -torch.arange(start, start + x.n, device=DEVICE)
        token_map[start : start + x.n] = x.tokens
        keep = torch.from_numpy(np.flatnonzero(next(masks))).to(DEVICE, non_blocking=True)
        return resolve_(torch.cat([x.prefill, placeholders[keep]]), token_map)

    return cycle


def pool_indexed_cycle(x: Inputs) -> Callable[[], torch.Tensor]:
    masks = itertools.cycle(x.masks)
    buf = torch.zeros(2 * x.n + 8, dtype=torch.int64, device=DEVICE)
    req_pool_indices = torch.randperm(2 * x.n + 8)[: x.n].to(DEVICE)

    def cycle() -> torch.Tensor:
        buf[req_pool_indices] = x.tokens
        keep = torch.from_numpy(np.flatnonzero(next(masks))).to(DEVICE, non_blocking=True)
        return torch.cat([x.prefill, buf[req_pool_indices[keep]]])

    return cycle


def make_cycles(n: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Every line's cycle at batch size ``n``, each checked against the expected ids."""
    x = Inputs(n)
    cycles = {
        "tfuture": tfuture_cycle(x),
        "seed_ring": seed_ring_cycle(x),
        "pool_indexed": pool_indexed_cycle(x),
    }
    if not HAS_CUDA:
        cycles["checked_floor"] = checked_floor_cycle(x)  # a CPU map's floor
    example = torch.cat([x.prefill, -torch.ones(x.n_keep, dtype=torch.int64, device=DEVICE)])
    ring = torch.zeros(4 * x.n + 1, dtype=torch.int64, device=DEVICE)  # the ring's shape: one compile
    compiled = baselines.compiled(seed_resolve_, example, ring)
    if compiled is not None:
        cycles["seed_ring_compile"] = seed_ring_cycle(x, compiled)
    for name, cycle in cycles.items():
        for i in range(3):
            if not torch.equal(cycle(), x.expected(i)):
                raise AssertionError(f"host cycle: {name} resolved wrong ids at n={n}, cycle {i}")
    return cycles


@functools.cache
def measure(n: int) -> dict[str, np.ndarray]:
    """``{line: [REPEATS]}`` us per cycle, the lines interleaved; a batch is ~2 ms of cycles."""
    cycles = make_cycles(n)
    sync = torch.cuda.synchronize if HAS_CUDA else (lambda: None)
    slowest = max(harness.time_calls(c, 20) / 20 for c in cycles.values())
    # On CUDA a batch stays far below the ~1024-launch queue (about 10 launches a cycle).
    calls = int(min(16 if HAS_CUDA else 500, max(5, (5e-4 if harness.CI else 2e-3) / slowest)))

    def timed(cycle: Callable[[], object]) -> Callable[[], float]:
        def once() -> float:
            sync()
            return harness.time_calls(cycle, calls) / calls * 1e6

        return once

    return harness.interleaved({name: timed(c) for name, c in cycles.items()}, REPEATS)


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=["bs"],
        x_vals=BATCH,
        x_log=True,
        y_log=True,
        line_arg="provider",
        line_vals=LINES,
        line_names=LINES,
        styles=STYLES,
        xlabel=f"batch size (decodes per step, ~90% kept, {N_PREFILL} prefill ids, {DEVICE})",
        ylabel="us",
        plot_name="host_cycle",
        args={},
    )
)
def host_cycle(bs: int, provider: str) -> harness.Timing:
    """Host wall time of one decode cycle (alloc, store, filter, cat, resolve, release): median, p20-p80."""
    samples = measure(bs).get(provider)
    return harness.NAN3 if samples is None else harness.band(samples)


def look(_: triton.testing.Benchmark) -> harness.Look:
    """Host time per cycle, with the contract's bound against the request-pool-indexed buffer (the
    bound against the seed ring is its own line: a limit of 1)."""
    limit = next(t[2] for t in contract.TARGETS if t[3] == "host_cycle.tfuture_over_pool_indexed")
    bound = harness.Ref(
        f"contract: tfuture \u2264 {limit:g}{harness.TIMES}pool_indexed",
        lambda m: limit * m["pool_indexed"],
        color="blue",
        ls=(0, (3, 1, 1, 1, 1, 1)),
    )
    return harness.Look(
        what="one decode cycle of future bookkeeping: host time per cycle",
        ylabel=harness.time_label("host_cost", "cycle"),
        xlabel=f"batch size (decodes per step, ~90% kept, {N_PREFILL} prefill ids, {DEVICE})",
        refs=(bound,),
    )


def main() -> None:
    harness.save(host_cycle, look)
    if any("seed_ring_compile" not in measure(n) for n in BATCH):
        harness.skip("host_cycle: seed_ring_compile line", "torch.compile failed here (see the log)")

    def ratio(num: str, den: str) -> list[float]:
        return [round(float(np.median(measure(n)[num] / measure(n)[den])), 3) for n in BATCH]

    ran = {line for line in LINES if all(line in measure(n) for n in BATCH)}
    ratios = {key: ratio("tfuture", line) for line, key in RATIOS.items() if line in ran}
    if "checked_floor" in ran:
        ratios["checked_floor_over_pool_indexed"] = ratio("checked_floor", "pool_indexed")
    else:
        harness.skip("host_cycle: checked_floor line", "the floor prototype is a CPU map's (numpy)")
    harness.record("host_cycle", {"batch_sizes": BATCH, "repeats": REPEATS, **ratios})
    for key, values in ratios.items():
        print(f"{key} (median of per-repeat ratios):", dict(zip(BATCH, values, strict=True)))


if __name__ == "__main__":
    main()
