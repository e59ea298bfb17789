"""Step graphs: a bucket's whole token step (prepare, forward, sample, store) captured once and
replayed, so a step costs one H2D copy, one replay and one D2H copy on the host.

``OverlapRuntime(model, fmap, buckets=..., graphs=True)``. A step runs as its bucket's graph when
it fits a bucket exactly as :class:`tfuture.steps.token.Buckets` pads it, nothing in it waits for
a mask, and it samples greedily with no per-request parameters (the model's own ``sample``, or
tfuture's :class:`tfuture.sampling.Sampler` on a step whose plan is greedy). Every other step
runs eagerly, as without graphs: a step larger than the largest bucket, a delayed (grammar)
step, a step with sampling parameters or penalties.

Per bucket ``(rows, reqs)`` a static int64 device buffer holds the step's staged index data in a
fixed layout (tokens padded to ``rows``; segment starts, prefix lengths, request ids, sequence
lengths, sampling requests and the slots to store into, each padded to ``reqs``); the runtime
copies each step's staged data straight into it. The first step of a bucket runs eagerly on
those buffers (its results are the step's) and is then captured (CUDA: ``torch.cuda.graph`` on
the forward stream, which synchronizes the device once); later steps of the bucket replay it.
Padding sampling rows store into one scratch slot the step kind holds, never a live slot.

**A graph-safe model** says so (``graph_safe = True`` on its class; without it ``graphs=True`` is
refused, and :class:`tfuture.models.HFCausalLM`, which reads the host mirrors, does not) and
computes the same kernels on the same tensors every call for a given shape: no host sync
(``.item()``, ``.tolist()``, printing a device tensor), no decision on host values that change
between steps (``batch.step``, ``batch.host``, Python counters: they keep the values of the
captured step), no new tensors kept across calls except module state, and it reads its inputs
only from the ``ForwardBatch`` tensors. Its forward and sample run twice on a bucket's
first step (once eagerly, once under capture). A failure during capture raises
:class:`GraphCaptureError` naming the bucket. On a CPU map nothing is captured: the first step's
ops are re-run on the same static buffers at each replay (the same data flow, no speedup), so the
bookkeeping is testable without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tfuture.core.batch import ForwardBatch, HostMeta
from tfuture.core.future_map import FutureMap
from tfuture.core.slots import FutureIndices
from tfuture.kernels.resolve import PreparedInputs
from tfuture.kernels.store import launch_store
from tfuture.sampling.plan import greedy_plan
from tfuture.steps.masks import check_logits
from tfuture.steps.samplers import SamplePath

__all__ = ["GraphBucket", "GraphCaptureError", "StepGraphs", "capture", "graph_run", "layout", "plan_graphed"]


class GraphCaptureError(RuntimeError):
    """A bucket's step could not be captured into a CUDA graph (the model is not graph-safe)."""


def layout(rows: int, reqs: int) -> list[int]:
    """Words per staged part of a graphed step, in ``TokenInputs`` order: tokens, seg_starts,
    prefix_lens, req_ids, seq_lens, sample_reqs, late, now, sampler_words, store_slots."""
    return [rows, reqs + 1, reqs, reqs, reqs, reqs, 0, 0, 0, reqs]


@dataclass(eq=False)
class GraphBucket:
    """One bucket's static buffers and, once its first step ran, its replay.

    ``static_in``: int64 ``[sum(layout(rows, reqs))]`` on the map's device; ``views``: its parts
    (split by :func:`layout`); ``prepared``: the fused prepare's fixed outputs; ``replay``:
    runs the captured step on the static buffers and returns its ``[reqs]`` sampled tokens.
    """

    rows: int
    reqs: int
    static_in: torch.Tensor
    views: tuple[torch.Tensor, ...]
    prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    replay: Callable[[], torch.Tensor] | None = None
    replays: int = 0


@dataclass(eq=False)
class StepGraphs:
    """The graphed steps' state: buckets by shape, the scratch slot, counts for tests and stats."""

    buckets: dict[tuple[int, int], GraphBucket] = field(default_factory=dict)
    scratch: FutureIndices | None = None
    captures: int = 0
    eager_steps: int = 0  # token steps that ran eagerly (did not fit, waited, or had parameters)

    def bucket(self, rows: int, reqs: int, fmap: FutureMap) -> GraphBucket:
        """The bucket ``(rows, reqs)``, its static buffers made on first use."""
        key = (rows, reqs)
        got = self.buckets.get(key)
        if got is None:
            dev = fmap.device
            sizes = layout(rows, reqs)
            static_in = torch.zeros(sum(sizes), dtype=torch.int64, device=dev)
            views = tuple(torch.split(static_in, sizes))
            prepared = (
                torch.zeros(rows, dtype=torch.int64, device=dev),  # staged tokens are int64
                torch.zeros(rows, dtype=torch.int64, device=dev),
                torch.zeros(reqs, dtype=torch.int64, device=dev),
            )
            got = self.buckets[key] = GraphBucket(rows, reqs, static_in, views, prepared)
        return got

    def scratch_slot(self, fmap: FutureMap) -> int:
        """The slot padding sampling rows store into (held until :meth:`close`)."""
        if self.scratch is None:
            self.scratch = fmap.alloc(1)
        return int(self.scratch.slots[0])

    def close(self, fmap: FutureMap) -> None:
        """Give the scratch slot back (the stream was drained: no store writes it any more)."""
        if self.scratch is not None and not self.scratch.released:
            fmap.release(self.scratch)
        self.scratch = None


