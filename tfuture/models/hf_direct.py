"""A direct forward for Llama-structured decoders: the modules' own ops, without their calls.

A Hugging Face forward of a small model spends most of its time in Python: module calls,
decorators, output recording, kwargs. :class:`DirectForward` runs the same tensor ops in the same
order on the same tensors (so the logits are bit for bit the module path's) for the
architectures whose decoder is Llama's: ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` (its query and key norms). It reads the modules'
parameters at every call (weights loaded or swapped later are used), and attends through the
adapter's pooled attention with the model's own attention function (``sdpa`` or ``eager``).

It is used only where it is exact: :func:`DirectForward.build` takes a model whose modules are
exactly the architecture's classes (no LoRA, quantized or patched layer, no instance
``forward``), and the adapter's construction probe compares its logits with the module path's,
bit for bit (``tfuture.models.hf_probe._direct_exact``). At every step :meth:`DirectForward.intact`
checks that no module was swapped and that no forward hook was registered since (hooks run
only on the module path); otherwise the adapter runs the modules.

Tested on transformers 5.25.0 (torch 2.13, CPU). On other releases the construction probe
decides: where the modules' code differs (an op added, a branch), the logits differ and the
modules run.

Multi-token steps (prefill, verification) of grouped-query layers on the CPU through
transformers' own sdpa function run SDPA with ``enable_gqa`` instead of on ``repeat_kv``'s copies
of the keys and values (:func:`attention_call`): bit for bit the same there
(``tests/models/test_hf_direct.py`` sweeps shapes and dtypes), without the copies.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

__all__ = ["DirectForward", "attention_call"]


def _no_window(attn: nn.Module) -> object:
    return None


def _config_window(attn: nn.Module) -> object:
    return getattr(attn.config, "sliding_window", None)


def _module_window(attn: nn.Module) -> object:
    return getattr(attn, "sliding_window", None)


# Architectures whose decoder layer is Llama's (pre-norm attention and gated MLP, rotary
# embeddings from one module per model): whether queries and keys are normalized per head
# (Qwen3), and the ``sliding_window`` each attention call passes, read where the module reads it.
_ARCHS: dict[str, tuple[bool, Callable[[nn.Module], object]]] = {
    "Llama": (False, _no_window),
    "Mistral": (False, _config_window),
    "Qwen2": (False, _module_window),
    "Qwen3": (True, _module_window),
}

# (layer index, attention module, q [1, heads, n, head_dim], k, v [1, kv_heads, n, d]) -> [1, n, heads, v_dim]
Attend = Callable[[int, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rms(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` (and Mistral's, Qwen2's, Qwen3's): float32 variance, weight last."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _linear(layer: Any, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


@dataclass(frozen=True, slots=True)
class _Layer:
    decoder: Any  # the modules, typed loosely: their attributes are the architecture's
    attn: Any
    mlp: Any


class DirectForward:
    """The module path's forward of one model, op for op; see the module docstring."""

    def __init__(self, model: Any, qk_norm: bool, window_of: Callable[[nn.Module], object]) -> None:
        self.model, self.qk_norm = model, qk_norm
        #: The ``sliding_window`` the module path's attention call would pass for a layer.
        self.window_of = window_of
        inner = model.model
        self.inner: Any = inner
        self.layers = [_Layer(d, d.self_attn, d.mlp) for d in inner.layers]
        # The modeling module: its apply_rotary_pos_emb is looked up at each step, as the
        # attention's forward looks it up at each call.
        self._mod = sys.modules[type(self.layers[0].attn).__module__]
        # Per module the direct path stands for: its parent's child table, its name there, itself,
        # its class, and the dicts a hook, an instance forward or a compiled call would land in;
        # each parent's number of children (one added or removed); each class's forward (the
        # class patched). Read at every step.
        tree = [
            (parent._modules, name, child)
            for parent in model.modules()
            for name, child in parent._modules.items()
        ]
        tree.append(({"": model}, "", model))
        self._watch = [
            (table, name, child, type(child), child._forward_hooks, child._forward_pre_hooks, child.__dict__)
            for table, name, child in tree
            if child is not None
        ]
        self._sizes = list({id(table): (table, len(table)) for table, _, _ in tree}.values())
        self._forwards = list({cls: (cls, cls.forward) for *_, cls, _, _, _ in self._watch}.values())

    @staticmethod
    def build(model: Any) -> DirectForward | None:
        """A :class:`DirectForward` of ``model``, or None where its modules are not exactly
        those of a supported architecture (the adapter then runs the modules)."""
        name = type(model).__name__
        prefix = name.removesuffix("ForCausalLM")
        if prefix == name or prefix not in _ARCHS:
            return None
        qk_norm, window_of = _ARCHS[prefix]
        mod = sys.modules.get(type(model).__module__)
        want = {
            f"{prefix}{k}"
            for k in ("Model", "DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding")
        }
        for m in model.modules():
            if "forward" in m.__dict__ or m.__dict__.get("_compiled_call_impl") is not None:
                return None
            cls = type(m)
            if cls in (nn.Linear, nn.Embedding, nn.ModuleList) or cls is type(model):
                continue
            if cls.__name__ not in want or getattr(mod, cls.__name__, None) is not cls:
                if not (cls.__module__.startswith("transformers.activations") or cls in (nn.SiLU, nn.GELU)):
                    return None
        inner = getattr(model, "model", None)
        if inner is None or type(getattr(model, "lm_head", None)) is not nn.Linear:
            return None
        if getattr(mod, "apply_rotary_pos_emb", None) is None:
            return None
        for d in inner.layers:
            a = d.self_attn
            if qk_norm != (hasattr(a, "q_norm") and hasattr(a, "k_norm")):
                return None
            if not all(hasattr(a, k) for k in ("head_dim", "scaling", "layer_idx")):
                return None
        return DirectForward(model, qk_norm, window_of)

    def intact(self) -> bool:
        """No module swapped, added, removed, compiled or given another class since :meth:`build`,
        no class's ``forward`` patched, no forward hook or instance ``forward``, and no global
        forward hook: the direct path still is the module path."""
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
            return False
        for table, name, child, cls, hooks, pre_hooks, attrs in self._watch:
            if (
                table.get(name) is not child
                or type(child) is not cls
                or hooks
                or pre_hooks
                or "forward" in attrs
                or attrs.get("_compiled_call_impl") is not None
            ):
                return False
        for table, n in self._sizes:
            if len(table) != n:
                return False
        return all(cls.forward is fwd for cls, fwd in self._forwards)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, sample_rows: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Logits ``[len(sample_rows), vocab]`` of the packed tokens ``input_ids [n]`` at
        ``positions [n]`` (int64); each layer's attention goes through ``attend``."""
        inner, n = self.inner, input_ids.shape[0]
        e = inner.embed_tokens  # nn.Embedding.forward's call, argument for argument
        x = F.embedding(
            input_ids[None], e.weight, e.padding_idx, e.max_norm, e.norm_type, e.scale_grad_by_freq, e.sparse
        )
        cos, sin = inner.rotary_emb(x, positions[None])
        rope = self._mod.apply_rotary_pos_emb
        for layer in self.layers[: inner.config.num_hidden_layers]:  # as the model iterates them
            a, mlp, d = layer.attn, layer.mlp, layer.decoder
            h = _rms(d.input_layernorm, x)
            shape = (1, n, -1, a.head_dim)
            q = _linear(a.q_proj, h).view(shape)
            k = _linear(a.k_proj, h).view(shape)
            if self.qk_norm:
                q, k = _rms(a.q_norm, q), _rms(a.k_norm, k)
            q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            v = _linear(a.v_proj, h).view(shape).transpose(1, 2)
            out = attend(a.layer_idx, a, q, k, v).reshape(1, n, -1).contiguous()
            x = x + _linear(a.o_proj, out)
            h = _rms(d.post_attention_layernorm, x)
            x = x + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, h)) * _linear(mlp.up_proj, h))
        x = _rms(inner.norm, x)
        return _linear(self.model.lm_head, x[:, sample_rows])[0]

    def matches(self, inner: str, fn: Any) -> bool:
        """Whether this forward and the model's modules give the same logits, bit for bit, on
        steps of 1 and 5 random tokens, each attending causally through ``fn`` (the model's
        ``inner`` = ``"sdpa"`` or ``"eager"`` attention function)."""
        gen = torch.Generator().manual_seed(0)
        return all(self._equal(inner, fn, n, gen) for n in (1, 5))

    def _equal(self, inner: str, fn: Any, n: int, gen: torch.Generator) -> bool:
        model = self.model
        param = next(model.parameters())
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).to(param.device)
        pos = torch.arange(n, device=param.device)
        fill = torch.finfo(param.dtype).min if inner == "eager" else float("-inf")
        mask = torch.zeros((1, 1, n, n), dtype=param.dtype, device=param.device)
        mask.masked_fill_(pos[None, :] > pos[:, None], fill)

        def attend(
            layer: int, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            return attention_call(inner, fn, module)(q, k, v, mask)

        with torch.no_grad():
            kw = dict(position_ids=pos[None], attention_mask=mask, use_cache=False, logits_to_keep=pos)
            want = model(input_ids=ids[None], **kw).logits[0]
            got = self.forward(ids, pos, pos, attend)
        return got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


# SDPA takes grouped-query keys and values as they are (``enable_gqa``) from torch 2.5.
_TORCH_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
AttnCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_call(inner: str, fn: Any, module: Any) -> AttnCall:
    """The direct forward's attention call for ``module``'s layer, ``(q, k, v, mask) -> [n, width,
    heads, v_dim]``: ``fn`` (the model's sdpa or eager function) as the module path calls it. A
    multi-token query of a grouped-query layer on the CPU, through transformers' own sdpa
    function, runs SDPA with ``enable_gqa`` instead (the construction probe checks it bit for bit
    on a 5-token step); any other registered sdpa function runs as it is."""
    scaling = module.scaling

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return fn(module, q, k, v, mask, dropout=0.0, scaling=scaling)[0]

    if inner != "sdpa" or not _TORCH_GQA or getattr(module, "num_key_value_groups", 1) <= 1:
        return call
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if fn is not sdpa_attention_forward:
        return call

    def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if q.shape[2] == 1 or q.device.type != "cpu":
            return call(q, k, v, mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous()

    return grouped
