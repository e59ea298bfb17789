"""The speculative step's per-row arithmetic on the forward stream, each with its numpy twin.

Four pieces of :class:`tfuture.spec.SpecTokenStep` between verification and the slots: the true
positions of the requests that verify (their host prefix is only a bound), each sampling request's
new length, each fresh slot's copy of it (its ``seq_len`` field), and the tokens stored into the
step's fresh slots. Each is a ``*_torch`` function for a device and a ``*_numpy`` twin for the
CPU, where a numpy op costs a few microseconds against several for a torch op on the CPU worker's
critical path; the unsuffixed name picks by the tensors' device (tests compare each pair on the
CPU). Inputs are the step's staged :data:`tfuture.spec.staging.DraftInputs` (``inputs``) as
device views.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = [
    "new_lengths",
    "new_lengths_numpy",
    "new_lengths_torch",
    "out_lengths",
    "out_lengths_numpy",
    "out_lengths_torch",
    "store_tokens",
    "store_tokens_numpy",
    "store_tokens_torch",
    "true_positions",
    "true_positions_numpy",
    "true_positions_torch",
]


def true_positions(fwd: Any, inputs: Any, seq_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`true_positions_torch`, or its numpy twin for CPU tensors."""
    shift = true_positions_numpy if seq_len.device.type == "cpu" else true_positions_torch
    return shift(fwd, inputs, seq_len)


def true_positions_torch(fwd: Any, inputs: Any, seq_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ON THE STREAM: ``fwd``'s positions and seq_lens with each verifying request's host bound
    (``inputs.spec_prefix``) replaced by its true prefix, its previous step's ``seq_len`` field
    (``seq_len [slots]`` int64) minus its last token. New tensors; ``fwd``'s are not written."""
    delta = seq_len.index_select(0, inputs.spec_slots) - 1 - inputs.spec_prefix
    positions = fwd.positions.clone()
    positions.index_add_(0, inputs.spec_tok, delta.index_select(0, inputs.spec_tok_of))
    return positions, fwd.seq_lens.clone().index_add_(0, inputs.spec_reqs, delta)


def true_positions_numpy(fwd: Any, inputs: Any, seq_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`true_positions_torch` on the CPU, with numpy; a verifying request's token rows are its
    own, so each row is shifted once."""
    delta = seq_len.numpy()[inputs.spec_slots.numpy()] - 1 - inputs.spec_prefix.numpy()
    positions, seq_lens = fwd.positions.numpy().copy(), fwd.seq_lens.numpy().copy()
    positions[inputs.spec_tok.numpy()] += delta[inputs.spec_tok_of.numpy()]
    seq_lens[inputs.spec_reqs.numpy()] += delta
    return torch.from_numpy(positions), torch.from_numpy(seq_lens)


def new_lengths(seq_lens: torch.Tensor, inputs: Any, n_commit: torch.Tensor) -> torch.Tensor:
    """:func:`new_lengths_torch`, or its numpy twin for CPU tensors."""
    lengths = new_lengths_numpy if seq_lens.device.type == "cpu" else new_lengths_torch
    return lengths(seq_lens, inputs, n_commit)


def new_lengths_torch(seq_lens: torch.Tensor, inputs: Any, n_commit: torch.Tensor) -> torch.Tensor:
    """ON THE STREAM: ``[n_sample]`` int64, each sampling request's length after the step: its
    true length with every verified draft (``seq_lens``, the step's) less the drafts it
    verified, plus the tokens it committed (``n_commit [n_sample]``)."""
    return seq_lens.index_select(0, inputs.sample_idx) - inputs.n_verify + n_commit


def new_lengths_numpy(seq_lens: torch.Tensor, inputs: Any, n_commit: torch.Tensor) -> torch.Tensor:
    """:func:`new_lengths_torch` on the CPU, with numpy."""
    real = seq_lens.numpy()[inputs.sample_idx.numpy()]
    return torch.from_numpy(real - inputs.n_verify.numpy() + n_commit.numpy())


def out_lengths(new_len: torch.Tensor, inputs: Any) -> torch.Tensor:
    """:func:`out_lengths_torch`, or its numpy twin for CPU tensors."""
    lengths = out_lengths_numpy if new_len.device.type == "cpu" else out_lengths_torch
    return lengths(new_len, inputs)


def out_lengths_torch(new_len: torch.Tensor, inputs: Any) -> torch.Tensor:
    """ON THE STREAM: ``[n_out]`` int64, the ``seq_len`` field of each fresh slot: its sampling
    request's new length (``new_len [n_sample]``)."""
    return new_len.index_select(0, inputs.out_req)


def out_lengths_numpy(new_len: torch.Tensor, inputs: Any) -> torch.Tensor:
    """:func:`out_lengths_torch` on the CPU, with numpy."""
    return torch.from_numpy(new_len.numpy()[inputs.out_req.numpy()])


def store_tokens(last: torch.Tensor, drafts: torch.Tensor, inputs: Any, n_out: int, top: int) -> torch.Tensor:
    """:func:`store_tokens_torch`, or its numpy twin for CPU tensors."""
    store = store_tokens_numpy if last.device.type == "cpu" else store_tokens_torch
    return store(last, drafts, inputs, n_out, top)


def store_tokens_torch(
    last: torch.Tensor, drafts: torch.Tensor, inputs: Any, n_out: int, top: int
) -> torch.Tensor:
    """ON THE STREAM: ``[n_out]`` int64, what the step's fresh slots take: each sampling request's
    last committed token (``last [n_sample]``, -1 where none: 0), then its next drafts (``drafts
    [n_sample, k]``, clamped into ``[0, top]``: a drafter's out-of-vocab id never reaches a
    model's input)."""
    tokens = torch.empty(n_out, dtype=torch.int64, device=last.device)
    tokens.index_copy_(0, inputs.out_first, last.clamp_min(0))
    if inputs.out_draft.numel():
        flat_t = drafts.reshape(-1).to(torch.int64).clamp(0, top)
        tokens.index_copy_(0, inputs.out_draft, flat_t.index_select(0, inputs.draft_at))
    return tokens


def store_tokens_numpy(
    last: torch.Tensor, drafts: torch.Tensor, inputs: Any, n_out: int, top: int
) -> torch.Tensor:
    """:func:`store_tokens_torch` on the CPU, with numpy."""
    out = np.empty(n_out, dtype=np.int64)
    out[inputs.out_first.numpy()] = np.maximum(last.numpy(), 0)
    if inputs.out_draft.numel():
        # Not np.clip: its Python wrapper costs more than the two ufuncs.
        flat = np.minimum(np.maximum(drafts.reshape(-1).numpy(), 0), top)
        out[inputs.out_draft.numpy()] = flat[inputs.draft_at.numpy()]
    return torch.from_numpy(out)
