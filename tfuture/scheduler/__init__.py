"""The schedulers users drive the runtime with: :class:`ContinuousBatcher` (arrivals, chunked
prefill, decode, grammar masks, back-pressure) over :class:`RequestSpec` requests, and
:class:`ServingScheduler` (requests added and aborted from any thread while a run goes, per
request stop tokens, finish reasons, timings and token callbacks); :class:`GenerationParams`,
a request's options with vLLM's names and defaults."""

from tfuture.scheduler.batcher import DELAYS, FINISH_REASONS, ContinuousBatcher
from tfuture.scheduler.options import GenerationParams
from tfuture.scheduler.request import RequestSpec
from tfuture.scheduler.serving import (
    Completion,
    RequestTimings,
    ServingScheduler,
    TokenUpdate,
    UpdateCallback,
)

__all__ = [
    "DELAYS",
    "FINISH_REASONS",
    "Completion",
    "ContinuousBatcher",
    "GenerationParams",
    "RequestSpec",
    "RequestTimings",
    "ServingScheduler",
    "TokenUpdate",
    "UpdateCallback",
]
