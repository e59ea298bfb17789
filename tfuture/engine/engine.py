"""The front door: :class:`Engine` (submit, abort, stream, generate); :func:`generate` is in
:mod:`tfuture.engine.front`.

An engine owns one model, its :class:`tfuture.FutureMap`, a :class:`tfuture.sampling.Sampler`,
an :class:`tfuture.OverlapRuntime` and a :class:`tfuture.scheduler.ServingScheduler`. Requests
come as text (with a tokenizer) or token ids, with :class:`tfuture.scheduler.GenerationParams`.

Who drives the runtime: one thread at a time. :meth:`Engine.generate` on an idle engine runs
the runtime on the calling thread until the engine is idle again (exceptions re-raise there,
Ctrl-C included, after the runtime released everything). :meth:`Engine.submit` and
:meth:`Engine.stream` on an idle engine start a background thread that runs the runtime while
there is work and ends when there is none (no thread waits idle); requests added while a run
goes, from any thread, join that run. When a run fails, every live request finishes with
reason ``"error"``: :meth:`Engine.generate` re-raises the exception (driving) or raises
:class:`EngineError` from it (waiting), a stream raises :class:`EngineError` from it, and the
engine stays usable for new requests. A request's callback that raises (``on_tokens``, or
``submit(callback=)``) ends that request only, with reason ``"error"`` and the exception; the
engine serves the other requests on (the ``generate`` call it belongs to re-raises it). The
driving itself is :class:`tfuture.engine.driver.RunDriver`, the engine's base.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from tfuture.core.future_map import FutureMap
from tfuture.engine.driver import RunDriver
from tfuture.engine.inputs import (
    Prompt,
    _adapt,
    _check_context,
    _check_tokenizer,
    _count,
    _device,
    _eos,
    _progress_bar,
    _vocab,
    context,
)
from tfuture.engine.outputs import (
    EngineError,
    GenerateResult,
    RequestOutput,
    TokenStream,
    _Collector,
)
from tfuture.engine.requests import RequestPreparer, _Prepared
from tfuture.engine.speculative import chain, check_drafter, claim_drafter, margin, spec_step
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.scheduler.options import GenerationParams
from tfuture.scheduler.request import RequestSpec
from tfuture.scheduler.serving import (
    ServingScheduler,
    TokenUpdate,
    UpdateCallback,
)
from tfuture.spec.multistep import MultiStepTokenStep
from tfuture.streams.stats import RunStats

__all__ = [
    "Engine",
    "EngineError",
    "GenerateResult",
    "OnTokens",
    "RequestOutput",
    "TokenStream",
]

OnTokens = Callable[["Engine", TokenUpdate], None]


class Engine(RunDriver):
    """Serve one model: :meth:`submit`, :meth:`abort`, :meth:`stream`, :meth:`generate`.

    Args:
        model: a ``transformers`` causal LM (wrapped in :class:`tfuture.models.HFCausalLM` with
            ``max_running`` KV rows of ``max_len`` positions), an ``HFCausalLM``, or any
            tfuture :class:`tfuture.Model`. A model without a language-model head (a base
            ``LlamaModel``, a classifier) or a plain torch layer raises ``TypeError``.
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer`` object (a name
            such as ``"gpt2"`` is refused with a ``TypeError``: nothing is downloaded; pass
            ``AutoTokenizer.from_pretrained(name)``): text prompts, output text, and
            structured output (xgrammar compiles for it).
        max_running: requests running at once (more wait).
        max_len: positions per request (prompt plus ``max_tokens``), checked at submission
            (a request past it raises ``ValueError``). Default for a Hugging Face model: its
            context (``config.max_position_embeddings``, GPT-2's ``n_positions``), at most
            4096; a ``max_len`` past the context raises ``ValueError`` (positions a model was
            not trained for give wrong tokens). For another model: unchecked.
        overlap: False runs every step in sync (for A/B).
        eos_token_id: the model's end tokens (an id or a list), the default stop tokens of
            every request. Default: the model's ``generation_config.eos_token_id``, else its
            ``config.eos_token_id`` (either may be a list), else the tokenizer's; ``()`` for none.
        chunk, token_budget: prompt chunk and tokens per step (chunked prefill).
        device: the map's device for a model that does not say (default: the model's).
        vocab_size: the logits width, for a model that does not say (grammar masks).
        history_rows: live requests with penalties at once (default ``max_running``).
        stream, delay, trace: :class:`tfuture.OverlapRuntime`'s ``stream`` and ``trace`` and
            the scheduler's ``delay`` (grammar rows). ``stream="auto"`` (the default) is CUDA
            streams on a GPU and, on the CPU, the ``"inline"`` stream: the forward runs on the
            runtime's own thread. A worker thread (``stream="worker"``) has little to overlap
            there: the host's Python and a Hugging Face forward's Python share the GIL, and its
            two handoffs a step cost more than they hide (``python -m perf.stream_ab 8 ngram``).
        speculative: a drafter (:class:`tfuture.NGramDrafter`, :class:`tfuture.ModelDrafter`,
            or a :class:`tfuture.spec.Drafter` of your own): every request verifies ``k`` drafts
            a step (greedy output equal to plain decoding; sampled output following the model's
            distribution exactly; penalties too). A structured-output request's drafts are
            checked by its grammar's masks, one per draft. None (the default): plain decoding.
            A drafter serves one engine at a time: another engine built with it while this one
            is open raises ``ValueError``.
        multi_step: decode steps per window (``K``; 1, the default: one per step). A window
            is one schedule, one launch and one result for ``K`` tokens per request, each step's
            input the previous one's output on the device (:class:`tfuture.spec.MultiStepTokenStep`):
            for small models whose host work per step outweighs the device's. The tokens are
            those of plain decoding for every ``K``; a finish inside a window drops the tokens
            past it (``stats``/the scheduler's ``extra_tokens``); a window with a grammar
            request runs one step. With ``speculative`` too, requests that draft keep their
            speculative steps, and a step runs as a window when none of its requests drafts
            (those submitted with ``GenerationParams(speculative=False)``;
            :class:`tfuture.spec.SpecWindowStep`).

    Use it as a context manager, or call :meth:`close`: it aborts what is live, waits for
    the background thread, and gives a Hugging Face model it wrapped back its train/eval mode
    and attention implementation (the model generates in eval mode meanwhile; see
    :mod:`tfuture.engine.model_state`).
    """

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        max_running: int = 8,
        max_len: int | None = None,
        overlap: bool = True,
        eos_token_id: int | Iterable[int] | None = None,
        chunk: int = 512,
        token_budget: int = 2048,
        device: str | torch.device | None = None,
        vocab_size: int | None = None,
        history_rows: int | None = None,
        stream: str = "auto",
        delay: str = "batch",
        trace: bool = False,
        speculative: Any = None,
        multi_step: int = 1,
    ) -> None:
        _check_tokenizer(tokenizer)
        max_running = _count("max_running", max_running)
        if max_len is not None:
            max_len = _count("max_len", max_len)
        multi_step = _count("multi_step", multi_step)
        self.drafter = check_drafter(speculative)
        # KV positions for drafts verified, or a window's steps run, past a request's end.
        extra = margin(self.drafter) + multi_step - 1
        if max_len is not None:
            # The requests' positions, and the ones drafts or a window's steps reach past a
            # request's end (their tokens are discarded, but the model still sees the position).
            _check_context(max_len, context(model), extra)
        pool_max = None if max_len is None else max_len + extra
        self.model, pool_len, give_back = _adapt(model, max_running, pool_max)
        # What gives a Hugging Face model wrapped here its mode and attention back (at close).
        self._give_back: Callable[[], None] | None = give_back
        try:
            self.max_len = max_len if max_len is not None or pool_len is None else pool_len - extra
            self.tokenizer = tokenizer
            self.vocab: int | None = vocab_size if vocab_size is not None else _vocab(self.model)
            self.eos: tuple[int, ...] = _eos(eos_token_id, self.model, tokenizer)
            rows = max_running if history_rows is None else history_rows
            k = 0 if self.drafter is None else self.drafter.k
            self.fmap = FutureMap((4 * max_running + 8) * (1 + k), device=_device(self.model, device))
            if stream == "auto" and self.fmap.device.type == "cpu":
                stream = "inline"  # see the docstring
            self.sampler = Sampler(history_rows=rows)
            if multi_step > 1 and self.drafter is None:
                window = MultiStepTokenStep(self.model, self.sampler)
                self.runtime = OverlapRuntime(window, self.fmap, overlap=overlap, stream=stream, trace=trace)
            elif self.drafter is None:
                self.runtime = OverlapRuntime(
                    self.model, self.fmap, overlap=overlap, stream=stream, sampler=self.sampler, trace=trace
                )
            else:
                assert self.max_len is not None
                claim_drafter(self.drafter, self)
                kind, draft_back = spec_step(
                    self.model, self.drafter, self.sampler, max_running, self.max_len + extra, multi_step > 1
                )
                if draft_back is not None:  # the draft model's state, given back with the model's
                    give_back = self._give_back = chain(give_back, draft_back)
                self.runtime = OverlapRuntime(kind, self.fmap, overlap=overlap, stream=stream, trace=trace)
            self.scheduler = ServingScheduler(
                self.fmap,
                max_running=max_running,
                chunk=chunk,
                token_budget=token_budget,
                delay=delay,
                history_rows=rows,
                retain=False,
                speculative=k,
                multi_step=multi_step,
            )
            self.max_running = max_running
            self.last_stats: RunStats | None = None  # the last run that ended normally
            self.last_error: BaseException | None = None  # the last run's failure
            self._cond = threading.Condition(self.scheduler.lock)
            self._ids = itertools.count()
            self._driver: str | None = None  # None, "foreground" or "background"
            self._thread: threading.Thread | None = None  # the background thread
            self._driver_thread: threading.Thread | None = None  # the thread that drives the runtime
            self._closed = False
            self._local = threading.local()  # the generate() call whose on_tokens runs here
            self._requests = RequestPreparer(self.tokenizer, self.vocab, self.max_len, self.eos)
        except BaseException:
            if give_back is not None:
                give_back()  # refused after wrapping: the model is left as it was
            raise

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        prompt: Prompt,
        params: GenerationParams | None = None,
        *,
        callback: UpdateCallback | None = None,
    ) -> int:
        """Queue one request (thread-safe) and return its id. ``callback(update)`` hears its
        :class:`TokenUpdate` s on the runtime's host thread (token ids only: see
        :meth:`stream` for text); if it raises, the request finishes with reason ``"error"``
        (its last update carries the exception) and the others go on. Starts the background
        thread if nothing drives the engine."""
        prepared = self._requests.prepare(prompt, params)
        collector: _Collector | None = getattr(self._local, "collector", None)
        return self._add_many([prepared], callback, collector)[0]

    def abort(self, rid: int) -> bool:
        """Abort request ``rid`` (thread-safe); False if it is not live. It finishes with reason
        ``"abort"`` and the tokens processed so far, at the scheduler's next step."""
        return self.scheduler.abort(rid)

    def stream(self, prompts: Prompt | Sequence[Prompt], params: Any = None) -> TokenStream:
        """Submit ``prompts`` and iterate over their :class:`TokenUpdate` s as they are processed:
        ``for rid, tokens, finished in engine.stream(...)``, with ``update.text`` the new text
        when the engine has a tokenizer. The iterator blocks on a queue (no busy waiting), ends
        when every request finished, and aborts the requests left when closed early:
        ``break`` out of (or an exception in) a ``for`` loop over it, even with the stream
        still held in a variable; ``close()``; ``with engine.stream(...) as s``; garbage
        collection. A stream stepped with ``next()`` is stopped by ``close()`` (or ``with``)."""
        items = self._requests.prepare_all(prompts, params)
        q: queue.SimpleQueue[TokenUpdate] = queue.SimpleQueue()
        return TokenStream(self, self._add_many(items, q.put, None), q)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: Any = None,
        *,
        on_tokens: OnTokens | None = None,
        progress: bool | None = None,
    ) -> GenerateResult:
        """Run ``prompts`` to completion; their :class:`RequestOutput` s in order, then those of
        requests that ``on_tokens`` submitted.

        ``params``: one :class:`GenerationParams` for all, a list of one per prompt, or None
        (the defaults). ``on_tokens(engine, update)`` hears every :class:`TokenUpdate` (with
        ``text`` when there is a tokenizer) on the runtime's host thread; it may
        :meth:`submit` requests (they join this call's outputs; a refused one raises there
        and is not waited for) and :meth:`abort` them. If it raises, that request ends with
        reason ``"error"``, the call's other requests are aborted, and this call re-raises the
        exception once they ended; other callers' requests are not touched.
        ``progress``: a tqdm bar over requests (None: only when stderr is a terminal and the
        call takes over a second, and only if tqdm is installed; True: always, needs tqdm).
        """
        items = self._requests.prepare_all(prompts, params)
        if not items:
            return GenerateResult([], None)
        bar = _progress_bar(progress, len(items))
        col = _Collector(self, on_tokens, bar)
        try:
            self._check_not_driving("generate()")
            with self._cond:
                self._add_many(items, None, col, start=False)
                drive = self._driver is None
                if drive:
                    self._driver, self._driver_thread = "foreground", threading.current_thread()
            stats = self._drive() if drive else None
            try:
                col.wait()
            except BaseException:
                for rid in col.order:
                    self.abort(rid)
                raise
        finally:
            if bar is not None:
                bar.close()
        return col.result(stats)

    def close(self, timeout: float | None = None) -> None:
        """Abort every live request, refuse new ones, and wait for the background thread.

        A Hugging Face model this engine wrapped gets back its train/eval mode and its own
        attention implementation once no run of the engine goes (at once when idle, else when
        the running one ends) and no other engine over the same model is open (the last one
        to close gives them back). An ``HFCausalLM`` passed in is left as it is."""
        with self._cond:
            self._closed = True
            for rid in self.scheduler.live:
                self.scheduler.abort(rid)
            thread = self._thread
            self._give_back_if_done()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _add_many(
        self,
        items: list[_Prepared],
        callback: UpdateCallback | None,
        collector: _Collector | None,
        start: bool = True,
    ) -> list[int]:
        """Give each request an id and queue it, all or none; then make sure a thread drives
        the runtime (``start``)."""
        rids: list[int] = []
        with self._cond:
            if self._closed:
                raise RuntimeError("this Engine is closed")
            try:
                for p in items:
                    rid = next(self._ids)
                    cb = callback if collector is None else collector.callback(rid, callback)
                    self.scheduler.add(RequestSpec(rid, 0, p.ids, **p.spec_kw), cb)
                    if collector is not None:  # only what the scheduler accepted is waited for
                        collector.register(rid, p.text)
                    rids.append(rid)
            except BaseException:
                for rid in rids:  # queued already: they finish as aborted at the next step
                    self.scheduler.abort(rid)
                self._ensure_driver()
                raise
            if start:
                self._ensure_driver()
        return rids
