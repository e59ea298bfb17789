"""A model and its FutureMap on different devices are refused before the first step, by name.

On a GPU host a ``FutureMap()`` defaults to CUDA while a model built in code sits on the CPU:
without these checks the first forward raised torch's "Expected all tensors to be on the same
device" from the forward stream, naming neither the map nor the fix. The foreign device here is
``cuda:0`` reported by the model, so the checks run on a CPU-only machine too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiny_hf import tiny

from tfuture import FutureMap
from tfuture.models import HFCausalLM
from tfuture.runtime import OverlapRuntime
from tfuture.spec import ModelDrafter
from tfuture.testing import ToyModel

CUDA0 = torch.device("cuda", 0)


class ElsewhereModel(ToyModel):
    """A toy model that says its parameters are on ``cuda:0``."""

    device = CUDA0


def test_a_model_on_another_device_than_the_map_is_refused_naming_both() -> None:
    fmap = FutureMap(16, device="cpu")
    with pytest.raises(ValueError, match=r"model is on cuda:0 and the FutureMap on cpu.*device='cuda:0'"):
        OverlapRuntime(ElsewhereModel(), fmap)
    assert fmap.in_use == 0
    OverlapRuntime(ToyModel(), fmap).close()  # the map is unharmed; a model without .device passes


def test_the_hf_adapter_reports_its_models_device() -> None:
    adapter = HFCausalLM(tiny("LlamaConfig"), max_requests=2, max_len=16)
    assert adapter.device == torch.device("cpu") == adapter.pool.k.device
    OverlapRuntime(adapter, FutureMap(16, device="cpu")).close()


def test_a_draft_model_on_another_device_than_the_map_is_refused() -> None:
    drafter = ModelDrafter(tiny("LlamaConfig"), k=2)
    with pytest.raises(
        ValueError, match=r"ModelDrafter: the draft model is on cpu and the FutureMap on cuda:0"
    ):
        drafter.bind(2, 16, CUDA0)
    drafter.bind(2, 16, torch.device("cpu"))  # the same drafter binds to a map on its device
