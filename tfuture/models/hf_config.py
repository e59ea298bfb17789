"""What a Hugging Face config says about attention that the pooled attention must reproduce.

:func:`layer_windows`: each layer's sliding window, read as ``transformers`` reads it to build
its masks (``masking_utils``, transformers >= 4.53): with ``config.layer_types``, a
``"sliding_attention"`` layer attends within ``config.sliding_window`` and a
``"full_attention"`` layer over the whole prefix; without it, a ``sliding_window`` that is
set windows every layer (Mistral, Mixtral, Phi-3, Starcoder2; Qwen2's ``use_sliding_window=False``
switches it off). Any other non-full attention (chunked, linear, bidirectional, an unknown
``*window`` key) is refused when it binds below ``max_len``.

:func:`check_rope`: rope types whose frequencies follow the longest position of the forward
(``"dynamic"``, ``"longrope"``) would tie a request's tokens to the others in its step (all
requests share one ``position_ids`` row); refused when ``max_len`` passes the original context,
where the frequencies are fixed.
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["check_rope", "layer_windows"]

FULL, SLIDING = "full_attention", "sliding_attention"
_BATCH_ROPE = ("dynamic", "longrope")


def arch(model: Any) -> str:
    return f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r})"


def _sizes(value: object) -> list[int]:
    """The ints in a config value (an int, or a per-layer list of them, nested or with None)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list | tuple):
        return [v for item in value for v in _sizes(item)]
    return []


def _masks_from_layer_types() -> bool:
    """Whether this transformers builds its masks in ``masking_utils`` (>= 4.53), whose window
    semantics :mod:`tfuture.models.kv_pool` reproduces; older models build their own."""
    return importlib.util.find_spec("transformers.masking_utils") is not None


def _other_windows(model: Any, max_len: int) -> None:
    """Refuse any window-like config key but the top-level ``sliding_window`` that binds below ``max_len``."""
    todo: list[tuple[str, dict[str, Any]]] = [("", model.config.to_dict())]
    while todo:
        where, d = todo.pop()
        for key, value in d.items():
            if isinstance(value, dict):
                todo.append((f"{where}{key}.", value))
                continue
            if not isinstance(key, str) or not (
                key.endswith(("window", "window_size")) or key == "attention_chunk_size"
            ):
                continue
            if where == "" and key == "sliding_window":
                continue  # read per layer by layer_windows
            small = [v for v in _sizes(value) if v < max_len]
            if small:
                raise ValueError(
                    f"{arch(model)}: config.{where}{key}={value!r} limits attention below the KV pool's "
                    f"max_len={max_len} in a way the pooled attention does not reproduce (only "
                    f"config.sliding_window is supported; build the adapter with max_len <= {min(small)}, "
                    "or use a model without it)"
                )


def layer_windows(model: Any, max_len: int) -> tuple[int | None, ...]:
    """Per layer, the sliding window that binds below ``max_len`` (query ``i`` sees keys ``j``
    with ``i - window < j <= i``), or ``None`` for full attention.

    Raises ``ValueError`` naming the config key for attention the pooled attention does not
    reproduce (other layer types, bidirectional or chunked attention, windows on transformers
    < 4.53 where each model masks in its own way)."""
    cfg, name = model.config, arch(model)
    n_layers = cfg.num_hidden_layers
    _other_windows(model, max_len)
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{name}: config.use_bidirectional_attention=True is not causal; not supported")
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", None) is False or isinstance(window, bool):
        window = None
    if window is not None and (type(window) is not int or window < 1):
        raise ValueError(f"{name}: config.sliding_window must be an int >= 1 or None, got {window!r}")
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = [SLIDING if window is not None else FULL] * n_layers
    types = list(types)
    others = sorted({str(t) for t in types} - {FULL, SLIDING})
    if others or len(types) != n_layers:
        raise ValueError(
            f"{name}: config.layer_types must give {FULL!r} or {SLIDING!r} for each of its {n_layers} "
            f"layers, got {len(types)} entries with {others or 'no other types'}; not supported"
        )
    if SLIDING in types and window is None:
        raise ValueError(f"{name}: config.layer_types has {SLIDING!r} layers, config.sliding_window is None")
    windows = tuple(window if t == SLIDING and window < max_len else None for t in types)  # type: ignore[operator]
    if any(w is not None for w in windows) and not _masks_from_layer_types():
        raise ValueError(
            f"{name}: config.sliding_window={window} is below the KV pool's max_len={max_len}, and this "
            "transformers (< 4.53, without masking_utils) builds sliding masks per model; upgrade "
            f"transformers or build the adapter with max_len <= {window}"
        )
    return windows


def _rope_limits(module: Any, cfg: Any) -> list[tuple[str, int]]:
    """``(rope type, original context)`` of a rotary module's batch-dependent rope types."""
    types = module.rope_type
    per_type = types.items() if isinstance(types, dict) else [(None, types)]
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    params = params if isinstance(params, dict) else {}
    out = []
    for layer_type, rope_type in per_type:
        if not isinstance(rope_type, str) or not any(t in rope_type for t in _BATCH_ROPE):
            continue
        p = params.get(layer_type, params) if layer_type is not None else params
        # The smallest context any of them names: below all of them the frequencies are fixed.
        found = [
            getattr(module, "original_max_seq_len", None),
            p.get("original_max_position_embeddings") if isinstance(p, dict) else None,
            getattr(cfg, "original_max_position_embeddings", None),
            getattr(cfg, "max_position_embeddings", None),
        ]
        ints = [v for v in found if isinstance(v, int) and not isinstance(v, bool)]
        out.append((rope_type, min(ints, default=0)))  # none named: no context is known safe
    return out


def check_rope(model: Any, max_len: int) -> None:
    """Raise ``ValueError`` when a rope type picks its frequencies from the longest position of
    the forward (``"dynamic"``, ``"longrope"``) and ``max_len`` passes the original context."""
    for module in model.modules():
        if not hasattr(module, "rope_type"):
            continue
        for rope_type, limit in _rope_limits(module, model.config):
            if max_len > limit:
                raise ValueError(
                    f"{arch(model)}: rope type {rope_type!r} picks its frequencies from the longest position "
                    f"in the forward, and every request of a step shares one forward, so a short request's "
                    f"tokens would depend on a long one beside it; max_len={max_len} passes the original "
                    f"context of {limit} positions, where the frequencies start to change (build the "
                    f"adapter with max_len <= {limit})"
                )
