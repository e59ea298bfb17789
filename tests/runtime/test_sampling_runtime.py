"""The runtime with tfuture's sampler: per-request parameters through the step's one H2D copy,
sync == overlap for sampled requests, penalties exact under overlap (against a plain host loop),
packed bitmasks, only grammar rows wait, and the errors (nothing left allocated)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from support import worker_threads

from tfuture import FutureMap
from tfuture.core.batch import Batch, ForwardBatch
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplingParams, pack_params
from tfuture.testing import (
    ContinuousBatcher,
    RequestSpec,
    ToyGrammar,
    ToyModel,
    random_workload,
    run_workload,
)

VOCAB = 64
SAMPLED = (
    SamplingParams(temperature=0.8, top_p=0.9, seed=11),
    SamplingParams(temperature=1.3, top_k=8, seed=12),
    SamplingParams(temperature=1.0, min_p=0.05, seed=2**62),
    SamplingParams(),  # greedy
)
PENALISED = SamplingParams(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.5)


class SoftToy(ToyModel):
    """The toy model with logits in [0, 8): temperature and penalties change tokens."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return super().forward(batch) / 2**21


def stream_jitter(op: str) -> float:
    """Stream delays that reorder the host against the device."""
    return {"prepare": 0.0004, "forward": 0.001, "sample_now": 0.0007, "sample": 0.0003}.get(op, 0.0)


def with_params(specs: list[RequestSpec], params: tuple[SamplingParams, ...]) -> list[RequestSpec]:
    return [dataclasses.replace(s, params=params[s.rid % len(params)]) for s in specs]


def run(specs, *, overlap, sampler, jitter=None, **batcher_kw):
    """``jitter``: stream delays; ``batcher_kw`` to the ContinuousBatcher."""
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(specs, fmap, eos=-1, **batcher_kw)
    stats = OverlapRuntime(
        SoftToy(vocab=VOCAB), fmap, overlap=overlap, delay=jitter, sampler=sampler, trace=True
    ).run(sched)
    assert fmap.in_use == 0
    return sched.outputs, stats


def test_sampled_requests_agree_in_sync_and_overlap_under_delays() -> None:
    specs = with_params(random_workload(3, 10, vocab=VOCAB, max_new=12), SAMPLED)
    sampler = Sampler()
    sync, _ = run(specs, overlap=False, sampler=sampler)
    over, _ = run(specs, overlap=True, sampler=sampler, jitter=stream_jitter)
    assert sync == over
    greedy, _ = run([dataclasses.replace(s, params=None) for s in specs], overlap=True, sampler=Sampler())
    sampled = [s.rid for s in specs if not s.params.greedy]
    assert any(over[r] != greedy[r] for r in sampled), "temperature > 0 never changed a token"
    assert all(over[s.rid] == greedy[s.rid] for s in specs if s.params.greedy)


def test_a_sampled_request_draws_the_same_tokens_alone_and_in_a_batch() -> None:
    """Draws depend on (seed, position) only, never on the batch the request ran in."""
    specs = with_params(random_workload(5, 8, vocab=VOCAB, max_new=10), SAMPLED)
    together, _ = run(specs, overlap=True, sampler=Sampler(), jitter=stream_jitter)
    for spec in specs[:4]:
        alone, _ = run([spec], overlap=True, sampler=Sampler())
        assert alone[spec.rid] == together[spec.rid]


