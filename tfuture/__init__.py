"""tfuture: future slots, resolve/store kernels and an overlap runtime for LLM serving."""

from tfuture.fields import FutureFields
from tfuture.futures import FutureError, FutureIndices, FutureMap, FutureMapFull
from tfuture.kernels.resolve import PreparedInputs, prepare_inputs, resolve_futures_
from tfuture.kernels.store import store_futures

__all__ = [
    "FutureError",
    "FutureFields",
    "FutureIndices",
    "FutureMap",
    "FutureMapFull",
    "PreparedInputs",
    "prepare_inputs",
    "resolve_futures_",
    "store_futures",
]
__version__ = "0.1.0"
