"""The numpy prepare's decode fast path (one token a request) equals its general path."""

from __future__ import annotations

import pytest
import torch

from tfuture.kernels import cpu


def run(tokens, seg, prefix, token_map):
    n_rows, n_reqs = len(tokens), len(prefix)
    out = (torch.full((n_rows,), -7), torch.full((n_rows,), -7), torch.full((n_reqs,), -7))
    err = torch.zeros(2, dtype=torch.int64)
    cpu.prepare(torch.tensor(tokens), torch.tensor(seg), torch.tensor(prefix), token_map, out, err)
    return [t.tolist() for t in out], err.tolist()


@pytest.mark.parametrize("n", [1, 3, 16])
def test_decode_layout_matches_the_general_path(n: int) -> None:
    token_map = torch.arange(100, 100 + 2 * n + 1)
    tokens = [-(i + 1) for i in range(n)]
    prefix = [5 * i + 2 for i in range(n)]
    got, err = run(tokens, list(range(n + 1)), prefix, token_map)
    assert got == [[100 + i + 1 for i in range(n)], prefix, list(range(n))] and err == [0, 0]
    # Two segments of 2 and 0 tokens: the same boundaries in number, not a decode: general path.
    if n == 2:
        got, _ = run(tokens, [0, 2, 2], prefix, token_map)
        assert got[1] == [prefix[0], prefix[0] + 1] and got[2] == [1, 1]


def test_a_non_decode_layout_with_as_many_rows_as_requests_takes_the_general_path() -> None:
    token_map = torch.arange(10, 20)
    got, err = run([1, 2, 3], [0, 0, 2, 3], [4, 7, 9], token_map)
    # request 0 is empty, request 1 owns rows 0-1, request 2 row 2
    assert got[1] == [7, 8, 9] and got[2] == [0, 1, 2] and err == [0, 0]
