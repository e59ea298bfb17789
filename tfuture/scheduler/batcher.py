"""A small continuous-batching scheduler: arrivals, chunked prefill, decode, grammar, finish.

It is the host side the runtime drives. Under overlap it schedules step N+1 before it has
seen step N's tokens: a decode's input is then a placeholder from step N's ``out`` handle,
and a request that finished at step N (end token) still runs in step N+1, whose token is
discarded (the extra step). Requests that reach their length limit are known finished
without seeing the token, so they get no extra step. A speculative request's step commits an
unknown number of tokens: when every request of the next step may reach its limit in the step
in flight, ``schedule`` returns None and the runtime processes that step first (one host
round trip, against a whole step spent on finished requests at the end of a run).

Structured output: a grammar request keeps one matcher (:class:`tfuture.grammars.Matcher`)
from its grammar; :meth:`ContinuousBatcher.build_mask` fills a packed int32 bitmask row per
delayed request, :meth:`ContinuousBatcher.process` feeds the matcher each sampled token, and
the request finishes when its matcher terminates. Per-request sampling parameters
(:class:`tfuture.sampling.SamplingParams`) go to the runtime once, in ``Batch.params`` of the
request's first step; its end is reported in ``Batch.ended``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from tfuture.core.batch import Batch
from tfuture.core.future_map import FutureIndices, FutureMap
from tfuture.core.params import SamplingParams
from tfuture.grammars.base import (
    MASK_KINDS,
    Grammar,
)
from tfuture.scheduler.drafting import DraftScheduling
from tfuture.scheduler.request import RequestSpec, check_params, grammar_vocab
from tfuture.scheduler.request_state import _Req, spin
from tfuture.scheduler.results import TokenResults
from tfuture.spec.batch import DraftBatch

__all__ = ["DELAYS", "FINISH_REASONS", "ContinuousBatcher", "RequestSpec", "spin"]

_NO_TOKENS = np.empty(0, dtype=np.int64)  # a row's tokens until its slots' placeholders are read

DELAYS = ("rows", "batch")
# Why a request finished: a stop token, its length limit, an abort, its grammar terminated (on a
# token that is not one of its stop tokens), the run failed (ServingScheduler), or its grammar
# accepted an output its matcher then found invalid (xgrammar #800: JSON that does not parse).
FINISH_REASONS = ("stop", "length", "abort", "grammar", "error", "invalid")


class ContinuousBatcher(DraftScheduling, TokenResults):
    """Schedules ``specs`` onto a runtime: at most ``max_running`` requests, ``token_budget``
    tokens per step, prompts in chunks of at most ``chunk`` tokens.

    ``outputs[rid]`` holds each request's generated tokens (the stop token included) and
    ``finish_reasons[rid]`` why it finished (``"stop"``: a stop token, ``"grammar"``: its
    matcher terminated on another token, ``"length"``: ``max_new`` tokens, ``"invalid"``: its
    matcher found the output it accepted invalid, e.g. JSON that does not parse because of
    xgrammar #800, with a ``RuntimeWarning``). ``eos`` is one stop
    token or a collection of them, for every request whose ``RequestSpec.stop`` is None. Each
    batch reports in ``Batch.ended`` the requests that finished since the last batch (they
    appear in no later step), so a model can free their KV cache; requests that finish after the
    last batch are left to the model's ``close()``.
    If the map cannot hold another step's slots, new prefills are held back (back-pressure).
    ``host_work_s`` seconds of host work per processed step stand in for T_cpu: a sleep (like
    work in C extensions that release the GIL), or with ``host_work_holds_gil`` a Python spin.

    Structured output: ``grammar`` (a :class:`tfuture.grammars.Grammar`, e.g. a
    :class:`tfuture.testing.ToyGrammar` or a compiled JSON schema) serves the requests whose
    ``RequestSpec.grammar`` is True; a request may also bring its own grammar (every grammar
    must have the same ``vocab``). A grammar request finishes on a stop token, at its length
    limit, or when its matcher terminates. ``mask``: ``"bitmask"`` (packed int32 rows) or
    ``"bool"`` from :meth:`build_mask`. ``delay``: ``"batch"`` (the default: the whole
    step's sample waits when any grammar request samples) or ``"rows"`` (only the grammar
    requests' samples wait for their masks: ``Batch.delayed`` is a bool array). ``"batch"`` is
    the default because on an H200 splitting a step's sample in two cost about 10% more than it
    saved at 50% grammar requests (``perf/results/h200/``, ``bench_grammar_overlap``), while on
    the CPU worker "rows" gained about 10% (``perf/results/cpu/``). A request's ``params``
    go out once, in ``Batch.params`` of its first step.
    ``history_rows``: the runtime Sampler's ``history_rows``; requests with penalties wait for
    admission while that many run (back-pressure), instead of failing the run for want of a row.
    """

    def __init__(
        self,
        specs: list[RequestSpec],
        fmap: FutureMap,
        *,
        eos: int | Iterable[int] = 0,
        max_running: int = 8,
        chunk: int = 8,
        token_budget: int = 32,
        grammar: Grammar | None = None,
        host_work_s: float = 0.0,
        host_work_holds_gil: bool = False,
        mask: str = "bitmask",
        delay: str = "batch",
        history_rows: int | None = None,
        speculative: int = 0,
        multi_step: int = 1,
    ) -> None:
        if mask not in MASK_KINDS:
            raise ValueError(f"mask must be one of {MASK_KINDS}, got {mask!r}")
        if delay not in DELAYS:
            raise ValueError(f"delay must be one of {DELAYS}, got {delay!r}")
        self.fmap, self.grammar, self.mask, self.delay = fmap, grammar, mask, delay
        for name, v in (("max_running", max_running), ("chunk", chunk), ("token_budget", token_budget)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.vocab = grammar_vocab(specs, grammar)
        check_params(specs)
        seen: set[int] = set()
        for s in specs:
            if not isinstance(s, RequestSpec):
                raise TypeError(f"specs must hold RequestSpec objects, got {type(s).__name__}")
            if s.rid in seen:
                raise ValueError(f"request id {s.rid} appears twice: request ids must be unique")
            seen.add(s.rid)
        if history_rows is not None and history_rows < 1:
            raise ValueError(f"history_rows must be None or >= 1, got {history_rows}")
        self.history_rows = history_rows
        if isinstance(speculative, bool) or not isinstance(speculative, int) or speculative < 0:
            raise ValueError(f"speculative must be an int >= 0 (drafts per step), got {speculative!r}")
        if speculative and fmap.capacity < 2 * (1 + speculative):
            raise ValueError(
                f"a FutureMap of {fmap.capacity} slots cannot run speculative decoding with {speculative} "
                f"drafts: a request holds 1 + k slots between steps and its next step needs as many again "
                f"(give the map at least {2 * (1 + speculative)}; the Engine sizes it "
                "(4 * max_running + 8) * (1 + k))"
            )
        if speculative and token_budget < 1 + speculative:
            raise ValueError(
                f"token_budget={token_budget} cannot hold a speculative decode of 1 + {speculative} tokens "
                f"(the last committed token and its drafts): give token_budget >= {1 + speculative}"
            )
        if isinstance(multi_step, bool) or not isinstance(multi_step, int) or multi_step < 1:
            raise ValueError(f"multi_step must be an int >= 1 (decode steps per window), got {multi_step!r}")
        #: Decode steps per window (:class:`tfuture.spec.MultiStepTokenStep`; 1: one per step).
        #: With ``speculative`` too (:class:`tfuture.spec.SpecWindowStep`), a step runs as a
        #: window only when none of its requests drafts or verifies drafts.
        self.multi_step = multi_step
        #: Drafts each request makes per step (0: plain decoding, plain Batches). A grammar
        #: request's drafts are checked by masks the host builds from its matcher, walked through
        #: them and rolled back (one whose matcher cannot roll back makes none).
        self.speculative = speculative
        self.stop = frozenset((eos,) if isinstance(eos, int | np.integer) else (int(t) for t in eos))
        self.eos = min(self.stop) if self.stop else -1  # one of them, for callers that read eos
        self.max_running, self.chunk, self.token_budget = max_running, chunk, token_budget
        self.host_work_s = host_work_s
        self._host_work = spin if host_work_holds_gil else time.sleep
        self.waiting = sorted(specs, key=lambda s: (s.arrival, s.rid))
        self.n_requests = len(specs)
        self.running: list[_Req] = []
        self.outputs: dict[int, list[int]] = {}
        self.finish_reasons: dict[int, str] = {}
        self.tick = 0
        self.extra_tokens = 0  # tokens sampled for already-finished requests, then discarded
        self.drafted_tokens = 0  # drafts verified, over every request (speculative)
        self.accepted_tokens = 0  # of those, accepted (before a finish cut an accepted run)
        self._ended: list[int] = []  # finished requests not reported in a Batch yet

    def _admit(self, spec: RequestSpec) -> _Req:
        """A running request: its grammar's fresh matcher, its packed sampling row (once)."""
        req = _Req(spec)
        if spec.grammar is not False:
            grammar = self.grammar if spec.grammar is True else spec.grammar
            assert grammar is not None  # checked in __init__
            req.matcher = grammar.matcher()
        return req

    def schedule(self) -> Batch | None:
        self.tick += 1
        # Finished requests leave the batch for good: report them in the next batch built.
        self._ended.extend(r.spec.rid for r in self.running if r.finished)
        self.running = [r for r in self.running if not r.finished]
        while (
            self.waiting
            and len(self.running) < self.max_running
            and self.waiting[0].arrival <= self.tick
            and self._history_row_free(self.waiting[0])
        ):
            self.running.append(self._admit(self.waiting.pop(0)))
        if not self.running and self.waiting:
            # Idle until the next arrival: jump the clock instead of spinning.
            self.tick = self.waiting[0].arrival - 1
            return self.schedule()
        rows: list[tuple[_Req, int, bool]] = []
        budget, slots_left = self.token_budget, self.fmap.free
        # Speculative: requests that hold slots between steps (their drafts); each step needs as
        # many fresh ones. A request starts holding only while one more could still step.
        holders = sum(r.pending is not None for r in self.running) if self.speculative else 0
        for r in self.running:
            need = 1 + self._drafts(r)  # slots of a sampling request: its token, then its drafts
            if r.fed < r.spec.prompt.size:
                n = min(self.chunk, r.spec.prompt.size - r.fed, budget)
                samples = r.fed + n == r.spec.prompt.size
                if n <= 0 or (samples and slots_left < need):
                    continue
                if samples and self.speculative:
                    if (holders + 2) * (1 + self.speculative) > self.fmap.capacity:
                        continue  # back-pressure: it waits until a holder finishes
                    holders += 1
            elif r.done_by_length:
                continue
            else:
                # A speculative decode verifies the drafts its last step made.
                n = r.pending[2] if self.speculative and r.pending is not None else 1
                if budget < n or slots_left < need:
                    self._keep(r)  # waits a step: its drafts' slots must outlive their step
                    continue
                samples = True
            budget -= n
            slots_left -= need if samples else 0
            rows.append((r, n, samples))
        if not rows:
            self._check_not_stuck()
            return None
        if self.speculative and self._wait_for_flight(rows):
            self.tick -= 1  # a wait, not a step: arrivals keep their ticks
            return None
        return self._build(rows)

    def _history_row_free(self, spec: RequestSpec) -> bool:
        """With ``history_rows``: a request with penalties waits until a running one ends."""
        if self.history_rows is None or spec.params is None or not spec.params.has_penalties:
            return True
        held = sum(r.spec.params is not None and r.spec.params.has_penalties for r in self.running)
        return held < self.history_rows

    def _check_not_stuck(self) -> None:
        """Called when nothing can be scheduled: raise if nothing ever will be.

        With a sampled token still unprocessed, its step's processing frees slots and moves
        requests on, and the runtime calls :meth:`schedule` again after it. Without one (and a
        non-sampling prefill chunk frees nothing), unfinished requests would be dropped silently.
        """
        if any(r.n_pending for r in self.running):
            return
        left = len(self.waiting) + sum(not r.finished for r in self.running)
        if not left:
            return
        fmap = self.fmap
        kept = [r.kept for r in self.running if r.kept is not None]
        if fmap.free < 1 + self.speculative:
            held = sum(len(h) for h in kept)
            why = (
                f"the FutureMap has {fmap.free} free slots of {fmap.capacity} and a step needs "
                f"{1 + self.speculative} per sampling request; "
            )
            if held:
                why += (
                    f"{held} are held for waiting requests' drafts, so no step can start (the "
                    "Engine sizes the map (4 * max_running + 8) * (1 + k))"
                )
            else:
                why += (
                    f"{fmap.in_use} are held by handles this batcher does not own; release them or give "
                    "the batcher its own map"
                )
        else:
            why = f"nothing fits token_budget={self.token_budget} with chunk={self.chunk}"
        fmap.release_live(kept)  # the run ends here: the waiting requests' slots go back
        for r in self.running:
            r.kept = None
        raise RuntimeError(
            f"ContinuousBatcher is stuck with {left} of {self.n_requests} requests unfinished: {why}"
        )

    def _build(self, rows: list[tuple[_Req, int, bool]]) -> Batch:
        tokens: list[np.ndarray] = []
        seg, prefix, rids, sample = [], [], [], []
        consumes: list[FutureIndices] = []
        by_batch: dict[int, tuple[Batch, list[int], list[tuple[int, int]]]] = {}
        decodes: set[int] = set()  # requests whose segment names their last step's slots
        for i, (r, n, samples) in enumerate(rows):
            if r.fed < r.spec.prompt.size:
                tokens.append(r.spec.prompt[r.fed : r.fed + n])
                prefix.append(r.fed)
                r.fed += n
            else:
                # Speculative steps in flight may commit up to pending_extra more tokens: the
                # host's prefix is a bound, the step takes the true one from the slots.
                prefix.append(r.known_len - 1 + r.pending_extra)
                if r.kept is not None:  # it waited: its own handle on its slots
                    consumes.append(r.kept)
                    tokens.append(r.kept.host_placeholders().astype(np.int64))
                    r.kept = None
                    decodes.add(i)
                elif r.pending is not None:
                    b, row, _ = r.pending
                    entry = by_batch.setdefault(id(b), (b, [], []))
                    entry[1].extend(range(row, row + n))
                    entry[2].append((i, n))
                    decodes.add(i)
                    tokens.append(_NO_TOKENS)  # its placeholders, below
                else:
                    tokens.append(np.array(r.out[-1:], dtype=np.int64))
            seg.append(n)
            rids.append(r.spec.rid)
            sample.append(samples)
        try:
            for b, out_rows, req_idx in by_batch.values():
                assert b.out is not None
                h = b.out.filter(np.asarray(out_rows, dtype=np.int64))
                consumes.append(h)
                phs, at = h.host_placeholders(), 0
                for i, n in req_idx:
                    tokens[i] = phs[at : at + n]  # int64 views: concatenated into the batch's own
                    at += n
            batch, verify, sample_mask = self._batch(
                rows, tokens, seg, prefix, rids, sample, consumes, decodes
            )
        except BaseException:
            self.fmap.release_live(consumes)  # the handles made or taken here: nothing leaks
            raise
        self._ended = []
        extra = None if verify is None else verify[sample_mask].tolist()
        # A sampling request's slots: its last token, then the drafts it makes (the batch's own).
        drafts = batch.n_draft[sample_mask].tolist() if isinstance(batch, DraftBatch) else None
        first = 0
        for row, r in enumerate(batch.tag):
            need = 1 + (self._drafts(r) if drafts is None else drafts[row])
            r.pending = (batch, first, need)
            first += need
            r.n_pending += 1
            if extra is not None:
                r.pending_extra += extra[row]
        if isinstance(batch, DraftBatch) and batch.n_steps > 1:
            for r in batch.tag:  # a window: every sampling request gets n_steps tokens
                r.pending_extra += batch.n_steps - 1
                r.sure_extra += batch.n_steps - 1
        return batch

    def _batch(
        self,
        rows: list[tuple[_Req, int, bool]],
        tokens: list[np.ndarray],
        seg: list[int],
        prefix: list[int],
        rids: list[int],
        sample: list[bool],
        consumes: list[FutureIndices],
        decodes: set[int],
    ) -> tuple[Batch, np.ndarray | None, np.ndarray]:
        """The checked batch (a :class:`DraftBatch` when speculative), its ``n_verify`` (None
        for a plain batch) and its sample mask."""
        sample_mask = np.asarray(sample, dtype=bool)
        seg_lens = np.asarray(seg, dtype=np.int64)
        common: dict[str, Any] = {
            "consumes": consumes,
            "tag": [r for r, _, s in rows if s],
            "ended": np.asarray(self._ended, dtype=np.int64),
            "delayed": self._delayed(rows, sample_mask),
            "params": self._admitted(rows),
        }
        arrays = (
            np.concatenate(tokens),
            seg_lens,
            np.asarray(prefix, dtype=np.int64),
            np.asarray(rids, dtype=np.int64),
        )
        if self.multi_step > 1 and not (self.speculative and self._any_drafts(rows)):
            return self._window_batch(rows, arrays, sample_mask, common), None, sample_mask
        if not self.speculative:
            return Batch(*arrays, sample_mask, **common), None, sample_mask
        batch, verify = self._draft_batch(rows, arrays, sample_mask, common, decodes)
        return batch, verify, sample_mask

    def _delayed(self, rows: list[tuple[_Req, int, bool]], sample: np.ndarray) -> bool | np.ndarray:
        """``Batch.delayed``: False without a sampling grammar request; with ``delay="rows"`` a
        bool array marking the grammar requests (True when every sampling request has one)."""
        grammar = np.fromiter((r.matcher is not None for r, _, _ in rows), dtype=bool, count=len(rows))
        waits = int(np.count_nonzero(grammar & sample))
        if not waits:
            return False
        if (self.delay == "batch" and not self.speculative) or waits == int(np.count_nonzero(sample)):
            return True
        # Speculative: only the grammar rows wait (the others carry drafts, which take no mask).
        return grammar

    def _admitted(self, rows: list[tuple[_Req, int, bool]]) -> dict[int, SamplingParams] | None:
        """``Batch.params``: the parameters of requests in their first step (None if none)."""
        params = None
        for r, _, _ in rows:
            if not r.admitted:
                r.admitted = True
                if r.spec.params is not None:
                    params = params or {}
                    params[r.spec.rid] = r.spec.params
        return params

    @property
    def idle(self) -> bool:
        return not self.waiting and all(r.finished for r in self.running)
