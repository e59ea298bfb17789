"""A small soak of speculative decoding with the real drafters on a tiny Hugging Face Llama:
six seeded episodes of a few dozen steps each (about 300 in all), with random arrivals, chunked
prefill, penalties, stop tokens inside accepted runs, aborts (while waiting, in prefill, mid-decode) and
random stream and host delays, through :class:`tfuture.spec.SpecTokenStep` and a
:class:`tfuture.scheduler.ServingScheduler`. Every greedy request's output is checked against
plain greedy decoding, every seeded sampled request's against a sync speculative run without
stops, aborts or delays: equal, or for an aborted request a prefix; no slot or thread is left.

The main soak (``soak.py``) runs the same step over the toy target with a seeded fallible
drafter; the tiny Llama is too slow for its thousands of steps, hence this separate one.

The drafter has exactly ``max_running`` rows and the token budget is drawn small enough that
decodes wait for it: both failed before main's ab265e4 (a drafter row freed after the step that
admits the next request took its rows; a waiting decode's drafts' slots released under it).
The map is large: a map of one step's slots deadlocks (a strict xfail in
``tests/spec/test_spec_step_faults.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from support import worker_threads

from tfuture import FutureMap
from tfuture.core.params import SamplingParams
from tfuture.examples.hf import build_llama
from tfuture.models import HFCausalLM
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.scheduler import RequestSpec, ServingScheduler, TokenUpdate
from tfuture.spec import ModelDrafter, NGramDrafter, SpecTokenStep
from tfuture.testing.faults import SPEC_POINTS, FaultPlan

VOCAB, MAX_LEN, MAX_K = 96, 112, 4
EPISODES = 6


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    target = build_llama(vocab=VOCAB, hidden=48, layers=2, seed=0)
    return {
        "target": target,
        "twin": copy.deepcopy(target),
        "small": build_llama(vocab=VOCAB, hidden=32, layers=1, seed=3),
    }


@dataclass
class Episode:
    """One seeded episode: requests, when to abort which, the drafter and the run's settings."""

    seed: int
    specs: list[RequestSpec]
    # rid -> abort once this many tokens were delivered to it (0: as soon as any update of any
    # request arrives, so it may still wait or be in prefill)
    aborts: dict[int, int]
    drafter: str
    k: int
    max_running: int
    chunk: int
    token_budget: int
    overlap: bool
    plan_kw: dict[str, Any] = field(default_factory=dict)


def prompt(rng: np.random.Generator) -> np.ndarray:
    """A random prompt, half of the time quoting itself (prompt lookup then finds matches)."""
    base = rng.integers(3, VOCAB, size=int(rng.integers(2, 12)))
    if rng.random() < 0.5:
        return base
    return np.concatenate([base] * int(rng.integers(2, 4)) + [base[: int(rng.integers(1, base.size + 1))]])


def make_episode(seed: int) -> Episode:
    rng = np.random.default_rng([7, seed])
    n = int(rng.integers(4, 11))
    specs = []
    for rid in range(n):
        draw, params = rng.random(), None
        if draw < 0.15:  # greedy by another path (the rows' parameters): top_k=1
            params = SamplingParams(temperature=0.7, top_k=1, seed=rid)
        elif draw < 0.35:  # sampled, seeded: rejection sampling
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=1000 * seed + rid)
        elif draw < 0.5:  # greedy with penalties: each verification row sees its own history
            params = SamplingParams(temperature=0, presence_penalty=0.6, repetition_penalty=1.3)
        specs.append(
            RequestSpec(
                rid, int(rng.integers(0, 3 * n)), prompt(rng), int(rng.integers(1, 25)), params=params
            )
        )
    aborts = {s.rid: int(rng.integers(0, s.max_new)) for s in specs if rng.random() < 0.25 and s.max_new > 1}
    chunk = int(rng.integers(2, 17))
    k, max_running = int(rng.integers(1, MAX_K + 1)), int(rng.integers(1, 7))
    plan_kw: dict[str, Any] = {"seed": seed}
    if rng.random() < 0.5:
        plan_kw["max_delay_s"] = float(rng.uniform(2e-4, 2e-3))
        ops = rng.choice([*SPEC_POINTS, "release"], int(rng.integers(1, 4)), replace=False)
        plan_kw["delay_ops"] = tuple(str(op) for op in ops)
    if rng.random() < 0.3:
        plan_kw["host_delay_s"] = float(rng.uniform(2e-4, 2e-3))
    return Episode(
        seed,
        specs,
        aborts,
        drafter=("ngram", "twin", "ngram", "small")[seed % 4],
        k=k,
        max_running=max_running,
        chunk=chunk,
        # Often too small for every running request's chunk or decode: some wait a step.
        token_budget=int(rng.integers(max(chunk, k + 1), 49)),
        overlap=seed % 4 != 1,
        plan_kw=plan_kw,
    )


