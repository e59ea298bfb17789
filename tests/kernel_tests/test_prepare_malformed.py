"""Input preparation on malformed segments and into narrow outputs, the kernel against the numpy path.

On malformed segments (``seg_starts[0] != 0``, a segment running backwards, a negative prefix)
the kernel's binary search alone defines each row's request; the numpy path repeats it step for
step (``cpu._search``), so both give the same positions, last rows and error counts: one per
malformed request and one more for a nonzero ``seg_starts[0]``. An int32 ``input_ids`` output
over int64 tokens flags a concrete id past int32 instead of wrapping it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfuture.kernels import cpu
from tfuture.kernels._common import use_triton
from tfuture.kernels.resolve import PreparedInputs, launch_prepare

from ._helpers import new_err
from ._paths import PATHS, path_device

N_SLOTS = 16
MALFORMED = {
    "seg0-nonzero": ([2, 3, 5], [0, 1]),
    "backwards": ([0, 4, 2, 6], [0, 1, 2]),
    "negative-prefix": ([0, 1, 3, 4], [5, -2, 0]),
    "seg0-and-backwards": ([1, 5, 3, 3, 7, 6], [0, 0, 3, 1, 2]),
    "many-backwards": ([0, 9, 2, 8, 1, 7, 3, 6, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9]),
}


def token_map(device: str) -> torch.Tensor:
    return (torch.arange(N_SLOTS, device=device) + 100) * 3


def run_prepare(seg: list[int], prefix: list[int], n_tok: int, device: str, numpy: bool):
    tokens = torch.tensor([-(i % (N_SLOTS - 1) + 1) if i % 2 else i for i in range(n_tok)], device=device)
    seg_t, prefix_t = torch.tensor(seg, device=device), torch.tensor(prefix, device=device)
    err = new_err(device)
    n_rows = n_tok + 2
    if numpy:
        out = PreparedInputs(
            torch.full((n_rows,), -5, dtype=torch.int64),
            torch.full((n_rows,), -5, dtype=torch.int64),
            torch.full((len(prefix),), -5, dtype=torch.int64),
        )
        cpu.prepare(tokens, seg_t, prefix_t, token_map("cpu"), out, err)
    else:
        out = launch_prepare(tokens, seg_t, prefix_t, token_map(device), n_rows, None, err)
    return [t.cpu() for t in out], err.cpu()


def expected_count(seg: list[int], prefix: list[int]) -> int:
    s, p = np.array(seg), np.array(prefix)
    return int((((s[1:] - s[:-1]) < 0) | (p < 0)).sum()) + int(s[0] != 0)


@pytest.mark.parametrize("n_tok", [6, 12])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_kernel_and_numpy_path_agree_on_malformed_segments(case, n_tok, device):
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("the Triton path needs CUDA or TRITON_INTERPRET=1")
    seg, prefix = MALFORMED[case]
    (ids, pos, last), err = run_prepare(seg, prefix, n_tok, device, numpy=False)
    (ids_np, pos_np, last_np), err_np = run_prepare(seg, prefix, n_tok, "cpu", numpy=True)
    assert torch.equal(ids, ids_np)
    assert pos.tolist() == pos_np.tolist()
    assert last.tolist() == last_np.tolist()
    assert err.tolist() == err_np.tolist()
    assert int(err[0]) == expected_count(seg, prefix)
    assert bool((pos >= 0).all())


@pytest.mark.parametrize("path", PATHS)
def test_a_nonzero_first_seg_start_counts_once_more(path, device, monkeypatch):
    device = path_device(path, device, monkeypatch)
    seg = torch.tensor([3, 3, 5], device=device)
    prefix = torch.tensor([0, 0], device=device)
    err = new_err(device)
    launch_prepare(torch.arange(5, device=device), seg, prefix, token_map(device), 5, None, err)
    assert err.tolist() == [1, -3]


@pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64], ids=["map_int32", "map_int64"])
@pytest.mark.parametrize("path", PATHS)
def test_int64_concrete_ids_past_int32_are_flagged_in_an_int32_output(path, map_dtype, device, monkeypatch):
    device = path_device(path, device, monkeypatch)
    big = 2**31 + 5
    tokens = torch.tensor([big, -1, 7, -2], dtype=torch.int64, device=device)
    seg = torch.tensor([0, 2, 4], device=device)
    prefix = torch.tensor([0, 3], device=device)
    out = PreparedInputs(
        torch.full((4,), -5, dtype=torch.int32, device=device),
        torch.zeros(4, dtype=torch.int64, device=device),
        torch.zeros(2, dtype=torch.int64, device=device),
    )
    err = new_err(device)
    launch_prepare(tokens, seg, prefix, token_map(device).to(map_dtype), 4, out, err)
    assert out.input_ids.tolist() == [0, 303, 7, 306]
    assert out.positions.tolist() == [0, 1, 3, 4]
    assert int(err[0]) == 1
