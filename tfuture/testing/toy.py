"""A deterministic integer toy model and a toy grammar (a finite automaton over token ids)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch
from tfuture.kernels.bitmask import pack_bool_mask

_P = 2_147_483_647  # 2**31 - 1: every product below stays under 2**62, no int64 wrap


def _mix(x: torch.Tensor) -> torch.Tensor:
    """One round of an LCG-style mix on int64 values in [0, 2**31)."""
    return (x * 1_103_515_245 + 12_345) % _P


def device_work(seconds: float, device: torch.device, matmul: int = 0, since: float | None = None) -> None:
    """Stand-in device work: sleep on the stream (CUDA ``_sleep`` / worker sleep), or a matmul.

    ``since``: on the CPU worker, a ``time.perf_counter()`` reading taken when the forward
    began; the sleep then ends ``seconds`` after it, so that the forward's own ops (the toy's
    logits) count towards its device time instead of adding to it."""
    if matmul:
        x = torch.ones(matmul, matmul, device=device)
        (x @ x).sum()
    if seconds <= 0:
        return
    if device.type == "cuda":
        torch.cuda._sleep(int(seconds * 1.9e9))
    elif since is None:
        time.sleep(seconds)
    elif (left := since + seconds - time.perf_counter()) > 0:
        time.sleep(left)


def greedy_sample(logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
    """Argmax over each sampling row's logits (``[n_sample, vocab]``), after an optional bool mask."""
    rows = logits
    if mask is not None:
        rows = rows.masked_fill(~mask, float("-inf"))
    return rows.argmax(dim=-1)


def _row_requests(batch: ForwardBatch) -> torch.Tensor:
    """The request id of each of ``batch.sample_rows``: one row per sampling request, or (a
    speculative step's verification rows, several per request) found from the segment starts."""
    if batch.sample_rows.numel() == batch.sample_reqs.numel():
        return batch.req_ids.index_select(0, batch.sample_reqs)
    if batch.seg_starts is None:
        raise ValueError("ToyModel: sample rows other than one per request need ForwardBatch.seg_starts")
    ends = batch.seg_starts[1 : batch.req_ids.numel() + 1]
    return batch.req_ids.index_select(0, torch.searchsorted(ends, batch.sample_rows, right=True))


