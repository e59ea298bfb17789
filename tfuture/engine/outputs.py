"""What an :class:`tfuture.engine.Engine` hands back: :class:`RequestOutput` and
:class:`GenerateResult` (``generate``), :class:`TokenStream` (``stream``), :class:`EngineError`,
and the collector that gathers one ``generate`` call's completions."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tfuture.engine.detok import IncrementalDecoder, decode
from tfuture.scheduler.serving import Completion, RequestTimings, TokenUpdate, UpdateCallback
from tfuture.streams.stats import RunStats

__all__ = ["EngineError", "GenerateResult", "RequestOutput", "TokenStream"]


class EngineLike(Protocol):
    """What a stream and a collector use of their :class:`tfuture.engine.Engine` (a protocol:
    this module is below the engine's)."""

    tokenizer: Any
    _cond: threading.Condition
    _local: threading.local

    def abort(self, rid: int) -> bool: ...

    def _check_not_driving(self, what: str) -> None: ...


class EngineError(RuntimeError):
    """A run failed while a request's results were awaited; ``__cause__`` is the run's error."""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request produced: token ids (the stop token included), text (with a tokenizer:
    the output's text, special tokens left out), why it finished (``"stop"``, ``"length"``,
    ``"abort"``, ``"grammar"``, ``"error"``, or ``"invalid"``: the grammar accepted an output
    that is not valid, e.g. JSON with a raw control character, xgrammar #800), its host
    timings (``timings.ttft``, ``timings.tpot``, ``timings.latency``) and counts
    (``timings.steps``: model steps that gave it tokens; ``timings.drafted`` and
    ``timings.accepted``: speculative drafts verified and accepted)."""

    rid: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    timings: RequestTimings


@dataclass(slots=True)
class GenerateResult:
    """:func:`generate`'s outputs in request order (the prompts', then requests added during
    the call) and the run's :class:`tfuture.RunStats` (None when another thread drove the run;
    merged when the call took more than one run). Indexable and iterable over the outputs."""

    outputs: list[RequestOutput]
    stats: RunStats | None

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[RequestOutput]:
        return iter(self.outputs)

    def __getitem__(self, i: int) -> RequestOutput:
        return self.outputs[i]

    def by_rid(self, rid: int) -> RequestOutput:
        for o in self.outputs:
            if o.rid == rid:
                return o
        raise KeyError(rid)

    @property
    def drafted(self) -> int:
        """Draft tokens verified over every request (speculative decoding; 0 without)."""
        return sum(o.timings.drafted for o in self.outputs)

    @property
    def accepted(self) -> int:
        """Of :attr:`drafted`, the accepted ones (a finish may cut an accepted run short)."""
        return sum(o.timings.accepted for o in self.outputs)


class TokenStream:
    """The iterator :meth:`Engine.stream` returns (see there); ``rids`` are its requests' ids.

    Closing it aborts the requests still running: ``close()``, ``with``, dropping the stream,
    and leaving a ``for`` loop over it early (``break``, ``return``, an exception in the body),
    even while a variable still holds the stream: each ``for`` loop (``iter(stream)``) gets
    its own iterator, which closes the stream when the loop drops it before the end (so does
    any consumer that stops early, such as ``itertools.islice(stream, n)``: step with
    ``next(stream)`` to take a few updates and go on later). ``next(stream)`` has no loop to
    leave: call ``close()`` (or use ``with``) to stop."""

    def __init__(self, engine: EngineLike, rids: list[int], q: queue.SimpleQueue[TokenUpdate]) -> None:
        self.engine, self.rids, self._q = engine, rids, q
        self._open = set(rids)
        tok = engine.tokenizer
        self._decoders = {rid: IncrementalDecoder(tok) for rid in rids} if tok is not None else None

    def __iter__(self) -> Iterator[TokenUpdate]:
        return self._loop()

    def _loop(self) -> Iterator[TokenUpdate]:
        """One ``for`` loop's iterator: when the loop drops it before the end (``break``), the
        generator is closed at once (CPython frees it on the spot) and so is the stream."""
        try:
            while True:
                try:
                    update = next(self)
                except StopIteration:
                    return
                yield update
        finally:
            self.close()  # aborts nothing when every request finished

    def __next__(self) -> TokenUpdate:
        if not self._open:
            raise StopIteration
        self.engine._check_not_driving("iterating a stream")
        update = self._q.get()
        if update.error is not None:
            self.close()
            raise EngineError(
                f"the engine's run failed while request {update.rid} was live"
            ) from update.error
        if self._decoders is not None:
            dec = self._decoders[update.rid]
            text = dec.push(update.tokens) + (dec.flush() if update.finished else "")
            update = replace(update, text=text)
        if update.finished:
            self._open.discard(update.rid)
        return update

    def close(self) -> None:
        """Abort the requests of this stream that have not finished."""
        left, self._open = self._open, set()
        for rid in left:
            self.engine.abort(rid)

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _Collector:
    """One :meth:`Engine.generate` call: its requests' completions, ``on_tokens``, the bar."""

    def __init__(
        self, engine: EngineLike, on_tokens: Callable[[Any, TokenUpdate], None] | None, bar: Any
    ) -> None:
        self.engine, self.on_tokens, self.bar = engine, on_tokens, bar
        self.order: list[int] = []
        self.texts: dict[int, str | None] = {}
        self.done: dict[int, Completion] = {}
        self.decoders: dict[int, IncrementalDecoder] = {}
        self.error: BaseException | None = None  # the first error a request finished with
        self.callback_error: Exception | None = None  # the first one on_tokens raised
        self._failed: set[int] = set()  # requests whose callback raised

    def callback(self, rid: int, also: UpdateCallback | None) -> UpdateCallback:
        """The scheduler's callback for request ``rid`` of this call (``also``: the callback it
        was submitted with). One that raises ends that request with reason ``"error"`` (the
        scheduler contains it); the call's other requests are aborted and :meth:`wait` re-raises
        the exception. :meth:`register` the request once the scheduler accepted it."""

        def callback(update: TokenUpdate) -> None:
            try:
                if rid not in self._failed:  # a failed callback does not hear its own error
                    if also is not None:
                        also(update)
                    if self.on_tokens is not None:
                        self._call(update)
            except Exception as e:
                self._callback_failed(rid, e)
                raise
            finally:
                if update.finished:
                    self._finished(update)

        return callback

    def register(self, rid: int, text: str | None) -> None:
        """Under the engine's lock, once the scheduler accepted ``rid``: it belongs to this call
        (a refused request is never waited for)."""
        self.order.append(rid)
        self.texts[rid] = text
        if self.bar is not None and len(self.order) > self.bar.total:
            self.bar.total = len(self.order)
            self.bar.refresh()

    def _callback_failed(self, rid: int, error: Exception) -> None:
        """``on_tokens`` (or a request's callback) raised: the call will raise ``error``, so its
        other requests stop now instead of running to their limits."""
        with self.engine._cond:
            self._failed.add(rid)
            if self.callback_error is None:
                self.callback_error = error
            left = [r for r in self.order if r not in self.done and r != rid]
        for r in left:
            self.engine.abort(r)

    def _call(self, update: TokenUpdate) -> None:
        assert self.on_tokens is not None
        tok = self.engine.tokenizer
        if tok is not None:
            dec = self.decoders.get(update.rid)
            if dec is None:
                dec = self.decoders[update.rid] = IncrementalDecoder(tok)
            text = dec.push(update.tokens) + (dec.flush() if update.finished else "")
            update = replace(update, text=text)
        local = self.engine._local
        outer, local.collector = getattr(local, "collector", None), self
        try:
            self.on_tokens(self.engine, update)
        finally:
            local.collector = outer

    def _finished(self, update: TokenUpdate) -> None:
        assert update.completion is not None
        with self.engine._cond:
            self.done[update.rid] = update.completion
            if update.error is not None and self.error is None:
                self.error = update.error
            self.decoders.pop(update.rid, None)
            self.engine._cond.notify_all()
        if self.bar is not None:
            self.bar.update(1)

    def wait(self) -> None:
        """Block (no polling) until every request of the call finished; re-raise what a callback
        of the call raised, or raise :class:`EngineError` if a run failed."""
        with self.engine._cond:
            while len(self.done) < len(self.order):
                self.engine._cond.wait()
        if self.callback_error is not None:
            raise self.callback_error
        if self.error is not None:
            raise EngineError("the engine's run failed during generate()") from self.error

    def result(self, stats: RunStats | None) -> GenerateResult:
        tok = self.engine.tokenizer
        outs = []
        for rid in self.order:
            c = self.done[rid]
            text = decode(tok, c.token_ids) if tok is not None else None
            outs.append(
                RequestOutput(
                    rid, self.texts[rid], c.prompt_token_ids, c.token_ids, text, c.finish_reason, c.timings
                )
            )
        return GenerateResult(outs, stats)
