"""Multi-step decode: host CPU and wall time per generated token against the window length ``K``.

    python -m perf bench_multistep        # CI=1: fewer repeats

Two parts, ``K`` in {1, 2, 4, 8} (``K = 1``: the plain token step):

* ``host-bound``: the regime multi-step decode exists for, as ``bench_overlap`` builds it.
  ``tfuture.testing.ToyModel(work_s=T_dev)`` sleeps ``T_dev`` = 1 ms per forward on the CPU
  worker (device time: the GIL is free meanwhile; its logits cost little), and the scheduler
  does ``T_cpu`` = 2 ms of host work per processed step (``ContinuousBatcher(host_work_s=2e-3)``,
  a sleep: a step's detokenizing and I/O), overlapped. ``BATCH`` greedy requests of ``NEW``
  tokens each, their prompts prefilled together in the first step (a token budget of 16 per
  request: the decode regime from the start; with the batcher's default budget of 32 the
  prompts prefill over two steps and the requests end two windows apart); the end token ends
  some early. Lines: wall time per generated token, and the
  host thread's CPU time per generated token (``time.thread_time``: the runtime's, the
  scheduler's and the result handling's own Python, what the window amortizes), in ms.
  Nominal: ``K = 1`` is host-bound at ``T_cpu`` per step; a window of ``K`` costs
  ``max(T_cpu, K * T_dev)`` for ``K * BATCH`` tokens.
* ``generate``: ``tfuture.generate(..., multi_step=K)`` on the 3M Hugging Face Llama of
  ``bench_generate`` (fp32, one torch thread), batch 8, ``NEW`` greedy tokens each, engine
  construction included: tokens per second of wall time. A reference goes to the summary
  (``generate_forward_floor_tokens_per_s``, ``generate_ceiling_over_k1``): the same batch
  through the bare model's own module forwards with its own cache, prefill and ``NEW`` decode
  steps, nothing else, run in turn with the ``K`` runs: the ceiling of an engine that calls the
  modules. tfuture's direct forward (``tfuture.models.hf_direct``: the same ops without the
  module calls) runs below the modules' time, so a window may pass it. The engine's own bound
  goes there too (``generate_k1_forward_share``, ``generate_ceiling_over_k1_own_forward``): the
  share of a traced ``K = 1`` run's wall time spent in its forwards (:func:`forward_share`),
  which no window removes, and one over it, the most any ``K`` can give over ``K = 1``.

Every ``K`` gives the same tokens as ``K = 1`` (checked). Summary (``summary.json`` under
``multistep``): per ``K`` the medians and the ratios to ``K = 1``, and the tokens wasted past
a finish (the toy workload ends some requests by the end token inside a window).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch
import triton

from perf import harness

KS = [1, 2, 4, 8]
BATCH, NEW = 8, 64
T_DEV, T_CPU = 1e-3, 2e-3
REPEATS = harness.sweep([5], [2])[0]
VOCAB = 64
EOS = 10**9  # none: every request runs NEW tokens (the waste is measured apart, with a real end token)
WASTE_EOS = 3  # the end token of the waste runs: ToyModel's greedy output ends every request with it
LINES = {"host-bound": ["wall ms per token", "host CPU ms per token"], "generate": ["tokens/s"]}
STYLES = {"host-bound": [("blue", "-"), ("red", "--")], "generate": [("blue", "-")]}

# Why the generate part did not run, if it did not.
CANNOT_RUN: list[str] = []


def toy_run(k: int, eos: int = EOS, overlap: bool = True) -> tuple[float, float, int, dict[int, list[int]]]:
    """(wall s, host thread CPU s, tokens wasted, outputs) of one host-bound run with windows of ``k``."""
    from tfuture import FutureMap
    from tfuture.runtime import OverlapRuntime
    from tfuture.sampling import Sampler
    from tfuture.scheduler import RequestSpec
    from tfuture.spec import MultiStepTokenStep
    from tfuture.testing import ContinuousBatcher, ToyModel

    rng = np.random.default_rng(0)
    specs = [RequestSpec(i, 0, rng.integers(1, VOCAB, 12), NEW) for i in range(BATCH)]
    fmap = FutureMap(256)
    sched = ContinuousBatcher(
        specs,
        fmap,
        eos=eos,
        max_running=BATCH,
        chunk=16,
        token_budget=16 * BATCH,
        multi_step=k,
        host_work_s=T_CPU,
    )
    model = ToyModel(vocab=VOCAB, work_s=T_DEV)
    sampler = Sampler()
    runtime = (
        OverlapRuntime(model, fmap, sampler=sampler, stream="worker", overlap=overlap)
        if k == 1
        else OverlapRuntime(MultiStepTokenStep(model, sampler), fmap, stream="worker", overlap=overlap)
    )
    wall, cpu = time.perf_counter(), time.thread_time()
    runtime.run(sched)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return wall, cpu, sched.extra_tokens, sched.outputs


def forward_floor(model: Any, ps: list[list[int]]) -> float:
    """Tokens/s if a step cost only the model's own module forward: the bare HF model (no
    tfuture, no ``generate``) prefilling the left-padded batch and running ``NEW`` greedy decode
    forwards with its own cache. No engine that calls the modules reaches this."""
    from perf.bench_generate import hf_kwargs

    kw = hf_kwargs(ps, NEW)
    ids, mask = kw["input_ids"], kw["attention_mask"]
    t0 = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    for _ in range(NEW - 1):
        tok = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
        out = model(input_ids=tok, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
    return len(ps) * NEW / (time.perf_counter() - t0)


def _generate(model: Any, ps: list[list[int]], k: int, trace: bool = False) -> tuple[Any, float]:
    """One ``tfuture.generate`` call with windows of ``k``: its result and its wall seconds."""
    import tfuture
    from tfuture.scheduler import GenerationParams

    params = GenerationParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    t0 = time.perf_counter()
    out = tfuture.generate(model, ps, params, multi_step=k, trace=trace, progress=False)
    return out, time.perf_counter() - t0


def generate_run(model: Any, ps: list[list[int]], k: int) -> tuple[float, list[list[int]]]:
    """(tokens/s, tokens) of one ``tfuture.generate`` call with windows of ``k``."""
    out, wall = _generate(model, ps, k)
    return len(ps) * NEW / wall, [list(o.token_ids) for o in out]


def forward_share(model: Any, ps: list[list[int]]) -> float:
    """The share of a traced ``K = 1`` run's wall time that the model's forwards take (its
    ``forward`` spans on the stream, engine construction included in the wall): no window can
    remove that time, so ``1 / share`` bounds ``K``'s gain over ``K = 1`` (from above: tracing
    adds host time, which lowers the share)."""
    out, wall = _generate(model, ps, 1, trace=True)
    assert out.stats is not None
    return sum(s.end - s.start for s in out.stats.device_spans if s.name == "forward") / wall


@functools.cache
def measure() -> dict[tuple[str, int], np.ndarray]:
    """``{(part, K): [REPEATS, ...]}``: host-bound (wall, cpu per token in ms, waste), generate (tokens/s)."""
    got: dict[tuple[str, int], np.ndarray] = {}
    ref: dict[str, Any] = {}

    def toy(k: int) -> Any:
        def once() -> tuple[float, float, float]:
            wall, cpu, waste, outputs = toy_run(k)
            if ref.setdefault("toy", outputs) != outputs:
                raise AssertionError(f"bench_multistep: K={k} gave other tokens than K=1")
            n = sum(len(v) for v in outputs.values())
            return wall / n * 1e3, cpu / n * 1e3, float(waste)

        return once

    for k, v in harness.interleaved({str(k): toy(k) for k in KS}, REPEATS).items():
        got[("host-bound", int(k))] = v
    for k in KS:  # tokens wasted past an end token, per finished request (sync, then overlapped)
        waste = []
        for overlap in (False, True):
            _, _, n, outputs = toy_run(k, WASTE_EOS, overlap)
            ended = sum(1 for v in outputs.values() if v and v[-1] == WASTE_EOS)
            waste.append(n / max(ended, 1))
        got[("waste", k)] = np.asarray(waste)
    try:
        from perf.bench_generate import build, prompts
    except ModuleNotFoundError as exc:  # pragma: no cover - perf without the hf extra
        CANNOT_RUN.append(f"{exc.name} is not installed (the hf extra)")
        return got
    try:
        model = build("3M")
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "transformers":
            raise
        CANNOT_RUN.append("transformers is not installed (the hf extra)")
        return got
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            ps = prompts("3M", BATCH)
            generate_run(model, ps[:2], 1)  # first-call costs out

            def gen(k: int) -> Any:
                def once() -> float:
                    rate, toks = generate_run(model, ps, k)
                    if ref.setdefault("generate", toks) != toks:
                        raise AssertionError(
                            f"bench_multistep: generate with K={k} gave other tokens than K=1"
                        )
                    return rate

                return once

            # The floor runs in turn with the windows: a slow spell of the machine hits both.
            runs = {str(k): gen(k) for k in KS} | {"floor": lambda: forward_floor(model, ps)}
            for name, v in harness.interleaved(runs, REPEATS).items():
                got[("floor", 1) if name == "floor" else ("generate", int(name))] = v
            got[("forward share", 1)] = np.asarray([forward_share(model, ps) for _ in range(REPEATS)])
    finally:
        torch.set_num_threads(before)
    return got


def _benchmark(part: str) -> triton.testing.Benchmark:
    return harness.batch_sweep(
        KS,
        LINES[part],
        STYLES[part],
        "decode steps per window (K)",
        "ms per generated token" if part == "host-bound" else "tokens/s",
        f"multistep_{part.replace('-', '_')}",
        {"part": part},
    )


@triton.testing.perf_report([_benchmark(p) for p in LINES])
def multistep_report(batch: int, line: str, part: str) -> harness.Timing:
    """Multi-step decode against K (the x axis): ms per generated token (wall, host CPU) in the
    host-bound regime, or tokens/s of tfuture.generate (median, p20-p80 over interleaved repeats)."""
    samples = measure().get((part, batch))
    if samples is None:
        return harness.NAN3
    if part == "generate":
        return harness.band(samples)
    return harness.band(samples[:, LINES[part].index(line)])


def _look(bench: Any) -> harness.Look:
    if bench.args["part"] == "host-bound":
        ks = np.asarray(KS, dtype=float)
        nominal = np.maximum(T_CPU, ks * T_DEV) / ks / BATCH * 1e3  # a step gives BATCH tokens
        return harness.Look(
            what=(
                f"multi-step decode, host-bound: T_cpu {T_CPU * 1e3:g} ms/step, "
                f"T_dev {T_DEV * 1e3:g} ms/step, batch {BATCH}, {NEW} tokens, CPU worker"
            ),
            ylabel="ms per generated token (wall; host thread CPU)",
            xlabel="decode steps per window (K)",
            refs=(harness.Ref("nominal max(T_cpu, K T_dev) / (K batch)", list(nominal), color="gray"),),
        )
    return harness.Look(
        what=f"multi-step decode: tfuture.generate tokens/s, 3M HF Llama fp32, 1 thread, batch {BATCH}",
        ylabel="generated tokens per second (engine construction included)",
        xlabel="decode steps per window (K)",
    )


def main() -> None:
    got = measure()
    if CANNOT_RUN:
        harness.skip("bench_multistep (generate)", CANNOT_RUN[0])
    harness.save(multistep_report, _look)
    summary: dict[str, Any] = {"t_dev_ms": T_DEV * 1e3, "t_cpu_ms": T_CPU * 1e3, "batch": BATCH, "new": NEW}
    base = np.median(got[("host-bound", 1)], axis=0)
    for k in KS:
        med = np.median(got[("host-bound", k)], axis=0)
        summary[f"K{k}"] = {
            "wall_ms_per_token": round(float(med[0]), 4),
            "host_cpu_ms_per_token": round(float(med[1]), 4),
            "wall_over_k1": round(float(med[0] / base[0]), 3),
            "host_cpu_over_k1": round(float(med[1] / base[1]), 3),
            "wasted_per_ended_request_sync": round(float(got[("waste", k)][0]), 2),
            "wasted_per_ended_request_overlap": round(float(got[("waste", k)][1]), 2),
        }
        if ("generate", k) in got:
            rate = float(np.median(got[("generate", k)]))
            summary[f"K{k}"]["generate_tokens_per_s"] = round(rate, 1)
            summary[f"K{k}"]["generate_over_k1"] = round(rate / float(np.median(got[("generate", 1)])), 3)
    if ("floor", 1) in got:
        floor = float(np.median(got[("floor", 1)]))
        summary["generate_forward_floor_tokens_per_s"] = round(floor, 1)
        # The most any K can give over K = 1 on this model and machine: every host cost gone
        # (the median of each repeat's floor over the K = 1 run beside it).
        paired = got[("floor", 1)] / got[("generate", 1)]
        summary["generate_ceiling_over_k1"] = round(float(np.median(paired)), 3)
    if ("forward share", 1) in got:
        share = float(np.median(got[("forward share", 1)]))
        summary["generate_k1_forward_share"] = round(share, 3)
        summary["generate_ceiling_over_k1_own_forward"] = round(1 / share, 3)
    harness.record("multistep", summary)
    for key, row in summary.items():
        print(f"bench_multistep {key}: {row}")


if __name__ == "__main__":
    main()
