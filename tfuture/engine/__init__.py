"""The front door: :func:`generate` (three lines from a Hugging Face model to outputs) and
:class:`Engine` (submit, abort, stream and generate against one model, from any thread)."""

from tfuture.engine.detok import IncrementalDecoder
from tfuture.engine.engine import (
    Engine,
    EngineError,
    GenerateResult,
    OnTokens,
    RequestOutput,
    TokenStream,
)
from tfuture.engine.front import generate

__all__ = [
    "Engine",
    "EngineError",
    "GenerateResult",
    "IncrementalDecoder",
    "OnTokens",
    "RequestOutput",
    "TokenStream",
    "generate",
]
