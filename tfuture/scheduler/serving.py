"""The serving scheduler: :class:`ContinuousBatcher` plus what a server needs.

Requests are added and aborted while a run is going, from any thread; each request has its own
stop tokens (``RequestSpec.stop``), a finish reason, host timings, and an optional callback that
hears its tokens as the scheduler processes them (:class:`TokenUpdate`).

Threads: :meth:`ServingScheduler.add` and :meth:`ServingScheduler.abort` may be called from any
thread. They touch only a queue and a set under :attr:`ServingScheduler.lock`; the runtime's
host thread takes both at the start of :meth:`~ServingScheduler.schedule` and applies them
there, so the request state the step loop reads (the running set, pending tokens, consumed
handles) changes on that one thread only. Callbacks run on the runtime's host thread, inside
``schedule`` (aborts) or ``process`` (tokens): keep them short. A request's callback that raises
an ``Exception`` ends that request only: it finishes with reason ``"error"`` and the exception
(``TokenUpdate.error``, ``Completion.error``), its callback hears that last update, and the run
goes on for the others (an exception on the request's own last update is warned about, a
``RuntimeWarning``, and recorded in :attr:`ServingScheduler.completions`). An exception in
``on_update``, or a ``BaseException`` such as ``KeyboardInterrupt``, stops the run like any
scheduler error.

Abort semantics: an aborted request that waits is dropped; a running one is marked finished
(reason ``"abort"``) at the next ``schedule``, leaves the running set like a request that hit
its stop token, and is reported in that step's ``Batch.ended`` (the model frees its KV row, the
sampler its rows, on the stream after its last forward). Its tokens still in flight are
discarded when their step is processed (the runtime releases each step's ``out`` after
processing it, so no slot leaks), and no other request's pending token is touched: the step
that consumes them is built from the remaining requests only. Its output is the tokens processed
before the abort.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from tfuture.core.batch import Batch, StepResult
from tfuture.core.future_map import FutureMap
from tfuture.scheduler.batcher import ContinuousBatcher, _Req
from tfuture.scheduler.request import RequestSpec, check_params, grammar_vocab

__all__ = ["Completion", "RequestTimings", "ServingScheduler", "TokenUpdate", "UpdateCallback"]


@dataclass(slots=True)
class RequestTimings:
    """Host times of one request (``time.perf_counter()`` seconds), stamped when the scheduler
    adds it and when it processes its tokens (so under overlap a token is stamped one step
    after its forward was launched, when the host sees it), and its counts: tokens, model steps
    that gave it tokens, and (speculative decoding) drafts verified and accepted."""

    submitted: float
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    n_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token: submitted to first token processed (None without tokens)."""
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: ``(last - first) / (n_tokens - 1)``."""
        if self.first_token is None or self.last_token is None or self.n_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.n_tokens - 1)

    @property
    def latency(self) -> float | None:
        """Submitted to finished."""
        return None if self.finished is None else self.finished - self.submitted


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request: its prompt and generated token ids (the stop token included), why it
    finished (:data:`tfuture.scheduler.batcher.FINISH_REASONS`), its timings, and for
    ``"error"`` the exception: the run's, or the one its callback raised."""

    rid: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    timings: RequestTimings
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """New tokens of one request, in order: ``for rid, tokens, finished in updates`` unpacks it.

    ``tokens`` are the tokens processed since the last update (empty for an abort); the last
    update of a request has ``finished=True``, its ``finish_reason`` and ``completion``.
    ``text`` is the decoded text delta when a tokenizer is known (the engine fills it), and
    ``error`` the exception that ended it (``finish_reason == "error"``): the run's failure, or
    the one the request's own callback raised.
    """

    rid: int
    tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    completion: Completion | None = None
    text: str | None = None
    error: BaseException | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.rid, self.tokens, self.finished))


UpdateCallback = Callable[[TokenUpdate], None]


@dataclass(slots=True, eq=False)
class _Live:
    spec: RequestSpec
    callback: UpdateCallback | None
    timings: RequestTimings


