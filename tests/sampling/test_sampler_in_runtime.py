"""Through the real runtime: a model that samples with Sampler gives the same tokens in sync and
overlap mode (CPU worker stream), and those of the plain host loop, penalties and draws included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampling_penalties import VOCAB, Req, Step, model_logits, reference, requests, schedule

from tfuture import FutureMap
from tfuture.core.batch import Batch, ForwardBatch, StepResult
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplerPlan, SamplerState, pack_params


class SamplingModel:
    """Logits from a table by (request, last token); samples with the Sampler on the stream."""

    def __init__(self, sampler: Sampler, plans: dict[int, SamplerPlan], n_reqs: int, device: str) -> None:
        self.sampler, self.plans, self.states = sampler, plans, {}
        table = np.array([[model_logits(r, t) for t in range(VOCAB)] for r in range(n_reqs)])
        self.table = torch.tensor(table, device=device)  # [n_reqs, VOCAB (last token), VOCAB] float64

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        plan = self.plans.pop(batch.step)
        # Stands in for the runtime's staging: a copy of plan.words made on the stream.
        words = torch.from_numpy(plan.words.copy()).to(batch.input_ids.device)
        state = self.sampler.prepare(plan, words)
        self.sampler.observe(state, batch.input_ids)
        self.states[batch.step] = state
        last = batch.input_ids.index_select(0, batch.sample_rows)
        rid = batch.req_ids.index_select(0, batch.sample_reqs)
        return self.table[rid, last]

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        state: SamplerState = self.states.pop(batch.step)
        tokens = self.sampler.sample(state, logits)
        self.sampler.record(state, tokens)
        return tokens


class StepScheduler:
    """Replays structural steps; decode inputs are futures of the previous step's ``out``."""

    def __init__(self, steps: list[Step], sampler: Sampler, plans: dict[int, SamplerPlan]) -> None:
        self.steps, self.sampler, self.plans = steps, sampler, plans
        self.i = 0
        self.last: Batch | None = None  # launched, not processed yet
        self.last_sampling: list[int] = []
        self.outputs: dict[int, list[int]] = {}

    def schedule(self) -> Batch | None:
        if self.i == len(self.steps):
            return None
        step = self.steps[self.i]
        rids = np.array([r.rid for r in step.reqs], dtype=np.int64)
        decodes = [self.last_sampling.index(t[0]) for t in step.tokens if not isinstance(t, int)]
        consumes, futures = [], []
        if decodes and self.last is not None:
            assert self.last.out is not None
            kept = self.last.out.filter(np.array(decodes, dtype=np.int64))
            consumes, futures = [kept], kept.host_placeholders().tolist()
        else:
            futures = [self.outputs[t[0]][t[1]] for t in step.tokens if not isinstance(t, int)]
        tokens = [t if isinstance(t, int) else futures.pop(0) for t in step.tokens]
        sample_reqs = np.flatnonzero(step.sample).astype(np.int64)
        table = pack_params([r.params for r in step.reqs])
        self.plans[self.i] = self.sampler.plan(
            table, rids, step.seg_lens, step.prefix_lens, sample_reqs, step.ended, self.i
        )
        batch = Batch(np.array(tokens, dtype=np.int64), step.seg_lens, step.prefix_lens, rids, step.sample,
                      consumes=consumes, ended=step.ended, tag=rids[sample_reqs].tolist())  # fmt: skip
        self.i += 1
        self.last, self.last_sampling = batch, batch.tag
        return batch

    def process(self, result: StepResult) -> None:
        for rid, tok in zip(result.batch.tag, result.tokens.tolist(), strict=True):
            self.outputs.setdefault(rid, []).append(tok)
        if result.batch is self.last:
            self.last = None

    def build_mask(self, batch: Batch) -> None:
        return None


@pytest.mark.parametrize("overlap", [False, True])
def test_sync_and_overlap_match_the_host_loop(overlap: bool, device: str) -> None:
    reqs = requests()
    want = {r.rid: reference(r) for r in reqs}
    steps = schedule([Req(r.rid, r.prompt, r.params, r.max_new) for r in reqs], max_running=3)
    sampler, plans = Sampler(history_rows=3), {}
    sched = StepScheduler(steps, sampler, plans)
    fmap = FutureMap(64, device=device)
    # A delay on the stream keeps the host a step ahead in overlap mode.
    runtime = OverlapRuntime(
        SamplingModel(sampler, plans, len(reqs), device),
        fmap,
        overlap=overlap,
        stream="auto",
        delay=lambda op: 0.002 if op == "forward" else 0.0,
    )
    runtime.run(sched)
    sampler.reset()
    assert sched.outputs == want
    assert fmap.in_use == 0
