"""What :mod:`tfuture.engine.engine` does to its inputs before a run: prompts and parameters
normalised and checked, a Hugging Face model wrapped in :class:`tfuture.models.HFCausalLM`, the
end tokens, device and vocab found, the progress bar, the run's thread context and stats merged.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tfuture.engine.detok import tokenizer_eos
from tfuture.engine.model_state import wrap
from tfuture.scheduler.options import GenerationParams
from tfuture.streams.stats import RunStats

Prompt = str | Sequence[int] | np.ndarray

# An idle Engine's KV rows for a Hugging Face model without max_len: the context, at most this.
DEFAULT_MAX_LEN = 4096
# Where a Hugging Face config gives the model's context (trained positions), in this order.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def _count(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)


def _is_adapter(model: object) -> bool:
    """Whether ``model`` is an :class:`tfuture.models.HFCausalLM` (without importing the hf extra)."""
    hf = sys.modules.get("tfuture.models.hf")
    return hf is not None and isinstance(model, hf.HFCausalLM)


def _is_hf_model(model: object) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def _check_tokenizer(tokenizer: Any) -> None:
    """``TypeError`` unless ``tokenizer`` is None or an object that encodes and decodes (a name
    is refused: nothing is loaded or downloaded at run time)."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, str | bytes | os.PathLike):
        raise TypeError(
            f"tokenizer must be a tokenizer object, got the {type(tokenizer).__name__} {tokenizer!r}: "
            "tfuture loads nothing by name (no download); pass e.g. "
            f"transformers.AutoTokenizer.from_pretrained({str(tokenizer)!r}) or a tokenizers.Tokenizer"
        )
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(
            "tokenizer must have encode(text) and decode(ids) (a transformers tokenizer or a "
            f"tokenizers.Tokenizer), got {type(tokenizer).__name__}"
        )


def _check_model(model: Any) -> None:
    """``TypeError`` for a model that gives no next-token logits: a plain torch layer, or a
    Hugging Face model without a language-model head (a base ``LlamaModel``, a classifier)."""
    if _is_hf_model(model):
        get_head = getattr(model, "get_output_embeddings", None)
        if not callable(get_head) or get_head() is None:
            raise TypeError(
                f"model is a {type(model).__name__}, which has no language-model head "
                "(get_output_embeddings() is None), so it gives no next-token logits: load it with "
                "transformers.AutoModelForCausalLM"
            )
    elif isinstance(model, torch.nn.Module) and type(model).__module__.startswith("torch."):
        raise TypeError(
            f"model is a plain torch {type(model).__name__}, not a causal LM: pass a transformers "
            "causal LM (AutoModelForCausalLM), a tfuture.models.HFCausalLM, or a tfuture Model "
            "(forward(batch: ForwardBatch) -> logits)"
        )


def context(model: Any) -> tuple[int, str] | None:
    """A Hugging Face model's context: the positions it was trained for and the config key
    that says so (``max_position_embeddings``, GPT-2's ``n_positions``, ...); None when the
    model is not a Hugging Face one (or its config does not say)."""
    if _is_adapter(model):
        model = model.model
    if not _is_hf_model(model):
        return None
    cfg = model.config
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        cfg = get_text()
    aliases = getattr(cfg, "attribute_map", None) or {}
    for key in _CONTEXT_KEYS:
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, f"config.{aliases.get(key, key)}"  # the key the config really has
    return None


def _check_context(max_len: int, ctx: tuple[int, str] | None, extra: int = 0) -> None:
    """Refuse ``max_len`` (plus ``extra`` positions that drafts or a multi-step window may run
    past a request's end) beyond the model's context ``ctx``."""
    if ctx is not None and max_len > ctx[0]:
        raise ValueError(
            f"max_len={max_len} positions per request exceeds the model's context of {ctx[0]} "
            f"positions ({ctx[1]}): positions past it were never trained (a RoPE model gives wrong "
            "tokens silently, a learned-position model fails)"
        )
    if ctx is not None and max_len + extra > ctx[0]:
        raise ValueError(
            f"max_len={max_len} positions per request plus the {extra} that speculative drafts or a "
            f"multi-step window may run past a request's end exceed the model's context of {ctx[0]} "
            f"positions ({ctx[1]}; a learned-position model fails there): give max_len <= "
            f"{ctx[0] - extra}, or fewer drafts or window steps"
        )


