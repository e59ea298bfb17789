"""Drive a Hugging Face causal LM (``transformers``, the ``[hf]`` extra) through the runtime.

:class:`HFCausalLM` wraps any ``AutoModelForCausalLM``-style model whose attention goes
through ``transformers``' ``AttentionInterface`` (Llama, Qwen2, Mistral, ... in transformers
>= 4.51; tested on 4.51.0, 4.52.4, 4.53.3 and 5.24.0). Each step runs ONE forward over the packed
tokens of every request (prefill chunks and decodes mixed, ``position_ids`` = prefix + offset,
so rotary embeddings see true positions), and projects only ``sample_rows`` to logits.

The cache is our own :class:`tfuture.models.kv_pool.KVPool`, not an HF ``Cache``: the Cache API
changes between releases (5.x renamed its argument), the attention function interface does
not. The adapter switches the model's attention to ``tfuture_<inner>`` (``inner`` = ``sdpa``
or ``eager``, what the model had): during the adapter's forward it writes the step's K/V into
the pool and attends over each request's cached row through the inner function with an
explicit mask; without the adapter's step (``generate``, training) it is exactly ``inner``.
Sliding-window and other non-full attention layers are not supported.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch
from tfuture.models.kv_pool import KVPool, StepLayout

__all__ = ["HFCausalLM"]

_STEP_KW = "tfuture_step"
_PREFIX = "tfuture_"
_INNER = ("sdpa", "eager")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("tfuture.models.hf needs transformers: pip install 'tfuture[hf]'") from e
    return transformers


def _inner_fn(inner: str, module: torch.nn.Module) -> Any:
    if inner == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    # Eager attention is per model (softcapping, scaling): the function beside the module's class.
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise TypeError(f"{type(module).__name__} has no eager_attention_forward beside it")
    return fn


def _pool_attention(
    inner: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered ``tfuture_<inner>`` attention: over the KV pool inside an adapter step."""
    layout: StepLayout | None = kwargs.pop(_STEP_KW, None)
    fn = _inner_fn(inner, module)
    if layout is None:
        return fn(module, query, key, value, attention_mask, **kwargs)
    kwargs["dropout"] = 0.0

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return fn(module, q, k, v, mask, **kwargs)[0]

    return layout.attend(module.layer_idx, query, key, value, attn), None  # type: ignore[arg-type]


def _register(inner: str) -> str:
    """Register ``tfuture_<inner>`` once (attention, and the mask of ``inner`` for ``generate``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = _PREFIX + inner
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, functools.partial(_pool_attention, inner))
        try:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        except ImportError:  # before 4.53 models build their masks themselves
            return name
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


class HFCausalLM:
    """A :class:`tfuture.core.batch.Model` over a Hugging Face causal LM with a pooled KV cache.

    Args:
        model: a ``transformers`` causal LM (``PreTrainedModel`` with ``lm_head``), put in eval
            mode; its attention implementation must be ``sdpa`` or ``eager``.
        max_requests: cache rows: requests that may be live at once (running, or ended but not
            yet reported in :attr:`tfuture.core.batch.Batch.ended`).
        max_len: positions per row (prompt plus generated tokens).

    ``pool.k``/``pool.v`` ``[n_layers, max_requests, max_len, n_kv_heads, head_dim]`` in the
    model's dtype, on its device, allocated once. ``forward`` reads only host mirrors on the
    host (no device sync) and returns logits ``[n_sample, vocab]`` for the sampling rows.
    """

    def __init__(self, model: Any, *, max_requests: int, max_len: int) -> None:
        _transformers()
        cfg = model.config
        impl = cfg._attn_implementation
        inner = impl.removeprefix(_PREFIX)
        if inner not in _INNER:
            raise ValueError(f"attention implementation must be one of {_INNER}, got {impl!r}")
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"only full-attention layers are supported, got layer_types={sorted(set(layer_types))}"
            )
        name = _register(inner)
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(name)
        else:
            cfg._attn_implementation = name
        if cfg._attn_implementation != name:
            raise TypeError(f"{type(model).__name__} does not use transformers' AttentionInterface")
        self.model, self.inner = model.eval(), inner
        param = next(model.parameters())
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        self.vocab = cfg.vocab_size
        self.pool = KVPool(
            cfg.num_hidden_layers,
            max_requests,
            max_len,
            n_kv,
            head_dim,
            dtype=param.dtype,
            device=param.device,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One batched forward over the step's real tokens; logits of ``batch.sample_rows``."""
        assert batch.host is not None, "ForwardBatch.host is set by TokenStep"
        n_tok = batch.host.n_tokens
        if n_tok == 0:
            return torch.zeros(0, self.vocab, device=batch.input_ids.device)
        layout = StepLayout.build(self.pool, batch)
        if self.inner == "eager":
            # Eager attention adds its mask to the scores: an additive float mask.
            dtype = self.pool.k.dtype
            additive = torch.zeros(layout.mask.shape, dtype=dtype, device=layout.mask.device)
            layout = replace(layout, mask=additive.masked_fill_(~layout.mask, torch.finfo(dtype).min))
        with torch.no_grad():
            out = self.model(
                input_ids=batch.input_ids[None, :n_tok],
                position_ids=layout.tok_pos[None],
                # A 4D mask is used as is: the model builds none (and reads no cache length).
                attention_mask=layout.mask,
                use_cache=False,
                logits_to_keep=batch.sample_rows,
                **{_STEP_KW: layout},
            )
        return out.logits[0]

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        """Greedy: argmax of each row, after the optional bool ``mask [n_sample, vocab]``."""
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        return logits.argmax(dim=-1)

    def release(self, req_ids: np.ndarray) -> None:
        """Free the cache rows of ended requests (on the forward stream, after their last forward)."""
        self.pool.release(req_ids)

    def close(self) -> None:
        """End of a run: every row is free again (the tensors stay, for the next run)."""
        self.pool.clear()
