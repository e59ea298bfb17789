"""tfuture: future slots, resolve/store kernels and an overlap runtime for LLM serving.

Layers, each importing only those above it in this list: ``errors``, ``args``; ``slots`` (host
slot bookkeeping, ``FutureIndices``); ``kernels``; ``debug`` (device slot states); ``futures``
(``FutureMap``); ``fields``; ``stream_base``, ``streams``, ``staging``, ``stats``, ``faults``;
``batch``, ``steps``, ``token_step``, ``speculative``; ``runtime``; ``testing``, ``models``,
``examples``.
"""

from tfuture.core.errors import FutureError, FutureMapFull
from tfuture.core.future_fields import FutureFields
from tfuture.core.future_map import FutureMap
from tfuture.core.slots import FutureIndices
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
