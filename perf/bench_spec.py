"""Speculative decoding through the front door: tokens/s and model steps per generated token.

    python -m perf bench_spec        # CI=1: fewer repeats

``tfuture.generate`` on a small random-weight Hugging Face Llama (built from a config in code,
float32; on CPU hidden 128, 4 layers, vocab 1024), greedy, ``NEW`` tokens per request with the
end token ignored, engine construction included as a user pays it. Lines: plain decoding,
``NGramDrafter(k=4)`` (prompt lookup) and ``ModelDrafter(twin, k=4)`` whose draft model is an
exact copy of the target (every draft is accepted: the floor of steps per token), each
overlapped and in sync. Every cell gives the same tokens as plain decoding (checked).

Two workloads, batch 1 and 8: ``repetitive`` prompts quote themselves (a random prefix, the
model's own greedy continuation of it, the prefix again: prompt lookup finds its continuation),
``random`` prompts are random ids (nothing to look up in the prompt; a random-weight model's
output still repeats itself, which prompt lookup also finds). Model steps per generated token
are the run's steps times the batch over its tokens: 1 for plain decoding, down to
``1 / (k + 1)`` when every draft is accepted. Acceptance rates (accepted over drafted) go to
``summary.json``, with a ceiling per batch size (:func:`forward_ratio`): the bare HF forward of
``k + 1`` tokens per request over one, and the n-gram speed-up it leaves at the measured steps
per token. Needs the ``hf`` extra.
"""

from __future__ import annotations

import copy
import functools
import time
from typing import Any

import numpy as np
import torch
import triton

from perf import harness
from perf.harness import DEVICE

K = 4
NEW = 64
BATCHES = [1, 8]
REPEATS = harness.sweep([11], [3])[0]  # runs of a fraction of a second: medians need many
WORKLOADS = ["repetitive", "random"]
DRAFTERS = ["plain", "ngram", "twin"]
LINES = [f"{d} {m}" for d in DRAFTERS for m in ("overlap", "sync")]
COLORS = {"plain": "black", "ngram": "blue", "twin": "green"}
STYLES = [(COLORS[line.split()[0]], "-" if line.endswith("overlap") else "--") for line in LINES]
VOCAB, HIDDEN, LAYERS = 1024, 128, 4

# Why the benchmark did not run, if it did not.
CANNOT_RUN: list[str] = []


@functools.cache
def build() -> Any:
    """The target model, built once (``measure`` and :func:`forward_ratio` share it)."""
    from tfuture.examples.hf import build_llama

    return build_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, seed=0).to(DEVICE)


def prompts(model: Any, workload: str, n: int) -> list[list[int]]:
    """``n`` prompts of 48 tokens (see the module docstring)."""
    import tfuture
    from tfuture.scheduler import GenerationParams

    rng = np.random.default_rng(1)
    if workload == "random":
        return [rng.integers(3, VOCAB, 48).tolist() for _ in range(n)]
    heads = [rng.integers(3, VOCAB, 12).tolist() for _ in range(n)]
    cont = tfuture.generate(model, heads, GenerationParams(max_tokens=24, temperature=0, ignore_eos=True))
    return [h + o.token_ids + h for h, o in zip(heads, cont, strict=True)]


def one_run(
    model: Any, twin: Any, ps: list[list[int]], line: str
) -> tuple[float, float, float, list[list[int]]]:
    """(tokens/s, model steps per generated token, acceptance rate, tokens) of one generate run."""
    import tfuture
    from tfuture.scheduler import GenerationParams

    drafter, mode = line.split()
    spec = None
    if drafter == "ngram":
        spec = tfuture.NGramDrafter(k=K)
    elif drafter == "twin":
        spec = tfuture.ModelDrafter(twin, k=K)
    params = GenerationParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    with tfuture.Engine(model, max_running=len(ps), max_len=len(ps[0]) + NEW, overlap=mode == "overlap",
                        speculative=spec) as engine:  # fmt: skip
        out = engine.generate(ps, params, progress=False)
    wall = time.perf_counter() - t0
    n_tok = sum(len(o.token_ids) for o in out)
    assert out.stats is not None
    sched = engine.scheduler
    rate = sched.accepted_tokens / sched.drafted_tokens if sched.drafted_tokens else float("nan")
    return n_tok / wall, out.stats.steps * len(ps) / n_tok, rate, [o.token_ids for o in out]


@functools.cache
def measure() -> dict[tuple[str, int, str], np.ndarray]:
    """``{(workload, batch, line): [REPEATS, 3]}`` (tokens/s, steps per token, acceptance)."""
    try:
        model = build()
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "transformers":
            raise
        CANNOT_RUN.append("transformers is not installed (the hf extra)")
        return {}
    twin = copy.deepcopy(model)
    got: dict[tuple[str, int, str], np.ndarray] = {}
    with torch.inference_mode():
        for workload in WORKLOADS:
            for batch in BATCHES:
                ps = prompts(model, workload, batch)
                ref: dict[str, list[list[int]]] = {}

                def timed(line: str, ps: list[list[int]] = ps, ref: dict[str, Any] = ref) -> Any:
                    def once() -> tuple[float, float, float]:
                        rate, steps, acc, toks = one_run(model, twin, ps, line)
                        if ref.setdefault("tokens", toks) != toks:
                            raise AssertionError(f"bench_spec: {line} gave other tokens than plain decoding")
                        return rate, steps, acc

                    return once

                runs = {line: timed(line) for line in LINES}
                for warm in runs.values():
                    warm()  # warm-up, and the token check of every line against the first (plain)
                for line, v in harness.interleaved(runs, REPEATS).items():
                    got[(workload, batch, line)] = v
    return got