class ServingScheduler(ContinuousBatcher):
    """A :class:`ContinuousBatcher` for serving: thread-safe :meth:`add` and :meth:`abort`, per
    request stop tokens, finish reasons, timings and token callbacks.

    Args:
        fmap: the run's future map.
        specs: requests known up front (more come with :meth:`add`).
        eos: stop tokens of requests whose ``RequestSpec.stop`` is None (default: none).
        on_update: called with every :class:`TokenUpdate` (after the request's own callback).
        retain: keep each finished request's :class:`Completion` in :attr:`completions` (and
            its tokens in ``outputs``); False forgets them once delivered (a long-lived server).
        kw: :class:`ContinuousBatcher`'s options (``max_running``, ``chunk``,
            ``token_budget``, ``grammar``, ``mask``, ``delay``, ``history_rows``,
            ``speculative``, ...); the
            defaults here are a server's: prompt chunks of 512 tokens, 2048 tokens a step.

    Finish reasons: ``"stop"`` (one of the request's stop tokens), ``"length"`` (``max_new``
    tokens), ``"grammar"`` (its matcher terminated on a token that is not a stop token),
    ``"abort"`` (:meth:`abort`), ``"error"`` (the run failed: :meth:`fail`; or the request's
    callback raised, which ends that request only), ``"invalid"`` (its grammar accepted an
    output that is not valid: JSON with a raw control character, xgrammar #800).
    """

    def __init__(
        self,
        fmap: FutureMap,
        specs: Iterable[RequestSpec] = (),
        *,
        eos: int | Iterable[int] = (),
        max_running: int = 8,
        chunk: int = 512,
        token_budget: int = 2048,
        on_update: UpdateCallback | None = None,
        retain: bool = True,
        **kw: Any,
    ) -> None:
        specs = list(specs)
        super().__init__(
            specs, fmap, eos=eos, max_running=max_running, chunk=chunk, token_budget=token_budget, **kw
        )
        self.lock = threading.RLock()
        self.on_update, self.retain = on_update, retain
        self.completions: dict[int, Completion] = {}
        self._incoming: list[RequestSpec] = []
        self._aborts: set[int] = set()
        now = time.perf_counter()
        self._live: dict[int, _Live] = {s.rid: _Live(s, None, RequestTimings(now)) for s in specs}
        self._ids: set[int] = set(self._live)  # live, or finished and not yet reported ended

    # ------------------------------------------------------------------ any thread
    def add(self, spec: RequestSpec, callback: UpdateCallback | None = None) -> None:
        """Queue ``spec`` (thread-safe); the next :meth:`schedule` admits it. ``callback`` hears
        its :class:`TokenUpdate` s. Raises ``ValueError`` for an id that is live (or ended and
        not yet reported), or a grammar whose vocab differs from the run's."""
        if not isinstance(spec, RequestSpec):
            raise TypeError(f"add() takes a RequestSpec, got {type(spec).__name__}")
        check_params([spec])
        with self.lock:
            if spec.rid in self._ids:
                raise ValueError(
                    f"request id {spec.rid} is live (or ended and not yet reported): request ids must "
                    "be unique among live requests"
                )
            vocab = grammar_vocab([spec], self.grammar)
            if vocab is not None:
                if self.vocab is not None and vocab != self.vocab:
                    raise ValueError(
                        f"request {spec.rid}'s grammar has vocab {vocab}, the run's grammars have "
                        f"{self.vocab}: every grammar of a run must have the model's vocab"
                    )
                self.vocab = vocab
            self._ids.add(spec.rid)
            self._live[spec.rid] = _Live(spec, callback, RequestTimings(time.perf_counter()))
            self._incoming.append(spec)
            self.n_requests += 1

    def abort(self, rid: int) -> bool:
        """Abort request ``rid`` (thread-safe) at the next :meth:`schedule`. False when it is not
        live (unknown, or finished already); a request that finishes on its own before the
        abort is applied keeps its own finish reason."""
        with self.lock:
            if rid not in self._live:
                return False
            self._aborts.add(rid)
            return True

    def has_work(self) -> bool:
        """True while a request is queued, waiting or running (thread-safe)."""
        with self.lock:
            return bool(self._incoming or self.waiting or any(not r.finished for r in self.running))

    @property
    def live(self) -> list[int]:
        """Ids of the requests not finished yet (queued, waiting or running)."""
        with self.lock:
            return list(self._live)

    @property
    def idle(self) -> bool:
        return not self.has_work()

    # --------------------------------------------------------- the runtime's host thread
    def schedule(self) -> Batch | None:
        with self.lock:
            incoming, self._incoming = self._incoming, []
            aborts, self._aborts = self._aborts, set()
        if incoming:
            self.waiting.extend(incoming)
            self.waiting.sort(key=lambda s: s.arrival)  # stable: first come, first served
        if aborts:
            self._apply_aborts(aborts)
        batch = super().schedule()
        if batch is not None and batch.ended.size:
            for rid in batch.ended.tolist():
                self._ids.discard(rid)
        return batch

    def _apply_aborts(self, aborts: set[int]) -> None:
        now = time.perf_counter()
        kept = []
        for s in self.waiting:
            if s.rid in aborts and s.rid in self._live:
                self._ids.discard(s.rid)  # never ran: nothing to report in Batch.ended
                self.outputs[s.rid] = []
                self.finish_reasons[s.rid] = "abort"
                self._complete(s.rid, [], [], "abort", now)
            else:
                kept.append(s)
        self.waiting = kept
        for r in self.running:
            if r.spec.rid in aborts and not r.finished:
                self._finish(r, "abort")  # leaves the running set now, reported in Batch.ended
                self._complete(r.spec.rid, r.out, [], "abort", now)

    def process(self, result: StepResult) -> None:
        tag: list[_Req] = result.batch.tag
        before = [-1 if r.finished else len(r.out) for r in tag]
        super().process(result)
        now = time.perf_counter()
        for r, n0 in zip(tag, before, strict=True):
            if n0 < 0:
                continue  # finished already: its token was discarded (the extra step)
            live = self._live.get(r.spec.rid)
            if live is None:
                continue
            new = r.out[n0:]
            t = live.timings
            t.steps, t.drafted, t.accepted = r.steps, r.drafted, r.accepted
            if new:
                if t.first_token is None:
                    t.first_token = now
                t.last_token = now
                t.n_tokens += len(new)
            if r.finished:
                assert r.reason is not None
                self._complete(r.spec.rid, r.out, new, r.reason, now)
            else:
                error = self._emit(live, TokenUpdate(r.spec.rid, new, False))
                if error is not None:  # its callback failed: this request ends, the others go on
                    self._finish(r, "error")
                    self._complete(r.spec.rid, r.out, [], "error", now, error)

    def _complete(
        self,
        rid: int,
        out: list[int],
        new: list[int],
        reason: str,
        now: float,
        error: BaseException | None = None,
    ) -> None:
        """Finish ``rid``'s bookkeeping and send its last update (with its :class:`Completion`)."""
        live = self._live.pop(rid)
        live.timings.finished = now
        done = Completion(rid, live.spec.prompt.tolist(), list(out), reason, live.timings, error)
        if self.retain:
            self.completions[rid] = done
        else:
            self.outputs.pop(rid, None)
            self.finish_reasons.pop(rid, None)
        failed = self._emit(live, TokenUpdate(rid, new, True, reason, done, error=error))
        if failed is not None and failed is not error:
            # The request had finished already: its callback heard its end. Nothing is left to
            # stop; the failure is recorded (retain) and warned about, never dropped silently.
            if self.retain:
                self.completions[rid] = replace(done, finish_reason="error", error=failed)
                self.finish_reasons[rid] = "error"
            warnings.warn(
                f"request {rid}'s callback raised on its last update ({type(failed).__name__}: "
                f"{failed}); the request had finished with reason {reason!r}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _emit(self, live: _Live, update: TokenUpdate) -> Exception | None:
        """Send ``update`` to the request's callback, then to :attr:`on_update`. A request's
        callback that raises an ``Exception`` is contained (returned: the caller ends that
        request with reason ``"error"``), so one caller's bug never stops the others' requests;
        ``on_update`` (the scheduler's owner's) and a ``BaseException`` (Ctrl-C) stop the run."""
        error: Exception | None = None
        if live.callback is not None:
            try:
                live.callback(update)
            except Exception as e:
                error = e
        if self.on_update is not None:
            self.on_update(update)
        return error

    def end_run(self) -> None:
        """After a run that ended normally: forget finished requests (the runtime's ``close``
        freed their state, so they need no ``Batch.ended`` report in a later run)."""
        self._ended.extend(r.spec.rid for r in self.running if r.finished)
        self.running = [r for r in self.running if not r.finished]
        with self.lock:
            self._ids.difference_update(self._ended)
        self._ended = []

    def fail(self, error: BaseException) -> None:
        """After a run that failed (the runtime released its slots and state): every live request
        finishes with reason ``"error"`` (its update carries ``error``) and the scheduler is
        empty, ready for new requests. Callback exceptions here are dropped (the run's own
        exception is the one that counts)."""
        with self.lock:
            self._incoming, self._aborts = [], set()
            now = time.perf_counter()
            outs = {r.spec.rid: r.out for r in self.running}
            self.running, self.waiting, self._ended = [], [], []
            for rid in list(self._live):
                out = outs.get(rid, [])
                self.outputs[rid] = out
                self.finish_reasons[rid] = "error"
                try:
                    self._complete(rid, out, [], "error", now, error)
                except Exception:
                    pass
            # A callback may have added requests meanwhile: they stay queued.
            self._ids = set(self._live)
