"""What a user asks of one request: :class:`GenerationParams`, with vLLM's names and defaults.

:class:`tfuture.sampling.SamplingParams` is what the device sampler reads (greedy by default, a
seed always set); :class:`GenerationParams` is the front door: the length limit, stop tokens and
structured output with the sampling knobs, converted by :meth:`GenerationParams.sampling_params`.
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tfuture.core.params import SEED_LIMIT, SamplingParams

__all__ = ["GenerationParams"]


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"GenerationParams.{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """One request's options: vLLM's ``SamplingParams`` names and defaults where they overlap.

    Attributes:
        max_tokens: tokens to generate at most (default 16, as vLLM); an int ``>= 1``.
        temperature: default 1.0 (as vLLM); ``0`` (or below 1e-5) is greedy.
        top_p: ``(0, 1]``, 1 = off.
        top_k: ``0`` or ``-1`` = off (both accepted, as in vLLM), else keep the k most likely.
        min_p: ``[0, 1]``, 0 = off.
        seed: ``None`` (default): fresh randomness, a random seed drawn for the request when it
            is submitted; an int in ``[0, 2**63)`` makes the request reproducible.
        stop_token_ids: tokens that end the request, in addition to the model's end tokens.
        ignore_eos: do not stop at the model's end tokens (``stop_token_ids`` still stop).
        presence_penalty, frequency_penalty: subtracted from the logits of tokens in the
            output (once, and once per occurrence); 0 = off.
        repetition_penalty: tokens in the prompt or output get ``logit / r`` (positive logit)
            or ``logit * r``; 1 = off.
        json_schema: structured output: the output is a JSON document valid under this schema
            (a dict or its JSON text; compiled with xgrammar for the engine's tokenizer). One
            that xgrammar accepted but does not parse (a raw control character in a string with
            ``maxLength``, xgrammar #800) finishes with reason ``"invalid"``.
        speculative: on an engine built with ``speculative=`` (a drafter), False makes this
            request decode plainly (no drafts) beside the others; ignored elsewhere.
        grammar: structured output: a :class:`tfuture.grammars.Grammar` (compiled already) or
            an xgrammar EBNF string (root rule ``root``). At most one of the two.

    Converted by :meth:`sampling_params`: ``top_k=-1`` becomes 0, ``seed=None`` a random seed,
    ``temperature=0`` greedy. Checked when built: a bad value raises ``TypeError`` or
    ``ValueError`` naming the field, the range and what came.

    Differences from vLLM's ``SamplingParams`` (V1 engine):

    * **Filter order**: tfuture applies top-k, then top-p, then min-p (each on the
      temperature-scaled distribution the previous one left); vLLM's V1 sampler applies min-p
      *before* top-k and top-p (its V0 sampler applied it after, as tfuture does). With min-p
      and top-p (or top-k) both on, the kept sets can differ.
    * **Random streams**: a seeded token is ``uniform_draws(seed, position)`` (a SplitMix64
      hash, inverse-CDF pick over a stable sort), so the same seed gives other tokens than
      vLLM's per-request ``torch.Generator``; ``seed=None`` draws a seed per request instead of
      using a global generator.
    * **Ranges**: the penalties take ``[-1e6, 1e6]`` (vLLM: ``[-2, 2]``), ``repetition_penalty``
      ``[1e-6, 1e6]``, ``temperature`` at most 1e6, ``top_p`` at least 1e-30 (float32 meaning).
    * ``max_tokens=None`` ("up to the context length") is refused: give a limit.
    * **Stop tokens**: the output's ``token_ids`` end with the stop token that ended them; the
      text leaves out special tokens (a non-special stop token's text stays, as in vLLM).
    * **Not supported**: ``n``/``best_of``, ``stop`` strings, ``min_tokens``, ``logprobs`` and
      ``prompt_logprobs``, ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
      ``include_stop_str_in_output``, ``detokenize``/``skip_special_tokens`` switches,
      ``truncate_prompt_tokens``; structured output is ``json_schema``/``grammar`` here, not
      ``guided_decoding``/``structured_outputs`` (no regex or choice). Each of these raises a
      ``TypeError`` naming the field and what to do instead.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: dict[str, Any] | str | None = None
    grammar: Any = None
    speculative: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            raise ValueError(
                "GenerationParams.max_tokens must be an int >= 1, got None (vLLM's 'up to the context "
                "length' is not supported: give a limit)"
            )
        max_tokens = _int("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise ValueError(f"GenerationParams.max_tokens must be an int >= 1, got {max_tokens}")
        object.__setattr__(self, "max_tokens", max_tokens)
        top_k = _int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"GenerationParams.top_k must be -1 or 0 (off) or an int >= 1, got {top_k}")
        object.__setattr__(self, "top_k", top_k)
        if self.seed is not None:
            seed = _int("seed", self.seed)
            if not 0 <= seed < SEED_LIMIT:
                raise ValueError(f"GenerationParams.seed must be None or an int in [0, 2**63), got {seed}")
            object.__setattr__(self, "seed", seed)
        stops: Any = self.stop_token_ids
        if isinstance(stops, int | np.integer) and not isinstance(stops, bool):
            stops = (stops,)
        if isinstance(stops, str | bytes) or not isinstance(stops, Sequence | set | frozenset | np.ndarray):
            raise TypeError(f"GenerationParams.stop_token_ids must be a list of token ids, got {stops!r}")
        ids = tuple(_int("stop_token_ids[]", t) for t in stops)
        if any(t < 0 for t in ids):
            raise ValueError(f"GenerationParams.stop_token_ids must be token ids >= 0, got {list(ids)}")
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.speculative, bool | np.bool_):
            raise TypeError(f"GenerationParams.speculative must be a bool, got {self.speculative!r}")
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise TypeError(f"GenerationParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.json_schema is not None and self.grammar is not None:
            raise ValueError("GenerationParams takes json_schema or grammar, not both")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, dict | str):
                got = type(self.json_schema).__name__
                raise TypeError(f"GenerationParams.json_schema must be a dict or a JSON string, got {got}")
            if isinstance(self.json_schema, str):
                try:
                    json.loads(self.json_schema)
                except ValueError as e:
                    raise ValueError(f"GenerationParams.json_schema is not valid JSON: {e}") from None
        if self.grammar is not None and not isinstance(self.grammar, str):
            if not (hasattr(self.grammar, "matcher") and hasattr(self.grammar, "vocab")):
                raise TypeError(
                    "GenerationParams.grammar must be a tfuture.grammars.Grammar (vocab, matcher()) or an "
                    f"EBNF string, got {type(self.grammar).__name__}"
                )
        # The sampling fields: SamplingParams' own checks, named for this class.
        self._sampling(0)

    @property
    def greedy(self) -> bool:
        return self._sampling(0).greedy

    @property
    def structured(self) -> bool:
        """True when the request has a JSON schema or a grammar."""
        return self.json_schema is not None or self.grammar is not None

    def sampling_params(self, seed: int | None = None) -> SamplingParams:
        """The device sampler's :class:`SamplingParams`: ``top_k`` -1 as 0, temperature 0 greedy,
        and the seed: ``self.seed``, else ``seed``, else a fresh random one (``secrets``)."""
        if self.seed is not None:
            seed = self.seed
        elif seed is None:
            seed = secrets.randbelow(SEED_LIMIT)
        return self._sampling(seed)

    def _sampling(self, seed: int) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_k=max(self.top_k, 0),
                top_p=self.top_p,
                min_p=self.min_p,
                seed=seed,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
                repetition_penalty=self.repetition_penalty,
            )
        except (TypeError, ValueError) as e:
            raise type(e)(str(e).replace("SamplingParams.", "GenerationParams.")) from None


_SEVERAL = "one output per request: submit the prompt that many times (seed=None draws a seed each)"
_NO_LOGPROBS = "not supported: outputs carry token ids (RequestOutput.token_ids), not log-probabilities"
_STRUCTURED = "give json_schema= (a JSON schema) or grammar= (EBNF or a Grammar) instead"
# vLLM SamplingParams fields that GenerationParams does not take, and what to do instead.
_UNSUPPORTED = {
    "n": _SEVERAL,
    "best_of": _SEVERAL,
    "stop": "stop strings are not supported: give stop_token_ids= (token ids that end the request)",
    "min_tokens": "not supported: a request may end at its first token (ignore_eos=True never stops on EOS)",
    "logprobs": _NO_LOGPROBS,
    "prompt_logprobs": _NO_LOGPROBS,
    "logit_bias": "not supported",
    "allowed_token_ids": "not supported (a grammar= can restrict the tokens)",
    "bad_words": "not supported",
    "include_stop_str_in_output": "stop strings are not supported: the stop token is always in token_ids",
    "detokenize": "not supported: text is decoded when the engine has a tokenizer",
    "skip_special_tokens": "not supported: text always leaves special tokens out",
    "spaces_between_special_tokens": "not supported",
    "truncate_prompt_tokens": "not supported: a prompt is never truncated",
    "guided_decoding": _STRUCTURED,
    "structured_outputs": _STRUCTURED,
}


def _refuse_unknown(init: Any) -> Any:
    """``GenerationParams.__init__`` that names an unknown keyword (a vLLM-only field says what
    to do instead) rather than Python's bare 'unexpected keyword argument'."""
    names = GenerationParams.__dataclass_fields__

    @functools.wraps(init)
    def __init__(self: GenerationParams, *args: Any, **kw: Any) -> None:
        for key in kw:
            if key not in names:
                hint = _UNSUPPORTED.get(key)
                if hint is not None:
                    raise TypeError(
                        f"GenerationParams does not take {key}= (a vLLM SamplingParams field): {hint}"
                    )
                raise TypeError(f"GenerationParams has no field {key!r}; its fields: {', '.join(names)}")
        init(self, *args, **kw)

    return __init__


GenerationParams.__init__ = _refuse_unknown(GenerationParams.__init__)  # type: ignore[method-assign]
