"""The construction probe of :class:`tfuture.models.hf.HFCausalLM`, kept per model.

:func:`probed` runs one one-token forward of a wrapped model through the pooled attention
(``tfuture_<inner>``, registered by the adapter) with a :class:`Probe` as the step: every layer's
attention call is recorded, and an architecture the pooled attention cannot serve is refused
(``TypeError``/``ValueError`` naming it). It also decides whether the direct forward
(:mod:`tfuture.models.hf_direct`) gives the module path's logits bit for bit. Its result is kept
per model while nothing it depends on changed.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from tfuture.models.hf_config import arch
from tfuture.models.hf_direct import DirectForward

__all__ = ["STEP_KW", "Call", "Probe", "Shapes", "binding", "describe", "inner_fn", "probed"]

STEP_KW = "tfuture_step"  # the forward kwarg that carries the step (a StepLayout or a Probe)


@dataclass(frozen=True, slots=True)
class Call:
    """One attention call seen by the construction probe."""

    layer: int | None
    key: tuple[int, ...]
    value: tuple[int, ...]
    window: object


@dataclass(slots=True)
class Probe:
    """Passed as the step during the construction probe: records every attention call."""

    calls: list[Call] = field(default_factory=list)


def inner_fn(inner: str, module: torch.nn.Module) -> Any:
    if inner == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    # Eager attention is per model (softcapping, scaling): the function beside the module's class.
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise TypeError(f"{type(module).__name__} has no eager_attention_forward beside it")
    return fn


def binding(window: object, max_len: int) -> int | None:
    """An attention call's ``sliding_window`` kwarg as the KV pool stores it (``None``: never binds)."""
    if isinstance(window, int) and not isinstance(window, bool) and window < max_len:
        return window
    return None


def describe(window: int | None) -> str:
    return "full attention" if window is None else f"a window of {window}"


@dataclass(frozen=True, slots=True)
class Shapes:
    """What every layer writes into the KV pool: key and value ``(heads, head_dim)``; whether
    the direct forward gives the module path's logits bit for bit (:func:`_direct_exact`)."""

    key: tuple[int, int]
    value: tuple[int, int]
    direct: bool = False


def _probe(model: Any, inner: str) -> tuple[tuple[Call, ...], Shapes]:
    """One-token forward through the registered attention: every layer's attention call and
    the key and value head shapes every layer writes; ``TypeError`` naming the architecture
    when a layer does not hand the step to its attention or the head shapes differ between
    layers. Nothing here depends on ``max_len`` (:func:`_check_windows` does)."""
    arch_, cfg = arch(model), model.config
    param = next(model.parameters())
    probe = Probe()
    if inner == "eager":
        mask = torch.zeros((1, 1, 1, 1), dtype=param.dtype, device=param.device)
    else:
        mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=param.device)
    ids = torch.zeros((1, 1), dtype=torch.int64, device=param.device)
    try:
        with torch.no_grad():
            model(
                input_ids=ids,
                position_ids=ids,
                attention_mask=mask,
                use_cache=False,
                logits_to_keep=1,
                **{STEP_KW: probe},
            )
    except Exception as e:
        raise TypeError(
            f"{arch_}: a one-token probe forward through tfuture's pooled attention failed "
            f"({type(e).__name__}: {e})"
        ) from e
    n_layers = cfg.num_hidden_layers
    if not probe.calls:
        raise TypeError(
            f"{arch_}: its decoder layers call the attention function without the attention kwargs, "
            "so the pooled attention would never see the step (each request would attend over its "
            "own new tokens only); not supported"
        )
    layers = sorted(c.layer for c in probe.calls if c.layer is not None)
    if len(layers) < len(probe.calls) or layers != list(range(n_layers)):
        raise TypeError(
            f"{arch_}: every one of its {n_layers} layers must call the attention function once per "
            f"forward with the attention kwargs and a layer_idx, got the calls of layers "
            f"{[c.layer for c in probe.calls]}; not supported"
        )
    first = probe.calls[0]
    shapes = Shapes((first.key[1], first.key[-1]), (first.value[1], first.value[-1]))
    for c in probe.calls:
        if Shapes((c.key[1], c.key[-1]), (c.value[1], c.value[-1])) != shapes:
            raise TypeError(
                f"{arch_}: the key/value head shapes differ between layers (layer 0: key {shapes.key}, "
                f"value {shapes.value}; layer {c.layer}: key {c.key[1], c.key[-1]}, value "
                f"{c.value[1], c.value[-1]}); not supported"
            )
    try:
        direct = _direct_exact(model, inner, probe.calls)
    except Exception:  # the direct forward does not fit this model: the modules run it
        direct = False
    return tuple(probe.calls), Shapes(shapes.key, shapes.value, direct)


