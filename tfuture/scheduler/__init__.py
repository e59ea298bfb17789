"""The continuous-batching scheduler users drive the runtime with: :class:`ContinuousBatcher`
(arrivals, chunked prefill, decode, grammar masks, back-pressure) over :class:`RequestSpec`
requests."""

from tfuture.scheduler.batcher import DELAYS, ContinuousBatcher
from tfuture.scheduler.request import RequestSpec

__all__ = ["DELAYS", "ContinuousBatcher", "RequestSpec"]
