"""Checks and shaping of a token step's sampler inputs: the forward's logits, and the mask a
delayed step's scheduler builds (a bool ``[rows, vocab]`` mask or a packed int32
``[rows, ceil(vocab / 32)]`` bitmask), taken on the host and readied for the forward stream."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tfuture.kernels.bitmask import empty_bitmask_rows

__all__ = ["check_logits", "check_mask", "check_rows", "check_width", "mask_on_stream", "ready_mask", "widen"]


def check_logits(logits: object, n: int, step: int) -> torch.Tensor:
    """The forward's logits as the sampler needs them: a ``[n_sample, vocab]`` float tensor."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != n:
        got = (
            f"{logits.dtype} {tuple(logits.shape)}"
            if isinstance(logits, torch.Tensor)
            else type(logits).__name__
        )
        raise ValueError(f"forward of step {step} must return [n_sample={n}, vocab] logits, got {got}")
    return logits


def check_width(mask: torch.Tensor, vocab: int, step: int) -> None:
    """Raise unless ``mask`` has the columns of ``vocab`` (bool) or ``ceil(vocab / 32)`` (packed)."""
    width = vocab if mask.dtype == torch.bool else -(-vocab // 32)
    if mask.shape[1] != width:
        what = "vocab" if mask.dtype == torch.bool else "ceil(vocab / 32)"
        raise ValueError(
            f"build_mask of step {step}: the mask must have {what} = {width} columns for the model's "
            f"vocab of {vocab}, got {mask.shape[1]}"
        )


def widen(mask: torch.Tensor, rows: np.ndarray, n: int) -> torch.Tensor:
    """A host ``mask`` of sampling rows ``rows`` as one of all ``n`` rows, the others allowing
    every token (for a model that samples every row at once)."""
    fill = True if mask.dtype == torch.bool else -1
    full = torch.full((n, mask.shape[1]), fill, dtype=mask.dtype, device=mask.device)
    full[torch.from_numpy(rows).to(mask.device)] = mask
    return full


def check_mask(mask: object, reqs: np.ndarray, step: int, vocab: int | None) -> torch.Tensor:
    """``mask`` for the waiting rows of requests ``reqs`` (their ids): a bool ``[m, vocab]``
    mask or a packed int32 ``[m, ceil(vocab / 32)]`` bitmask; on the host, every row allows a
    token (of the first ``vocab``, once known). Returns it as a row-major tensor (a copy when
    it came with other strides)."""
    m = reqs.size
    t = mask if isinstance(mask, torch.Tensor) else torch.as_tensor(mask)
    if t.dim() != 2 or t.shape[0] != m or t.dtype not in (torch.bool, torch.int32):
        raise ValueError(
            f"build_mask of step {step} must return a bool [rows={m}, vocab] mask or a packed int32 "
            f"[rows={m}, ceil(vocab / 32)] bitmask, got {t.dtype} of shape {tuple(t.shape)}"
        )
    if t.stride() != (t.shape[1], 1):
        # Row-major with contiguous rows, as the bitmask kernel and the unpacking need: a
        # column-major (or empty, odd-strided) mask is copied here, on the host, not refused
        # later on the stream. A mask built row-major costs nothing.
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    if vocab is not None:
        check_width(t, vocab, step)
    if not t.is_cuda:
        check_rows(t, reqs, step, vocab)
    return t


def check_rows(t: torch.Tensor, reqs: np.ndarray, step: int, vocab: int | None) -> None:
    """Raise unless every row of the host mask ``t`` allows one of the first ``vocab`` tokens
    (all of its columns or bits when ``vocab`` is None): an empty row would sample token 0
    silently. On the host this costs no sync."""
    if not reqs.size:
        return
    if t.dtype == torch.bool:
        empty = np.flatnonzero(~t[:, :vocab].any(dim=1).numpy())
    else:
        empty = empty_bitmask_rows(t, vocab)
    if empty.size:
        raise ValueError(
            f"build_mask of step {step}: the mask row of request id {int(reqs[empty[0]])} "
            f"(mask row {int(empty[0])}) allows no token ({empty.size} such row(s))"
        )


def ready_mask(state: Any, mask: object, step: int, vocab: int | None, to_cuda: bool) -> None:
    """HOST: check a delayed step's mask into ``state.mask`` (a
    :class:`tfuture.steps.token_state.TokenState`): every row of ``state.mask_rows`` allows a
    token, and the width when ``vocab`` is known; rows the mask does not cover are widened in.
    ``to_cuda``: ready it for a CUDA forward stream (pinned, or an event after its producer)."""
    reqs = state.host.req_ids[state.sample_reqs[state.mask_rows]]
    state.mask = check_mask(mask, reqs, step, vocab)
    if vocab is None and not state.mask.is_cuda:
        # Not known before the first sample: rows that allow only padding bits (tokens
        # past the vocab) are found on the stream, from this host tensor (no sync).
        state.unchecked = reqs
    if state.mask_rows.size < state.late.size:
        state.mask = widen(state.mask, state.mask_rows, state.late.size)
    if not to_cuda:
        return
    if state.mask.is_cuda:
        # Built on the caller's stream: the forward stream must wait for it.
        state.mask_ready = torch.cuda.Event()
        state.mask_ready.record()
    else:
        # Pinned (torch's caching host allocator keeps it until the copy ran): a truly
        # async H2D copy, where pageable memory may make the host wait.
        state.mask = state.mask.pin_memory()


def mask_on_stream(state: Any, step: int, device: torch.device) -> torch.Tensor:
    """FORWARD STREAM: ``state.mask`` on ``device``, after its producer's event, its rows checked
    against the logits' vocab first when the host could not check them (``state.unchecked``)."""
    if state.unchecked is not None:
        vocab = int(check_logits(state.logits, state.n_sample, step).shape[1])
        check_width(state.mask, vocab, step)
        check_rows(state.mask, state.unchecked, step, vocab)
    if state.mask_ready is not None:
        torch.cuda.current_stream(state.mask.device).wait_event(state.mask_ready)
    return state.mask.to(device, non_blocking=True)