@dataclass
class ToyModel:
    """Next token = argmax of hash(previous token, its position, request id, v) over the vocab.

    ``work_s`` seconds (or a ``matmul`` x ``matmul`` product) of device work per forward: on
    the CPU worker the whole forward, its logits included, takes ``work_s`` (then the sleep's
    overshoot, about 0.05-0.1 ms); on a GPU the logits are queued before a ``work_s`` sleep.
    ``fail_at`` makes the forward of that step raise, for failure tests.
    """

    vocab: int = 64
    work_s: float = 0.0
    matmul: int = 0
    fail_at: int | None = None
    fail_sample_at: int | None = None
    calls: int = field(default=0, init=False)
    #: Graph-safe (tfuture.steps.graphs): its ops read only the batch's tensors (``fail_at``
    #: reads ``batch.step``: a planted failure fires at capture, not at a replay).
    graph_safe = True

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.calls += 1
        if self.fail_at is not None and batch.step == self.fail_at:
            raise RuntimeError(f"ToyModel: planted failure in forward of step {batch.step}")
        began = time.perf_counter()
        # Logits for the sampling rows only: each sampling request's last token (every
        # verification row in a speculative step).
        rows = batch.sample_rows
        tok = batch.input_ids.index_select(0, rows).to(torch.int64)
        pos = batch.positions.index_select(0, rows)
        logits = self.scores(tok, pos, _row_requests(batch))
        # work_s is the whole forward's device time: on the CPU worker the logits above take
        # part of it (about 0.1 ms), on a GPU they are queued before the sleep.
        device_work(self.work_s, batch.input_ids.device, self.matmul, since=began)
        return logits

    def scores(self, tok: torch.Tensor, pos: torch.Tensor, rid: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` float32 logits after token ``tok`` at position ``pos`` of request ``rid``
        (each ``[n]`` int64): the model's whole function (its greedy token is their argmax)."""
        h = _mix(_mix(tok % _P + 7) + pos * 31 + rid * 131)
        v = torch.arange(self.vocab, device=tok.device, dtype=torch.int64)
        scores = _mix(_mix(h[:, None] + v[None, :] * 2_654_435) % 65_521 + v[None, :])
        # Below 2**24 every score is exact in float32, so argmax ties only on equal hashes.
        return (scores % 16_777_213).to(torch.float32)

    def sample(self, logits: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor | None) -> torch.Tensor:
        if self.fail_sample_at is not None and batch.step == self.fail_sample_at:
            raise RuntimeError(f"ToyModel: planted failure in sample of step {batch.step}")
        return greedy_sample(logits, batch, mask)

    def references(self, specs: Iterable[Any], eos: int | None = None) -> dict[int, list[int]]:
        """:meth:`reference` of every request spec (``rid``, ``prompt``, ``max_new``), by id."""
        return {s.rid: self.reference(s.prompt, s.rid, s.max_new, eos) for s in specs}

    def reference(self, prompt: np.ndarray, rid: int, n_new: int, eos: int | None = None) -> list[int]:
        """Plain host-side generation (no batching, no futures), for end-to-end checks."""
        seq, out = [int(t) for t in prompt], []
        for _ in range(n_new):
            ids = torch.tensor(seq[-1:], dtype=torch.int64)
            fb = ForwardBatch(
                0,
                ids,
                torch.tensor([len(seq) - 1]),
                torch.tensor([0]),
                torch.tensor([rid]),
                torch.tensor([len(seq)]),
                torch.tensor([0]),
                torch.tensor([0]),
            )
            tok = int(self.sample(self.forward(fb), fb, None)[0])
            out.append(tok)
            seq.append(tok)
            if tok == eos:
                break
        return out


class ToyGrammar:
    """A seeded finite automaton over token ids: ``allowed[state]`` and ``next[state, token]``.

    Every state allows at least two tokens. ``mask(states)`` is the host-built bool mask
    ``[n, vocab]`` a delayed sample needs; ``accepts(tokens)`` replays a sequence. It is a
    :class:`tfuture.grammars.Grammar`: ``matcher()`` makes a :class:`ToyMatcher` per request,
    which fills its packed bitmask row from ``packed [n_states, ceil(vocab / 32)]`` int32 (built
    once). It never terminates: its requests end on a stop token or their length limit.
    """

    def __init__(self, vocab: int, n_states: int = 5, seed: int = 0, density: float = 0.3) -> None:
        rng = np.random.default_rng(seed)
        self.vocab, self.n_states = vocab, n_states
        allowed = rng.random((n_states, vocab)) < density
        allowed[np.arange(n_states), rng.integers(0, vocab, n_states)] = True
        allowed[np.arange(n_states), rng.integers(0, vocab, n_states)] = True
        self.allowed = allowed
        self.next = rng.integers(0, n_states, (n_states, vocab))
        self.packed = pack_bool_mask(allowed)

    def mask(self, states: np.ndarray) -> np.ndarray:
        return self.allowed[states]

    def advance(self, state: int, token: int) -> int:
        if not self.allowed[state, token]:
            raise ValueError(f"token {token} is not allowed in grammar state {state}")
        return int(self.next[state, token])

    def accepts(self, tokens: list[int]) -> bool:
        state = 0
        for t in tokens:
            if not self.allowed[state, t]:
                return False
            state = int(self.next[state, t])
        return True

    def matcher(self) -> ToyMatcher:
        """A fresh per-request matcher in state 0."""
        return ToyMatcher(self)


class ToyMatcher:
    """One request's state in a :class:`ToyGrammar` (a :class:`tfuture.grammars.Matcher`)."""

    __slots__ = ("grammar", "state", "trail")

    def __init__(self, grammar: ToyGrammar) -> None:
        self.grammar, self.state = grammar, 0
        self.trail: list[int] = []  # the state before each accepted token (for rollback)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = self.grammar.packed[self.state]

    def accept(self, token: int) -> bool:
        g = self.grammar
        if not 0 <= token < g.vocab or not g.allowed[self.state, token]:
            return False
        self.trail.append(self.state)
        self.state = int(g.next[self.state, token])
        return True

    def is_terminated(self) -> bool:
        return False

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self.trail):
            raise ValueError(f"rollback({n}): the matcher accepted {len(self.trail)} tokens")
        if n:
            self.state = self.trail[-n]
            del self.trail[-n:]