def plain_greedy(models: dict[str, Any], specs: list[RequestSpec]) -> dict[int, list[int]]:
    """Every greedy request's plain decoding to its length limit (its penalties, no stop): one
    sync run, all at once."""
    n = len(specs)
    fmap = FutureMap(8 * n + 8, device="cpu")
    free = [RequestSpec(s.rid, 0, s.prompt, s.max_new, params=s.params) for s in specs if not sampled(s)]
    sched = ServingScheduler(fmap, free, max_running=n, chunk=64, token_budget=1024)
    hf = HFCausalLM(models["target"], max_requests=n, max_len=MAX_LEN)
    OverlapRuntime(hf, fmap, overlap=False, trace=False, sampler=Sampler(history_rows=n)).run(sched)
    assert fmap.in_use == 0
    return {rid: c.token_ids for rid, c in sched.completions.items()}


def with_stops(ep: Episode, free: dict[int, list[int]]) -> tuple[list[RequestSpec], dict[int, list[int]]]:
    """Give about a third of the requests a stop token their plain output reaches (inside it,
    where an accepted run may carry past it); their expected output ends at its first use."""
    rng = np.random.default_rng([11, ep.seed])
    specs, want = [], {}
    for s in ep.specs:
        out = free[s.rid]
        stop: frozenset[int] = frozenset()
        if len(out) > 2 and rng.random() < 0.35:
            tok = out[int(rng.integers(1, len(out)))]
            stop = frozenset({tok})
            out = out[: out.index(tok) + 1]
        specs.append(RequestSpec(s.rid, s.arrival, s.prompt, s.max_new, params=s.params, stop=stop))
        want[s.rid] = out
    return specs, want


def make_drafter(ep: Episode, models: dict[str, Any]) -> Any:
    if ep.drafter == "ngram":
        return NGramDrafter(k=ep.k, max_ngram=min(3, ep.k + 1))
    return ModelDrafter(models[ep.drafter], k=ep.k)


def sampled(s: RequestSpec) -> bool:
    return s.params is not None and not s.params.greedy


def run_spec(
    ep: Episode,
    models: dict[str, Any],
    specs: list[RequestSpec],
    overlap: bool,
    plan: FaultPlan | None = None,
    on_update: Any = None,
) -> tuple[ServingScheduler, int]:
    """``specs`` through the speculative step with the episode's drafter and settings, with
    ``on_update(sched, update)`` hearing every update; checks that no slot or thread is left.
    Returns the scheduler and the run's steps."""
    fmap = FutureMap(256, device="cpu")
    hear = None if on_update is None else lambda u: on_update(sched, u)
    sched = ServingScheduler(
        fmap,
        specs,
        max_running=ep.max_running,
        chunk=ep.chunk,
        token_budget=ep.token_budget,
        on_update=hear,
        speculative=ep.k,
    )
    drafter = make_drafter(ep, models)
    drafter.bind(ep.max_running, MAX_LEN, torch.device("cpu"))
    hf = HFCausalLM(models["target"], max_requests=ep.max_running, max_len=MAX_LEN)
    runtime = OverlapRuntime(
        SpecTokenStep(hf, drafter, Sampler(history_rows=ep.max_running)),
        fmap,
        overlap=overlap,
        faults=plan,
        trace=False,
    )
    stats = runtime.run(sched)
    assert fmap.in_use == 0, f"episode {ep.seed}: {fmap.in_use} slot(s) left"
    assert not worker_threads(), f"episode {ep.seed}: a forward-stream thread outlived the run"
    return sched, stats.steps


