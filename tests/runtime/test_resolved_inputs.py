"""The model sees real token ids only: every placeholder a scheduler puts in a step resolves
before the forward, so each request is fed exactly its prompt, then its own sampled tokens.

On both kernel paths of a CPU map: the Triton kernels (the interpreter, as the rest of the
suite runs them on a CPU machine) and the numpy path a CPU map takes outside the interpreter
(the host views a decode step resolves and stores through)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from tfuture import FutureMap
from tfuture.kernels import _common
from tfuture.runtime import OverlapRuntime
from tfuture.testing import ContinuousBatcher, ToyModel, random_workload

VOCAB = 64


class FedIds(ToyModel):
    """ToyModel that records, per request, the token ids each forward fed it (in step order)."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB)
        self.fed: dict[int, list[int]] = defaultdict(list)

    def forward(self, batch):  # type: ignore[no-untyped-def]
        host = batch.host
        ids = batch.input_ids[: host.n_tokens].tolist()
        starts = np.concatenate([[0], np.cumsum(host.seg_lens)])
        for q, rid in enumerate(host.req_ids.tolist()):
            self.fed[rid] += ids[starts[q] : starts[q + 1]]
        return super().forward(batch)


@pytest.mark.parametrize("path", ["kernels", "numpy"])
@pytest.mark.parametrize("stream", ["inline", "worker"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_each_request_is_fed_its_prompt_then_its_own_tokens(overlap, stream, path, monkeypatch):
    if path == "numpy":
        monkeypatch.setattr(_common, "INTERPRET", False)  # a CPU map's own path, outside tests
    specs = random_workload(11, 10, vocab=VOCAB, max_prompt=6, max_new=8)
    fmap = FutureMap(64, device="cpu")
    model = FedIds()
    sched = ContinuousBatcher(specs, fmap, max_running=4)
    OverlapRuntime(model, fmap, overlap=overlap, stream=stream).run(sched)
    assert fmap.in_use == 0
    for spec in specs:
        out = sched.outputs[spec.rid]
        assert model.fed[spec.rid] == spec.prompt.tolist() + out[:-1], spec.rid