def forward_ratio(model: Any, batch: int, repeats: int = harness.sweep([25], [5])[0]) -> float:
    """Median time of the bare HF forward of ``K + 1`` new tokens per request over one new token
    per request (``batch`` requests, a cache of 96 positions, the model's own cache and logits
    for every new position, as verification needs them), interleaved. With ``s`` model steps
    per generated token, a drafter's tokens/s over plain decoding cannot pass
    ``1 / (s * ratio)`` while the forward dominates the step: the ceiling in the summary."""
    ids = torch.randint(3, VOCAB, (batch, 96), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = model(input_ids=ids.to(DEVICE), use_cache=True).past_key_values

        def once(n: int) -> float:
            c = copy.deepcopy(cache)
            x = torch.randint(3, VOCAB, (batch, n)).to(DEVICE)
            t0 = time.perf_counter()
            model(input_ids=x, past_key_values=c, use_cache=True)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        got = harness.interleaved({"one": lambda: once(1), "verify": lambda: once(K + 1)}, repeats)
    return float(np.median(got["verify"]) / np.median(got["one"]))


def _benchmark(workload: str, metric: str) -> triton.testing.Benchmark:
    tokens = metric == "tokens"
    return harness.batch_sweep(
        BATCHES,
        LINES,
        STYLES,
        "requests",
        "tokens/s" if tokens else "steps per token",
        f"spec_{workload}_{'tokens_per_s' if tokens else 'steps_per_token'}",
        {"workload": workload, "metric": metric},
    )


@triton.testing.perf_report([_benchmark(w, m) for w in WORKLOADS for m in ("tokens", "steps")])
def spec_report(batch: int, line: str, workload: str, metric: str) -> harness.Timing:
    """Speculative decoding through tfuture.generate: generated tokens per second of wall time, or
    model steps per generated token (median, p20-p80 over interleaved repeats)."""
    samples = measure().get((workload, batch, line))
    if samples is None:
        return harness.NAN3
    return harness.band(samples[:, 0 if metric == "tokens" else 1])


def _look(bench: Any) -> harness.Look:
    workload, metric = bench.args["workload"], bench.args["metric"]
    about = f"{workload} prompts, greedy, {NEW} new tokens each, k={K}, small HF Llama ({DEVICE})"
    if metric == "tokens":
        return harness.Look(
            what=f"speculative decoding, tokens per second ({about})",
            ylabel="generated tokens per second (engine construction included)",
            xlabel="requests in the batch",
        )
    refs = (harness.Ref(f"every draft accepted: 1/(k+1) = {1 / (K + 1):.2f}", 1 / (K + 1), color="gray"),)
    return harness.Look(
        what=f"speculative decoding, model steps per generated token ({about})",
        ylabel="model steps per generated token (steps x batch / tokens)",
        xlabel="requests in the batch",
        refs=refs,
    )


def main() -> None:
    if not measure():
        harness.skip("bench_spec (all lines)", CANNOT_RUN[0])
        print(f"bench_spec: skipped: {CANNOT_RUN[0]}")
        return
    harness.save(spec_report, _look)
    summary: dict[str, Any] = {
        "model": f"Llama hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}, fp32",
        "k": K,
    }
    for (workload, batch, line), v in measure().items():
        med = np.median(v, axis=0)
        plain = np.median(measure()[(workload, batch, "plain " + line.split()[1])][:, 0])
        key = f"{workload} b{batch} {line}"
        summary[key] = {
            "tokens_per_s": round(float(med[0]), 1),
            "over_plain": round(float(med[0] / plain), 3),
            "steps_per_token": round(float(med[1]), 3),
            "acceptance": None if np.isnan(med[2]) else round(float(med[2]), 3),
        }
    for workload in WORKLOADS:
        for batch in BATCHES:
            for d in DRAFTERS:
                over, sync = (
                    np.median(measure()[(workload, batch, f"{d} {m}")][:, 0]) for m in ("overlap", "sync")
                )
                summary[f"{workload} b{batch} {d}"] = {"overlap_over_sync": round(float(over / sync), 3)}
    model = build()
    for batch in BATCHES:
        ratio = forward_ratio(model, batch)
        steps = summary[f"repetitive b{batch} ngram overlap"]["steps_per_token"]
        summary[f"forward b{batch}"] = {
            "verify_over_one_token": round(ratio, 3),
            "ngram_repetitive_ceiling_over_plain": round(1 / (steps * ratio), 3),
        }
    harness.record("spec", summary)
    for key, row in summary.items():
        print(f"bench_spec {key}: {row}")


if __name__ == "__main__":
    main()
