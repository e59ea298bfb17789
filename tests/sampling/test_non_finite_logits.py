"""Non-finite logits never yield a token the filters or the mask ban: the row is marked on the
device (-1, no sync) and the runtime raises at the step's host sync, naming request and step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfuture import FutureMap
from tfuture.core.batch import Batch, ForwardBatch
from tfuture.kernels import _common
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplingParams

VOCAB = 8
INF, NAN = float("inf"), float("nan")


def sample_one(row: list[float], params: SamplingParams, bitmask: torch.Tensor | None = None) -> int:
    sampler = Sampler()
    owner = object()
    sampler.claim(owner)
    try:
        one = np.zeros(1, np.int64)
        plan = sampler.plan_step({0: params}, one, np.ones(1, np.int64), one, one, np.empty(0, np.int64), 0)
        state = sampler.prepare(plan, torch.from_numpy(plan.words.copy()))
        return int(sampler.sample(state, torch.tensor([row]), None, bitmask)[0])
    finally:
        sampler.unclaim(owner)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=1.0, top_k=2, seed=3),
        SamplingParams(temperature=0.5, top_p=0.9, seed=4),
        SamplingParams(),  # greedy
    ],
    ids=["temperature", "top-k", "top-p", "greedy"],
)
@pytest.mark.parametrize(
    "row",
    [[0.0, 1.0, NAN, 2.0, 0.5, 0.1, 0.2, 0.3], [-INF] * VOCAB],
    ids=["nan", "all-minus-inf"],
)
def test_rows_without_a_distribution_are_marked(row: list[float], params: SamplingParams) -> None:
    assert sample_one(row, params) == -1


def test_plus_inf_with_temperature_is_marked_and_greedy_takes_it() -> None:
    row = [0.0, 5.0, 1.0, INF, 0.0, 0.0, 0.0, 0.0]
    assert sample_one(row, SamplingParams(temperature=1.0, top_k=2, seed=1)) == -1
    assert sample_one(row, SamplingParams()) == 3  # the argmax is the +inf token: a real choice


def test_a_bitmask_that_allows_only_minus_inf_tokens_is_marked() -> None:
    row = [5.0, 4.0, -INF, -INF, 1.0, 0.0, 0.0, 0.0]
    allow_2_3 = torch.tensor([[0b1100]], dtype=torch.int32)
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=2)):
        assert sample_one(row, params, allow_2_3) == -1


class Crafted:
    """Logits [n_sample, VOCAB] with a NaN in request 1's row from step 1 on."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        logits = torch.zeros(batch.sample_rows.numel(), VOCAB)
        logits[:, 2] = 1.0
        if batch.step >= 1 and batch.sample_reqs.numel() > 1:
            logits[1, 5] = NAN
        return logits


class TwoDecodes:
    def __init__(self, with_params: bool = True) -> None:
        self.with_params = with_params
        self.n = 0
        self.last: Batch | None = None
        self.processed: list[int] = []

    def schedule(self) -> Batch | None:
        if self.n == 3:
            return None
        consumes, tokens = [], np.array([1, 1])
        if self.last is not None and self.last.out is not None:
            kept = self.last.out.filter(np.array([True, True]))
            consumes, tokens = [kept], kept.host_placeholders()
        params = None
        if self.n == 0 and self.with_params:
            params = {10: SamplingParams(temperature=1.0, seed=1), 11: SamplingParams()}
        ones = np.ones(2, np.int64)
        batch = Batch(
            tokens,
            ones,
            ones * self.n,
            np.array([10, 11]),
            np.ones(2, bool),
            consumes=consumes,
            params=params,
        )
        self.n += 1
        self.last = batch
        return batch

    def process(self, result) -> None:
        self.processed.append(result.step)
        if result.batch is self.last:
            self.last = None

    def build_mask(self, batch: Batch) -> None:
        return None


def _kernel_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``numpy``: the CPU map's own path outside the interpreter (stores through host views)."""
    if path == "numpy":
        monkeypatch.setattr(_common, "INTERPRET", False)


@pytest.mark.parametrize("path", ["kernels", "numpy"])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_runtime_raises_naming_the_request_and_step(overlap: bool, path: str, monkeypatch) -> None:
    _kernel_path(path, monkeypatch)
    fmap = FutureMap(16, device="cpu")
    sched = TwoDecodes()
    with pytest.raises(ValueError, match=r"step 1: the sampler found no valid token for request id 11"):
        OverlapRuntime(Crafted(), fmap, overlap=overlap, sampler=Sampler()).run(sched)
    assert sched.processed == [0] and fmap.in_use == 0


class MarksItsOwn(Crafted):
    """A model whose own ``sample`` returns -1 for request 11 from step 1 on (no valid token)."""

    def __init__(self) -> None:
        self.stored: list[torch.Tensor] = []

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        tokens = torch.full((logits.shape[0],), 2, dtype=torch.int64)
        if batch.step >= 1:
            tokens[1] = -1
        return tokens


@pytest.mark.parametrize("path", ["kernels", "numpy"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_models_own_minus_one_raises_naming_the_request_and_is_never_stored(
    overlap: bool, path: str, monkeypatch
) -> None:
    _kernel_path(path, monkeypatch)
    # The runtime stores a model's tokens unclamped: the store writes 0 for the -1 and flags it,
    # and the step's own check (first) names the request.
    fmap = FutureMap(16, device="cpu")
    sched = TwoDecodes(with_params=False)  # the model samples itself: no parameters to admit
    rt = OverlapRuntime(MarksItsOwn(), fmap, overlap=overlap)
    with pytest.raises(ValueError, match=r"step 1: the sampler found no valid token for request id 11"):
        rt.run(sched)
    assert sched.processed == [0] and fmap.in_use == 0
    assert int(fmap.token_map.min()) >= 0  # no -1 ever reached the map
    assert fmap.err.tolist() == [0, 0]  # the run's abort cleared the flag
