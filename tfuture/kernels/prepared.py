"""The fused input preparation's outputs and host argument checks (:mod:`tfuture.kernels.resolve`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from tfuture.kernels import cpu
from tfuture.kernels._common import INT_DTYPES, as_int, check_err, check_same_device, check_vector


class PreparedInputs(NamedTuple):
    """Outputs of :func:`prepare_inputs`, padded to fixed shapes."""

    input_ids: torch.Tensor  # [n_rows], resolved tokens; padding rows hold 0
    positions: torch.Tensor  # [n_rows] int64, prefix_len + offset in segment; padding rows 0
    last_rows: torch.Tensor  # [n_reqs] int64, row of each request's last token (sampler rows)


def check_prepare_args(
    tokens: object,
    seg_starts: object,
    prefix_lens: object,
    token_map: object,
    n_rows: object,
    out: object,
    err: object,
) -> tuple[int, PreparedInputs | None]:
    """:func:`prepare_inputs`' checks; returns ``n_rows`` as an int and ``out`` as a
    :class:`PreparedInputs` (or None)."""
    check_vector("token_map", token_map)
    assert isinstance(token_map, torch.Tensor)
    for name, t in (("tokens", tokens), ("seg_starts", seg_starts), ("prefix_lens", prefix_lens)):
        check_vector(name, t)
        assert isinstance(t, torch.Tensor)
        check_same_device(name, t, "token_map", token_map)
    assert isinstance(tokens, torch.Tensor) and isinstance(seg_starts, torch.Tensor)
    assert isinstance(prefix_lens, torch.Tensor)
    n_reqs = prefix_lens.numel()
    if seg_starts.numel() != n_reqs + 1:
        raise ValueError(
            f"seg_starts must have len(prefix_lens) + 1 = {n_reqs + 1} entries, got {seg_starts.numel()}"
        )
    rows = tokens.numel() if n_rows is None else as_int("n_rows", n_rows)
    if rows < tokens.numel():
        raise ValueError(f"n_rows must be >= len(tokens) = {tokens.numel()}, got {rows}")
    if out is not None:
        if not isinstance(out, PreparedInputs):
            if isinstance(out, torch.Tensor) or not isinstance(out, Sequence) or len(out) != 3:
                got = type(out).__name__
                got = f"a {got} of {len(out)}" if isinstance(out, Sequence) else got
                raise TypeError(f"out must be a PreparedInputs (or 3 tensors), got {got}")
            out = PreparedInputs(*out)
        for name, t, size, dtypes in zip(
            PreparedInputs._fields,
            out,
            (rows, rows, n_reqs),
            (INT_DTYPES, (torch.int64,), (torch.int64,)),
            strict=True,
        ):
            check_vector(f"out.{name}", t, dtypes)
            check_same_device(f"out.{name}", t, "token_map", token_map)
            if t.numel() != size:
                raise ValueError(f"out.{name} must have {size} entries, got {t.numel()}")
    if err is not None:
        check_err(err, token_map)
    return rows, out


def check_segments(seg_starts: torch.Tensor, prefix_lens: torch.Tensor) -> None:
    """Host check of CPU segment data (no sync): ``ValueError`` naming the first malformed entry."""
    msg = cpu.segment_error(seg_starts.numpy(), prefix_lens.numpy())
    if msg is not None:
        raise ValueError(msg)
