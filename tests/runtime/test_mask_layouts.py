"""A scheduler's mask in any memory layout: a column-major (Fortran-order) bitmask or bool mask
is made row-major on the host by the token step's mask check, and samples the same tokens as a
row-major one, with tfuture's Sampler and with a model's own sample."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.steps.masks import check_mask
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyGrammar, ToyModel, random_workload

VOCAB = 70  # 3 words a bitmask row: a column-major bitmask has stride(1) != 1


class FortranMasks(ContinuousBatcher):
    def build_mask(self, batch: Any) -> Any:
        mask = super().build_mask(batch)
        return np.asfortranarray(mask)


def _run(cls: type[ContinuousBatcher], kind: str, sampler: bool) -> dict[int, list[int]]:
    specs = random_workload(5, 6, vocab=VOCAB, max_new=6, max_prompt=4, grammar_share=1.0)
    fmap = FutureMap(32, device="cpu")
    sched = cls(specs, fmap, grammar=ToyGrammar(VOCAB, seed=5), max_running=4, eos=-1, mask=kind)
    OverlapRuntime(ToyModel(vocab=VOCAB), fmap, sampler=Sampler() if sampler else None).run(sched)
    assert fmap.in_use == 0
    return sched.outputs


@pytest.mark.parametrize("kind", ["bitmask", "bool"])
@pytest.mark.parametrize("sampler", [True, False], ids=["sampler", "model-sample"])
def test_a_column_major_mask_samples_like_a_row_major_one(kind, sampler):
    assert _run(FortranMasks, kind, sampler) == _run(ContinuousBatcher, kind, sampler)


def test_check_mask_returns_row_major_rows():
    reqs = np.arange(3, dtype=np.int64)
    words = np.asfortranarray(np.full((3, 3), -1, dtype=np.int32))
    t = check_mask(words, reqs, 0, VOCAB)
    assert t.stride() == (3, 1) and torch.equal(t, torch.full((3, 3), -1, dtype=torch.int32))
    empty = check_mask(np.zeros((0, 3), dtype=np.int32), reqs[:0], 0, VOCAB)
    assert empty.shape == (0, 3) and empty.stride() == (3, 1)


class RecordingModel(ToyModel):
    """:class:`ToyModel` that keeps the bool mask its own ``sample`` gets, per step."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.masks: list[torch.Tensor] = []

    def sample(self, logits, batch, mask):
        if mask is not None:
            self.masks.append(mask.clone())
        return super().sample(logits, batch, mask)


@pytest.mark.parametrize("kind", ["bitmask", "bool"])
def test_rows_that_pad_a_delayed_steps_mask_allow_every_token(kind):
    # Issue 30 item 16: with delay="rows" only the grammar requests' rows wait for the mask; a
    # model's own sample takes every row at once, so the mask is widened with rows for the free
    # requests, which must allow every token (a padding row that allows none samples token 0).
    specs = [RequestSpec(rid, 0, np.array([rid + 1, 7, 9]), 6, grammar=rid % 2 == 0) for rid in range(4)]
    fmap = FutureMap(32, device="cpu")
    sched = ContinuousBatcher(
        specs, fmap, grammar=ToyGrammar(VOCAB, seed=5), max_running=6, eos=-1, mask=kind, delay="rows"
    )
    model = RecordingModel(vocab=VOCAB)
    OverlapRuntime(model, fmap).run(sched)
    assert fmap.in_use == 0
    padded = [m for m in model.masks if bool(m.all(dim=1).any())]
    assert padded, "no step mixed waiting and free rows"
    for s in specs:
        if not s.grammar:  # a free request samples as without any grammar in the run
            assert sched.outputs[s.rid] == model.reference(s.prompt, s.rid, s.max_new), s.rid
