"""End to end: tokens/s of ``tfuture.generate`` against Hugging Face ``model.generate``.

    python -m perf bench_generate        # CI=1: the 3M model, batch 1 and 8, one thread

A random-weight Hugging Face Llama built from a config in code (``tfuture.examples.hf.build_llama``,
nothing downloaded, float32 on the CPU) of about 3M parameters (hidden 256, 4 layers, vocab 1024)
and about 80M (hidden 768, 10 layers, 12/4 heads, MLP 2048, vocab 8192). ``batch`` requests with
prompts of 16 to 32 random ids generate ``NEW`` tokens each, greedily, the end token ignored.

Lines (generated tokens per second of wall time, median of ``REPEATS[size]`` interleaved runs after one
warm-up run per model and thread count): ``overlap`` and ``sync`` are ``tfuture.generate(model,
prompts, params, overlap=...)`` called as a user calls it (engine construction included, the
front door's defaults otherwise); ``hf`` is ``model.generate`` on the left-padded batch
(``attention_mask`` marking the padding, ``pad_token_id`` set, ``min_new_tokens = max_new_tokens``
so that no end token stops it, greedy); ``hf_cb`` is Hugging Face's continuous batching,
``model.generate_batch`` on the unpadded prompts (same generation settings), with a
``ContinuousBatchingConfig`` sized for the batch (pages of 32 tokens, as many as the prompts and
their new tokens fill, one more per request): left to its defaults it sizes its cache from the
machine's memory, and on this CPU a batch-8 run of the 3M model took 15 s instead of 0.7 s. It
is a reference line, with no target; where ``generate_batch`` does not exist (transformers
older than 4.56) or fails, its line is empty and ``summary.json`` says why
(``hf_cb_skipped``). Torch's intra-op threads are set per cell (1 and 2,
``torch.set_num_threads``) and restored after.

Every line gives the same tokens (checked): tfuture against the left-padded ``hf`` batch; where
the padded batch differs from unpadded generation by numerics (padding changes the shapes of
the matmuls), each request is checked against its own unpadded ``model.generate`` instead.
``hf_cb``'s paged attention may round differently: the requests whose tokens equal tfuture's are
counted (``hf_cb_same_tokens``), not required. Ratios per cell (``overlap_over_hf``,
``sync_over_hf``, ``overlap_over_sync``, ``overlap_over_hf_cb``) go to ``summary.json`` under
``generate``; the contract asks overlap >= 1.0x hf and >= 0.98x sync in every cell. Needs the
``hf`` extra.

Read the 2-thread cells from a quiet machine: on a 2-core machine whose cores are busy, a forward
on the calling thread with 2 intra-op threads (``hf``) stalls in OpenMP waits (a batch-32 run of the
80M model took several times its 1-thread time there); those cells then measure the machine's
load, not the code. The engine runs the forward on its own thread on the CPU (the inline stream),
as ``generate`` does: overlap and sync then run the same ops.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch
import triton

from perf import harness
from perf.harness import DEVICE

# name: build_llama arguments (about 3M and 80M parameters)
MODELS: dict[str, dict[str, int]] = {
    "3M": dict(vocab=1024, hidden=256, layers=4, heads=4, kv_heads=2, mlp=512),
    "80M": dict(vocab=8192, hidden=768, layers=10, heads=12, kv_heads=4, mlp=2048),
}
# The 80M model at batch 32 runs ~0.2 s a step on one CPU thread: fewer tokens keep the sweep short.
NEW = {"3M": harness.sweep([64], [16])[0], "80M": 32}
SIZES = harness.sweep(["3M", "80M"], ["3M"])
THREADS = harness.sweep([1, 2], [1])
BATCHES = harness.sweep([1, 8, 32], [1, 8])
# The 3M model's runs last a fraction of a second each, where a noisy VM's swings are widest: more repeats.
REPEATS = {"3M": harness.sweep([7], [2])[0], "80M": harness.sweep([5], [2])[0]}
PROMPT = (16, 32)  # prompt lengths, inclusive
LINES = ["overlap", "sync", "hf", "hf_cb"]
STYLES = [("blue", "-"), ("red", "--"), ("black", ":"), ("gray", "-.")]
CB_PAGE = 32  # hf_cb's page size in tokens

# Why the benchmark did not run, if it did not.
CANNOT_RUN: list[str] = []
# Why the hf_cb line is empty, if it is (the first failure).
CB_SKIPPED: list[str] = []
# Per cell: the requests whose hf_cb tokens equal tfuture's.
CB_SAME: dict[str, int] = {}


def cell(size: str, threads: int, batch: int) -> str:
    """The key of one cell in ``summary.json`` and the contract (no dots: they split paths)."""
    return f"{size}_t{threads}_b{batch}"


@functools.cache
def build(size: str) -> Any:
    from tfuture.examples.hf import build_llama

    return build_llama(**MODELS[size], max_len=512).to(DEVICE)


def build_or_none(size: str, cannot_run: list[str]) -> Any:
    """:func:`build`, or None with the reason put in ``cannot_run`` when transformers is missing."""
    try:
        return build(size)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "transformers":
            raise
        cannot_run[:] = ["transformers is not installed (the hf extra)"]
        return None


def prompts(size: str, batch: int) -> list[list[int]]:
    rng = np.random.default_rng(batch)
    lo, hi = PROMPT
    return [
        rng.integers(3, MODELS[size]["vocab"], int(rng.integers(lo, hi + 1))).tolist() for _ in range(batch)
    ]


def hf_kwargs(ps: list[list[int]], new: int) -> dict[str, Any]:
    """``model.generate`` arguments for ``ps`` left-padded with id 0: greedy, exactly ``new`` tokens."""
    width = max(map(len, ps))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=DEVICE)
    return dict(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
    )


def hf_run(model: Any, ps: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """(tokens/s, tokens per request) of one ``model.generate`` on the left-padded batch."""
    kw = hf_kwargs(ps, new)
    t0 = time.perf_counter()
    out = model.generate(**kw)
    wall = time.perf_counter() - t0
    width = kw["input_ids"].shape[1]
    return len(ps) * new / wall, [row[width:].tolist() for row in out]


def hf_cb_run(model: Any, ps: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """(tokens/s, tokens per request) of one ``model.generate_batch`` on the unpadded prompts, its
    cache sized for them (see the module docstring); ``(nan, [])`` with the reason in
    ``CB_SKIPPED`` where it is missing or fails."""
    import logging

    if CB_SKIPPED:
        return float("nan"), []
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError as e:
        CB_SKIPPED.append(f"transformers has no continuous batching ({e})")
        return float("nan"), []
    pages = sum(-(-(len(p) + new) // CB_PAGE) for p in ps) + len(ps)
    cb = ContinuousBatchingConfig(
        page_size=CB_PAGE, num_blocks=pages, max_batch_tokens=max(256, sum(map(len, ps)))
    )
    gen = GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    log = logging.getLogger("ContinuousBatchingLogger")
    level = log.level
    log.setLevel(logging.CRITICAL)  # per call: "psutil is not available" and its memory breakdown
    try:
        t0 = time.perf_counter()
        out = model.generate_batch(
            ps, generation_config=gen, continuous_batching_config=cb, progress_bar=False
        )
        wall = time.perf_counter() - t0
    except Exception as e:  # a release whose continuous batching does not run here
        CB_SKIPPED.append(f"model.generate_batch failed: {type(e).__name__}: {e}")
        return float("nan"), []
    finally:
        log.setLevel(level)
    # generate_batch catches a failure itself (logged, here silenced): a request then comes back
    # with an error, unfinished or short, and a missing one is a failure too.
    rows = sorted(out.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
    tokens = [list(o.generated_tokens) for o in rows]
    bad = [o for o, t in zip(rows, tokens, strict=True) if o.error or len(t) != new]
    if len(rows) != len(ps) or bad:
        why = f"{len(rows)} of {len(ps)} requests came back"
        if bad:
            o = bad[0]
            why = f"request {o.request_id}: {len(o.generated_tokens)} of {new} tokens, error {o.error!r}"
        CB_SKIPPED.append(f"model.generate_batch failed: {why}")
        return float("nan"), []
    return len(ps) * new / wall, tokens


def tfuture_run(model: Any, ps: list[list[int]], new: int, overlap: bool) -> tuple[float, list[list[int]]]:
    """(tokens/s, tokens per request) of one ``tfuture.generate`` call, engine construction included."""
    import tfuture
    from tfuture.scheduler import GenerationParams

    params = GenerationParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    out = tfuture.generate(model, ps, params, overlap=overlap, progress=False)
    wall = time.perf_counter() - t0
    return len(ps) * new / wall, [list(o.token_ids) for o in out]


def check_tokens(model: Any, ps: list[list[int]], new: int, tokens: dict[str, list[list[int]]]) -> None:
    """tfuture's tokens equal HF greedy: the padded batch, else each request unpadded."""
    if tokens["overlap"] != tokens["sync"]:
        raise AssertionError("bench_generate: overlap and sync gave different tokens")
    if tokens["overlap"] == tokens["hf"]:
        return
    for i, p in enumerate(ps):
        _, (want,) = hf_run(model, [p], new)
        if tokens["overlap"][i] != want:
            raise AssertionError(f"bench_generate: request {i}: tfuture {tokens['overlap'][i]} != HF {want}")


