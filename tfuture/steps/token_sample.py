"""The token step's ops after the forward: :class:`TokenSampling`, a base of
:class:`tfuture.steps.token.TokenStep`.

``sample`` runs the step's sample path (:class:`tfuture.steps.samplers.SamplePath`) over every
row at once, or, for a delayed step, over its waiting rows with their checked grammar mask after
its free rows sampled right after the forward (``sample_now``); the sampler then records the
tokens into its device history. ``store`` writes them into the step's fresh slots. A graphed
step instead replays its bucket's captured graph (``replay``), which samples and stores. The
host side of a delayed step's mask (``take_mask``) checks it and readies it for the stream.
"""

from __future__ import annotations

import torch

from tfuture.core.batch import Model
from tfuture.core.future_map import FutureMap
from tfuture.steps.base import InFlight, Op
from tfuture.steps.graphs import StepGraphs, capture, graph_run
from tfuture.steps.masks import check_logits, check_width, mask_on_stream, ready_mask
from tfuture.steps.samplers import SamplePath

__all__ = ["TokenSampling"]


class TokenSampling:
    """The sampling half of :class:`tfuture.steps.token.TokenStep` (see the module docstring),
    over the step's state below, which the token step sets up and owns."""

    model: Model
    fmap: FutureMap | None
    path: SamplePath
    samples: bool
    graphs: StepGraphs | None
    _vocab: int | None

    def sample_ops(self, rec: InFlight, mask: object) -> list[Op]:
        if rec.state.graph is not None:
            return []  # the replay sampled and stored
        if mask is not None:
            self.take_mask(rec, mask)
        return [("sample", lambda: self.sample(rec)), ("store", lambda: self.store(rec))]

    def store(self, rec: InFlight) -> None:
        """FORWARD STREAM: the step's tokens into its fresh slots: the runtime's own handle,
        tokens checked by the sample path, so the lean store. A CPU map's store hands back its
        numpy view of the tokens: the result copy reads the sampled tokens through it."""
        state, fmap = rec.state, self.fmap
        assert fmap is not None
        host = fmap.launch_store(rec.out, state.clean)
        if state.clean is state.sampled:
            state.sampled_host = host

    def take_mask(self, rec: InFlight, mask: object) -> None:
        """HOST: check a delayed step's mask (every row allows a token; the width, once the
        vocab is known) and ready it for the stream (pinned, or an event after its producer)."""
        if mask is None:
            return
        assert self.fmap is not None
        vocab = self._vocab if self._vocab is not None else self.path.vocab
        ready_mask(rec.state, mask, rec.step, vocab, self.samples and self.fmap.device.type == "cuda")

    def sample(self, rec: InFlight) -> None:
        """FORWARD STREAM: the step's (late) rows with the mask, then the sampler's record."""
        state, path = rec.state, self.path
        if state.mask is None and not state.split:
            # The usual step: every row at once, no mask (_sample_rows(rec, None, None) inline).
            logits, n = state.logits, state.sample_reqs.size
            if type(logits) is not torch.Tensor or logits.dim() != 2 or logits.shape[0] != n:
                logits = check_logits(logits, state.n_sample, rec.step)  # raises, or a Tensor subclass
            self._vocab = logits.shape[1]
            state.sampled = path.sample(state.sstate, state.fwd, logits, None, None)
        else:
            mask_dev = None
            if state.mask is not None:
                assert self.fmap is not None
                mask_dev = mask_on_stream(state, rec.step, self.fmap.device)
            self._sample_rows(rec, state.late_dev if state.split else None, mask_dev)
        if path.records:
            state.clean = state.sampled.clamp(min=0)
            path.record(state.sstate, state.clean)
        else:
            state.clean = state.sampled  # a -1 is stored as 0 and flagged by the store itself

    def _sample_rows(self, rec: InFlight, rows: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """On the stream: sample ``rows`` (all when None) of the step into ``state.sampled``."""
        state, n = rec.state, rec.state.n_sample
        logits = check_logits(state.logits, n, rec.step)
        self._vocab = int(logits.shape[1])
        if mask is not None:
            check_width(mask, self._vocab, rec.step)  # the host checks it once the vocab is known
        if rows is not None:
            logits = logits.index_select(0, rows)
        tokens = self.path.sample(state.sstate, state.fwd, logits, rows, mask)
        if rows is None:
            state.sampled = tokens
            return
        if state.sampled is None:
            state.sampled = torch.empty(n, dtype=torch.int64, device=logits.device)
        state.sampled.index_copy_(0, rows, tokens)

    def _replay(self, rec: InFlight) -> None:
        """FORWARD STREAM: a graphed step. A bucket's first step runs eagerly on the static
        buffers (its results are the step's), then is captured; later steps replay it."""
        state, fmap, graphs = rec.state, self.fmap, self.graphs
        assert fmap is not None and graphs is not None and state.graph is not None
        bucket = state.graph
        if bucket.replay is None:
            run = graph_run(bucket, fmap, self.model, self.path, rec.step, state.host)
            sampled = run()
            capture(bucket, fmap.device, run)
            graphs.captures += 1
        else:
            sampled = bucket.replay()
            bucket.replays += 1
        state.sampled = sampled[: state.sample_reqs.size]
