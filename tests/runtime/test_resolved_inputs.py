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


class ReusesItsArrays:
    """Decodes ``n`` requests for ``steps`` steps, handing every batch the same position and id
    arrays, and writing over them as soon as ``schedule`` returns the next one (legal: a batch's
    arrays are the scheduler's; the runtime stages its own copy at launch)."""

    def __init__(self, n: int, steps: int) -> None:
        self.n, self.left = n, steps
        self.pos = np.zeros(n, dtype=np.int64)
        self.ids = np.arange(n, dtype=np.int64)
        self.tokens = np.ones(n, dtype=np.int64)  # step k feeds token k + 1
        self.last = None

    def schedule(self):  # type: ignore[no-untyped-def]
        from tfuture.core.batch import Batch

        if self.last is not None:
            self.pos += 1  # the previous batch's arrays, rewritten after its launch
            self.tokens += 1
        if not self.left:
            return None
        self.left -= 1
        self.last = Batch(self.tokens, np.ones(self.n, np.int64), self.pos, self.ids, np.ones(self.n, bool))
        return self.last

    def process(self, result) -> None:  # type: ignore[no-untyped-def]
        pass

    def build_mask(self, batch):  # type: ignore[no-untyped-def]
        return None


class FedPositions(ToyModel):
    def __init__(self) -> None:
        super().__init__(vocab=VOCAB)
        self.seen: list[tuple[list[int], list[int]]] = []

    def forward(self, batch):  # type: ignore[no-untyped-def]
        self.seen.append((batch.input_ids.tolist(), batch.positions.tolist()))
        return super().forward(batch)


@pytest.mark.parametrize("path", ["kernels", "numpy"])
def test_a_step_reads_its_own_copy_of_arrays_the_scheduler_rewrites_after_launch(path, monkeypatch):
    if path == "numpy":
        monkeypatch.setattr(_common, "INTERPRET", False)
    fmap = FutureMap(32, device="cpu")
    model = FedPositions()
    # The stream starts each step's prepare late: the host has rewritten the arrays by then.
    delay = lambda name: 5e-3 if name == "prepare" else 0.0
    OverlapRuntime(model, fmap, overlap=True, stream="worker", delay=delay).run(ReusesItsArrays(3, 4))
    assert model.seen == [([k + 1] * 3, [k] * 3) for k in range(4)]
    assert fmap.in_use == 0