def references(ep: Episode, models: dict[str, Any]) -> dict[int, list[int]]:
    """Every request's tokens to its length limit without stops or aborts: plain greedy decoding,
    and for a seeded sampled request a sync speculative run (its draws are keyed by seed and
    position: the same alone, batched, overlapped or with other requests aborted)."""
    free = plain_greedy(models, ep.specs)
    if any(sampled(s) for s in ep.specs):
        sched, _ = run_spec(ep, models, ep.specs, overlap=False)
        free.update({s.rid: sched.completions[s.rid].token_ids for s in ep.specs if sampled(s)})
    return free


def run_episode(ep: Episode, models: dict[str, Any]) -> int:
    specs, want = with_stops(ep, references(ep, models))
    updates: dict[int, list[int]] = {s.rid: [] for s in specs}
    finals: dict[int, TokenUpdate] = {}

    def on_update(sched: ServingScheduler, u: TokenUpdate) -> None:
        assert u.rid not in finals, f"request {u.rid}: an update after its last one"
        updates[u.rid] += u.tokens
        if u.finished:
            finals[u.rid] = u
        for rid, at in ep.aborts.items():
            if rid not in finals and len(updates[rid]) >= at:
                sched.abort(rid)

    plan = FaultPlan(**ep.plan_kw)
    _, steps = run_spec(ep, models, specs, ep.overlap, plan, on_update)
    where = f"episode {ep.seed} ({ep.drafter}, k={ep.k}, max_running={ep.max_running}, overlap={ep.overlap})"
    assert set(finals) == {s.rid for s in specs}, f"{where}: requests without a last update"
    for s in specs:
        done = finals[s.rid].completion
        assert done is not None
        got, w = done.token_ids, want[s.rid]
        assert got == updates[s.rid], f"{where}: request {s.rid}'s updates do not add up"
        if done.finish_reason == "abort":
            assert s.rid in ep.aborts and got == w[: len(got)], f"{where}: request {s.rid} {got} vs {w}"
        else:
            reason = "stop" if s.stop and w[-1] in s.stop else "length"
            assert (got, done.finish_reason) == (w, reason), f"{where}: request {s.rid}"
    return steps


@pytest.mark.parametrize("seed", range(EPISODES))
def test_speculative_soak_episode(models: dict[str, Any], seed: int) -> None:
    assert run_episode(make_episode(seed), models) > 0


def test_the_episodes_cover_every_drafter_mode_and_request_kind() -> None:
    eps = [make_episode(seed) for seed in range(EPISODES)]
    assert {ep.drafter for ep in eps} == {"ngram", "twin", "small"}
    assert {ep.overlap for ep in eps} == {True, False}
    assert any(ep.aborts for ep in eps) and any("max_delay_s" in ep.plan_kw for ep in eps)
    specs = [s for ep in eps for s in ep.specs]
    assert any(sampled(s) for s in specs) and any(s.params is None for s in specs)
    assert any(s.params is not None and s.params.has_penalties for s in specs)
    assert any(ep.token_budget < ep.max_running * (ep.k + 1) for ep in eps), "no decode waits for budget"
    assert len({s.arrival for s in specs}) > 1 and max(s.prompt.size for s in specs) > 16
