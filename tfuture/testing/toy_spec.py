"""A toy speculative decoder: the toy target, a seeded fallible draft, a scheduler, a check.

The target is :class:`tfuture.testing.toy.ToyModel`: its next token depends on the previous
token, its position and the request id only, so a prompt enters through its last token at
position ``len(prompt) - 1``. The draft proposes the target's greedy token, except that with
probability ``error_rate`` (a seeded hash of token, position and request) it proposes another
one. With greedy acceptance the committed tokens must equal plain greedy decoding, whatever
the drafts: :func:`check_spec_equivalence` checks that, overlapped and in sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch
from tfuture.core.future_fields import Shape
from tfuture.core.future_map import FutureIndices, FutureMap
from tfuture.kernels.spec import SpecInputs
from tfuture.runtime import OverlapRuntime
from tfuture.scheduler import RequestSpec
from tfuture.steps.speculative import SpecBatch, SpecResult, SpecStep
from tfuture.streams.backends import Delay
from tfuture.streams.stats import RunStats
from tfuture.testing.equivalence import first_difference
from tfuture.testing.toy import ToyModel

_P = 2_147_483_647


def _hash(*xs: torch.Tensor | int) -> torch.Tensor:
    """A deterministic int64 hash in [0, 2**31 - 1) of integer tensors (no int64 overflow)."""
    h = torch.zeros((), dtype=torch.int64)
    for x in xs:
        h = ((h * 1_103_515_245 + torch.as_tensor(x, dtype=torch.int64) % _P) * 69_069 + 12_345) % _P
    return h


class ToySpecModel:
    """Target = ``target``'s greedy token; draft = the same token, wrong with ``error_rate``.

    Besides ``draft_tokens [k]`` the draft returns ``draft_probs [k]`` float32 and ``hidden [d]``
    bf16 passenger fields (stored with the others), so every dtype rides the real loop.
    """

    def __init__(
        self,
        target: ToyModel | None = None,
        *,
        k: int = 3,
        error_rate: float = 0.3,
        seed: int = 0,
        hidden: int = 4,
    ) -> None:
        self.target = ToyModel() if target is None else target
        self.k, self.error_rate, self.seed, self.hidden = k, error_rate, seed, hidden
        self.extra_fields: dict[str, tuple[Shape, torch.dtype]] = {
            "draft_probs": ((k,), torch.float32),
            "hidden": ((hidden,), torch.bfloat16),
        }

    def greedy(self, tok: torch.Tensor, pos: torch.Tensor, req_ids: torch.Tensor) -> torch.Tensor:
        """``[m]`` int64: the target's greedy next token after ``tok`` at ``pos`` (all ``[m]``)."""
        m = tok.numel()
        rows = torch.arange(m, device=tok.device)
        fb = ForwardBatch(-1, tok.to(torch.int64), pos, rows, req_ids, pos + 1, rows, rows)
        return self.target.sample(self.target.forward(fb), fb, None)

    def verify(self, step: int, inputs: SpecInputs, req_ids: torch.Tensor) -> torch.Tensor:
        if self.target.fail_at is not None and step == self.target.fail_at:
            raise RuntimeError(f"ToySpecModel: planted failure in verify of step {step}")
        n, w = inputs.input_ids.shape
        rids = req_ids.repeat_interleave(w)
        return self.greedy(inputs.input_ids.reshape(-1), inputs.positions.reshape(-1), rids).view(n, w)

    def draft(
        self, last: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        tok, pos, drafts, probs = last, positions, [], []
        vocab = self.target.vocab
        for _ in range(self.k):
            good = self.greedy(tok, pos, req_ids)
            h = _hash(tok, pos, req_ids, self.seed)
            wrong = (h % 1_000_000) < int(self.error_rate * 1_000_000)
            tok = torch.where(wrong, (good + 1 + h % (vocab - 1)) % vocab, good)
            drafts.append(tok)
            probs.append(torch.where(wrong, 0.25, 0.75).to(torch.float32))
            pos = pos + 1
        n = last.numel()
        hidden = (
            _hash(last[:, None], positions[:, None], torch.arange(self.hidden, device=last.device)) % 4096
            - 2048
        ) / 64
        return {
            "draft_tokens": torch.stack(drafts, 1) if drafts else last.new_zeros((n, 0)),
            "draft_probs": torch.stack(probs, 1) if probs else torch.zeros((n, 0), device=last.device),
            "hidden": hidden.to(torch.bfloat16).reshape(n, self.hidden),
        }


@dataclass(slots=True, eq=False)
class _Req:
    spec: RequestSpec
    out: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)
    pending: tuple[SpecBatch, int] | None = None  # the latest launched step naming this request
    finished: bool = False