def host_loop_with_penalties(model: ToyModel, spec: RequestSpec, p: SamplingParams) -> list[int]:
    """One request, one token at a time on the host: penalties from the plain token lists."""
    seq, out = [int(t) for t in spec.prompt], []
    for _ in range(spec.max_new):
        n = len(seq)
        fb = ForwardBatch(
            0,
            torch.tensor(seq[-1:]),
            torch.tensor([n - 1]),
            torch.tensor([0]),
            torch.tensor([spec.rid]),
            torch.tensor([n]),
            torch.tensor([0]),
            torch.tensor([0]),
        )
        x = model.forward(fb)[0]
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[torch.tensor(seq)] = True
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=VOCAB).to(x.dtype)
        r = torch.tensor(p.repetition_penalty, dtype=x.dtype)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - torch.tensor(p.frequency_penalty, dtype=x.dtype) * counts
        x = x - torch.tensor(p.presence_penalty, dtype=x.dtype) * (counts > 0)
        tok = int(x.argmax())
        out.append(tok)
        seq.append(tok)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_are_exact_under_overlap_against_a_host_loop(overlap: bool) -> None:
    """Step N+1 is scheduled before step N's token is known; its penalties must still count it."""
    specs = with_params(random_workload(7, 6, vocab=VOCAB, max_new=14, max_prompt=6), (PENALISED,))
    outputs, _ = run(specs, overlap=overlap, sampler=Sampler(history_rows=6), jitter=stream_jitter)
    plain, _ = run([dataclasses.replace(s, params=None) for s in specs], overlap=overlap, sampler=Sampler())
    assert any(outputs[s.rid] != plain[s.rid] for s in specs), "the penalties changed nothing"
    for spec in specs:
        assert outputs[spec.rid] == host_loop_with_penalties(SoftToy(vocab=VOCAB), spec, PENALISED)


def grammar_specs(share: float, seed: int = 9) -> list[RequestSpec]:
    specs = random_workload(seed, 10, vocab=VOCAB, max_new=10, grammar_share=share)
    return with_params(specs, SAMPLED)


@pytest.mark.parametrize("mask", ["bitmask", "bool"])
def test_only_grammar_rows_wait_and_agree_with_sync_and_with_the_whole_step_waiting(mask: str) -> None:
    grammar = ToyGrammar(VOCAB, seed=4)
    specs = grammar_specs(0.5)
    kw = {"grammar": grammar, "mask": mask}
    sync, _ = run(specs, overlap=False, sampler=Sampler(), **kw)
    rows, stats = run(specs, overlap=True, sampler=Sampler(), jitter=stream_jitter, delay="rows", **kw)
    whole, _ = run(specs, overlap=True, sampler=Sampler(), jitter=stream_jitter, delay="batch", **kw)
    assert sync == rows == whole
    for s in specs:
        if s.grammar:
            assert grammar.accepts(rows[s.rid])
    # Non-grammar rows of a mixed step sampled right after the forward, before the mask came.
    assert any(span.name == "sample_now" for span in stats.device_spans)


def test_the_models_own_sample_takes_a_packed_bitmask_as_a_bool_mask() -> None:
    """Without tfuture's sampler a mixed step waits whole; the bitmask reaches sample unpacked."""
    grammar = ToyGrammar(VOCAB, seed=5)
    specs = random_workload(2, 8, vocab=VOCAB, max_new=8, grammar_share=0.5)
    outs = []
    for mask in ("bitmask", "bool"):
        outputs, _, _, fmap = run_workload(
            ToyModel(vocab=VOCAB),
            specs,
            overlap=True,
            grammar=grammar,
            mask=mask,
            eos=-1,
            delay=stream_jitter,
        )
        assert fmap.in_use == 0
        outs.append(outputs)
    assert outs[0] == outs[1]
    assert all(grammar.accepts(outs[0][s.rid]) for s in specs if s.grammar)


# ----------------------------------------------------------------------------------- errors


class OneStep:
    """A scheduler of one batch, with a chosen mask."""

    def __init__(self, batch: Batch, mask: object = None) -> None:
        self.batch, self.mask, self.done = batch, mask, False

    def schedule(self) -> Batch | None:
        if self.done:
            return None
        self.done = True
        return self.batch

    def process(self, result) -> None:
        pass

    def build_mask(self, batch: Batch) -> object:
        return self.mask


def two_requests(**kw) -> Batch:
    return Batch(
        np.array([3, 4], dtype=np.int64),
        np.array([1, 1]),
        np.array([0, 0]),
        np.array([7, 8]),
        np.array([True, True]),
        **kw,
    )


