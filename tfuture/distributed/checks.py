"""Cross-rank agreement checks: the run's configuration, and (debug) every step's batch and tokens.

Every rank runs the same scheduler, so every rank must launch the same batch with the same
slots, and every rank's map must hold the same tokens. Debug mode checks both each step:
the host compares a digest of the batch (tokens with their placeholders, segments, request
ids, the step's slots) over the gloo ``host_group``; the forward stream compares a digest of
the tokens just stored, read back from the map, over ``check_group``. All ranks gather the
same digests, so all of them raise the same :class:`RankDivergence` at the same step.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tfuture.core.batch import Batch
from tfuture.distributed.context import ParallelContext

__all__ = ["RankDivergence", "agree", "batch_digest", "check_stored_tokens", "tokens_digest"]

_P = 2_147_483_647  # 2**31 - 1: every product below stays under 2**62


class RankDivergence(ValueError):
    """Ranks that must agree (configuration, a step's batch, the stored tokens) do not."""


def agree(ctx: ParallelContext, values: dict[str, Any], where: str = "") -> None:
    """All ranks gather ``values`` (name -> value) over the host group in one collective; raise
    :class:`RankDivergence` on every rank, naming the first value that differs, unless all agree.
    ``where`` prefixes the message (where the check runs)."""
    got: list[Any] = [None] * ctx.world
    dist.all_gather_object(got, values, group=ctx.host_group)
    for what in values:
        for r, theirs in enumerate(got):
            if theirs.get(what) != got[0].get(what):
                raise RankDivergence(
                    f"{where}ranks disagree on {what}: rank 0 has {got[0].get(what)!r}, rank {r} has "
                    f"{theirs.get(what)!r} (this is rank {ctx.rank})"
                )


def batch_digest(step: int, micro: Batch | None, slots: np.ndarray, in_use: int) -> tuple[str, str]:
    """A digest of what step ``step`` launches, and a short readable summary of it."""
    h = hashlib.blake2b(digest_size=12)
    h.update(np.asarray([step, in_use], dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(slots, dtype=np.int64).tobytes())
    if micro is None:
        return h.hexdigest(), f"a bubble, slots {slots[:6].tolist()}"
    for a in (micro.tokens, micro.seg_lens, micro.prefix_lens, micro.req_ids, micro.sample, micro.ended):
        h.update(np.ascontiguousarray(a).tobytes())
        h.update(b"|")
    summary = (
        f"{micro.n_reqs} requests {micro.req_ids[:6].tolist()}, tokens {micro.tokens[:6].tolist()}, "
        f"slots {slots[:6].tolist()}, {in_use} slots in use"
    )
    return h.hexdigest(), summary


def check_batch(ctx: ParallelContext, step: int, micro: Batch | None, slots: np.ndarray, in_use: int) -> None:
    """Host, debug: every rank launches the same batch at ``step`` (raises on every rank)."""
    digest, summary = batch_digest(step, micro, slots, in_use)
    got: list[Any] = [None] * ctx.world
    dist.all_gather_object(got, (digest, summary), group=ctx.host_group)
    for r, (theirs, their_summary) in enumerate(got):
        if theirs != got[0][0]:
            raise RankDivergence(
                f"the schedulers diverged at step {step}: rank 0 launches {got[0][1]}; rank {r} launches "
                f"{their_summary} (this is rank {ctx.rank}). Every rank must run the same scheduler on "
                "the same requests, deterministically"
            )


def tokens_digest(tokens: torch.Tensor) -> torch.Tensor:
    """``[1]`` int64 on ``tokens``' device: an order-sensitive hash of int ``tokens [n]``."""
    t = tokens.to(torch.int64) % _P
    w = (torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.int64) * 69_069 + 12_345) % _P
    return ((t * w) % _P).sum().remainder(_P).reshape(1) + t.numel() * _P


def diverging_ranks(ctx: ParallelContext, tokens: torch.Tensor) -> list[int]:
    """Forward stream, debug: the ranks whose ``tokens`` (int64) digest differs from rank 0's,
    gathered over ``check_group`` (a host sync)."""
    mine = tokens_digest(tokens)
    got = [torch.zeros_like(mine) for _ in range(ctx.world)]
    dist.all_gather(got, mine, group=ctx.check_group)
    values = torch.cat(got).tolist()
    return [r for r, v in enumerate(values) if v != values[0]]


def check_stored_tokens(ctx: ParallelContext, step: int, token_map: torch.Tensor, slots: np.ndarray) -> None:
    """Forward stream, debug: the tokens just stored into ``slots`` are the same on every rank.

    Reads them back from ``token_map`` (so it checks the map, not the sampler's output) and
    gathers a digest over ``check_group``; a host sync, as every debug check is.
    """
    idx = torch.from_numpy(np.array(slots, dtype=np.int64)).to(token_map.device)
    bad = diverging_ranks(ctx, token_map.index_select(0, idx))
    if bad:
        raise RankDivergence(
            f"the FutureMaps diverged at step {step}: the digest of the {slots.size} tokens stored into "
            f"slots {slots[:6].tolist()} differs between rank 0 and rank(s) {bad} (this is rank {ctx.rank})"
        )
