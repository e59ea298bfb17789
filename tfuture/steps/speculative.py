"""Overlapped speculative decoding: the step kind, its batch and result, the model protocol.

The scheduler (policy, on the host) builds a :class:`SpecBatch` per step and gets a
:class:`SpecResult` back; ``OverlapRuntime(SpecStep(model), fmap)`` runs it. Per step, on the
forward stream: ``prepare`` (one launch: each request's ``[last accepted token, k drafts]`` row
and positions, read from its previous step's slot fields, so the accepted length never visits
the host), ``verify`` (target greedy tokens and greedy acceptance), ``draft`` (the next step's
drafts), ``store`` (every field of the step into its fresh slots, one launch), then ``copy``
(``tokens`` and ``accept_len`` gathered from those slots to the host). The host learns step N's
accepted lengths only when it processes step N, after step N+1 was launched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from tfuture.core.batch import check_consumes
from tfuture.core.future_fields import FutureFields, Shape
from tfuture.core.future_map import FutureMap
from tfuture.core.slots import FutureIndices
from tfuture.kernels.spec import SpecInputs, prepare_spec_inputs
from tfuture.steps.base import InFlight, Op, StepKind, StepPlan

# What the host reads back per step; the other fields stay on the device for the next step.
HOST_FIELDS = ("tokens", "accept_len")


def spec_fields(k: int) -> dict[str, tuple[Shape, torch.dtype]]:
    """The fields every speculative step stores: accepted tokens, counts and next drafts."""
    return {
        "tokens": ((k + 1,), torch.int64),  # target tokens; the first accept_len are committed
        "accept_len": ((), torch.int32),  # committed tokens this step, in [1, k + 1]
        "new_seq_len": ((), torch.int64),  # sequence length after the step
        "draft_tokens": ((k,), torch.int64),  # drafts for the next step
    }


class SpecModel(Protocol):
    """Target and draft. Both methods run on the forward stream.

    Optionally ``vocab`` (an int): :class:`SpecStep` then also refuses target ids ``>= vocab``.
    """

    k: int

    @property
    def extra_fields(self) -> Mapping[str, tuple[Shape, torch.dtype]]:
        """Draft-side fields stored per step beside the required ones (may be empty)."""
        ...

    def verify(self, step: int, inputs: SpecInputs, req_ids: torch.Tensor) -> torch.Tensor:
        """``[n, k+1]`` integer token ids (``0 <= id < vocab``): the target's greedy token after
        each input row."""
        ...

    def draft(
        self, last: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``{"draft_tokens": [n, k] int64, **extra_fields}`` continuing ``last`` at ``positions``."""
        ...


@dataclass(slots=True, eq=False)
class SpecBatch:
    """One step, built by the scheduler on the host.

    ``last [n]``: ``-slot`` of the request's previous step (from ``host_placeholders()``) or a
    concrete last token of a fresh request, whose length is ``seq_lens [n]``. ``consumes``: the
    handles those placeholders came from; the runtime releases them once prepare is enqueued.
    """

    last: np.ndarray
    seq_lens: np.ndarray
    req_ids: np.ndarray
    consumes: list[FutureIndices] = field(default_factory=list)
    tag: Any = None
    out: FutureIndices | None = None
    step: int = -1

    def __post_init__(self) -> None:
        check_consumes("SpecBatch", self.consumes)
        n = np.asarray(self.last).size
        for name in ("last", "seq_lens", "req_ids"):
            a = np.asarray(getattr(self, name))
            if a.ndim != 1 or a.size != n or not np.issubdtype(a.dtype, np.integer):
                raise TypeError(
                    f"SpecBatch.{name} must be a 1-D int array of {n} entries, got {a.dtype} {a.shape}"
                )
            setattr(self, name, a.astype(np.int64, copy=False))


@dataclass(slots=True, eq=False)
class SpecResult:
    """A processed step: ``tokens [n, k+1]`` int64, of which row ``i`` commits ``accept_len[i]``."""

    step: int
    batch: SpecBatch
    tokens: np.ndarray
    accept_len: np.ndarray


class SpecScheduler(Protocol):
    def schedule(self) -> SpecBatch | None: ...

    def process(self, result: SpecResult) -> None: ...


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def flag_bad_tokens(target: torch.Tensor, vocab: int | None, err: torch.Tensor) -> torch.Tensor:
    """On the stream, no host sync: ``target`` with every id outside ``[0, vocab)`` (``< 0`` when
    ``vocab`` is None) replaced by 0 and counted in the error flag ``err`` (``err[0]`` += count,
    ``err[1]`` = min(``err[1]``, the bad ids)), as the kernels flag bad values; the runtime raises
    :class:`tfuture.core.errors.FutureError` when it processes the step, before the scheduler
    sees its tokens."""
    bad = target < 0 if vocab is None else (target < 0) | (target >= vocab)
    err[0] += bad.sum()
    err[1:] = torch.minimum(err[1:], torch.where(bad, target, 0).min().reshape(1))
    return target.masked_fill(bad, 0)