def runs(model: Any, ps: list[list[int]], new: int, tokens: dict[str, Any]) -> dict[str, Any]:
    """One timed call per line; each remembers its first tokens and checks the later ones."""

    def timed(line: str) -> Any:
        def once() -> float:
            if line == "hf":
                rate, toks = hf_run(model, ps, new)
            elif line == "hf_cb":
                rate, toks = hf_cb_run(model, ps, new)
            else:
                rate, toks = tfuture_run(model, ps, new, overlap=line == "overlap")
            if line == "hf_cb" and not toks:
                return rate  # NaN: the line stopped running (CB_SKIPPED says why)
            if tokens.setdefault(line, toks) != toks:
                raise AssertionError(f"bench_generate: the {line} runs gave different tokens")
            return rate

        return once

    return {line: timed(line) for line in LINES}


@functools.cache
def measure(size: str, threads: int) -> dict[tuple[int, str], np.ndarray]:
    """``{(batch, line): [REPEATS[size]]}`` tokens/s; empty when transformers is missing."""
    model = build_or_none(size, CANNOT_RUN)
    if model is None:
        return {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    got: dict[tuple[int, str], np.ndarray] = {}
    try:
        with torch.inference_mode():
            warm = prompts(size, 2)
            for first_call in (hf_run, hf_cb_run):  # first-call costs out
                first_call(model, warm, 4)
            tfuture_run(model, warm, 4, True)
            for batch in BATCHES:
                ps, tokens = prompts(size, batch), {}
                for line, v in harness.interleaved(runs(model, ps, NEW[size], tokens), REPEATS[size]).items():
                    got[(batch, line)] = v
                check_tokens(model, ps, NEW[size], tokens)
                cb = tokens.get("hf_cb") or []  # empty where the line did not run
                CB_SAME[cell(size, threads, batch)] = sum(
                    a == b for a, b in zip(cb, tokens["overlap"], strict=False)
                )
    finally:
        torch.set_num_threads(before)
    return got


def _benchmark(size: str, threads: int) -> triton.testing.Benchmark:
    return harness.batch_sweep(
        BATCHES,
        LINES,
        STYLES,
        "requests in the batch",
        "tokens/s",
        f"generate_{size}_t{threads}_tokens_per_s",
        {"size": size, "threads": threads},
    )


@triton.testing.perf_report([_benchmark(s, t) for s in SIZES for t in THREADS])
def generate_report(batch: int, line: str, size: str, threads: int) -> harness.Timing:
    """tfuture.generate (overlap, sync) against Hugging Face generate: generated tokens per second
    of wall time, engine construction included (median, p20-p80 over interleaved repeats)."""
    samples = measure(size, threads).get((batch, line))
    return harness.NAN3 if samples is None else harness.band(samples)


def _look(bench: Any) -> harness.Look:
    size, threads = bench.args["size"], bench.args["threads"]
    return harness.Look(
        what=f"tfuture.generate vs HF generate: tokens/s, {size} Llama fp32, {threads} torch thread(s)",
        ylabel="generated tokens per second (engine construction included)",
        xlabel=f"requests in the batch (greedy, {NEW[size]} new tokens each; prompts of "
        f"{PROMPT[0]}-{PROMPT[1]} ids, left-padded for HF; {DEVICE})",
    )


def call_ms(size: str, repeats: int = 5) -> dict[str, float]:
    """Median ms of one-token calls, batch 1, one thread, per repeat a prompt one id longer than
    every earlier one: ``tfuture.generate`` on it first (``new_length``: the engine's ``max_len`` is
    new; the construction probe's forwards ran again for each one before they were kept per
    model whatever ``max_len``), then again (``same_length``), and HF ``generate`` on it
    (``hf``). Engine construction included, as in the sweep; one warm-up call each first."""
    model = build(size)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    base = prompts(size, 1)[0] * 4
    got: dict[str, list[float]] = {"new_length": [], "same_length": [], "hf": []}
    try:
        with torch.inference_mode():
            for hf in (False, True):  # warm-up
                _one_token_ms(model, base[: PROMPT[1]], hf)
            for n in range(PROMPT[1] + 1, PROMPT[1] + 1 + repeats):
                got["new_length"].append(_one_token_ms(model, base[:n], hf=False))
                got["same_length"].append(_one_token_ms(model, base[:n], hf=False))
                got["hf"].append(_one_token_ms(model, base[:n], hf=True))
    finally:
        torch.set_num_threads(before)
    return {line: round(float(np.median(v)), 2) for line, v in got.items()}


def _one_token_ms(model: Any, prompt: list[int], hf: bool) -> float:
    """Wall ms of one one-token call on ``prompt``, as the sweep's lines time it."""
    rate = hf_run(model, [prompt], 1)[0] if hf else tfuture_run(model, [prompt], 1, True)[0]
    return 1e3 / rate  # one token a second at rate 1


def summary() -> dict[str, Any]:
    """Median tokens/s and the ratios per cell."""
    out: dict[str, Any] = {
        "models": {
            s: f"build_llama({', '.join(f'{k}={v}' for k, v in MODELS[s].items())}), fp32" for s in SIZES
        },
        "new_tokens": {s: NEW[s] for s in SIZES},
        "tokens_per_s": {},
        "overlap_over_hf": {},
        "sync_over_hf": {},
        "overlap_over_sync": {},
        "overlap_over_hf_cb": {},
        "hf_cb_same_tokens": {},
    }
    for size in SIZES:
        for threads in THREADS:
            got = measure(size, threads)
            for batch in BATCHES:
                med = {line: float(np.median(got[(batch, line)])) for line in LINES}
                key = cell(size, threads, batch)
                out["tokens_per_s"][key] = {line: None if v != v else round(v, 1) for line, v in med.items()}
                out["overlap_over_hf"][key] = round(med["overlap"] / med["hf"], 3)
                out["sync_over_hf"][key] = round(med["sync"] / med["hf"], 3)
                out["overlap_over_sync"][key] = round(med["overlap"] / med["sync"], 3)
                if med["hf_cb"] == med["hf_cb"]:  # not NaN: the line ran
                    out["overlap_over_hf_cb"][key] = round(med["overlap"] / med["hf_cb"], 3)
                    out["hf_cb_same_tokens"][key] = f"{CB_SAME.get(key, 0)} of {batch}"
    if CB_SKIPPED:
        out["hf_cb_skipped"] = CB_SKIPPED[0]
    out["one_token_call_ms"] = {size: call_ms(size) for size in SIZES}
    return out


def main() -> None:
    if not measure(SIZES[0], THREADS[0]):
        harness.skip("bench_generate (all lines)", CANNOT_RUN[0])
        print(f"bench_generate: skipped: {CANNOT_RUN[0]}")
        return
    harness.save(generate_report, _look)
    got = summary()
    harness.record("generate", got)
    if CB_SKIPPED:
        harness.skip("bench_generate hf_cb line", CB_SKIPPED[0])
    for key in ("overlap_over_hf", "overlap_over_sync", "overlap_over_hf_cb", "one_token_call_ms"):
        print(f"bench_generate {key}: {got[key]}")


if __name__ == "__main__":
    main()
