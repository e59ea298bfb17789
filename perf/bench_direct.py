"""The direct forward against the module path: time per step of a Hugging Face Llama in tfuture.

    python -m perf bench_direct        # CI=1: fewer repeats, the 3M model only

``tfuture.generate`` over an :class:`tfuture.models.HFCausalLM` built with ``direct=True``
(``direct``: the modules' ops without their calls, :mod:`tfuture.models.hf_direct`) and with
``direct=False`` (``modules``: the model's own forward, as before), on the random-weight Llamas of
``bench_generate`` (about 3M and 80M parameters, fp32, one torch thread), greedy, ``NEW`` tokens
per request, end token ignored, with the forward inline on the calling thread and in sync (no
worker thread, no overlap: the difference is the forward's own). Lines: wall milliseconds per
step (a run's wall time over its ``NEW`` steps, prefill and engine construction included),
median of ``REPEATS`` interleaved runs after a warm-up. Both lines give the same tokens
(checked). Summary (``summary.json`` under ``direct``): per cell the medians and ``direct`` over
``modules``. Needs the ``hf`` extra.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch
import triton

from perf import bench_generate, harness
from perf.harness import DEVICE

SIZES = harness.sweep(["3M", "80M"], ["3M"])
BATCHES = {"3M": harness.sweep([1, 8, 32], [1, 8]), "80M": [1, 8]}
NEW = {"3M": 64, "80M": 16}
REPEATS = harness.sweep([7], [2])[0]
LINES = ["modules", "direct"]
STYLES = [("black", ":"), ("blue", "-")]

# Why the benchmark did not run, if it did not.
CANNOT_RUN: list[str] = []


def run(adapter: Any, ps: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """(wall ms per step, tokens) of one inline, sync ``tfuture.generate`` over ``adapter``."""
    import tfuture
    from tfuture.scheduler import GenerationParams

    params = GenerationParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    out = tfuture.generate(adapter, ps, params, overlap=False, stream="inline", progress=False)
    return (time.perf_counter() - t0) / new * 1e3, [list(o.token_ids) for o in out]


def runs(adapters: dict[str, Any], ps: list[list[int]], new: int) -> dict[str, Any]:
    """One timed call per line; every call's tokens must equal the first ``modules`` call's."""
    tokens: dict[str, list[list[int]]] = {}

    def timed(line: str) -> Any:
        def once() -> float:
            ms, toks = run(adapters[line], ps, new)
            if tokens.setdefault("modules", toks) != toks:
                raise AssertionError(f"bench_direct: {line} gave other tokens than the modules")
            return ms

        return once

    return {line: timed(line) for line in LINES}


@functools.cache
def measure(size: str) -> dict[tuple[int, str], np.ndarray]:
    """``{(batch, line): [REPEATS]}`` ms per step; empty when transformers is missing."""
    model = bench_generate.build_or_none(size, CANNOT_RUN)
    if model is None:
        return {}
    from tfuture.models import HFCausalLM

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    got: dict[tuple[int, str], np.ndarray] = {}
    try:
        with torch.inference_mode():
            for batch in BATCHES[size]:
                ps = bench_generate.prompts(size, batch)
                max_len = max(map(len, ps)) + NEW[size]
                adapters = {
                    line: HFCausalLM(model, max_requests=batch, max_len=max_len, direct=line == "direct")
                    for line in LINES
                }
                if adapters["direct"]._direct is None:
                    raise AssertionError("bench_direct: the direct forward did not apply to the Llama")
                calls = runs(adapters, ps, NEW[size])
                for once in calls.values():
                    once()  # warm-up, and the tokens to compare with
                for line, v in harness.interleaved(calls, REPEATS).items():
                    got[(batch, line)] = v
    finally:
        torch.set_num_threads(before)
    return got


def _benchmark(size: str) -> triton.testing.Benchmark:
    return harness.batch_sweep(
        BATCHES[size],
        LINES,
        STYLES,
        "requests in the batch",
        "ms per step",
        f"direct_{size}_ms_per_step",
        {"size": size},
    )


@triton.testing.perf_report([_benchmark(s) for s in SIZES])
def direct_report(batch: int, line: str, size: str) -> harness.Timing:
    """The direct forward against the modules: wall ms per step of an inline, sync
    ``tfuture.generate`` (median, p20-p80 over interleaved repeats)."""
    samples = measure(size).get((batch, line))
    return harness.NAN3 if samples is None else harness.band(samples)


def _look(bench: Any) -> harness.Look:
    size = bench.args["size"]
    return harness.Look(
        what=f"direct forward vs the modules: ms per step, {size} Llama fp32, 1 torch thread",
        ylabel="wall ms per step (inline, sync; engine construction included)",
        xlabel=f"requests in the batch (greedy, {NEW[size]} new tokens each; {DEVICE})",
    )


def summary() -> dict[str, Any]:
    out: dict[str, Any] = {
        "new_tokens": {s: NEW[s] for s in SIZES},
        "ms_per_step": {},
        "direct_over_modules": {},
    }
    for size in SIZES:
        got = measure(size)
        for batch in BATCHES[size]:
            med = {line: float(np.median(got[(batch, line)])) for line in LINES}
            key = f"{size}_b{batch}"
            out["ms_per_step"][key] = {line: round(v, 3) for line, v in med.items()}
            out["direct_over_modules"][key] = round(med["direct"] / med["modules"], 3)
    return out


def main() -> None:
    if not measure(SIZES[0]):
        harness.skip("bench_direct (all lines)", CANNOT_RUN[0])
        print(f"bench_direct: skipped: {CANNOT_RUN[0]}")
        return
    harness.save(direct_report, _look)
    got = summary()
    harness.record("direct", got)
    print(f"bench_direct ms_per_step: {got['ms_per_step']}")
    print(f"bench_direct direct_over_modules: {got['direct_over_modules']}")


if __name__ == "__main__":
    main()
