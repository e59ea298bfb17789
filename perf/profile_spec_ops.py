"""Where a speculative step's time goes: per stream op and host phase, plain decoding against
``NGramDrafter(k=4)``, from a traced sync run of ``bench_spec``'s model and prompts (the spans of
``RunStats``: mean milliseconds per step and total), and the bare Hugging Face model's own forward
(no cache, no tfuture) over ``batch`` tokens and over ``batch * (k + 1)``: what verifying ``k``
drafts per request adds to any engine's forward on this machine.

    python -m perf.profile_spec_ops [batch] [workload]    # default 8 repetitive
"""

from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np

from perf import bench_spec


def main(argv: list[str] | None = None) -> None:
    import tfuture
    from tfuture.scheduler import GenerationParams

    args = sys.argv[1:] if argv is None else argv
    batch = int(args[0]) if args else 8
    workload = args[1] if len(args) > 1 else "repetitive"
    model = bench_spec.build()
    prompts = bench_spec.prompts(model, workload, batch)
    params = GenerationParams(max_tokens=bench_spec.NEW, temperature=0, ignore_eos=True)
    for name in ("plain", "ngram"):
        for _ in range(2):  # the first run warms up; the second is reported
            spec = tfuture.NGramDrafter(k=bench_spec.K) if name == "ngram" else None
            with tfuture.Engine(
                model, max_running=batch, max_len=len(prompts[0]) + bench_spec.NEW, overlap=False, trace=True,
                speculative=spec,
            ) as engine:  # fmt: skip
                out = engine.generate(prompts, params, progress=False)
        stats = out.stats
        assert stats is not None
        print(f"{name}: {stats.steps} steps, {stats.wall * 1e3:.1f} ms (batch {batch}, {workload})")
        for kind, spans in (("stream", stats.device_spans), ("host", stats.host_spans)):
            times: dict[str, list[float]] = defaultdict(list)
            for span in spans:
                times[span.name].append(span.end - span.start)
            for op, t in sorted(times.items(), key=lambda kv: -sum(kv[1])):
                print(f"  {kind} {op:<10} mean {np.mean(t) * 1e3:7.3f} ms  total {np.sum(t) * 1e3:7.1f} ms")
    bare_forward(model, batch)


def bare_forward(model: object, batch: int, calls: int = 200) -> None:
    """Median ms of ``model(input_ids [1, n])`` for a decode's ``n = batch`` tokens and a
    verification's ``n = batch * (k + 1)`` (a causal forward without a cache: the shapes' cost)."""
    import time

    import torch

    for n in (batch, batch * (bench_spec.K + 1)):
        ids = torch.randint(3, bench_spec.VOCAB, (1, n))
        times = []
        with torch.inference_mode():
            for i in range(calls + 20):
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False)  # type: ignore[operator]
                if i >= 20:
                    times.append(time.perf_counter() - t0)
        print(f"bare HF forward, {n} tokens: median {np.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
