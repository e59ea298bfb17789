"""What the direct-forward tests share: an adapter that records each step, and a mixed workload."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from tiny_hf import VOCAB

from tfuture import FutureMap
from tfuture.core.batch import ForwardBatch
from tfuture.models import HFCausalLM
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, random_workload

ROWS, MAX_LEN = 3, 40


class Recorded(HFCausalLM):
    """Keeps every step's logits, whether the step took the direct forward, and how many module
    calls it made."""

    def __init__(self, model: Any, direct: bool = True) -> None:
        super().__init__(model, max_requests=ROWS, max_len=MAX_LEN, direct=direct)
        self.logits: list[torch.Tensor] = []
        self.used: list[bool] = []
        self.module_calls: list[int] = []

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        d = self._direct
        self.used.append(d is not None and d.intact())
        calls = [0]
        real = torch.nn.Module._call_impl

        def counted(module: torch.nn.Module, *args: Any, **kw: Any) -> Any:
            calls[0] += 1
            return real(module, *args, **kw)

        with mock.patch.object(torch.nn.Module, "_call_impl", counted):
            out = super().forward(batch)
        self.logits.append(out.clone())
        self.module_calls.append(calls[0])
        return out


def run(adapter: HFCausalLM, seed: int = 0, overlap: bool = False) -> dict[int, list[int]]:
    """Mixed chunked prefills and decodes (chunk 5, 9 tokens a step), 7 requests through 3 rows."""
    specs = random_workload(seed, 7, vocab=VOCAB, max_prompt=14, max_new=10, arrival_span=5)
    fmap = FutureMap(32, device="cpu")
    sched = ContinuousBatcher(specs, fmap, eos=-1, max_running=ROWS, chunk=5, token_budget=9)
    with torch.inference_mode():
        OverlapRuntime(adapter, fmap, overlap=overlap).run(sched)
    return sched.outputs


def same_logits(a: Recorded, b: Recorded) -> bool:
    """Both adapters ran more than 10 steps, with equal logits (dtype and bits) at every one."""
    return len(a.logits) == len(b.logits) > 10 and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True)
    )