def fill_slots(dst: np.ndarray, out: FutureIndices, scratch: int) -> None:
    """``dst [reqs]``: the slots of ``out`` first, the scratch slot after them."""
    n = len(out)
    dst[:n] = out.slots
    dst[n:] = scratch


def capture(bucket: GraphBucket, device: torch.device, run: Callable[[], torch.Tensor]) -> None:
    """Make ``bucket.replay`` from ``run`` (the step's ops on the static buffers), on the current
    stream. CUDA: capture a graph (the device synchronizes once); CPU: re-run ``run`` itself."""
    if device.type != "cuda":
        bucket.replay = run
        return
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream(device)
    gen = torch.cuda.default_generators[
        device.index if device.index is not None else torch.cuda.current_device()
    ]
    before = gen.clone_state()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            out = run()
    except Exception as exc:
        # torch raises before its capture epilogue: the device's default generator stays marked
        # as capturing, and every later random op on the device would raise "Offset increment
        # outside graph capture". Its state from before the capture goes back.
        gen.graphsafe_set_state(before)
        raise GraphCaptureError(
            f"capturing the step of bucket (rows={bucket.rows}, reqs={bucket.reqs}) into a CUDA graph "
            f"failed: {type(exc).__name__}: {exc}. The model must be graph-safe (see "
            "tfuture.steps.graphs), or run without graphs=True"
        ) from exc

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    bucket.replay = replay


def plan_graphed(
    graphs: StepGraphs, fmap: FutureMap, buckets: Any, state: Any, inputs: Any, delayed: bool
) -> tuple[GraphBucket, Any, Callable[[FutureIndices], None]] | None:
    """HOST, at plan: ``(bucket, padded inputs, with_out)`` when the step runs as its bucket's
    graph, else None (it runs eagerly; counted in ``graphs.eager_steps``).

    ``state``/``inputs``: the token step's :class:`tfuture.steps.token.TokenState` and
    ``TokenInputs`` (padded to the bucket by the plan already, but for the tokens and the
    sampling requests, padded here, and the slots to store into, filled once ``out`` exists).
    """
    rows, reqs = state.n_rows, inputs.prefix_lens.size
    # Greedy and without history: a plan with no words (parameters, penalties or new history
    # rows all travel as words), the same ops every step. Nothing waits for a mask.
    if delayed or state.splan.words.size or rows not in buckets.rows or reqs not in buckets.reqs:
        graphs.eager_steps += 1
        return None
    bucket = graphs.bucket(rows, reqs, fmap)
    tokens = np.zeros(rows, dtype=np.int64)
    tokens[: inputs.tokens.size] = inputs.tokens
    sample_reqs = np.zeros(reqs, dtype=np.int64)  # padding rows sample request 0's last row
    sample_reqs[: inputs.sample_reqs.size] = inputs.sample_reqs
    slots = np.zeros(reqs, dtype=np.int64)
    padded = inputs._replace(tokens=tokens, sample_reqs=sample_reqs, store_slots=slots)

    def with_out(out: FutureIndices) -> None:
        fill_slots(slots, out, graphs.scratch_slot(fmap))

    return bucket, padded, with_out


def graph_run(
    bucket: GraphBucket, fmap: FutureMap, model: Any, path: SamplePath, step: int, host: HostMeta
) -> Callable[[], torch.Tensor]:
    """The ops of a bucket's step on its static buffers: the fused prepare into the bucket's
    fixed outputs, the forward, the greedy sample of every (padded) sampling row, and the store
    of the tokens (a -1 of a row without a valid token read as 0) into the staged slots. Returns
    the ``[reqs]`` sampled tokens. ``step`` and ``host`` are the first step's: a graph-safe model
    does not read them."""
    tokens, seg, prefix, rids, lens, sample_reqs, _, _, words, slots = bucket.views
    plan = greedy_plan(bucket.reqs, step)
    out = PreparedInputs(*bucket.prepared)

    def run() -> torch.Tensor:
        ids, positions, last = fmap.launch_prepare(tokens, seg, prefix, bucket.rows, out)
        rows = last.index_select(0, sample_reqs)
        fwd = ForwardBatch(step, ids, positions, last, rids, lens, sample_reqs, rows, seg, host)
        sstate = path.prepare(plan, words, ids)
        logits = model.forward(fwd)
        if logits is None:
            raise ValueError("forward must return logits (or what sample takes), got None")
        sampled = path.sample(sstate, fwd, check_logits(logits, bucket.reqs, step), None, None)
        # The padding rows store into the scratch slot; -1 (no valid token) is stored as 0 and the
        # host copy of ``sampled`` names the request.
        launch_store(fmap.token_map, slots, sampled.clamp(min=0), fmap.err)
        return sampled

    return run
