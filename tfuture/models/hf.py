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

Llama, Mistral, Qwen2 and Qwen3 models whose modules are exactly transformers' own run the same
ops without the module calls (:mod:`tfuture.models.hf_direct`; 0.83x the module path's time per
step on a 3M-parameter Llama on CPU at batch 1, ``python -m perf bench_direct``):
used only where a construction probe finds their logits equal to the modules' bit for bit, and
left for the modules at any step after a forward hook was registered or a module swapped.

Sliding-window layers (Mistral, Mixtral, Qwen2/Qwen3 with ``layer_types``, Gemma2, Gemma3,
Phi-3, Starcoder2, gpt-oss) attend within their window as transformers masks them (see
:mod:`tfuture.models.hf_config`; transformers >= 4.53, tested on 5.24.0). Keys and values may
differ in shape (DeepSeek-V2/V3's latent attention): the pool holds each in its own.

What is refused at construction (nothing of the model changes then): other limited attention
below ``max_len`` (``attention_chunk_size``, other ``*window``/``*window_size`` keys, layer
types other than full and sliding, bidirectional attention; sliding windows on transformers
< 4.53), a rope type whose frequencies follow the step's longest position (``"dynamic"``,
``"longrope"``) when ``max_len`` passes the original context, and, found by a one-token probe
forward (:mod:`tfuture.models.hf_probe`), architectures whose layers do not hand the attention
kwargs to the attention function (StableLM, Nemotron: the pooled attention would never see the
step; Falcon, Bloom, MPT do not use the attention interface at all), whose head shapes differ
between layers, or whose attention calls carry a window other than the one their config gives.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch
from tfuture.models.hf_config import check_rope, layer_windows
from tfuture.models.hf_direct import DirectForward, attention_call
from tfuture.models.hf_probe import STEP_KW, Call, Probe, binding, describe, inner_fn, probed
from tfuture.models.kv_pool import KVPool, StepLayout
from tfuture.streams.backends import stream_host_thread

__all__ = ["HFCausalLM"]

