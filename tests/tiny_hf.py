"""Tiny random-weight Hugging Face models built from configs in code (nothing downloaded),
shared by the model tests (importable from any test folder; needs the ``hf`` extra)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

VOCAB = 64
# Two layers, GQA (4 query heads, 2 KV heads), no special tokens.
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny(config: str, attn: str = "sdpa", **kw: Any) -> Any:
    """A random-weight (seed 0) model of ``transformers.<config>`` with :data:`TINY` updated by
    ``kw``, in eval mode (skipped where this transformers has no such config)."""
    import transformers

    cls = getattr(transformers, config, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config}")
    torch.manual_seed(0)
    cfg = cls(**{**TINY, **kw})
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
