"""Overlap runtime entry point; the future slots live in :mod:`tfuture.futures`."""

from tfuture.futures import FutureError, FutureIndices, FutureMap, FutureMapFull

__all__ = ["FutureError", "FutureIndices", "FutureMap", "FutureMapFull"]