def _check_windows(
    model: Any, calls: tuple[Call, ...], max_len: int, windows: tuple[int | None, ...]
) -> None:
    """``ValueError`` naming the architecture when a layer's attention call (``calls``, from the
    probe) carries a window other than the one its config gives at ``max_len`` (``windows``)."""
    for c in calls:
        assert c.layer is not None
        # Models that mask without passing the window (PhiMoE, Qwen2-MoE) pass None: the config decides.
        if c.window is not None and binding(c.window, max_len) != windows[c.layer]:
            raise ValueError(
                f"{arch(model)}: layer {c.layer} attends with sliding_window={c.window!r}, its config gives "
                f"it {describe(windows[c.layer])} (max_len={max_len}): the pooled attention cannot tell "
                "which one its masks follow; not supported"
            )


def _direct_exact(model: Any, inner: str, calls: list[Call]) -> bool:
    """Whether :class:`DirectForward` applies to ``model``, reads each layer's window where its
    attention call did in the probe (``calls``), and gives the module path's logits bit for bit
    (:meth:`DirectForward.matches`)."""
    direct = DirectForward.build(model)
    if direct is None:
        return False
    if any(direct.window_of(direct.layers[c.layer].attn) != c.window for c in calls if c.layer is not None):
        return False
    return direct.matches(inner, inner_fn(inner, direct.layers[0].attn))


# Probe results by model: wrapping a model again (every tfuture.generate call wraps it) with the
# same modules, attention and windows skips the probe, a whole forward and the direct forward's
# comparison (about 20 ms at 3M parameters and 150 ms at 80M on the CPU). ``max_len`` is not in the
# key, only the windows the config gives at it (they change only where max_len crosses a layer's
# window: never for a model without sliding windows): a generate call whose
# prompts or max_tokens differ from the last one's reuses the calls, and only the window check (no
# forward) runs again. A config whose window changed since (the calls carry the window the
# attention read then) is probed again. A few keys per model.
_PROBED: weakref.WeakKeyDictionary[Any, dict[tuple[object, ...], tuple[tuple[Call, ...], Shapes]]] = (
    weakref.WeakKeyDictionary()
)
_PROBED_LOCK = threading.Lock()
_PROBED_PER_MODEL = 8


def probed(model: Any, inner: str, max_len: int, windows: tuple[int | None, ...]) -> Shapes:
    """:func:`_probe`, or its result for this model when nothing it depends on changed since: the
    same attention, the same ``windows`` (the config's at ``max_len``) and the same module
    objects with the same classes, class ``forward`` functions and instance ``forward``
    overrides (a layer swapped, or patched on itself or on its class, is probed again); then the
    calls' windows checked against ``windows`` at ``max_len`` (:func:`_check_windows`, every
    time). The few most recently used results per model are kept; refusals are not."""
    key = (
        inner,
        windows,
        tuple((id(m), type(m), id(m.__dict__.get("forward")), type(m).forward) for m in model.modules()),
    )
    with _PROBED_LOCK:
        seen = _PROBED.get(model)
        got = None if seen is None else seen.pop(key, None)
        if got is not None:
            assert seen is not None
            seen[key] = got  # the most recently used goes last: the oldest is dropped first
    if got is None:
        got = _probe(model, inner)
        with _PROBED_LOCK:
            seen = _PROBED.setdefault(model, {})
            seen[key] = got
            while len(seen) > _PROBED_PER_MODEL:
                del seen[next(iter(seen))]  # the least recently used
    calls, shapes = got
    _check_windows(model, calls, max_len, windows)
    return shapes
