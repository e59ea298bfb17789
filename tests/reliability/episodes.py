"""Soak episodes: seeded workloads with aborts, and the comparison of their outputs.

An episode is one fresh workload for the soak (``soak.py``): arrivals, chunked prefill,
grammar requests, finishes and aborts (:class:`AbortingBatcher`), with its own fault settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tfuture.core.batch import Batch, ForwardBatch, StepResult
from tfuture.core.future_map import FutureMap
from tfuture.grammars import mask_requests
from tfuture.sampling import Sampler, SamplingParams
from tfuture.scheduler import ContinuousBatcher, RequestSpec
from tfuture.steps.token import Buckets
from tfuture.testing.faults import HOST_POINTS, SPEC_POINTS, TOKEN_POINTS
from tfuture.testing.toy import ToyGrammar, ToyModel
from tfuture.testing.workload import random_workload


@dataclass(frozen=True, slots=True)
class Abort:
    """When and how a request is aborted.

    ``soft``: the client stops the request once it has ``tokens`` tokens (committed or in
    flight); tokens already in flight are still delivered, so sync and overlap agree exactly.
    ``hard``: the request is dropped at once and its in-flight token is discarded; overlap then
    delivers a prefix of sync's tokens, at most one shorter. ``fed``: a hard abort once that
    many prompt tokens were sent (mid-prefill) instead of a token count.
    """

    kind: str
    tokens: int = 0
    fed: int | None = None


class AbortingBatcher(ContinuousBatcher):
    """A :class:`ContinuousBatcher` whose requests can be aborted (client disconnects).

    An aborted request is marked finished and dropped from the running set at the next
    ``schedule``. Its pending slots are not touched here: the runtime releases a step's
    ``out`` after processing it, as for any other request, and the aborted request's in-flight
    token is then delivered (soft) or discarded (hard).
    """

    def __init__(
        self, specs: list[RequestSpec], fmap: FutureMap, aborts: dict[int, Abort], **kw: Any
    ) -> None:
        super().__init__(specs, fmap, **kw)
        self.aborts = aborts
        self.aborted: dict[int, str] = {}
        self.batches = 0  # schedule() calls that returned a batch: launched steps

    def schedule(self) -> Batch | None:
        for r in self.running:
            plan = self.aborts.get(r.spec.rid)
            if r.finished or plan is None:
                continue
            if plan.fed is not None:
                hit = r.fed >= plan.fed
            else:
                hit = r.fed >= r.spec.prompt.size and len(r.out) + r.n_pending >= plan.tokens
            if hit:
                r.finished = True
                self.aborted[r.spec.rid] = plan.kind
                self.outputs[r.spec.rid] = r.out if plan.kind == "soft" else list(r.out)
        return super().schedule()

    def _build(self, rows: list[Any]) -> Batch:
        self.batches += 1
        return super()._build(rows)

    def _delivers(self, rid: int) -> bool:
        """True for a soft-aborted request: its in-flight tokens still count."""
        return self.aborted.get(rid) == "soft"

    def process(self, result: StepResult) -> None:
        for r, tok in zip(result.batch.tag, result.tokens.tolist(), strict=True):
            r.n_pending -= 1
            if r.pending is not None and r.pending[0] is result.batch:
                r.pending = None
            rid = r.spec.rid
            if r.finished and not self._delivers(rid):
                self.extra_tokens += 1
                continue
            if r.spec.grammar and self.grammar is not None:
                r.state = self.grammar.advance(r.state, tok)
            r.out.append(tok)
            if tok == self.eos or len(r.out) >= r.spec.max_new:
                r.finished = True
                self.outputs[rid] = r.out

    def build_mask(self, batch: Batch) -> np.ndarray:
        """Bool rows for the sampling requests the mask covers (every one, or with
        ``delay="rows"`` the grammar requests'), from the grammar's state."""
        assert self.grammar is not None
        rows = mask_requests(batch).tolist()
        mask = np.ones((len(rows), self.grammar.vocab), dtype=bool)
        for j, i in enumerate(rows):
            r = batch.tag[i]
            if r.spec.grammar and (not r.finished or self._delivers(r.spec.rid)):
                mask[j] = self.grammar.allowed[r.state]
        return mask


# The shapes of the graph episodes' steps (a chunk is at most 16 tokens, a batch at most 64).
GRAPH_BUCKETS = Buckets(rows=(4, 8, 16, 32, 64), reqs=(2, 4, 8, 16))


class SoftToy(ToyModel):
    """The toy model with logits in [0, 8), so temperature and penalties change tokens."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return super().forward(batch) / 2**21


def draw_params(rng: np.random.Generator) -> SamplingParams:
    """One request's sampling parameters: greedy, sampled, filtered, penalised or a mix."""
    t = float(rng.choice([0.0, 0.0, 0.7, 1.3]))
    pen = rng.random() < 0.3
    return SamplingParams(
        temperature=t,
        top_k=int(rng.choice([0, 0, 1, 5])),
        top_p=float(rng.choice([1.0, 0.9, 0.5])),
        min_p=float(rng.choice([0.0, 0.0, 0.1])),
        seed=int(rng.integers(2**63 - 1)),
        frequency_penalty=float(rng.uniform(0, 1)) if pen else 0.0,
        presence_penalty=float(rng.uniform(0, 1)) if pen else 0.0,
        repetition_penalty=float(rng.choice([1.0, 1.3])) if pen else 1.0,
    )


@dataclass(slots=True)
class Episode:
    """One seeded episode: the workload, the scheduler settings and the fault plan's settings."""

    index: int
    seed: int
    specs: list[RequestSpec]
    vocab: int
    grammar: ToyGrammar | None
    aborts: dict[int, Abort]
    batcher_kw: dict[str, Any]
    plan_kw: dict[str, Any]
    debug: bool
    spec: bool = False  # a speculative episode (SpecTokenStep, ToyDrafter): no grammar, no aborts
    sampled: bool = False  # per-request SamplingParams through tfuture's Sampler (SoftToy model)
    graphs: bool = False  # padded to GRAPH_BUCKETS, greedy steps as step graphs (tfuture.steps.graphs)

    def model(self) -> ToyModel:
        return SoftToy(vocab=self.vocab) if self.sampled else ToyModel(vocab=self.vocab)

    def runtime_kw(self) -> dict[str, Any]:
        """The runtime's options of the episode's overlapped run (its sync rerun takes none)."""
        return {"buckets": GRAPH_BUCKETS, "graphs": True} if self.graphs else {}

    def sampler(self) -> Sampler | None:
        """A fresh sampler for a sampled episode: a history row for every running request."""
        return Sampler(history_rows=2 * self.batcher_kw["max_running"]) if self.sampled else None


def make_episode(seed: int, index: int) -> Episode:
    """Draw episode ``index`` of soak ``seed``: the same arguments always give the same episode."""
    rng = np.random.default_rng([seed, index])
    vocab = int(rng.choice([16, 32, 64]))
    n = int(rng.integers(6, 33))
    grammar_share = float(rng.choice([0.0, 0.0, 0.3, 0.7, 1.0]))
    specs = random_workload(
        int(rng.integers(2**31)),
        n,
        vocab=vocab,
        max_prompt=int(rng.integers(2, 41)),
        max_new=int(rng.integers(2, 33)),
        arrival_span=int(n * rng.uniform(0.0, 4.0)),
        grammar_share=grammar_share,
    )
    grammar = ToyGrammar(vocab, seed=int(rng.integers(2**31))) if grammar_share else None
    aborts: dict[int, Abort] = {}
    abort_share = float(rng.choice([0.0, 0.1, 0.3]))
    for s in specs:
        if rng.random() >= abort_share:
            continue
        if s.prompt.size > 1 and rng.random() < 0.25:
            aborts[s.rid] = Abort("hard", fed=int(rng.integers(1, s.prompt.size)))
        elif s.max_new > 1:
            kind = "soft" if rng.random() < 0.5 else "hard"
            aborts[s.rid] = Abort(kind, tokens=int(rng.integers(1, s.max_new)))
    chunk = int(rng.integers(2, 17))
    batcher_kw = {
        "max_running": int(rng.integers(1, 13)),
        "chunk": chunk,
        "token_budget": int(rng.integers(chunk, 65)),
        "eos": 0,
    }
    plan_kw: dict[str, Any] = {"seed": int(rng.integers(2**31))}
    if rng.random() < 0.2:
        k = int(rng.integers(1, 3))
        plan_kw["max_delay_s"] = float(rng.uniform(5e-5, 3e-4))
        plan_kw["delay_ops"] = tuple(str(op) for op in rng.choice(TOKEN_POINTS, k, replace=False))
    if rng.random() < 0.15:
        plan_kw["host_delay_s"] = float(rng.uniform(5e-5, 3e-4))
    if rng.random() < 0.2:
        plan_kw["gc_every_step"] = True
    if rng.random() < 0.04:
        point = str(rng.choice(TOKEN_POINTS + HOST_POINTS))
        plan_kw["raise_at"] = {point: int(rng.integers(0, 40))}
    debug = bool(rng.random() < 0.03)
    # Drawn last, so the other draws (and every token episode) stay as they were.
    spec = grammar is None and bool(rng.random() < 0.2)
    if spec:
        aborts = {}
        if "delay_ops" in plan_kw:
            plan_kw["delay_ops"] = tuple(str(op) for op in rng.choice(SPEC_POINTS, k, replace=False))
        if "raise_at" in plan_kw:
            point = str(rng.choice([*SPEC_POINTS, "schedule", "process"]))
            plan_kw["raise_at"] = {point: int(rng.integers(0, 40))}
    # Drawn after everything above, so every earlier episode stays as it was.
    sampled = not spec and bool(rng.random() < 0.3)
    if sampled:
        specs = [dataclasses.replace(s, params=draw_params(rng)) for s in specs]
        if grammar is not None and rng.random() < 0.5:
            batcher_kw["delay"] = "rows"
    # Drawn after everything above, so every earlier episode stays as it was.
    graphs = not spec and not debug and bool(rng.random() < 0.25)
    return Episode(
        index, seed, specs, vocab, grammar, aborts, batcher_kw, plan_kw, debug, spec, sampled, graphs
    )


def compare(ep: Episode, sync: dict[int, list[int]], over: dict[int, list[int]]) -> str | None:
    """The first request whose overlap tokens break the rule for its kind, or None."""
    for s in ep.specs:
        a, b = sync.get(s.rid), over.get(s.rid)
        if a is None or b is None:
            return f"request {s.rid}: no output in the {'sync' if a is None else 'overlap'} run"
        abort = ep.aborts.get(s.rid)
        if abort is not None and abort.kind == "hard":
            # Overlap learns of a hard abort one step later than sync; it may be one token short.
            if b != a[: len(b)] or len(b) < len(a) - 1:
                return f"request {s.rid} (hard abort): overlap {b} is not sync {a} or one token short"
        elif a != b:
            return f"request {s.rid}: sync {a} != overlap {b}"
    return None
