"""A Hugging Face Llama through the runtime: tokens/s in sync, overlapped, and via ``tfuture.generate``.

    python -m perf bench_hf        # CI=1: fewer repeats

A random-weight ``LlamaForCausalLM`` built from a config in code (nothing is downloaded) wrapped
in :class:`tfuture.models.HFCausalLM`. On a GPU: about 0.5B parameters in bf16 (hidden 1280, 24
layers, 20 query and 4 KV heads of 64, MLP 3456, vocab 32000); on CPU a tiny float32 one (hidden
64, 2 layers), which only checks the path (its numbers say nothing about a GPU). ``batch``
requests with ``PROMPT``-token prompts each generate ``NEW`` tokens greedily, no end token, for
each ``batch`` of ``BATCHES`` (the plot's x axis).

Lines (tokens generated per second of wall time, median of ``REPEATS`` interleaved runs after a
warm-up): ``sync`` and ``overlap`` (``OverlapRuntime`` driven by a ``ContinuousBatcher``, trace
off) and ``generate`` (``tfuture.generate``, the front door: engine, sampler, scheduler, and a
run with tracing on by default). All three must give the same tokens. Needs the ``hf`` extra;
without ``transformers`` the benchmark says so and writes nothing.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch
import triton

from perf import harness
from perf.harness import DEVICE, HAS_CUDA
from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.scheduler import ContinuousBatcher, GenerationParams, RequestSpec

BATCHES = harness.sweep([1, 4, 16, 32], [1, 16]) if HAS_CUDA else harness.sweep([1, 2, 4, 8], [1, 4])
MAX_BATCH = max(BATCHES)  # the KV pool's rows
PROMPT, NEW = (32, 64) if HAS_CUDA else (8, 8)
REPEATS = harness.sweep([5], [3])[0]
LINES = ["sync", "overlap", "generate"]
STYLES = [("red", "--"), ("blue", "-"), ("green", "-.")]
# hidden, layers, query heads, KV heads, MLP, vocab, dtype
SHAPE = (1280, 24, 20, 4, 3456, 32000, torch.bfloat16) if HAS_CUDA else (64, 2, 4, 2, 128, 256, torch.float32)


@functools.cache
def build_model() -> Any:
    """The Llama of ``SHAPE`` on ``DEVICE`` (``tfuture.examples.hf.build_llama``), wrapped in
    ``HFCausalLM`` (``MAX_BATCH`` KV rows), and the transformers model itself."""
    from tfuture.examples.hf import build_llama
    from tfuture.models import HFCausalLM

    hidden, layers, heads, kv_heads, mlp, vocab, dtype = SHAPE
    hf = build_llama(
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        mlp=mlp,
        max_len=4 * (PROMPT + NEW),
    ).to(device=DEVICE, dtype=dtype)
    return HFCausalLM(hf, max_requests=MAX_BATCH, max_len=PROMPT + NEW), hf


def prompts(batch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, SHAPE[5], PROMPT, dtype=np.int64) for _ in range(batch)]


def runtime_run(model: Any, overlap: bool, batch: int) -> tuple[float, list[list[int]]]:
    """(tokens/s, tokens per request) of one run of ``batch`` requests through ``OverlapRuntime``."""
    specs = [RequestSpec(i, arrival=0, prompt=p, max_new=NEW) for i, p in enumerate(prompts(batch))]
    fmap = FutureMap(4 * batch, device=DEVICE)
    sched = ContinuousBatcher(
        specs, fmap, eos=-1, max_running=batch, chunk=PROMPT, token_budget=batch * PROMPT
    )
    sync_device()
    t0 = time.perf_counter()
    OverlapRuntime(model, fmap, overlap=overlap, trace=False).run(sched)
    wall = time.perf_counter() - t0
    return batch * NEW / wall, [sched.outputs[i] for i in range(batch)]


def generate_run(hf: Any, batch: int) -> tuple[float, list[list[int]]]:
    """(tokens/s, tokens per request) of ``tfuture.generate`` on the transformers model itself."""
    import tfuture

    params = GenerationParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    sync_device()
    t0 = time.perf_counter()
    out = tfuture.generate(hf, [p.tolist() for p in prompts(batch)], params, progress=False)
    wall = time.perf_counter() - t0
    return batch * NEW / wall, [list(o.token_ids) for o in out]


def sync_device() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


# Why the benchmark did not run, if it did not.
CANNOT_RUN: list[str] = []


@functools.cache
def measure(batch: int) -> dict[str, np.ndarray]:
    """``{line: [REPEATS]}`` tokens/s at ``batch`` requests, interleaved; empty when
    transformers is missing."""
    try:
        model, hf = build_model()
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "transformers":
            raise
        if not CANNOT_RUN:
            CANNOT_RUN.append("transformers is not installed (the hf extra)")
        return {}
    tokens: dict[str, list[list[int]]] = {}

    def timed(line: str) -> Any:
        def once() -> float:
            if line == "generate":
                rate, toks = generate_run(hf, batch)
            else:
                rate, toks = runtime_run(model, line == "overlap", batch)
            if tokens.setdefault(line, toks) != toks:
                raise AssertionError(f"bench_hf: the {line} runs gave different tokens")
            return rate

        return once

    with torch.inference_mode():
        runs = {line: timed(line) for line in LINES}
        for once in runs.values():
            once()  # warm-up: first-call costs (kernels, allocator) out of the timing
        got = harness.interleaved(runs, REPEATS)
    if not (tokens["sync"] == tokens["overlap"] == tokens["generate"]):
        raise AssertionError("bench_hf: sync, overlap and generate gave different tokens")
    return got


@triton.testing.perf_report(
    harness.batch_sweep(
        BATCHES,
        LINES,
        STYLES,
        f"requests ({DEVICE}; prompt {PROMPT}, {NEW} new tokens each, greedy)",
        "tokens/s",
        "hf_tokens_per_s",
    )
)
def hf_tokens(batch: int, line: str) -> harness.Timing:
    """Generated tokens per second of wall time: median, p20-p80 over repeats."""
    samples = measure(batch).get(line)
    return harness.NAN3 if samples is None else harness.band(samples)


LOOK = harness.Look(
    what="a Hugging Face Llama through HFCausalLM: tokens per second",
    ylabel="generated tokens per second",
    xlabel=f"requests ({DEVICE}; prompt {PROMPT}, {NEW} new tokens each, greedy)",
)


def main() -> None:
    if not measure(BATCHES[0]):
        harness.skip("bench_hf (all lines)", CANNOT_RUN[0])
        print(f"bench_hf: skipped: {CANNOT_RUN[0]}")
        return
    harness.save(hf_tokens, lambda _: LOOK)
    rates = {
        f"batch{bs}": {line: round(float(np.median(v)), 1) for line, v in measure(bs).items()}
        for bs in BATCHES
    }
    hidden, layers, heads, kv_heads, mlp, vocab, dtype = SHAPE
    harness.record(
        "hf",
        {
            "model": f"Llama hidden {hidden}, {layers} layers, {heads}/{kv_heads} heads, MLP {mlp}, "
            f"vocab {vocab}, {str(dtype).removeprefix('torch.')}",
            "batches": BATCHES,
            "prompt": PROMPT,
            "new_tokens": NEW,
            "tokens_per_s": rates,
            "overlap_over_sync": {k: round(r["overlap"] / r["sync"], 3) for k, r in rates.items()},
        },
    )
    print(f"bench_hf tokens/s (median of {REPEATS}): {rates}")


if __name__ == "__main__":
    main()