class SpecBatcher:
    """Runs every admitted request every step (at most ``max_running``). Under overlap, step
    N+1 names step N's slots, so a request that finished at step N runs one extra step whose
    tokens are discarded. ``outputs[rid]`` holds each request's tokens (end token included),
    ``accepts[rid]`` its committed tokens per step.
    """

    def __init__(
        self, specs: list[RequestSpec], fmap: FutureMap, *, eos: int = 0, max_running: int = 8
    ) -> None:
        self.fmap, self.eos, self.max_running = fmap, eos, max_running
        self.waiting = sorted(specs, key=lambda s: (s.arrival, s.rid))
        self.running: list[_Req] = []
        self.outputs: dict[int, list[int]] = {}
        self.accepts: dict[int, list[int]] = {}
        self.tick = 0
        self.extra_rows = 0
        self.rows = 0  # request-steps processed
        self.accepted = 0  # tokens committed by them

    @property
    def mean_accept(self) -> float:
        """Tokens committed per request-step (1 = no draft ever accepted)."""
        return self.accepted / self.rows if self.rows else 0.0

    def schedule(self) -> SpecBatch | None:
        self.tick += 1
        self.running = [r for r in self.running if not r.finished]
        # One fresh slot per running request per step: admit only what the map can hold.
        # Every running request takes a fresh slot per step while its previous step's slot is
        # still held (the next step reads its drafts there): at most capacity // 2 can run.
        cap = min(self.max_running, self.fmap.capacity // 2)
        while (
            self.waiting
            and len(self.running) < cap
            and self.waiting[0].arrival <= self.tick
            and self.fmap.free > len(self.running)
        ):
            self.running.append(_Req(self.waiting.pop(0)))
        if not self.running:
            if not self.waiting:
                return None
            self.tick = self.waiting[0].arrival - 1
            return self.schedule()
        n = len(self.running)
        last, lens = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        by_batch: dict[int, tuple[SpecBatch, list[int], list[int]]] = {}
        for i, r in enumerate(self.running):
            if r.pending is None:
                last[i], lens[i] = r.spec.prompt[-1], r.spec.prompt.size
            else:
                entry = by_batch.setdefault(id(r.pending[0]), (r.pending[0], [], []))
                entry[1].append(r.pending[1])
                entry[2].append(i)
        consumes: list[FutureIndices] = []
        for b, rows, idx in by_batch.values():
            assert b.out is not None
            h = b.out.filter(np.asarray(rows, dtype=np.int64))
            consumes.append(h)
            last[idx] = h.host_placeholders()
        rids = np.array([r.spec.rid for r in self.running], dtype=np.int64)
        batch = SpecBatch(last, lens, rids, consumes, tag=list(self.running))
        for i, r in enumerate(self.running):
            r.pending = (batch, i)
        return batch

    def process(self, result: SpecResult) -> None:
        self.rows += int(result.accept_len.size)
        self.accepted += int(result.accept_len.sum())
        for r, toks, acc in zip(
            result.batch.tag, result.tokens.tolist(), result.accept_len.tolist(), strict=True
        ):
            if r.finished:
                self.extra_rows += 1
                continue
            r.accepts.append(acc)
            for tok in toks[:acc]:
                r.out.append(tok)
                if tok == self.eos or len(r.out) >= r.spec.max_new:
                    r.finished = True
                    self.outputs[r.spec.rid] = r.out
                    self.accepts[r.spec.rid] = r.accepts
                    break


@dataclass(slots=True)
class SpecRun:
    outputs: dict[int, list[int]]
    accepts: dict[int, list[int]]
    stats: RunStats
    batcher: SpecBatcher
    fmap: FutureMap


def run_spec(
    specs: list[RequestSpec],
    *,
    overlap: bool,
    k: int = 3,
    error_rate: float = 0.3,
    seed: int = 0,
    delay: Delay | None = None,
    capacity: int = 64,
    max_running: int = 8,
    eos: int = 0,
    target: ToyModel | None = None,
) -> SpecRun:
    """Decode ``specs`` speculatively with :class:`ToySpecModel` on a fresh CPU (or CUDA) map."""
    fmap = FutureMap(capacity, device="cuda" if torch.cuda.is_available() else "cpu")
    model = ToySpecModel(target, k=k, error_rate=error_rate, seed=seed)
    batcher = SpecBatcher(specs, fmap, eos=eos, max_running=max_running)
    stats = OverlapRuntime(SpecStep(model), fmap, overlap=overlap, delay=delay).run(batcher)
    return SpecRun(batcher.outputs, batcher.accepts, stats, batcher, fmap)


def reference_outputs(
    specs: list[RequestSpec], eos: int = 0, target: ToyModel | None = None
) -> dict[int, list[int]]:
    """Plain non-speculative greedy decoding of every request (``ToyModel.reference``)."""
    target = ToyModel() if target is None else target
    return {s.rid: target.reference(s.prompt, s.rid, s.max_new, eos) for s in specs}


def random_delay(seed: int, p: float = 0.3, max_s: float = 2e-3) -> Callable[[str], float]:
    """A seeded ``delay`` hook for the forward stream: sleep up to ``max_s`` before some ops."""
    rng = np.random.default_rng(seed)
    return lambda name: float(rng.uniform(0, max_s)) if rng.random() < p else 0.0


def check_spec_equivalence(
    specs: list[RequestSpec], *, delay: Delay | None = None, **kw: object
) -> str | None:
    """None when overlapped and sync speculative decoding both equal plain greedy decoding for
    every request (and agree on every accepted length) and leave no slot in use; else the first
    difference, in words.
    """
    eos = int(kw.get("eos", 0))  # type: ignore[call-overload]
    ref = reference_outputs(specs, eos)
    sync = run_spec(specs, overlap=False, **kw)  # type: ignore[arg-type]
    over = run_spec(specs, overlap=True, delay=delay, **kw)  # type: ignore[arg-type]
    for name, run in (("sync-spec", sync), ("overlap-spec", over)):
        diff = first_difference(ref, run.outputs, ("reference", name))
        if diff is None and run.fmap.in_use:
            diff = f"{name} run left {run.fmap.in_use} slot(s) in use"
        if diff is not None:
            return diff
    return first_difference(sync.accepts, over.accepts, ("sync accept lengths", "overlap accept lengths"))
