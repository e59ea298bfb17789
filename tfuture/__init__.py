"""tfuture: future slots, resolve/store kernels and an overlap runtime for LLM serving.

The names here are what a user writes against: the front door (:func:`generate`,
:class:`Engine`, :class:`GenerationParams`), the runtime (:class:`OverlapRuntime`), the
schedulers (:class:`ContinuousBatcher`, :class:`ServingScheduler`, :class:`RequestSpec`), the
step data and protocols
(:class:`Batch`, :class:`StepResult`, :class:`ForwardBatch`, :class:`HostMeta`, :class:`Model`,
:class:`Scheduler`), sampling (:class:`SamplingParams`, :class:`Sampler`), padding buckets
(:class:`Buckets`), run statistics (:class:`RunStats`) and the future slots with their checked
kernels. No module of tfuture imports this package itself.

Layers, lowest first; a module imports only from its own layer or lower ones
(``tests/test_layers.py`` holds the exact list):

1. ``core.errors``, ``core.checks``: exceptions and argument checks;
2. ``core.params`` (``SamplingParams`` and its packing), ``core.slots`` (host slot bookkeeping)
   and ``core.handles`` (``FutureIndices``);
3. ``kernels``: the Triton kernels and their numpy twins;
4. ``core.debug`` (device slot states), 5. ``core.future_map`` (``FutureMap``),
   6. ``core.future_fields`` (``FutureFields``), 7. ``core.batch`` (``Batch`` and the protocols);
8. ``streams``: stream backends, staging rings, ``RunStats``;
9. ``sampling``: the device ``Sampler``;
10. ``steps``: step kinds (``steps.masks``; ``steps.base``; ``steps.token``; ``spec.step``, the
    token step with drafts, and ``spec.multistep``, the token step with windows; ``spec.batch``,
    ``spec.ngram`` and ``spec.verify`` sit lower, beside the batch and the sampler);
11. ``grammars``: the matcher protocol, bitmasks, the xgrammar adapter;
12. ``runtime``: the loop; 13. ``scheduler``: ``ContinuousBatcher``, ``ServingScheduler``,
    ``GenerationParams``; 14. ``models`` (then ``spec.model_drafter`` and the ``spec`` package);
    15. ``engine``: ``Engine``, ``generate``; 16. this package; 17. ``distributed``,
    18. ``examples``, 19. ``testing`` (test tools: nothing else imports them).
"""

from tfuture.core.batch import Batch, ForwardBatch, HostMeta, Model, Scheduler, StepResult
from tfuture.core.errors import FutureError, FutureMapFull
from tfuture.core.future_fields import FutureFields
from tfuture.core.future_map import FutureMap
from tfuture.core.params import SamplingParams
from tfuture.core.slots import FutureIndices
from tfuture.engine import Engine, EngineError, GenerateResult, RequestOutput, TokenStream, generate
from tfuture.kernels.resolve import PreparedInputs, prepare_inputs, resolve_futures_
from tfuture.kernels.store import store_futures
from tfuture.runtime import OverlapRuntime
from tfuture.sampling.sampler import Sampler
from tfuture.scheduler import (
    Completion,
    ContinuousBatcher,
    GenerationParams,
    RequestSpec,
    RequestTimings,
    ServingScheduler,
    TokenUpdate,
)
from tfuture.spec import Drafter, ModelDrafter, NGramDrafter
from tfuture.steps.token import Buckets
from tfuture.streams.stats import RunStats

__all__ = [
    "Batch",
    "Buckets",
    "Completion",
    "ContinuousBatcher",
    "Drafter",
    "Engine",
    "EngineError",
    "ForwardBatch",
    "FutureError",
    "FutureFields",
    "FutureIndices",
    "FutureMap",
    "FutureMapFull",
    "GenerateResult",
    "GenerationParams",
    "HostMeta",
    "Model",
    "ModelDrafter",
    "NGramDrafter",
    "OverlapRuntime",
    "PreparedInputs",
    "RequestOutput",
    "RequestSpec",
    "RequestTimings",
    "RunStats",
    "Sampler",
    "SamplingParams",
    "Scheduler",
    "ServingScheduler",
    "StepResult",
    "TokenStream",
    "TokenUpdate",
    "generate",
    "prepare_inputs",
    "resolve_futures_",
    "store_futures",
]
__version__ = "0.1.0"
