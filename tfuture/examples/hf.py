"""``python -m tfuture.examples.hf``: a Hugging Face Llama through the runtime, sync vs overlap.

Builds a small random-weight ``LlamaForCausalLM`` from a config in code (nothing is
downloaded), wraps it in :class:`tfuture.models.HFCausalLM` (pooled KV cache, one batched
forward per step), runs one seeded workload in sync mode and overlapped, checks that both give
the same tokens, prints wall time, tokens/s and device idle of each, and writes the overlapped
run's Chrome trace (open it in https://ui.perfetto.dev). ``--host-ms`` of host work per step
(a sleep, like detokenizing or network I/O in C code, which releases the GIL) is what the
overlap hides: the speedup rests on it, so the pair of runs is repeated without it (the model
alone, where a tiny CPU model leaves little to hide) and both speedups are printed. Needs the
``hf`` extra (from a clone: ``pip install -e '.[hf]'``); ``--help`` works without it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tfuture.core.future_map import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.scheduler import ContinuousBatcher, RequestSpec
from tfuture.streams.stats import RunStats

if TYPE_CHECKING:
    from tfuture.models import HFCausalLM

NEEDS_HF = (
    "tfuture.examples.hf needs the 'hf' extra (transformers is not installed): from a clone of tfuture, "
    "pip install -e '.[hf]'"
)


def _no_transformers(exc: ModuleNotFoundError) -> bool:
    """Whether ``exc`` says transformers is missing (not some other module)."""
    return (exc.name or "").partition(".")[0] == "transformers"


def _hf_causal_lm() -> type[HFCausalLM]:
    try:
        from tfuture.models import HFCausalLM
    except ModuleNotFoundError as exc:
        if not _no_transformers(exc):
            raise
        raise ModuleNotFoundError(NEEDS_HF, name="transformers") from exc
    return HFCausalLM


def build_llama(
    *,
    vocab: int = 256,
    hidden: int = 128,
    layers: int = 2,
    seed: int = 0,
    attn: str = "sdpa",
    heads: int = 4,
    kv_heads: int = 2,
    mlp: int | None = None,
    max_len: int = 512,
) -> Any:
    """A random-weight Llama with GQA (``heads`` query heads, ``kv_heads`` KV heads; MLP width
    ``mlp``, default ``2 * hidden``), ``attn`` attention, float32 on the CPU."""
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ModuleNotFoundError as exc:
        if not _no_transformers(exc):
            raise
        raise ModuleNotFoundError(NEEDS_HF, name="transformers") from exc

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden if mlp is None else mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def make_requests(
    seed: int, n: int, *, vocab: int, max_prompt: int, max_new: int, arrival_span: int
) -> list[RequestSpec]:
    """``n`` seeded requests: random prompts of 1..``max_prompt`` ids (no id 0), limits of
    1..``max_new`` tokens, arrivals in ticks 0..``arrival_span``."""
    rng = np.random.default_rng(seed)
    return [
        RequestSpec(
            rid,
            arrival=int(rng.integers(0, arrival_span + 1)),
            prompt=rng.integers(1, vocab, int(rng.integers(1, max_prompt + 1)), dtype=np.int64),
            max_new=int(rng.integers(1, max_new + 1)),
        )
        for rid in range(n)
    ]


def run(
    model: HFCausalLM, specs: list[RequestSpec], *, overlap: bool, max_running: int, host_s: float
) -> tuple[dict[int, list[int]], RunStats]:
    """One run of ``specs`` (no end token: every request runs to its limit)."""
    fmap = FutureMap(4 * max_running, device=model.pool.k.device)
    sched = ContinuousBatcher(
        specs, fmap, eos=-1, max_running=max_running, chunk=16, token_budget=64, host_work_s=host_s
    )
    stats = OverlapRuntime(model, fmap, overlap=overlap, trace=True).run(sched)  # spans: the timeline
    if fmap.in_use or model.pool.n_free != model.pool.n_rows:
        raise AssertionError("slots or KV rows left in use after the run")
    return sched.outputs, stats


def main(argv: list[str] | None = None) -> dict[str, RunStats]:
    p = argparse.ArgumentParser(
        prog="python -m tfuture.examples.hf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=32, help="number of requests (default 32)")
    p.add_argument("--max-new", type=int, default=32, help="longest generation per request")
    p.add_argument("--max-prompt", type=int, default=32, help="longest prompt, tokens")
    p.add_argument("--max-running", type=int, default=8, help="requests in flight (KV pool rows)")
    p.add_argument("--hidden", type=int, default=128, help="the Llama's hidden size")
    p.add_argument("--layers", type=int, default=2, help="the Llama's decoder layers")
    p.add_argument("--host-ms", type=float, default=4.0, help="host work per step, ms (a sleep)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload")
    p.add_argument(
        "--trace",
        default=os.path.join(tempfile.gettempdir(), "tfuture-hf-trace.json"),
        help="Chrome trace of the overlapped run (default: %(default)s)",
    )
    args = p.parse_args(argv)
    vocab = 256
    model = _hf_causal_lm()(
        build_llama(vocab=vocab, hidden=args.hidden, layers=args.layers, seed=args.seed),
        max_requests=args.max_running,
        max_len=args.max_prompt + args.max_new,
    )
    specs = make_requests(
        args.seed,
        args.requests,
        vocab=vocab,
        max_prompt=args.max_prompt,
        max_new=args.max_new,
        arrival_span=4,
    )
    print(
        f"Llama hidden={args.hidden} layers={args.layers} GQA 4/2 heads, {args.requests} requests, "
        f"torch threads={torch.get_num_threads()}"
    )
    stats: dict[str, RunStats] = {}
    # With the host work first (what overlap hides), then without it: the model alone.
    for host_ms, suffix in ((args.host_ms, ""), (0.0, "_no_host")) if args.host_ms > 0 else ((0.0, ""),):
        what = f"{host_ms:g} ms host work per step (a sleep)" if host_ms else "no host work (the model alone)"
        print(f"-- {what}")
        kw = {"max_running": args.max_running, "host_s": host_ms / 1e3}
        with torch.inference_mode():
            run(model, specs[:2], overlap=True, **kw)  # warm-up: first-call costs out of the timing
            sync_out, sync = run(model, specs, overlap=False, **kw)
            over_out, over = run(model, specs, overlap=True, **kw)
        if sync_out != over_out:
            raise AssertionError("sync and overlap runs gave different tokens")
        print(sync.summary())
        print(over.summary())
        print(
            f"overlap speedup with {what}: {sync.wall / over.wall:.2f}x wall time, same tokens in both runs"
        )
        stats["sync" + suffix], stats["overlap" + suffix] = sync, over
    stats["overlap"].write_chrome_trace(args.trace)
    print(f"timeline of the overlapped run with host work: {args.trace} (open in https://ui.perfetto.dev)")
    return stats


if __name__ == "__main__":
    main()