def _adapt(
    model: Any, max_running: int, max_len: int | None
) -> tuple[Any, int | None, Callable[[], None] | None]:
    """The model the runtime drives, the positions of its KV rows (``max_len``: the caller
    checked it against the context with :func:`_check_context`; without it, the context
    bounds them; None: unchecked), and for a Hugging Face model wrapped here, what gives its
    state back (see :mod:`tfuture.engine.model_state`)."""
    _check_model(model)
    ctx = context(model)
    if _is_adapter(model):
        pool = model.pool
        if pool.n_rows < max_running:
            raise ValueError(
                f"the HFCausalLM has {pool.n_rows} KV rows (max_requests), fewer than "
                f"max_running={max_running}"
            )
        if max_len is not None and max_len > pool.max_len:
            raise ValueError(
                f"max_len={max_len} exceeds the HFCausalLM's KV rows of {pool.max_len} positions"
            )
        return model, max_len or min(pool.max_len, ctx[0] if ctx is not None else pool.max_len), None
    if _is_hf_model(model):
        if max_len is None:
            max_len = min(ctx[0] if ctx is not None else DEFAULT_MAX_LEN, DEFAULT_MAX_LEN)
        adapter, give_back = wrap(model, max_running, max_len)
        return adapter, max_len, give_back
    if not callable(getattr(model, "forward", None)):
        raise TypeError(
            "model must be a transformers PreTrainedModel, a tfuture.models.HFCausalLM or a tfuture Model "
            f"(forward(batch) -> logits), got {type(model).__name__}"
        )
    return model, max_len, None


def _vocab(model: Any) -> int | None:
    for name in ("vocab", "vocab_size"):
        v = getattr(model, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _ids_of(value: object, what: str) -> tuple[int, ...]:
    items = [value] if isinstance(value, int | np.integer) else value
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise TypeError(f"{what} must be a token id or a list of them, got {value!r}")
    ids = tuple(int(t) for t in items)
    if any(t < 0 for t in ids):
        raise ValueError(f"{what} must be token ids >= 0, got {list(ids)}")
    return ids


def _eos(explicit: object, model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The end tokens: ``explicit``, else the model's (generation config, then config), else
    the tokenizer's."""
    if explicit is not None:
        return _ids_of(explicit, "eos_token_id")
    src = model.model if _is_adapter(model) else model
    for holder in (getattr(src, "generation_config", None), getattr(src, "config", None), src):
        eos = getattr(holder, "eos_token_id", None) if holder is not None else None
        if eos is not None:
            return _ids_of(eos, "the model's eos_token_id")
    return tokenizer_eos(tokenizer) if tokenizer is not None else ()


def _device(model: Any, device: str | torch.device | None) -> torch.device:
    if _is_adapter(model):
        return model.pool.k.device
    if device is not None:
        return torch.device(device)
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device | str):
        return torch.device(dev)
    params = getattr(model, "parameters", None)
    if callable(params):
        p = next(iter(params()), None)
        if p is not None:
            return p.device
    return torch.device("cpu")


def _token_ids(prompt: object) -> np.ndarray:
    if isinstance(prompt, np.ndarray):
        a = prompt
    elif isinstance(prompt, list | tuple):
        a = np.asarray(prompt) if len(prompt) else np.empty(0, dtype=np.int64)
    else:
        raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise TypeError(f"a token-id prompt must be a flat list of ints, got {a.dtype} of shape {a.shape}")
    return a.astype(np.int64, copy=False)


def _len(prompt: Prompt) -> int:
    if isinstance(prompt, str):
        raise ValueError("a text prompt needs a tokenizer: pass tokenizer=...")
    return int(_token_ids(prompt).size)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A list of prompts: one str or one token-id list/array becomes a list of one."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a str, a list of token ids, or a list of those, got {prompts!r}")
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt of token ids
    return items


def _params_list(params: Any, n: int) -> list[GenerationParams | None]:
    if params is None or isinstance(params, GenerationParams):
        return [params] * n
    if isinstance(params, Sequence) and not isinstance(params, str):
        if len(params) != n:
            raise ValueError(
                f"params has {len(params)} entries for {n} prompts (one per prompt, or one for all)"
            )
        return list(params)
    raise TypeError(
        "params must be a GenerationParams, a list of them (one per prompt) or None, got "
        f"{type(params).__name__}"
    )


def _progress_bar(progress: bool | None, total: int) -> Any:
    """A tqdm bar over requests: ``None`` only on a terminal and for calls over a second."""
    if progress is False:
        return None
    if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        if progress:
            raise ImportError("generate(progress=True) needs tqdm: pip install tqdm") from None
        return None
    return tqdm(total=total, unit="req", desc="tfuture.generate", delay=0.0 if progress else 1.0)


@contextlib.contextmanager
def _run_context(device: torch.device) -> Iterator[None]:
    """A run's thread state: inference mode, and the map's CUDA device current."""
    with torch.inference_mode():
        if device.type == "cuda":
            with torch.cuda.device(device):
                yield
        else:
            yield


def _merge(a: RunStats | None, b: RunStats | None) -> RunStats | None:
    """One :class:`RunStats` for consecutive runs."""
    if a is None or b is None:
        return a if b is None else b
    out = RunStats(
        mode=a.mode,
        steps=a.steps + b.steps,
        tokens=a.tokens + b.tokens,
        wall=a.wall + b.wall,
        host_spans=a.host_spans + b.host_spans,
        device_spans=a.device_spans + b.device_spans,
    )
    return out  # its device totals are accounted from the spans when read
