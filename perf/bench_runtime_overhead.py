"""The runtime's own cost per step: OverlapRuntime against a hand-written loop doing the same work.

    python -m perf.bench_runtime_overhead     # CI=1: fewer steps and repeats

A zero-work model (``forward`` returns a view of a zero ``[n, 2]`` logits buffer, ``sample`` its
argmax) and :class:`perf.decode.DecodeScheduler`: ``max_running`` requests that never finish,
each step decoding every request from the last step's ``out`` handle. Lines:

* ``runtime_<mode>_<backend>``: ``OverlapRuntime(model, fmap, overlap=..., stream=backend,
  trace=False).run(scheduler, max_steps=STEPS)`` for mode sync / overlap and backend ``worker``
  (the CPU worker thread), ``inline`` (forward-stream ops run at once on the calling thread:
  the host path a GPU would see) and, on a GPU, ``auto`` (CUDA streams).
* ``hand_<mode>``: :class:`HandLoop`, the same tensor work inline with no runtime: alloc, one
  packed H2D copy, ``prepare_inputs``, forward, sample, store, the D2H copy of tokens and error
  flag, release; under overlap a step's tokens are read after the next step was launched.

Two plots: process CPU time per step (``time.process_time``: the host thread plus the worker)
and wall time per step. All lines of a point run interleaved, ``REPEATS`` times each.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import torch
import triton

from perf import harness
from perf.decode import DecodeScheduler
from perf.harness import DEVICE, HAS_CUDA
from tfuture import FutureMap
from tfuture.core.batch import ForwardBatch
from tfuture.runtime import OverlapRuntime

MAX_RUNNING = [1, 16, 64, 256]
STEPS = harness.sweep([200], [40])[0]
REPEATS = harness.sweep([15], [5])[0]
BACKENDS = (["auto"] if HAS_CUDA else []) + ["worker", "inline"]
LINES = [f"runtime_{m}_{b}" for b in BACKENDS for m in ("sync", "overlap")] + ["hand_sync", "hand_overlap"]
COLORS = {"auto": "green", "worker": "blue", "inline": "red", "sync": "black", "overlap": "black"}
STYLES = [(COLORS[line.split("_")[-1]], "--" if "sync" in line else "-") for line in LINES]


class ZeroModel:
    """No device work: ``forward`` returns a zero logits view, ``sample`` its argmax (token 0)."""

    def __init__(self, n: int) -> None:
        self.logits = torch.zeros(n, 2, device=DEVICE)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits[: batch.sample_rows.numel()]

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        return logits.argmax(dim=1)


class HandLoop:
    """The runtime's tensor work per decode step, inline on this thread: no stream, no Batch."""

    def __init__(self, n: int, overlap: bool) -> None:
        self.n, self.overlap, self.model = n, overlap, ZeroModel(n)
        self.fmap = FutureMap(4 * n + 64, device=DEVICE)
        self.seg_starts, self.req_ids = np.arange(n + 1), np.arange(n)
        self.split = np.cumsum([n, n + 1, n, n, n]).tolist()
        self.staging = [torch.empty(n + 2, dtype=torch.int64, pin_memory=HAS_CUDA) for _ in range(2)]

    def run(self, steps: int) -> None:
        fmap, n, keep = self.fmap, self.n, np.ones(self.n, dtype=bool)
        positions, tokens = np.full(n, 3), np.arange(1, n + 1)
        prev = None  # (out handle, staging, event) of the step whose tokens are not read yet
        for step in range(steps):
            kept = prev[0].filter(keep) if prev is not None else None
            ids = tokens if kept is None else kept.host_placeholders()
            out = fmap.alloc(n)
            packed = np.concatenate(
                [ids, self.seg_starts, positions, self.req_ids, positions + 1, self.req_ids]
            )
            dev_in = torch.from_numpy(packed).to(DEVICE, non_blocking=True, copy=True)
            ids_d, seg, prefix, rids, lens, sample_reqs = torch.tensor_split(dev_in, self.split)
            prepared = fmap.prepare_inputs(ids_d, seg, prefix)
            rows = prepared.last_rows.index_select(0, sample_reqs)
            fb = ForwardBatch(step, *prepared, rids, lens, sample_reqs, rows)
            sampled = self.model.sample(self.model.forward(fb), fb, None)
            fmap.store(out, sampled)
            if kept is not None:
                fmap.release(kept)
            host = self.staging[step % 2]
            host[:n].copy_(sampled, non_blocking=True)
            host[n:].copy_(fmap.err, non_blocking=True)
            fmap.err.zero_()
            event = torch.cuda.Event() if HAS_CUDA else None
            if event is not None:
                event.record()
            cur = (out, host, event)
            if self.overlap:
                cur, prev = prev, cur
            if cur is not None:
                tokens = self.read(*cur)
            positions = positions + 1
        if prev is not None:
            self.read(*prev)

    def read(self, out: object, host: torch.Tensor, event: torch.cuda.Event | None) -> np.ndarray:
        """Wait for a step's copy, check its error flag, release its handle: its tokens."""
        if event is not None:
            event.synchronize()
        got = host.numpy().copy()
        if got[self.n]:
            raise AssertionError(f"hand loop: {got[self.n]} bad placeholder(s)")
        self.fmap.release(out)  # type: ignore[arg-type]
        return got[: self.n]


