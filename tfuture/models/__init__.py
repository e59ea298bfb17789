"""Adapters that drive real models through the runtime (``transformers`` is imported lazily)."""

from tfuture.models.hf import HFCausalLM
from tfuture.models.kv_pool import KVPool, StepLayout

__all__ = ["HFCausalLM", "KVPool", "StepLayout"]
