"""Fused input preparation (one launch) vs the unfused torch sequence engines run.

    python -m perf.bench_prepare          # CI=1: the small sweep

A batch of ``bs`` requests: decodes (one placeholder each, into an 8192-slot map holding real
tokens) and, on the ``mixed`` lines, half of them prefill chunks instead (8..128 concrete
tokens, random prefix). Lines are ``(provider, mix)``:

* ``tfuture``: ``prepare_inputs(tokens, seg_starts, prefix_lens, token_map, out=..., err=...)``
  on the mixed stream, into preallocated outputs as under CUDA-graph capture. On CPU (no
  ``TRITON_INTERPRET``) that is the launcher's checks plus its host path.
* ``torch``: :func:`prepare_unfused`: cat of the prefill tokens and the decode placeholders,
  gather + where to resolve, cumsum for the last-token rows, arange minus repeat_interleave
  for positions.

Both start from the same device inputs and give equal outputs (checked before timing).
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from perf import harness
from perf.harness import DEVICE, HAS_CUDA
from tfuture import FutureMap, PreparedInputs, prepare_inputs

N_SLOTS = 8192
BATCH = harness.sweep([1, 4, 16, 64, 256, 1024], [1, 64, 1024])
# Prefill share of the requests: "decode" lines have none, "mixed" lines half.
SHARES = {"decode": 0.0, "mixed": 0.5}
LINES = [(p, s) for s in SHARES for p in ("tfuture", "torch")]
NAMES = [f"{p} {s}" for p, s in LINES]
STYLES = [("blue" if p == "tfuture" else "red", "-" if s == "decode" else "--") for p, s in LINES]


def prepare_unfused(
    pre_tokens: torch.Tensor,
    dec_ph: torch.Tensor,
    ext_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    token_map: torch.Tensor,
    n_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused sequence: input ids, positions and last-token rows in about 12 launches."""
    ids = torch.cat([pre_tokens, dec_ph])
    ids = torch.where(ids < 0, token_map[(-ids).clamp(min=0)], ids)
    cu = torch.cumsum(ext_lens, 0)
    # Row r of request q sits at position r - (start_q - prefix_q); output_size avoids a sync.
    shift = torch.repeat_interleave(cu - ext_lens - prefix_lens, ext_lens, output_size=n_tokens)
    return ids, torch.arange(n_tokens, device=ids.device) - shift, cu - 1


class MixedBatch:
    """One batch of prefill chunks and decodes, in both input layouts, on ``DEVICE``."""

    def __init__(self, bs: int, share: float) -> None:
        g = torch.Generator().manual_seed(bs * 1000 + round(share * 100))
        n_pre = min(bs, math.ceil(share * bs))
        n_dec = bs - n_pre
        self.fmap = FutureMap(N_SLOTS, device=DEVICE, dtype=torch.int64)
        self.fmap.store(self.fmap.alloc(N_SLOTS), torch.randint(0, 32000, (N_SLOTS,), generator=g).to(DEVICE))
        pre_lens = torch.randint(8, 129, (n_pre,), generator=g)
        ext_lens = torch.cat([pre_lens, torch.ones(n_dec, dtype=torch.int64)])
        prefix = torch.cat(
            [torch.randint(0, 512, (n_pre,), generator=g), torch.randint(16, 4096, (n_dec,), generator=g)]
        )
        pre_tokens = torch.randint(0, 32000, (int(pre_lens.sum()),), generator=g)
        dec_ph = -(torch.randperm(N_SLOTS, generator=g)[:n_dec] + 1)
        self.n_tokens = int(ext_lens.sum())
        seg_starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(ext_lens, 0)])
        to = functools.partial(torch.Tensor.to, device=DEVICE)
        self.pre_tokens, self.dec_ph, self.ext_lens = to(pre_tokens), to(dec_ph), to(ext_lens)
        self.prefix_lens, self.seg_starts = to(prefix), to(seg_starts)
        self.tokens = to(torch.cat([pre_tokens, dec_ph]))
        empty = functools.partial(torch.empty, dtype=torch.int64, device=DEVICE)
        self.out = PreparedInputs(empty(self.n_tokens), empty(self.n_tokens), empty(bs))

    def fused(self) -> PreparedInputs:
        tm, err = self.fmap.token_map, self.fmap.err
        return prepare_inputs(self.tokens, self.seg_starts, self.prefix_lens, tm, out=self.out, err=err)

    def unfused(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tm = self.fmap.token_map
        return prepare_unfused(
            self.pre_tokens, self.dec_ph, self.ext_lens, self.prefix_lens, tm, self.n_tokens
        )


@functools.cache
def make_batch(bs: int, share: float) -> MixedBatch:
    batch = MixedBatch(bs, share)
    for name, a, b in zip(PreparedInputs._fields, batch.fused(), batch.unfused(), strict=True):
        if not torch.equal(a, b):
            raise AssertionError(f"prepare: fused {name} differs from the unfused sequence at bs={bs}")
    batch.fmap.check()
    return batch


@triton.testing.perf_report(
    [
        triton.testing.Benchmark(
            x_names=["bs"],
            x_vals=BATCH,
            x_log=True,
            y_log=True,
            line_arg="provider",
            line_vals=LINES,
            line_names=NAMES,
            styles=STYLES,
            xlabel="requests (prefill chunks 8-128 tokens, decodes 1 placeholder)",
            ylabel="us",
            plot_name=f"prepare_{timer}",
            args={"timer": timer},
        )
        for timer in harness.TIMERS
    ]
)
def prepare(bs: int, provider: tuple[str, str], timer: str) -> harness.Timing:
    """Building ids, positions and last rows: device time (do_bench) or host wall time (no sync).

    Median, band p20-p80. On CPU the whole preparation runs on the host.
    """
    batch = make_batch(bs, SHARES[provider[1]])
    return harness.timed(batch.fused if provider[0] == "tfuture" else batch.unfused, timer)


def look(bench: triton.testing.Benchmark) -> harness.Look:
    timer = bench.args["timer"]
    return harness.Look(
        what=f"prepare_inputs (fused) vs unfused torch: {harness.time_label(timer, unit=False)}",
        ylabel=harness.time_label(timer),
        xlabel="requests per call (prefill chunks 8-128 tokens, decodes 1 placeholder)",
    )


def main() -> None:
    if not HAS_CUDA:
        harness.skip("prepare_device_time (fused and unfused)", harness.NO_GPU)
    harness.save(prepare, look)


if __name__ == "__main__":
    main()