def check_target(target: object, n: int, k: int, vocab: int | None, step: int, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``target`` is an integer ``[n, k + 1]`` tensor on ``device``;
    on a CPU tensor also unless every id lies in ``[0, vocab)`` (``>= 0`` without a vocab): read
    in place on the stream, where a CPU value costs no host sync."""
    if not isinstance(target, torch.Tensor) or target.shape != (n, k + 1):
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"verify must return [{n}, {k + 1}] token ids, got {got}")
    if target.dtype not in _INT_DTYPES:
        raise ValueError(
            f"verify of step {step} must return integer token ids (int64, int32, ...), got {target.dtype}"
        )
    if target.device != device:
        raise ValueError(f"verify of step {step} must return its token ids on {device}, got {target.device}")
    if target.device.type != "cpu" or not target.numel():
        return
    lo, hi = (int(v) for v in target.aminmax())
    if lo < 0 or (vocab is not None and hi >= vocab):
        bad = lo if lo < 0 else hi
        where = f"in [0, vocab={vocab})" if vocab is not None else ">= 0"
        raise ValueError(f"verify of step {step} returned token id {bad}: token ids must be {where}")


def greedy_accept(inputs: SpecInputs, target: torch.Tensor) -> torch.Tensor:
    """``[n]`` int32: 1 + the longest prefix of valid drafts equal to the target's greedy tokens."""
    drafts = inputs.input_ids[:, 1:]
    k = drafts.shape[1]
    valid = torch.arange(k, device=drafts.device)[None, :] < inputs.n_draft[:, None]
    match = (drafts == target[:, :k]) & valid
    return (match.to(torch.int32).cumprod(dim=1).sum(dim=1) + 1).to(torch.int32)


@dataclass(slots=True, eq=False)
class SpecState:
    n: int
    inputs: SpecInputs | None = None
    req_ids: torch.Tensor | None = None
    payload: dict[str, torch.Tensor] = field(default_factory=dict)


class SpecStaged(NamedTuple):
    """A speculative step's staged index data (host arrays, then their device views)."""

    last: Any
    seq_lens: Any
    req_ids: Any


class SpecStep(StepKind):
    """The speculative step kind of a :class:`SpecModel` (see the module docstring).

    ``fields`` (the map's :class:`FutureFields`: tokens, accept_len, new_seq_len, draft_tokens
    and the model's extra fields) exists once the runtime bound the step to its map.
    """

    keeps_out = True
    stream_ops = (*StepKind.stream_ops, "verify", "draft", "store")

    def __init__(self, model: SpecModel) -> None:
        self.model = model
        self.k = int(model.k)
        vocab = getattr(model, "vocab", None)
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
            raise TypeError(f"the spec model's vocab must be an int >= 1 or absent, got {vocab!r}")
        #: Target ids must lie below it (when the model declares one).
        self.vocab: int | None = vocab
        self.fields: FutureFields | None = None
        self._bufs: list[torch.Tensor] = []
        self._fmap: FutureMap | None = None

    def bind(self, fmap: FutureMap) -> None:
        self._fmap = fmap
        self.fields = FutureFields(fmap, {**spec_fields(self.k), **self.model.extra_fields})
        self._bufs = [self.fields.buffer(n) for n in ("tokens", "accept_len", "new_seq_len", "draft_tokens")]

    def plan(self, batch: Any) -> StepPlan:
        if not isinstance(batch, SpecBatch):
            raise TypeError(f"schedule() must return a SpecBatch or None, got {type(batch).__name__}")
        n = batch.last.size
        return StepPlan(n, SpecStaged(batch.last, batch.seq_lens, batch.req_ids), SpecState(n))

    def prepare(self, rec: InFlight, inputs: SpecStaged) -> None:
        assert self._fmap is not None
        state: SpecState = rec.state
        state.req_ids = inputs.req_ids
        state.inputs = prepare_spec_inputs(inputs.last, inputs.seq_lens, *self._bufs, err=self._fmap.err)

    def forward_ops(self, rec: InFlight) -> list[Op]:
        state: SpecState = rec.state
        model, k, n, fields = self.model, self.k, state.n, self.fields
        assert fields is not None

        def verify() -> None:
            assert state.inputs is not None and state.req_ids is not None and self._fmap is not None
            target = model.verify(rec.step, state.inputs, state.req_ids)
            fmap = self._fmap
            check_target(target, n, k, self.vocab, rec.step, fmap.device)
            target = target.to(torch.int64)
            if target.device.type != "cpu":  # checked in place on the CPU; flagged on a device
                target = flag_bad_tokens(target, self.vocab, fmap.err)
            acc = greedy_accept(state.inputs, target)
            new_len = state.inputs.positions[:, 0] + 1 + acc
            state.payload = {"tokens": target, "accept_len": acc, "new_seq_len": new_len}

        def draft() -> None:
            assert state.req_ids is not None
            acc, new_len = state.payload["accept_len"], state.payload["new_seq_len"]
            last = state.payload["tokens"].gather(1, (acc.to(torch.int64) - 1)[:, None]).squeeze(1)
            state.payload |= model.draft(last, new_len - 1, state.req_ids)
            missing = sorted(set(fields.names) - state.payload.keys())
            if missing:
                raise ValueError(f"draft must return every declared field, missing {missing}")

        return [("verify", verify), ("draft", draft)]

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        fields = self.fields
        assert fields is not None
        return [("store", lambda: fields.store(rec.out, rec.state.payload))]

    def n_result(self, rec: InFlight) -> int:
        return rec.state.n * (self.k + 2)

    def copy_result(self, rec: InFlight, dst: torch.Tensor) -> None:
        assert self.fields is not None
        n, w = rec.state.n, self.k + 1
        got = self.fields.gather(rec.out, HOST_FIELDS)
        dst[: n * w].view(n, w).copy_(got["tokens"], non_blocking=True)
        dst[n * w :].copy_(got["accept_len"], non_blocking=True)

    def result(self, rec: InFlight, words: np.ndarray) -> SpecResult:
        n, w = rec.state.n, self.k + 1
        return SpecResult(rec.step, rec.batch, words[: n * w].reshape(n, w), words[n * w :])

    def n_tokens(self, result: SpecResult) -> int:
        return int(result.accept_len.sum())