def assert_refused(batch: Batch, mask: object, match: str, sampler: Sampler | None = None, err=ValueError):
    fmap = FutureMap(8, device="cpu")
    rt = OverlapRuntime(ToyModel(vocab=VOCAB), fmap, sampler=sampler)
    with pytest.raises(err, match=match):
        rt.run(OneStep(batch, mask))
    assert fmap.in_use == 0
    assert not worker_threads()


def test_batch_params_with_the_models_own_sample_is_refused() -> None:
    batch = two_requests(params={7: SamplingParams(temperature=1.0)})
    assert_refused(batch, None, "Batch.params needs tfuture's sampler")


def test_a_bitmask_row_that_allows_nothing_names_the_request_and_step() -> None:
    bitmask = np.full((1, 2), -1, dtype=np.int32)
    bitmask[0] = 0
    batch = two_requests(delayed=np.array([False, True]))
    assert_refused(batch, bitmask, r"step 0: the mask row of request id 8 .*allows no token", Sampler())


@pytest.mark.parametrize(
    "mask, match",
    [
        (np.ones((1, 2), dtype=np.int64), "bool .* mask or a packed int32"),
        (np.ones((2, 2), dtype=np.int32), r"rows=1"),
        (np.ones((1, 3), dtype=np.int32), r"ceil\(vocab / 32\) = 2 columns"),
        (np.ones((1, 65), dtype=bool), "vocab = 64 columns"),
    ],
)
def test_a_mask_of_the_wrong_shape_or_dtype_is_refused(mask, match) -> None:
    batch = two_requests(delayed=np.array([False, True]))
    assert_refused(batch, mask, match, Sampler())


def test_penalties_without_history_rows_are_refused() -> None:
    batch = two_requests(params={8: PENALISED})
    assert_refused(batch, None, "request 8 asks for penalties", Sampler())


def test_batch_checks_delayed_and_params() -> None:
    with pytest.raises(TypeError, match=r"Batch\.delayed must be a bool"):
        two_requests(delayed=np.array([1, 0]))
    with pytest.raises(TypeError, match=r"Batch\.params must be a dict"):
        two_requests(params=pack_params([SamplingParams()]))
    with pytest.raises(TypeError, match=r"Batch\.params\[7\] must be a SamplingParams"):
        two_requests(params={7: {"temperature": 1.0}})
    with pytest.raises(ValueError, match="names request 9, which is not in this batch"):
        two_requests(params={9: SamplingParams()})


def test_a_live_request_id_admitted_again_is_refused() -> None:
    """Parameters belong to a request from its first step until it ends: a second admission of
    a live id (two requests sharing an id) is refused, naming it."""

    class Twice:
        def __init__(self) -> None:
            self.n = 0

        def schedule(self) -> Batch | None:
            self.n += 1
            return two_requests(params={7: SamplingParams(temperature=1.0)}) if self.n <= 2 else None

        def process(self, result) -> None:
            pass

        def build_mask(self, batch: Batch) -> None:
            return None

    fmap = FutureMap(8, device="cpu")
    with pytest.raises(ValueError, match="request id 7 already holds row"):
        OverlapRuntime(ToyModel(vocab=VOCAB), fmap, sampler=Sampler()).run(Twice())
    assert fmap.in_use == 0


def test_a_sampler_must_be_a_sampler() -> None:
    # A step kind (the speculative one) takes no runtime sampler: tests/runtime/test_speculative.py.
    with pytest.raises(TypeError, match=r"sampler must be a tfuture\.sampling\.Sampler"):
        OverlapRuntime(ToyModel(), FutureMap(8, device="cpu"), sampler="greedy")  # type: ignore[arg-type]


