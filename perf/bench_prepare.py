"""Fused input preparation (one launch) vs the unfused torch sequence engines run.

``python -m perf.bench_prepare``. A batch of ``bs`` requests: a share of them are prefill chunks
(8..128 concrete tokens each, random prefix), the rest decodes (one placeholder each, into an
8192-slot map holding real tokens). Lines are ``provider, prefill share``:

* ``tfuture``: ``prepare_inputs(tokens, seg_starts, prefix_lens, token_map, out=..., err=...)``
  on the mixed stream (built on the host as one tensor), writing into preallocated outputs as
  under CUDA-graph capture. On CPU it is the launcher's checks plus its CPU path (numpy).
* ``torch``: :func:`prepare_unfused` below: cat of the prefill tokens and the decode
  placeholders (as an engine merges a prefill batch with its running decodes), gather + where
  to resolve, cumsum for the last-token rows, arange minus repeat_interleave for positions.

Both start from the same device inputs and produce equal outputs (checked before timing).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

from perf._common import (
    DEVICE,
    HAS_CUDA,
    HOST_TIMING,
    NO_GPU,
    Sweep,
    column,
    column_ratio,
    host_where,
    merge_summary,
    pick,
    r2,
    r2_list,
    skip,
    verdict,
    write_meta,
)
from tfuture import FutureMap
from tfuture.kernels.resolve import PreparedInputs, prepare_inputs

N_SLOTS = 8192
VOCAB = 32000
BATCH = pick([1, 4, 16, 64, 256, 1024], [1, 64, 1024])
SHARES = pick([0.0, 0.1, 0.5], [0.0, 0.5])
PROVIDERS = ("tfuture", "torch")
_LS = ("-", "--", ":")


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
    last_rows = cu - 1
    # Row r of request q sits at position r - (start_q - prefix_q); output_size avoids a sync.
    shift = torch.repeat_interleave(cu - ext_lens - prefix_lens, ext_lens, output_size=n_tokens)
    positions = torch.arange(n_tokens, device=ids.device) - shift
    return ids, positions, last_rows


class Batch:
    """One mixed batch, in both input layouts, on ``DEVICE``."""

    def __init__(self, bs: int, share: float) -> None:
        g = torch.Generator().manual_seed(bs * 1000 + round(share * 100))
        n_pre = min(bs, math.ceil(share * bs))
        n_dec = bs - n_pre
        self.fmap = FutureMap(N_SLOTS, device=DEVICE, dtype=torch.int64)
        self.fmap.store(self.fmap.alloc(N_SLOTS), torch.randint(0, VOCAB, (N_SLOTS,), generator=g).to(DEVICE))
        pre_lens = torch.randint(8, 129, (n_pre,), generator=g)
        ext_lens = torch.cat([pre_lens, torch.ones(n_dec, dtype=torch.int64)])
        prefix_lens = torch.cat(
            [torch.randint(0, 512, (n_pre,), generator=g), torch.randint(16, 4096, (n_dec,), generator=g)]
        )
        pre_tokens = torch.randint(0, VOCAB, (int(pre_lens.sum()),), generator=g)
        dec_ph = -(torch.randperm(N_SLOTS, generator=g)[:n_dec] + 1)
        self.n_tokens = int(ext_lens.sum())
        seg_starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(ext_lens, 0)])
        to = functools.partial(torch.Tensor.to, device=DEVICE)
        self.pre_tokens, self.dec_ph, self.ext_lens = to(pre_tokens), to(dec_ph), to(ext_lens)
        self.prefix_lens, self.seg_starts = to(prefix_lens), to(seg_starts)
        self.tokens = to(torch.cat([pre_tokens, dec_ph]))
        self.out = PreparedInputs(
            torch.empty(self.n_tokens, dtype=torch.int64, device=DEVICE),
            torch.empty(self.n_tokens, dtype=torch.int64, device=DEVICE),
            torch.empty(bs, dtype=torch.int64, device=DEVICE),
        )

    def fused(self) -> PreparedInputs:
        tm = self.fmap.token_map
        return prepare_inputs(
            self.tokens, self.seg_starts, self.prefix_lens, tm, out=self.out, err=self.fmap.err
        )

    def unfused(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return prepare_unfused(
            self.pre_tokens, self.dec_ph, self.ext_lens, self.prefix_lens, self.fmap.token_map, self.n_tokens
        )

    def check(self) -> None:
        got, want = self.fused(), self.unfused()
        for name, a, b in zip(PreparedInputs._fields, got, want, strict=True):
            if not torch.equal(a, b):
                raise AssertionError(f"prepare: fused {name} differs from the unfused sequence")
        self.fmap.check()


@functools.cache
def make_batch(bs: int, share: float) -> Batch:
    batch = Batch(bs, share)
    batch.check()
    return batch


def _fn(bs: int, provider: tuple[str, float]) -> Callable[[], object]:
    name, share = provider
    batch = make_batch(bs, share)
    return batch.fused if name == "tfuture" else batch.unfused


def _label(name: str, share: float) -> str:
    return f"{name}, {'decode only' if share == 0 else f'{share:.0%} prefill'}"


LINES = [(p, s) for s in SHARES for p in PROVIDERS]
NAMES = [_label(p, s) for p, s in LINES]


_COLORS = {"tfuture": "blue", "torch": "red"}
SWEEP = Sweep(
    "prepare",
    _fn,
    x_name="bs",
    x_vals=BATCH,
    xlabel="batch size (requests; prefill chunks 8-128 tokens, decodes 1 placeholder)",
    point="{provider} bs={bs}",
    line_names=NAMES,
    styles=[(_COLORS[p], _LS[SHARES.index(s)]) for p, s in LINES],
)


def _speedups(df: object) -> np.ndarray:
    """torch / tfuture per (batch size, share)."""
    return np.stack([column_ratio(df, _label("torch", s), _label("tfuture", s)) for s in SHARES])


def main() -> None:
    skipped: list[str] = []
    summary: dict[str, object] = {"batch_sizes": BATCH, "prefill_shares": SHARES}
    if HAS_CUDA:
        df = SWEEP.plot(
            "device",
            "prepare_device_time",
            LINES,
            title="prepare_inputs: fused launch vs unfused torch, device time per call",
            about="do_bench device time of building ids, positions, last rows",
        )
        speed = _speedups(df)
        summary |= {
            "unfused_over_fused_device_min": r2(np.nanmin(speed)),
            "unfused_over_fused_device_max": r2(np.nanmax(speed)),
        }
        worst = np.nanmin(speed)
        verdict(summary, "device: unfused / fused >= 4", worst, worst >= 4)
    else:
        skip(skipped, "prepare_device_time (fused and unfused)", NO_GPU)

    df = SWEEP.plot(
        "host",
        "prepare_host_cost",
        LINES,
        title=f"prepare_inputs: host cost per call ({host_where('GPU launches, no sync')})",
        about=HOST_TIMING,
    )
    speed = _speedups(df)
    summary |= {
        "unfused_over_fused_host_min": r2(np.nanmin(speed)),
        "unfused_over_fused_host_max": r2(np.nanmax(speed)),
        "fused_host_us_decode_only": r2_list(column(df, _label("tfuture", 0.0))),
        "unfused_host_us_decode_only": r2_list(column(df, _label("torch", 0.0))),
    }
    worst = 1 / np.nanmin(speed)
    verdict(summary, "host: fused / unfused <= 1", worst, worst <= 1, contract=HAS_CUDA)
    merge_summary("prepare", summary)
    write_meta("bench_prepare", skipped)


if __name__ == "__main__":
    main()
