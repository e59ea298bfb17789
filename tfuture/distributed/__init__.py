"""Tensor and pipeline parallel runs over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

Every rank runs the same scheduler and the one overlap loop with its own ``FutureMap``:

* tensor parallel: the last stage's tensor rank 0 samples and broadcasts the tokens on the
  forward stream, so every rank stores the same tokens into its map;
* pipeline parallel: the last stage sends the tokens to every earlier stage, which stores them
  into its own map on its forward stream; the first stage resolves the next micro-batch's
  placeholders on the device, with no host sync (:mod:`tfuture.distributed.micro`);
* a failure on one rank raises on every rank, releases every slot and tears the process groups
  down (:mod:`tfuture.distributed.failure`); debug mode checks that all ranks agree;
* speculative decoding: ``ParallelRuntime(..., speculative=drafter)``: the sampling rank
  verifies and drafts, and every rank stores its tokens, drafts and accepted lengths
  (:mod:`tfuture.distributed.spec_step`);
* multi-step windows: ``ParallelRuntime(..., windows=True)``: every rank runs each later step of
  a window, the sampling rank's tokens broadcast (and, under PP, sent back to the first stage)
  before the next one (:mod:`tfuture.distributed.window_step`).
"""

from tfuture.distributed.checks import RankDivergence
from tfuture.distributed.context import ParallelContext, free_port, init_parallel
from tfuture.distributed.failure import RankFailure
from tfuture.distributed.micro import MicroBatch, MicroBatchScheduler, MicroResult
from tfuture.distributed.runtime import ParallelRuntime
from tfuture.distributed.spec_step import ParallelSpecStep
from tfuture.distributed.step import ParallelStep, StageModel
from tfuture.distributed.window_step import ParallelWindowStep

__all__ = [
    "MicroBatch",
    "MicroBatchScheduler",
    "MicroResult",
    "ParallelContext",
    "ParallelRuntime",
    "ParallelSpecStep",
    "ParallelStep",
    "ParallelWindowStep",
    "RankDivergence",
    "RankFailure",
    "StageModel",
    "free_port",
    "init_parallel",
]