def test_a_model_without_sample_gets_the_default_sampler() -> None:
    class NoSample:
        def __init__(self) -> None:
            self.toy = ToyModel(vocab=VOCAB)

        def forward(self, batch: ForwardBatch) -> torch.Tensor:
            return self.toy.forward(batch)

    specs = random_workload(1, 6, vocab=VOCAB, max_new=6)
    fmap = FutureMap(64, device="cpu")
    sched = ContinuousBatcher(specs, fmap, eos=-1)
    OverlapRuntime(NoSample(), fmap).run(sched)
    expected, _ = run(specs, overlap=True, sampler=None)
    assert sched.outputs == expected


# ------------------------------------------------------------------ found in review


class FlipsDelayed:
    """Sets the next batch's ``delayed`` while processing a step (after that batch launched)."""

    def __init__(self, batches: list[Batch], flip_to: object) -> None:
        self.batches, self.flip_to, self.i, self.tokens = batches, flip_to, 0, []

    def schedule(self) -> Batch | None:
        if self.i == len(self.batches):
            return None
        self.i += 1
        return self.batches[self.i - 1]

    def process(self, result) -> None:
        self.tokens.append(result.tokens.tolist())
        if result.step + 1 < len(self.batches):
            self.batches[result.step + 1].delayed = self.flip_to

    def build_mask(self, batch: Batch) -> object:
        return None


@pytest.mark.parametrize("flip_to", [True, False])
def test_a_batch_edited_after_its_launch_samples_once(flip_to: bool) -> None:
    """The runtime decides at launch whether a step waits; a later edit changes nothing."""
    batches = [two_requests(delayed=not flip_to), two_requests(delayed=not flip_to)]
    fmap = FutureMap(8, device="cpu", debug=True)  # a second store into a slot would raise
    sched = FlipsDelayed(batches, flip_to)
    OverlapRuntime(SoftToy(vocab=VOCAB), fmap, sampler=Sampler(), delay=stream_jitter).run(sched)
    assert len(sched.tokens) == 2 and fmap.in_use == 0


def test_one_sampler_serves_one_run_at_a_time() -> None:
    sampler = Sampler()
    other = object()
    sampler.claim(other)  # as a runtime running elsewhere would
    assert_refused(two_requests(), None, "in use by another running runtime", sampler, RuntimeError)
    assert sampler.unclaim(other)
    fmap = FutureMap(8, device="cpu")
    OverlapRuntime(SoftToy(vocab=VOCAB), fmap, sampler=sampler).run(OneStep(two_requests()))
    assert fmap.in_use == 0 and sampler.unclaim(other) is False  # the run gave it back


def test_a_row_that_allows_only_padding_bits_is_refused_before_any_sample() -> None:
    """Vocab 40: the bitmask's second word has padding bits 40..63. Allowing only token 42 is
    allowing nothing, found on the first (delayed) step, before the host knows the vocab."""

    bitmask = np.full((1, 2), -1, dtype=np.int32)
    bitmask[0] = [0, 1 << 10]  # token 32 + 10 = 42 only
    batch = two_requests(delayed=np.array([False, True]))
    fmap = FutureMap(8, device="cpu")
    rt = OverlapRuntime(SoftToy(vocab=40), fmap, sampler=Sampler())
    with pytest.raises(ValueError, match=r"step 0: the mask row of request id 8 .*allows no token"):
        rt.run(OneStep(batch, bitmask))
    assert fmap.in_use == 0 and not worker_threads()


def test_an_ended_request_in_the_same_batch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Batch\.ended names request 8"):
        two_requests(ended=np.array([8]))


def test_the_batcher_holds_penalised_requests_back_while_history_rows_are_taken() -> None:
    specs = with_params(random_workload(4, 6, vocab=VOCAB, max_new=6, arrival_span=0), (PENALISED,))
    wide, _ = run(specs, overlap=True, sampler=Sampler(history_rows=6), max_running=6)
    narrow, _ = run(specs, overlap=True, sampler=Sampler(history_rows=2), max_running=6, history_rows=2)
    assert narrow == wide  # a penalised request's tokens depend on its own history only
    with pytest.raises(ValueError, match="all history_rows=2 device history rows are held"):
        run(specs, overlap=True, sampler=Sampler(history_rows=2), max_running=6)
