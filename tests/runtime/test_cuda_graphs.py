"""Padded steps can be captured: one CUDA graph per bucket of prepare + a toy forward, replayed
with other token streams and counts, equal to eager (GPU only; CPU checks the shapes)."""

from __future__ import annotations

import pytest
import torch

from tfuture import FutureMap
from tfuture.kernels.resolve import PreparedInputs

BUCKETS = [(16, 4), (64, 8)]  # (token rows, requests)


def toy_forward(inp: PreparedInputs, table: torch.Tensor) -> torch.Tensor:
    """A graph-safe stand-in for a model: embedding lookup mixed with positions, per last row."""
    h = table[inp.input_ids.long() % table.shape[0]] + inp.positions[:, None].float()
    return h.index_select(0, inp.last_rows)


def step_inputs(n_tok: int, n_reqs: int, rows: int, reqs: int, fmap: FutureMap, g: torch.Generator):
    """A mixed stream of ``n_tok`` ids over ``n_reqs`` requests, padded to (rows, reqs) shapes."""
    dev = fmap.device
    fi = fmap.alloc(n_reqs)
    fmap.store(fi, torch.randint(0, 1000, (n_reqs,), generator=g).to(dev))
    tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
    tokens[:n_tok] = torch.randint(0, 1000, (n_tok,), generator=g).to(dev)
    tokens[:n_reqs] = fi.placeholders()  # the first n_reqs rows are futures
    cuts = torch.sort(torch.randperm(n_tok - 1, generator=g)[: n_reqs - 1] + 1).values.tolist()
    seg = torch.full((reqs + 1,), n_tok, dtype=torch.int64)
    seg[0], seg[1:n_reqs] = 0, torch.tensor(cuts, dtype=torch.int64)
    prefix = torch.zeros(reqs, dtype=torch.int64)
    prefix[:n_reqs] = torch.randint(0, 50, (n_reqs,), generator=g)
    return fi, tokens, seg.to(dev), prefix.to(dev)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "reqs"), BUCKETS, ids=[f"rows{r}-reqs{q}" for r, q in BUCKETS])
def test_prepare_and_forward_replay_per_bucket(rows, reqs):
    fmap = FutureMap(256, device="cuda")
    g = torch.Generator().manual_seed(rows)
    table = torch.randn(1000, 8, device="cuda")
    # Static inputs and outputs: replays read and write these buffers.
    tokens = torch.zeros(rows, dtype=torch.int64, device="cuda")
    seg = torch.zeros(reqs + 1, dtype=torch.int64, device="cuda")
    prefix = torch.zeros(reqs, dtype=torch.int64, device="cuda")
    out = PreparedInputs(
        torch.zeros(rows, dtype=torch.int64, device="cuda"),
        torch.zeros(rows, dtype=torch.int64, device="cuda"),
        torch.zeros(reqs, dtype=torch.int64, device="cuda"),
    )
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) outside the capture
        fmap.prepare_inputs(tokens, seg, prefix, n_rows=rows, out=out)
        toy_forward(out, table)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fmap.prepare_inputs(tokens, seg, prefix, n_rows=rows, out=out)
        logits = toy_forward(out, table)
    for n_tok, n_reqs in ((rows, reqs), (rows // 2, reqs // 2), (reqs, reqs)):
        fi, t, s, p = step_inputs(n_tok, n_reqs, rows, reqs, fmap, g)
        want_inp = fmap.prepare_inputs(t.clone(), s, p, n_rows=rows)
        want = toy_forward(want_inp, table)
        tokens.copy_(t)
        seg.copy_(s)
        prefix.copy_(p)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.input_ids, want_inp.input_ids) and torch.equal(
            out.positions, want_inp.positions
        )
        assert torch.equal(logits, want)
        fmap.release(fi)
    fmap.check()
