"""Named multi-token futures: per-slot fields of any shape and dtype beside a :class:`FutureMap`.

A step of speculative decoding produces more than one token id per request: the accepted
tokens ``[k+1]``, the accepted length, the new sequence length, the next drafts ``[k]``, maybe
top-k probabilities or a hidden row. :class:`FutureFields` keeps one device buffer per field,
``[capacity + 1, *shape]``, indexed by the map's own slot numbers: the handle that names a
request's token slot names its fields too, with the same ownership (no second allocator).
``store`` writes every field of a step in one launch, ``gather`` reads any subset in one.

Stores and gathers run on the current stream and never sync. Field values are copied as raw
integer words, so floats round-trip bit for bit.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tfuture.core.future_map import FutureMap
from tfuture.core.slots import FutureIndices
from tfuture.kernels.fields import (
    as_words,
    gather_fields,
    launch_gather_fields,
    launch_store_fields,
    row_stride,
)

Shape = tuple[int, ...]


class UnknownFieldError(KeyError, ValueError):
    """A name that is not a declared field (a ``KeyError`` and a ``ValueError``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field: per-slot ``shape`` (``()`` for a scalar) and ``dtype`` (1, 2, 4 or 8 bytes)."""

    shape: Shape
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in self.shape
        ):
            raise ValueError(f"field shape must be a tuple of ints >= 0, got {self.shape!r}")
        # numpy integers are welcome; stored as Python ints (hashable, equal, printable).
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"field dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        as_words(torch.empty(0, dtype=self.dtype))

    @property
    def width(self) -> int:
        """Elements per slot."""
        return math.prod(self.shape)


def _spec(name: object, spec: object) -> FieldSpec:
    if not isinstance(name, str) or not name:
        raise TypeError(f"field names must be non-empty strings, got {name!r}")
    if isinstance(spec, FieldSpec):
        return spec
    if not isinstance(spec, tuple) or len(spec) != 2:
        raise TypeError(f"field {name!r} must be declared as (shape, dtype), got {spec!r}")
    shape, dtype = spec
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    return FieldSpec(tuple(shape), dtype)


class FutureFields:
    """Per-slot fields attached to ``fmap``'s slots.

    Args:
        fmap: the map whose slot numbers and handles index the fields.
        fields: ``{name: (shape, dtype)}`` declared up front (``shape`` a tuple, ``()`` for a
            scalar; an int ``k`` means ``(k,)``).
        allow_new: a ``store`` may name a field that is not declared yet; it is created from
            the first payload for a non-empty handle that names it (a payload must have one row
            per handle row either way). Default: True when ``fields`` is empty.
            Declaring from inside a store is not thread-safe with concurrent readers of
            :attr:`specs`; declare up front when stores run on a worker thread.

    Buffers start zeroed. A slot's fields keep their last values after release (like the
    token map), so read only slots a live handle names and a store has filled.
    """

    def __init__(
        self,
        fmap: FutureMap,
        fields: Mapping[str, tuple[Shape | int, torch.dtype] | FieldSpec] | None = None,
        *,
        allow_new: bool | None = None,
    ) -> None:
        if not isinstance(fmap, FutureMap):
            raise TypeError(f"fmap must be a FutureMap, got {type(fmap).__name__}")
        self.fmap = fmap
        self.allow_new = not fields if allow_new is None else bool(allow_new)
        self._specs: dict[str, FieldSpec] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._scratch = np.zeros(fmap.capacity + 1, dtype=np.int64)
        for name, spec in (fields or {}).items():
            self.declare(name, spec)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}: {list(s.shape)} {s.dtype}" for n, s in self._specs.items())
        return f"FutureFields({{{inner}}}, capacity={self.fmap.capacity}, device={self.fmap.device})"

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    @property
    def names(self) -> list[str]:
        return list(self._specs)

    @property
    def specs(self) -> dict[str, FieldSpec]:
        return dict(self._specs)

    def declare(self, name: str, spec: tuple[Shape | int, torch.dtype] | FieldSpec) -> torch.Tensor:
        """Add field ``name``; returns its zeroed buffer ``[capacity + 1, *shape]``."""
        fs = _spec(name, spec)
        if name in self._specs:
            raise ValueError(f"field {name!r} is already declared as {self._specs[name]}")
        buf = torch.zeros((self.fmap.capacity + 1, *fs.shape), dtype=fs.dtype, device=self.fmap.device)
        self._specs[name], self._buffers[name] = fs, buf
        return buf

    def buffer(self, name: str) -> torch.Tensor:
        """The device buffer of field ``name``: ``[capacity + 1, *shape]``, row ``s`` is slot ``s``."""
        self._check_names([name])
        return self._buffers[name]

    def store(self, fi: FutureIndices, payload: Mapping[str, torch.Tensor]) -> None:
        """Write ``payload[name][i]`` into field ``name`` of ``fi``'s row ``i`` slot, one launch.

        Args:
            fi: a live handle of this map with distinct slots.
            payload: ``{name: [len(fi), *shape]}`` tensors of each field's dtype on the map's
                device (rows may be strided; each row one contiguous block). Any subset of the
                fields; with ``allow_new``, unknown names are declared from their payload.

        Every check runs before anything changes: a bad payload raises ``ValueError`` or
        ``TypeError`` (naming the expected and actual value) and leaves the fields unchanged.
        """
        n = self._check_handle(fi, "store")
        if not isinstance(payload, Mapping):
            raise TypeError(f"payload must be a mapping name -> tensor, got {type(payload).__name__}")
        new: dict[str, FieldSpec] = {}
        names = []
        for name, t in payload.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"payload[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
            if t.device != self.fmap.device:
                raise ValueError(
                    f"payload[{name!r}] is on {t.device} but the FutureMap is on {self.fmap.device}"
                )
            fs = self._specs.get(name)
            if fs is None:
                if not self.allow_new:
                    raise UnknownFieldError(f"unknown field {name!r}; declared fields: {self.names}")
                if t.dim() < 1:
                    raise ValueError(f"payload[{name!r}] must be [n, *shape], got a 0-D tensor")
                if t.shape[0] != n:
                    # As for a declared field: the rows must match the handle, empty or not.
                    raise ValueError(
                        f"payload[{name!r}] must have len(fi) = {n} rows ([len(fi), *shape]), "
                        f"got shape {tuple(t.shape)}"
                    )
                if not n:
                    continue  # an empty handle's payload declares nothing: its shape may be a placeholder
                fs = new[name] = _spec(name, (tuple(t.shape[1:]), t.dtype))
            _check_payload(name, t, n, fs)
            names.append(name)
        if n > 1 and not fi.is_contiguous and self._has_duplicates(fi.slots):
            raise ValueError("store expects a handle with distinct slots, got one naming a slot twice")
        for name, fs in new.items():
            self.declare(name, fs)
        if n == 0 or not names:
            return
        values = [payload[k] for k in names]
        if values[0].is_cuda:
            stream = torch.cuda.current_stream(values[0].device)
            for v in values:
                v.record_stream(stream)
        slots, negated = self._slot_arg(fi)
        # Every check above covers what store_fields would check again: skip them (host cost).
        launch_store_fields([self._buffers[k] for k in names], slots, values, negated, None)

    def launch_store(self, fi: FutureIndices, name: str, values: torch.Tensor) -> None:
        """:meth:`store` of one declared field without its argument checks, for a caller that
        built ``values`` (``[len(fi), *shape]`` of the field's dtype, on the map's device) and
        holds ``fi`` (a live handle of this map with distinct slots: a step's fresh slots)."""
        if not len(fi):
            return
        if values.is_cuda:
            values.record_stream(torch.cuda.current_stream(values.device))
        slots, negated = self._slot_arg(fi)
        launch_store_fields([self._buffers[name]], slots, [values], negated, None)

    def gather(
        self,
        src: FutureIndices | torch.Tensor,
        names: Iterable[str] | None = None,
        *,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read fields ``names`` (default: all) for ``src``'s rows, in one launch.

        Args:
            src: a live handle of this map, or a device ``[n]`` int32/int64 tensor of slot
                numbers (1-based). A slot outside the map is never read: its rows are zero and
                it is flagged in ``fmap.err`` (``fmap.check()`` raises).
            names: the fields to read.
            out: optional preallocated ``{name: [n, *shape]}`` outputs (CUDA-graph capture).

        Returns ``{name: [n, *shape]}`` contiguous tensors of each field's dtype.
        """
        if isinstance(names, str):
            raise TypeError(f"names must be an iterable of field names, got the str {names!r}")
        names = self.names if names is None else list(names)
        self._check_names(names)
        if isinstance(src, FutureIndices):
            self._check_handle(src, "gather")
            slots, negated = self._slot_arg(src)
        elif isinstance(src, torch.Tensor):
            slots, negated = src, False
        else:
            raise TypeError(f"gather expects a FutureIndices or a slot tensor, got {type(src).__name__}")
        if not names:
            return {}
        outs = None if out is None else [out[k] for k in names]
        bufs = [self._buffers[k] for k in names]
        # A handle's slots and our own buffers need no second check; a user tensor or out= does.
        trusted = outs is None and isinstance(src, FutureIndices)
        if trusted:
            res = launch_gather_fields(bufs, slots, outs, negated, self.fmap.err)
        else:
            res = gather_fields(bufs, slots, out=outs, negated=negated, err=self.fmap.err)
        return dict(zip(names, res, strict=True))

    def _has_duplicates(self, slots: np.ndarray) -> bool:
        # Scatter row numbers and read them back: a slot named twice keeps only one row. O(n),
        # about 3 us at n=256 where np.unique (hash based, numpy 2) takes about 50 us.
        rows = np.arange(slots.size)
        self._scratch[slots] = rows
        return bool((self._scratch[slots] != rows).any())

    def _slot_arg(self, fi: FutureIndices) -> tuple[torch.Tensor | range, bool]:
        """A contiguous fresh handle needs no index tensor; others copy ``-slot`` to the device."""
        if fi.is_contiguous and len(fi):
            start = int(fi.slots[0])
            return range(start, start + len(fi)), False
        ph = fi.placeholders()
        if ph.is_cuda:
            ph.record_stream(torch.cuda.current_stream(ph.device))
        return ph, True

    def _check_names(self, names: Sequence[str]) -> None:
        for name in names:
            if name not in self._specs:
                raise UnknownFieldError(f"unknown field {name!r}; declared fields: {self.names}")

    def _check_handle(self, fi: object, what: str) -> int:
        if not isinstance(fi, FutureIndices):
            raise TypeError(f"{what} expects a FutureIndices, got {type(fi).__name__}")
        if fi.map is not self.fmap:
            raise ValueError(f"{what} expects a FutureIndices of this FutureFields' map, got a foreign one")
        if fi.released:
            raise ValueError(f"{what}: expected a live FutureIndices, got a released one")
        return len(fi)


def _check_payload(name: str, t: torch.Tensor, n: int, fs: FieldSpec) -> None:
    if t.dtype != fs.dtype:
        raise TypeError(f"payload[{name!r}] must have dtype {fs.dtype}, got {t.dtype}")
    want = (n, *fs.shape)
    if tuple(t.shape) != want:
        raise ValueError(
            f"payload[{name!r}] must have shape {want} ([len(fi), *shape]), got {tuple(t.shape)}"
        )
    row_stride(f"payload[{name!r}]", t)
