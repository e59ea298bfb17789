"""The three-line front door: :func:`generate` runs prompts on a one-off :class:`Engine`,
sized for them (KV rows for the prompts, positions for the longest prompt plus its
``max_tokens``, checked against the model's context)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tfuture.engine.detok import encode
from tfuture.engine.engine import Engine, OnTokens
from tfuture.engine.inputs import (
    Prompt,
    _check_tokenizer,
    _is_adapter,
    _len,
    _params_list,
    _prompt_list,
    context,
)
from tfuture.engine.outputs import GenerateResult
from tfuture.scheduler.options import GenerationParams

__all__ = ["generate"]

# generate()'s default cap on requests running at once (the KV pool's rows).
MAX_RUNNING = 32


def _check_fits(need: list[int], lens: list[int], ctx: tuple[int, str] | None) -> None:
    """``ValueError`` naming the first request (its id: its index) whose prompt plus
    ``max_tokens`` passes the model's context."""
    if ctx is None:
        return
    for rid, (n, m) in enumerate(zip(lens, need, strict=True)):
        if m > ctx[0]:
            raise ValueError(
                f"request {rid}: prompt of {n} tokens + max_tokens={m - n} = {m} positions exceeds the "
                f"model's context of {ctx[0]} positions ({ctx[1]}); ask for at most {ctx[0] - n} tokens "
                "or shorten the prompt"
                if n < ctx[0]
                else f"request {rid}: prompt of {n} tokens fills the model's context of {ctx[0]} positions "
                f"({ctx[1]}), leaving no room for a token"
            )


def generate(
    model: Any,
    prompts: Prompt | Sequence[Prompt],
    params: Any = None,
    *,
    tokenizer: Any = None,
    overlap: bool = True,
    on_tokens: OnTokens | None = None,
    progress: bool | None = None,
    max_running: int | None = None,
    max_len: int | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    trace: bool = False,
    **engine_kw: Any,
) -> GenerateResult:
    """Generate for ``prompts`` with ``model`` in three lines::

        model = AutoModelForCausalLM.from_pretrained(...); tok = AutoTokenizer.from_pretrained(...)
        out = tfuture.generate(model, ["Hello"], GenerationParams(max_tokens=32), tokenizer=tok)
        print(out[0].text, out[0].finish_reason, out[0].timings.ttft, out.stats.summary())

    ``model``: a ``transformers`` causal LM (wrapped in :class:`tfuture.models.HFCausalLM`),
    an ``HFCausalLM``, or any tfuture :class:`tfuture.Model`. ``prompts``: strings (need
    ``tokenizer``) or token id lists, or one of either. ``params``: a
    :class:`tfuture.scheduler.GenerationParams` for all, one per prompt, or None (vLLM's
    defaults: temperature 1, 16 tokens). ``max_running`` defaults to the number of prompts (at
    most 32) and ``max_len`` to the longest prompt plus its ``max_tokens`` (requests that
    ``on_tokens`` submits must fit). A request whose prompt plus ``max_tokens`` passes a
    Hugging Face model's context (``max_position_embeddings``, ``n_positions``) is refused
    with a ``ValueError`` naming it, the sum and the context, before anything runs:
    ``max_tokens`` is never cut silently. ``overlap=False`` runs in sync (A/B); ``trace=True``
    records the run's spans (device idle in ``stats.summary()``, ``stats.write_chrome_trace``;
    off by default, as everywhere: it costs host time per step). ``on_tokens``, ``progress``:
    see :meth:`Engine.generate`; ``engine_kw``: :class:`Engine`'s other options.

    Builds the engine (future map, KV pool, sampler, scheduler), runs on the calling thread,
    and returns a :class:`GenerateResult`: per request ``token_ids``, ``text`` (with a
    tokenizer), ``finish_reason`` and ``timings``, and the run's ``stats``.
    """
    _check_tokenizer(tokenizer)
    plist = _prompt_list(prompts)
    gp = _params_list(params, len(plist))
    if not plist:
        return GenerateResult([], None)
    if max_running is None:
        max_running = min(len(plist), MAX_RUNNING)
    if max_len is None and not _is_adapter(model):
        lens = [
            len(encode(tokenizer, p)) if isinstance(p, str) and tokenizer is not None else _len(p)
            for p in plist
        ]
        need = [
            n + (g if g is not None else GenerationParams()).max_tokens for n, g in zip(lens, gp, strict=True)
        ]
        _check_fits(need, lens, context(model))
        max_len = max(need)
    engine = Engine(
        model,
        tokenizer=tokenizer,
        max_running=max_running,
        max_len=max_len,
        overlap=overlap,
        eos_token_id=eos_token_id,
        trace=trace,
        **engine_kw,
    )
    with engine:
        return engine.generate(plist, gp, on_tokens=on_tokens, progress=progress)
