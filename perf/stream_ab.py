"""Interleaved A/B of the front door's forward stream on the CPU: generated tokens per second of
``bench_spec``'s model and repetitive prompts through ``Engine``, with ``stream="inline"`` and
``stream="worker"``, overlapped and in sync (one torch thread, engine construction included).

    python -m perf.stream_ab 8 ngram           # batch 8, NGramDrafter(k=4); "plain": no drafter
    python -m perf.stream_ab 1 plain --fixed   # the same turn order every repeat

Prints each line's median tokens/s and its median per-repeat ratio to ``sync worker``. With
``--fixed`` every repeat runs the lines in one order (overlap before sync, as the benchmarks did
before de76a15); without it the order alternates as :func:`perf.harness.interleaved` does. Not a
sweep of ``python -m perf`` (it writes no results): the measurement behind ``Engine``'s inline
stream on the CPU (7ffc7cd) and the alternating interleave order (de76a15).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from perf import bench_spec, harness

LINES = ["overlap inline", "sync inline", "overlap worker", "sync worker"]


def tokens_per_s(model: object, prompts: list[list[int]], line: str, drafter: str) -> float:
    import tfuture
    from tfuture.scheduler import GenerationParams

    mode, stream = line.split()
    spec = tfuture.NGramDrafter(k=bench_spec.K) if drafter == "ngram" else None
    params = GenerationParams(max_tokens=bench_spec.NEW, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    with tfuture.Engine(
        model,
        max_running=len(prompts),
        max_len=len(prompts[0]) + bench_spec.NEW,
        overlap=mode == "overlap",
        stream=stream,
        speculative=spec,
    ) as engine:
        out = engine.generate(prompts, params, progress=False)
    return sum(len(o.token_ids) for o in out) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("batch", type=int)
    parser.add_argument("drafter", choices=["plain", "ngram"])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--fixed", action="store_true", help="the same turn order every repeat")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = bench_spec.build()
    with torch.inference_mode():
        prompts = bench_spec.prompts(model, "repetitive", args.batch)
        runs = {line: (lambda line=line: tokens_per_s(model, prompts, line, args.drafter)) for line in LINES}
        for run in runs.values():
            run()  # warm-up
        if args.fixed:
            fixed: dict[str, list[float]] = {line: [] for line in LINES}
            for _ in range(args.repeats):
                for line in LINES:
                    fixed[line].append(runs[line]())
            got = {line: np.asarray(v) for line, v in fixed.items()}
        else:
            got = harness.interleaved(runs, args.repeats)
    base = got["sync worker"]
    for line in LINES:
        print(
            f"batch {args.batch} {args.drafter} {line:15s} median {np.median(got[line]):7.0f} tokens/s, "
            f"{np.median(got[line] / base):.3f}x sync worker (per-repeat median)"
        )


if __name__ == "__main__":
    main()