_PREFIX = "tfuture_"
_INNER = ("sdpa", "eager")
_CLAIM_LOCK = threading.Lock()


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "tfuture.models.hf needs transformers: from a clone of tfuture, pip install -e '.[hf]'"
        ) from e
    return transformers


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
    layout: StepLayout | Probe | None = kwargs.pop(STEP_KW, None)
    fn = inner_fn(inner, module)
    if layout is None:
        return fn(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")
    if isinstance(layout, Probe):
        idx = getattr(module, "layer_idx", None)
        layout.calls.append(Call(idx, tuple(key.shape), tuple(value.shape), window))
        return fn(module, query, key, value, attention_mask, **kwargs)
    layer: int = module.layer_idx  # type: ignore[assignment]
    _check_window(layout, layer, window)
    kwargs["dropout"] = 0.0

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return fn(module, q, k, v, mask, **kwargs)[0]

    return layout.attend(layer, query, key, value, attn), None


def _check_window(layout: StepLayout, layer: int, window: object) -> None:
    """``ValueError`` when a layer's attention call carries a window other than the pool's for it
    (the probe checked each layer at construction: the model changed since)."""
    if window is not None and binding(window, layout.pool.max_len) != layout.pool.windows[layer]:
        raise ValueError(
            f"layer {layer} attends with sliding_window={window}, the KV pool gives it "
            f"{describe(layout.pool.windows[layer])} (max_len={layout.pool.max_len})"
        )


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
            yet reported in :attr:`tfuture.core.batch.Batch.ended`): at least the scheduler's
            ``max_running``. A step with more requests than rows, or a new request when every
            row is live, raises ``RuntimeError`` ("KV pool full", naming both numbers) at that
            step.
        max_len: positions per row (prompt plus generated tokens). Sliding-window layers
            (``config.sliding_window``, per ``config.layer_types``) are masked to their window;
            other limited attention below it (chunked attention, other window keys) and a rope
            type that depends on the step's longest position (``"dynamic"``, ``"longrope"``)
            with ``max_len`` past the original context are refused (``ValueError`` naming the
            config key or rope type and the limit).
        direct: run a Llama, Mistral, Qwen2 or Qwen3 model's ops without its module calls where
            that is exact (:mod:`tfuture.models.hf_direct`); ``False`` always calls the modules.

    Construction runs a one-token probe forward and refuses (``TypeError``) architectures the
    pooled attention cannot serve (see the module docstring); the model is left unchanged then.
    Wrapping the same model again skips the probe while its modules, attention implementation
    and windows (as its config gives them at ``max_len``) are the ones probed; another
    ``max_len`` alone only checks the probed attention calls' windows again (no forward).

    One run at a time: the first ``forward`` (or ``release``) of a run claims the adapter for
    that run's host thread and ``close()`` (called by the runtime when the run ends or fails)
    gives it back; another run's ``forward`` in the meantime raises ``RuntimeError``, and its
    ``close()`` leaves the KV pool alone. Give each concurrent runtime its own adapter (they
    may wrap the same model).

    ``pool.k``/``pool.v`` ``[n_layers, max_requests, max_len, heads, head_dim]`` (keys and values
    each with the head shape the model gives them) in the model's dtype, on its device,
    allocated once. ``forward`` reads only host mirrors on the host (no device sync) and
    returns logits ``[n_sample, vocab]`` for the sampling rows.
    """

    def __init__(self, model: Any, *, max_requests: int, max_len: int, direct: bool = True) -> None:
        _transformers()
        cfg = model.config
        impl = cfg._attn_implementation
        inner = impl.removeprefix(_PREFIX)
        if inner not in _INNER:
            raise ValueError(f"attention implementation must be one of {_INNER}, got {impl!r}")
        if type(direct) is not bool:
            raise TypeError(f"direct must be a bool, got {type(direct).__name__}")
        for arg, v in (("max_requests", max_requests), ("max_len", max_len)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{arg} must be an int >= 1, got {v!r}")
        windows = layer_windows(model, max_len)
        check_rope(model, max_len)
        name = _register(inner)
        _set_attention(model, name)
        if cfg._attn_implementation != name:
            _set_attention(model, impl)
            raise TypeError(f"{type(model).__name__} does not use transformers' AttentionInterface")
        training = model.training
        model.eval()
        try:
            shapes = probed(model, inner, max_len, windows)
        except BaseException:
            _set_attention(model, impl)  # refused: the model is left as it was
            model.train(training)
            raise
        self.model, self.inner = model, inner
        # The module path's ops without its module calls, where the probe found it exact.
        self._direct = DirectForward.build(model) if direct and shapes.direct else None
        param = next(model.parameters())
        self.vocab = cfg.vocab_size
        self._owner: threading.Thread | None = None  # the host thread of the run using the pool
        self.pool = KVPool(
            cfg.num_hidden_layers,
            max_requests,
            max_len,
            *shapes.key,
            dtype=param.dtype,
            device=param.device,
            value_shape=shapes.value,
            windows=windows,
        )

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters and of its KV pool: the FutureMap's must match."""
        return self.pool.k.device

    def _claim(self) -> None:
        """On the stream: the adapter belongs to the run whose op calls this (until ``close``)."""
        host = stream_host_thread()
        if self._owner is host:
            return
        with _CLAIM_LOCK:
            owner = self._owner
            if owner is not None and owner is not host:
                if owner.is_alive():
                    raise RuntimeError(
                        f"this HFCausalLM is in use by another running runtime (host thread "
                        f"{owner.name!r}): its KV pool serves one run at a time, and that run's "
                        "close() would free the rows under this one; give each runtime its own "
                        "HFCausalLM (they may wrap the same model)"
                    )
                self.pool.clear()  # its thread ended without close(): its rows are stale
            self._owner = host

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One batched forward over the step's real tokens; logits of ``batch.sample_rows``."""
        assert batch.host is not None, "ForwardBatch.host is set by TokenStep"
        self._claim()
        n_tok = batch.host.n_tokens
        if n_tok == 0:
            return torch.zeros(0, self.vocab, device=batch.input_ids.device)
        # Eager attention adds its mask to the scores: an additive float mask. SDPA makes one
        # with -inf from a bool mask in every call: built once here instead, rounding the same.
        fill = None if self.inner == "eager" else float("-inf")
        layout = StepLayout.build(self.pool, batch, additive=self.pool.k.dtype, fill=fill)
        direct = self._direct
        if direct is not None and direct.intact():
            with torch.no_grad():
                return direct.forward(
                    batch.input_ids[:n_tok], layout.tok_pos, batch.sample_rows, self._attend(layout)
                )
        with torch.no_grad():
            out = self.model(
                input_ids=batch.input_ids[None, :n_tok],
                position_ids=layout.tok_pos[None],
                # A 4D mask is used as is: the model builds none (and reads no cache length).
                attention_mask=layout.mask,
                use_cache=False,
                logits_to_keep=batch.sample_rows,
                **{STEP_KW: layout},
            )
        return out.logits[0]

    def _attend(self, layout: StepLayout) -> Any:
        """The direct forward's attention: the pooled attention through the model's own function."""
        direct = self._direct
        assert direct is not None
        # Looked up at each step, as the module path looks it up at each attention call.
        inner, fn = self.inner, inner_fn(self.inner, direct.layers[0].attn)
        window_of = direct.window_of

        def attend(
            layer: int, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            _check_window(layout, layer, window_of(module))
            return layout.attend(layer, q, k, v, attention_call(inner, fn, module))

        return attend

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        """Greedy: argmax of each row, after the optional bool ``mask [n_sample, vocab]``."""
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        return logits.argmax(dim=-1)

    def release(self, req_ids: np.ndarray) -> None:
        """Free the cache rows of ended requests (on the forward stream, after their last forward)."""
        self._claim()
        self.pool.release(req_ids)

    def close(self) -> None:
        """End of a run (on its host thread): every row is free again and the adapter is free
        for the next run (the tensors stay). A no-op when another run holds the adapter."""
        with _CLAIM_LOCK:
            if self._owner is not None and self._owner is not threading.current_thread():
                return
            self.pool.clear()
            self._owner = None

    def restore(self) -> None:
        """Give the model back its own attention implementation (``inner``, what it had before
        construction switched it to ``tfuture_<inner>``), e.g. for Hugging Face's
        ``generate_batch``, which refuses a foreign one. Construction also put the model in eval
        mode: ``model.train()`` is the caller's. Call it once no run uses this adapter, nor any
        other adapter over the same model: their forwards need the pooled attention."""
        _set_attention(self.model, self.inner)


def _set_attention(model: Any, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
