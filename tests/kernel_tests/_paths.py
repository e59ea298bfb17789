"""Both paths through the launchers themselves: the Triton kernel, and the numpy path reached by
the dispatch (``tfuture.kernels._common.use_triton`` reads ``INTERPRET``; with it off, CPU
tensors take :mod:`tfuture.kernels.cpu`), so the launchers' own choice of CPU call is tested too.
"""

from __future__ import annotations

import pytest
import torch

from tfuture.kernels import _common

PATHS = ["triton", "numpy"]


def path_device(path: str, device: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The device a case runs on for ``path``; the numpy path switches the dispatch over."""
    if path == "numpy":
        monkeypatch.setattr(_common, "INTERPRET", False)
        assert not _common.use_triton(torch.empty(0))
        return "cpu"
    if not _common.use_triton(torch.empty(0, device=device)):
        pytest.skip("the Triton path needs CUDA or TRITON_INTERPRET=1")
    return device
