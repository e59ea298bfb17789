"""What a real model needs from the runtime: grad modes, request lifecycle, host mirrors,
logits for sampling rows only, padded (bucketed) step shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfuture import FutureMap
from tfuture.core.batch import ForwardBatch
from tfuture.runtime import OverlapRuntime
from tfuture.steps.token import Buckets
from tfuture.testing import ContinuousBatcher, ToyModel, random_workload


class Recorder(ToyModel):
    """ToyModel that records what each forward saw, and its release/close calls."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.seen: list[dict[str, object]] = []
        self.events: list[tuple[str, object]] = []
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        host = batch.host
        assert host is not None and batch.seg_starts is not None
        self.seen.append(
            {
                "grad": torch.is_grad_enabled(),
                "inference": torch.is_inference_mode_enabled(),
                "param_out_requires_grad": self.lin(torch.ones(1, 2)).requires_grad,
                "rows": batch.input_ids.numel(),
                "reqs": batch.last_rows.numel(),
                "n_tokens": host.n_tokens,
                "host_seg_lens": host.seg_lens.copy(),
                "seg_starts": batch.seg_starts.tolist(),
                "n_sample": batch.sample_rows.numel(),
            }
        )
        self.events.append(("forward", set(host.req_ids.tolist())))
        return super().forward(batch)

    def release(self, req_ids: np.ndarray) -> None:
        self.events.append(("release", set(req_ids.tolist())))

    def close(self) -> None:
        self.events.append(("close", None))


def run(model: Recorder, overlap: bool = True, **kw: object) -> tuple[ContinuousBatcher, FutureMap]:
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(random_workload(2, 10, max_new=8), fmap, max_running=4)
    OverlapRuntime(model, fmap, overlap=overlap, **kw).run(sched)  # type: ignore[arg-type]
    return sched, fmap


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("stream", ["worker", "inline"])
def test_worker_runs_with_the_callers_grad_and_inference_mode(mode, stream):
    model = Recorder()
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        sched, fmap = run(model, stream=stream)
    assert len(sched.outputs) == 10 and fmap.in_use == 0
    assert all(not s["grad"] and not s["param_out_requires_grad"] for s in model.seen)
    assert all(s["inference"] == (mode == "inference_mode") for s in model.seen)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_model_hears_ended_requests_after_their_last_forward_then_close(overlap):
    model = Recorder()
    run(model, overlap=overlap)
    assert model.events[-1] == ("close", None)
    released: set[int] = set()
    for i, (kind, ids) in enumerate(model.events[:-1]):
        if kind == "release":
            assert isinstance(ids, set) and not ids & released
            released |= ids
            # No later forward names a released request.
            assert not any(k == "forward" and ids & s for k, s in model.events[i + 1 :] if isinstance(s, set))
    assert released, "no request was released before the end of the run"


def test_forward_gets_host_mirrors_and_logits_rows_for_samplers_only():
    model = Recorder()
    run(model)
    for s in model.seen:
        seg = np.asarray(s["seg_starts"])
        assert s["n_tokens"] == int(np.sum(s["host_seg_lens"])) == seg[-1] == s["rows"]
        assert np.array_equal(np.diff(seg), s["host_seg_lens"])
        assert s["n_sample"] <= s["reqs"]
    assert any(s["n_sample"] < s["reqs"] for s in model.seen), "no step had a non-sampling prefill chunk"


def test_bucketed_steps_keep_shapes_in_buckets_and_results_unchanged():
    buckets = Buckets(rows=(8, 32, 64), reqs=(2, 4))
    plain, padded = Recorder(), Recorder()
    ref, _ = run(plain)
    got, fmap = run(padded, buckets=buckets)
    assert got.outputs == ref.outputs and fmap.in_use == 0
    for s in padded.seen:
        assert s["rows"] in buckets.rows or s["rows"] > buckets.rows[-1]
        assert s["reqs"] in buckets.reqs
        assert s["rows"] >= s["n_tokens"]
    assert {s["rows"] for s in padded.seen} <= {8, 32, 64}


def test_buckets_are_checked():
    with pytest.raises(ValueError, match="ascending"):
        Buckets(rows=(32, 8), reqs=(4,))
    # A step kind (the speculative one) takes no runtime buckets: tests/runtime/test_speculative.py.


def test_summary_reports_wall_time_and_tokens_per_second():
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(random_workload(0, 6), fmap)
    stats = OverlapRuntime(ToyModel(), fmap).run(sched)
    text = stats.summary()
    assert stats.tokens >= sum(len(v) for v in sched.outputs.values()) and stats.tokens_per_s > 0
    assert "tokens/s" in text and f"{stats.steps} steps" in text
