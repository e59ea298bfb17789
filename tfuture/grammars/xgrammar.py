"""xgrammar behind the :class:`tfuture.grammars.Grammar` protocol (optional extra, from a clone of
tfuture: ``pip install -e '.[grammar]'``; xgrammar is imported on first use, not with this module).

    compiler = XGrammarCompiler(tokenizer, vocab_size=model_vocab)      # once per tokenizer
    grammar = compiler.json_schema({"type": "object", ...})             # once per schema
    ContinuousBatcher(specs, fmap, grammar=grammar, eos=compiler.stop_token_ids)

``tokenizer``: a Hugging Face ``transformers`` tokenizer, a byte-level ``tokenizers.Tokenizer``
(e.g. one from :func:`tfuture.testing.tokenizer.train_bpe`), or an ``xgrammar.TokenizerInfo``.
``vocab_size`` is the model's logits width, which may exceed the tokenizer's vocabulary
(padded ``lm_head``): the extra ids are never allowed. Each request gets its own
:class:`XGrammarMatcher`, which fills its row of the packed int32 bitmask (xgrammar's layout,
the one :mod:`tfuture.kernels.bitmask` applies) and terminates once it accepted a stop token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["XGrammar", "XGrammarCompiler", "XGrammarMatcher", "tokenizer_info"]

_INSTALL = "from a clone of tfuture, pip install -e '.[grammar]'"


def _xgr() -> Any:
    """The xgrammar module, or an ImportError that says how to install it."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(f"tfuture.grammars.xgrammar needs the xgrammar package: {_INSTALL}") from exc
    return xgrammar


def _stop_ids(stop_token_ids: int | Sequence[int] | None) -> list[int] | None:
    if stop_token_ids is None:
        return None
    ids = [stop_token_ids] if isinstance(stop_token_ids, int | np.integer) else list(stop_token_ids)
    if not ids or not all(isinstance(t, int | np.integer) and t >= 0 for t in ids):
        raise ValueError(
            f"stop_token_ids must be a token id >= 0 or a non-empty list of them, got {stop_token_ids!r}"
        )
    return [int(t) for t in ids]


def _check_sizes(n_tokenizer: int, vocab_size: int | None, stops: list[int] | None) -> None:
    """Raise unless ``vocab_size`` covers the tokenizer's ``n_tokenizer`` ids and every stop id
    lies below the vocabulary (xgrammar would drop the others silently, and a grammar that can
    never stop leaves a request with a mask that allows no token some steps later)."""
    if vocab_size is not None and vocab_size < n_tokenizer:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the tokenizer's vocabulary ({n_tokenizer} ids): "
            "vocab_size is the model's logits width, which covers every token id (a padded lm_head "
            "may be wider, never narrower)"
        )
    size = n_tokenizer if vocab_size is None else vocab_size
    bad = [t for t in stops or () if t >= size]
    if bad:
        raise ValueError(
            f"stop_token_ids {bad} lie outside the vocabulary: token ids must be < {size} "
            f"({'vocab_size' if vocab_size is not None else 'the tokenizer size'})"
        )


