"""Misuse the fuzz throws at the FutureMap API, each with the exception the API documents, and
:func:`expect`, which runs a call and checks that it raised exactly that (or nothing)."""

import torch
from hypothesis import event

from tfuture import FutureError, FutureMapFull

DOCUMENTED = (ValueError, TypeError, FutureMapFull, FutureError)


def outcome(fn) -> tuple[object, BaseException | None]:
    try:
        return fn(), None
    except Exception as exc:
        assert isinstance(exc, DOCUMENTED), f"undocumented exception {type(exc).__name__}: {exc}"
        return None, exc


def expect(fn, want: type[BaseException] | None, what: str = ""):
    """Run ``fn``; it must raise exactly ``want`` (or succeed when ``want`` is None)."""
    if what:
        event(f"{what}: {'ok' if want is None else want.__name__}")
    res, exc = outcome(fn)
    if want is None:
        assert exc is None, f"expected success, got {type(exc).__name__}: {exc}"
    else:
        assert type(exc) is want, f"expected {want.__name__}, got {exc!r}"
    return res


# Tensors that must be refused as token / id vectors (n: the handle's length), with the
# exception the API documents.
BAD_VECTORS = {
    "float": (lambda n, dt: torch.ones(max(n, 1), dtype=torch.float32), ValueError),
    "bool": (lambda n, dt: torch.ones(max(n, 1), dtype=torch.bool), ValueError),
    "int16": (lambda n, dt: torch.ones(max(n, 1), dtype=torch.int16), ValueError),
    "meta": (lambda n, dt: torch.ones(max(n, 1), dtype=dt, device="meta"), ValueError),
    "2d": (lambda n, dt: torch.ones(max(n, 1), 1, dtype=dt), ValueError),
    "noncontig": (lambda n, dt: torch.arange(2 * max(n, 2), dtype=dt)[::2], ValueError),
    "list": (lambda n, dt: list(range(n)), TypeError),
    "none": (lambda n, dt: None, TypeError),
}
# Keeps that filter must refuse, likewise ("oor-index" draws its index from the data).
BAD_KEEPS = {
    "short-mask": (lambda n: [True] * (n + 1), ValueError),
    "float": (lambda n: [0.0] * max(n, 1), TypeError),
    "float-torch": (lambda n: torch.zeros(max(n, 1)), TypeError),
    "2d": (lambda n: torch.zeros(1, max(n, 1), dtype=torch.bool), ValueError),
    "scalar": (lambda n: 0, TypeError),
    "string": (lambda n: "01", TypeError),
    "strs": (lambda n: ["a"], TypeError),
    "ragged": (lambda n: [[0], [0, 0]], ValueError),
}


def bad_vector(kind: str, n: int, dtype: torch.dtype) -> tuple[object, type[BaseException]]:
    make, want = BAD_VECTORS[kind]
    return make(n, dtype), want