def make_runtime(n: int, overlap: bool, backend: str) -> Callable[[int], object]:
    """``run(steps)`` of an OverlapRuntime; raises TypeError where ``stream=`` is not known yet."""
    fmap, model = FutureMap(4 * n + 64, device=DEVICE), ZeroModel(n)
    try:
        rt = OverlapRuntime(model, fmap, overlap=overlap, stream=backend, trace=False)  # type: ignore[call-arg]
    except TypeError:
        if backend != "worker" or HAS_CUDA:
            raise
        # A runtime from before stream=: on CPU its one backend is the worker thread.
        rt = OverlapRuntime(model, fmap, overlap=overlap, trace=False)
    return lambda steps: rt.run(DecodeScheduler(n), max_steps=steps)


def per_step(run: Callable[[int], object]) -> Callable[[], tuple[float, float]]:
    """One timed run of ``STEPS`` steps: (process CPU us, wall us) per step."""

    def once() -> tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        run(STEPS)
        return (time.process_time() - cpu) / STEPS * 1e6, (time.perf_counter() - wall) / STEPS * 1e6

    return once


# Lines that cannot run here, and why (an OverlapRuntime without stream="inline", say).
CANNOT_RUN: dict[str, str] = {}


@functools.cache
def measure(n: int) -> dict[str, np.ndarray]:
    """``{line: [REPEATS, 2]}`` CPU and wall us per step; lines that cannot run are left out."""
    runs: dict[str, Callable[[], tuple[float, float]]] = {}
    for line in (line for line in LINES if line not in CANNOT_RUN):
        kind, mode, *backend = line.split("_")
        try:
            run = (
                HandLoop(n, mode == "overlap").run
                if kind == "hand"
                else make_runtime(n, mode == "overlap", backend[0])
            )
            run(5)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            if kind == "runtime" and isinstance(exc, TypeError):
                why = f"OverlapRuntime(..., stream={backend[0]!r}) raised {why}: no such backend yet"
            CANNOT_RUN[line] = why
            print(f"runtime overhead: {line} cannot run: {why}")
            continue
        runs[line] = per_step(run)
    return harness.interleaved(runs, REPEATS)


@triton.testing.perf_report(
    [
        triton.testing.Benchmark(
            x_names=["max_running"],
            x_vals=MAX_RUNNING,
            x_log=True,
            y_log=True,
            line_arg="impl",
            line_vals=LINES,
            line_names=LINES,
            styles=STYLES,
            xlabel=f"requests decoding per step (zero-work model, {DEVICE})",
            ylabel="us",
            plot_name=f"runtime_{metric}_per_step",
            args={"metric": metric},
        )
        for metric in ("cpu", "wall")
    ]
)
def runtime_per_step(max_running: int, impl: str, metric: str) -> harness.Timing:
    """Process CPU time (host thread plus worker) or wall time per decode step: median, p20-p80."""
    samples = measure(max_running).get(impl)
    return harness.NAN3 if samples is None else harness.band(samples[:, 0 if metric == "cpu" else 1])


def main() -> None:
    harness.save(runtime_per_step)
    for line, why in CANNOT_RUN.items():
        harness.skip(f"runtime overhead line {line}", why)
    # Median over repeats of (runtime line / hand loop of the same mode), CPU time.
    ratios = {
        line: [
            round(
                float(np.median(measure(n)[line][:, 0] / measure(n)[f"hand_{line.split('_')[1]}"][:, 0])), 3
            )
            for n in MAX_RUNNING
        ]
        for line in LINES
        if line.startswith("runtime") and line not in CANNOT_RUN
    }
    harness.record("runtime_overhead", {"max_running": MAX_RUNNING, "steps": STEPS, "cpu_over_hand": ratios})
    print("runtime CPU time per step / hand-written loop (median of per-repeat ratios):")
    for line, values in ratios.items():
        print(f"  {line:24s}", dict(zip(MAX_RUNNING, values, strict=True)))


if __name__ == "__main__":
    main()