def _byte_level_prefix_space(tokenizer: Any) -> bool:
    """``add_prefix_space`` of a byte-level ``tokenizers.Tokenizer``; ValueError for another kind."""
    spec = json.loads(tokenizer.to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise ValueError(
            "a tokenizers.Tokenizer must be byte-level (a ByteLevel decoder), got decoder "
            f"{decoder.get('type')!r}; pass a transformers tokenizer or an xgrammar.TokenizerInfo instead"
        )
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(p.get("type") == "ByteLevel" and p.get("add_prefix_space") for p in parts)


def _is_tokenizers_tokenizer(obj: object) -> bool:
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    return isinstance(obj, Tokenizer)


def tokenizer_info(
    tokenizer: Any, *, vocab_size: int | None = None, stop_token_ids: int | Sequence[int] | None = None
) -> Any:
    """An ``xgrammar.TokenizerInfo`` for ``tokenizer`` (see the module docstring) and the model's
    ``vocab_size`` (default: the tokenizer's). ``stop_token_ids`` default: the tokenizer's end
    token (transformers), or its special added tokens (``tokenizers.Tokenizer``)."""
    xgr = _xgr()
    if vocab_size is not None and (type(vocab_size) is not int or vocab_size < 1):
        raise ValueError(f"vocab_size must be an int >= 1 (the model's logits width), got {vocab_size!r}")
    stops = _stop_ids(stop_token_ids)
    if isinstance(tokenizer, xgr.TokenizerInfo):
        if vocab_size is not None and vocab_size != tokenizer.vocab_size:
            raise ValueError(
                f"vocab_size {vocab_size} does not match the TokenizerInfo's {tokenizer.vocab_size}"
            )
        if stops is not None and stops != list(tokenizer.stop_token_ids):
            raise ValueError(
                f"stop_token_ids {stops} do not match the TokenizerInfo's {tokenizer.stop_token_ids}"
            )
        _check_sizes(tokenizer.vocab_size, None, list(tokenizer.stop_token_ids))
        return tokenizer
    if not _is_tokenizers_tokenizer(tokenizer):
        if not callable(getattr(tokenizer, "get_vocab", None)):
            raise TypeError(
                "tokenizer must be a transformers tokenizer, a tokenizers.Tokenizer or an "
                f"xgrammar.TokenizerInfo, got {type(tokenizer).__name__}"
            )
        ids = tokenizer.get_vocab().values()
        _check_sizes(max(ids) + 1 if ids else 0, vocab_size, stops)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        _check_sizes(info.vocab_size, None, list(info.stop_token_ids))
        return info
    prefix_space = _byte_level_prefix_space(tokenizer)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    n_tokenizer = max(vocab.values()) + 1 if vocab else 0
    _check_sizes(n_tokenizer, vocab_size, stops)
    size = vocab_size or n_tokenizer
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    if stops is None:
        if not special:
            raise ValueError("the tokenizer has no special token to stop on: pass stop_token_ids")
        stops = sorted(special)
    # Special tokens are empty strings to xgrammar: never text inside the grammar's language.
    encoded = [""] * size
    for text, i in vocab.items():
        if i < size and i not in special:
            encoded[i] = text
    return xgr.TokenizerInfo(
        encoded,
        xgr.VocabType.BYTE_LEVEL,
        vocab_size=size,
        stop_token_ids=stops,
        add_prefix_space=prefix_space,
    )


class _JsonText:
    """What a JSON grammar's matchers need to check their output: each token's bytes
    (``xgrammar.TokenizerInfo.decoded_vocab``) and the stop tokens (no text of the document)."""

    __slots__ = ("decoded", "stops")

    def __init__(self, info: Any) -> None:
        self.decoded: list[bytes] = list(info.decoded_vocab)
        self.stops = frozenset(int(t) for t in info.stop_token_ids)

    def problem(self, tokens: list[int]) -> str | None:
        """Why ``tokens`` (stop tokens left out) are not one JSON document, or None."""
        text = b"".join(self.decoded[t] for t in tokens if t not in self.stops)
        try:
            json.loads(text.decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raw = sorted({f"{b:#04x}" for b in text if b < 0x20 and b not in b"\t\n\r "})
            why = f" (raw control characters {', '.join(raw)}: xgrammar #800)" if raw else ""
            return f"the grammar accepted output that is not valid JSON{why}: {exc}"
        return None


class XGrammarMatcher:
    """One request's ``xgrammar.GrammarMatcher`` (a :class:`tfuture.grammars.Matcher`).

    A JSON grammar's matcher keeps the tokens it accepted and checks, in :meth:`invalid`, that
    they parse: xgrammar's ``maxLength`` string rule lets raw control characters through
    (upstream, xgrammar #800), so an accepted output may not be JSON."""

    __slots__ = ("_json", "_m", "_out")

    def __init__(self, matcher: Any, json_text: _JsonText | None = None) -> None:
        self._m = matcher
        self._json = json_text
        self._out: list[int] | None = [] if json_text is not None else None

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of ``bitmask`` (int32 ``[n, ceil(vocab / 32)]``, host, C-contiguous)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        ok = bool(self._m.accept_token(token))
        if ok and self._out is not None:
            self._out.append(token)
        return ok

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculative decoding's drafts)."""
        if n > 0:
            self._m.rollback(n)
            if self._out is not None:
                del self._out[-n:]

    def invalid(self) -> str | None:
        """Why the accepted output is not a JSON document after all (a JSON grammar's only),
        or None."""
        if self._json is None or self._out is None:
            return None
        return self._json.problem(self._out)


class XGrammar:
    """A compiled xgrammar grammar (a :class:`tfuture.grammars.Grammar`): ``vocab`` and matchers."""

    def __init__(self, compiled: Any, vocab: int, json_text: _JsonText | None = None) -> None:
        self.compiled, self._vocab, self._json = compiled, vocab, json_text

    @property
    def vocab(self) -> int:
        return self._vocab

    def matcher(self) -> XGrammarMatcher:
        # Unlimited rollback (the default of xgrammar >= 0.2; older ones default to none).
        return XGrammarMatcher(_xgr().GrammarMatcher(self.compiled, max_rollback_tokens=-1), self._json)


class XGrammarCompiler:
    """Compiles grammars for one tokenizer and model (``xgrammar.GrammarCompiler``, with its cache).

    Args:
        tokenizer: a transformers tokenizer, a byte-level ``tokenizers.Tokenizer`` or an
            ``xgrammar.TokenizerInfo``.
        vocab_size: the model's logits width (default: the tokenizer's vocabulary size); a
            ``ValueError`` if smaller than the tokenizer's vocabulary.
        stop_token_ids: the tokens that end a request (default: the tokenizer's end token); a
            ``ValueError`` names any that lies outside the vocabulary.
        max_threads: xgrammar's compile threads.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: int | Sequence[int] | None = None,
        max_threads: int = 8,
    ) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab: int = self.info.vocab_size
        self.stop_token_ids: list[int] = list(self.info.stop_token_ids)
        self._compiler = _xgr().GrammarCompiler(self.info, max_threads=max_threads)
        self._json: _JsonText | None = None  # made by the first JSON grammar

    def _json_text(self) -> _JsonText:
        if self._json is None:
            self._json = _JsonText(self.info)
        return self._json

    def json_schema(
        self,
        schema: str | dict[str, Any],
        *,
        any_whitespace: bool = False,
        strict: bool = True,
        **options: Any,
    ) -> XGrammar:
        """Outputs that are JSON documents valid under ``schema`` (a dict or its JSON text).

        ``any_whitespace=False`` (the default here, xgrammar's is True) allows no free
        whitespace: with ``additionalProperties: false`` and bounded fields the language is
        finite, so every request ends. ``strict``: xgrammar's ``strict_mode`` (no properties or
        items beyond the schema's). ``options`` go to ``compile_json_schema`` (``indent``,
        ``separators``, ``max_whitespace_cnt``, ``any_order``).

        xgrammar's ``maxLength`` string rule lets raw control characters through (upstream,
        xgrammar #800), so an output the grammar accepted may not parse: its matchers check
        the output when it ends (:meth:`XGrammarMatcher.invalid`), and the schedulers finish
        such a request with reason ``"invalid"`` (and a ``RuntimeWarning``).
        """
        if not isinstance(schema, str | dict):
            raise TypeError(f"schema must be a dict or a JSON string, got {type(schema).__name__}")
        text = schema if isinstance(schema, str) else json.dumps(schema)
        compiled = self._compile(
            "JSON schema",
            lambda: self._compiler.compile_json_schema(
                text, any_whitespace=any_whitespace, strict_mode=strict, **options
            ),
        )
        return XGrammar(compiled, self.vocab, self._json_text())

    def builtin_json(self) -> XGrammar:
        """Any JSON document (xgrammar's built-in JSON grammar); unbounded, so set ``max_new``."""
        compiled = self._compile("built-in JSON grammar", self._compiler.compile_builtin_json_grammar)
        return XGrammar(compiled, self.vocab, self._json_text())

    def ebnf(self, grammar: str, root: str = "root") -> XGrammar:
        """A grammar in xgrammar's EBNF dialect, starting at rule ``root``."""
        if not isinstance(grammar, str):
            raise TypeError(f"grammar must be an EBNF string, got {type(grammar).__name__}")
        compiled = self._compile(
            "EBNF grammar", lambda: self._compiler.compile_grammar(grammar, root_rule_name=root)
        )
        return XGrammar(compiled, self.vocab)

    @staticmethod
    def _compile(what: str, compile_fn: Any) -> Any:
        try:
            return compile_fn()
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"xgrammar could not compile the {what}: {exc}") from exc
