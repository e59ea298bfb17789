"""Shared by the kernel tests: seeded generators, sentinel fences, and the two implementations."""

from __future__ import annotations

import pytest
import torch

from tfuture.kernels._common import use_triton

DTYPES = {"int32": torch.int32, "int64": torch.int64}
SENTINEL = -777
PAD = 40

# Every kernel family has two implementations: the Triton kernel (through the interpreter on a
# CPU-only machine) and the numpy path in tfuture.kernels.cpu, called directly so that it runs
# whatever TRITON_INTERPRET says. Both are compared with the torch reference.
IMPLS = ["triton", "cpu"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def impl_device(impl: str, device: str) -> str:
    """The device a case runs on: the CPU path is CPU-only; skip the Triton path where it can't run."""
    if impl.startswith("cpu"):
        return "cpu"
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("the Triton path needs CUDA or TRITON_INTERPRET=1")
    return device


def fenced(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, backing)``: ``values`` copied into the middle of a sentinel-filled buffer."""
    backing = torch.full((values.numel() + 2 * PAD,), SENTINEL, dtype=values.dtype, device=values.device)
    view = backing[PAD : PAD + values.numel()]
    view.copy_(values)
    return view, backing


def assert_fence(backing: torch.Tensor, n: int) -> None:
    """Nothing was written outside the ``n`` elements in the middle of ``backing``."""
    assert bool((backing[:PAD] == SENTINEL).all()) and bool((backing[PAD + n :] == SENTINEL).all())


def new_err(device: str) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64, device=device)
