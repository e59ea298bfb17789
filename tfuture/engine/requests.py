"""What :class:`tfuture.engine.Engine` does to a request before it is queued: the parameters
checked, the prompt tokenized and checked against the vocabulary and ``max_len``, the stop tokens
gathered, and the grammar of a structured request compiled (and cached by schema text), all on
the submitting thread: :class:`RequestPreparer`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tfuture.engine.detok import encode
from tfuture.engine.inputs import Prompt, _params_list, _prompt_list, _token_ids
from tfuture.grammars.xgrammar import XGrammarCompiler
from tfuture.scheduler.options import GenerationParams

# Compiled grammars an engine keeps (by schema text), for requests that repeat a schema.
_GRAMMAR_CACHE = 256


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A checked request, not yet submitted: its prompt ``text`` (None for token ids), its
    prompt ``ids`` (int64, shape ``(n,)``, ``n >= 1``), its ``params``, and the keywords of its
    :class:`tfuture.scheduler.request.RequestSpec` (``max_new``, ``params``, ``stop``,
    ``grammar``)."""

    text: str | None
    ids: np.ndarray
    params: GenerationParams
    spec_kw: dict[str, Any]


class RequestPreparer:
    """Check and tokenize an engine's requests and compile their grammars (thread-safe).

    Args:
        tokenizer: the engine's tokenizer (None: token id prompts only, no structured output).
        vocab: the model's logits width (None: unchecked).
        max_len: positions per request, prompt plus ``max_tokens`` (None: unchecked).
        eos: the model's end tokens, the default stop tokens of every request.

    The xgrammar compiler is built on the first structured request. Compiled grammars are
    kept by schema text (at most ``_GRAMMAR_CACHE``); the cache is read and filled under a
    lock, and a grammar compiles outside it.
    """

    def __init__(self, tokenizer: Any, vocab: int | None, max_len: int | None, eos: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.max_len = max_len
        self.eos = eos
        self._lock = threading.Lock()  # guards _compiler and _grammars
        self._compiler: XGrammarCompiler | None = None
        self._grammars: dict[str, Any] = {}

    def prepare_all(self, prompts: Prompt | Sequence[Prompt], params: Any) -> list[_Prepared]:
        """:meth:`prepare` each of ``prompts`` (one prompt or a list) with its ``params`` (one
        :class:`GenerationParams` for all, one per prompt, or None)."""
        plist = _prompt_list(prompts)
        return [self.prepare(p, gp) for p, gp in zip(plist, _params_list(params, len(plist)), strict=True)]

    def prepare(self, prompt: Prompt, params: GenerationParams | None) -> _Prepared:
        """Check and tokenize one request, compile its grammar, draw its seed: all before it is
        queued, on the submitting thread."""
        if params is None:
            params = GenerationParams()
        if not isinstance(params, GenerationParams):
            raise TypeError(
                "params must be a tfuture.scheduler.GenerationParams (it carries max_tokens and the stop "
                f"tokens; SamplingParams is the sampler's), got {type(params).__name__}"
            )
        text: str | None = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: Engine(model, tokenizer=...)")
            text, ids = prompt, np.asarray(encode(self.tokenizer, prompt), dtype=np.int64)
        else:
            ids = _token_ids(prompt)
        if not ids.size:
            raise ValueError(f"the prompt is empty (a request needs at least one token): {prompt!r}")
        if int(ids.min()) < 0 or (self.vocab is not None and int(ids.max()) >= self.vocab):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"prompt token id {bad} lies outside the model's vocabulary [0, {self.vocab})")
        if self.max_len is not None and ids.size + params.max_tokens > self.max_len:
            raise ValueError(
                f"prompt of {ids.size} tokens + max_tokens={params.max_tokens} exceeds "
                f"max_len={self.max_len} positions per request (build the engine with a larger "
                "max_len, or ask for fewer tokens)"
            )
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos)
        kw: dict[str, Any] = {
            "max_new": params.max_tokens,
            "params": params.sampling_params(),
            "stop": frozenset(stop),
            "grammar": self.grammar(params) if params.structured else False,
            "drafts": bool(params.speculative),
        }
        g = kw["grammar"]
        if g is not False and self.vocab is not None and g.vocab != self.vocab:
            raise ValueError(
                f"the request's grammar has vocab {g.vocab}, the model's logits have {self.vocab}"
            )
        return _Prepared(text, ids, params, kw)

    def grammar(self, params: GenerationParams) -> Any:
        """The grammar of a structured request: ``params.grammar`` when it is a grammar object,
        else its JSON schema or EBNF text compiled with xgrammar (cached by that text)."""
        if params.grammar is not None and not isinstance(params.grammar, str):
            return params.grammar
        if self.tokenizer is None:
            raise ValueError(
                "structured output (json_schema or an EBNF grammar) needs a tokenizer: "
                "Engine(model, tokenizer=...)"
            )
        if params.json_schema is not None:
            schema = params.json_schema
            key = "json:" + (schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True))
        else:
            key = "ebnf:" + str(params.grammar)
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                return grammar
            if self._compiler is None:
                self._compiler = XGrammarCompiler(
                    self.tokenizer, vocab_size=self.vocab, stop_token_ids=list(self.eos) or None
                )
            compiler = self._compiler
        if params.json_schema is not None:
            grammar = compiler.json_schema(params.json_schema)
        else:
            grammar = compiler.ebnf(str(params.grammar))
        with self._lock:
            if len(self._grammars) >= _GRAMMAR_CACHE:
                self._grammars.clear()  # a server with ever new schemas: keep memory bounded
            return self._grammars.setdefault(key, grammar)
