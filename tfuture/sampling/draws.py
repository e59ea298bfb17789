"""Counter-based uniform draws: a pure function of (seed, position), computed on the host.

The draw for the token a request samples at sequence position ``pos`` is
``uniform_draws(seed, pos)``; it depends on nothing else (no generator state, no batch, no
step), so sync and overlapped runs, and any batch composition, draw the same number. The hash
is SplitMix64's finaliser over a Weyl-style counter: ``u = mix(seed * SEED_MUL + (pos + 1) *
GOLDEN) >> 11``, scaled to ``[0, 1)`` (53 random bits); numpy uint64, wrapping arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["device_draws", "uniform_draws"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# An odd multiplier for the seed, unrelated to _GOLDEN: (seed, pos) and (seed', pos') share an
# input only if (seed - seed') * _SEED_MUL == (pos' - pos) * _GOLDEN mod 2**64.
_SEED_MUL = np.uint64(0xD1342543DE82EF95)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_TO_UNIT = 2.0**-53


def draws_unchecked(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """:func:`uniform_draws` of two int64 arrays of one shape, without the argument checks."""
    # Array (not scalar) uint64 arithmetic wraps silently: no errstate needed (it costs ~5 us).
    z = seeds.astype(np.uint64) * _SEED_MUL
    z += (positions.astype(np.uint64) + np.uint64(1)) * _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    z >>= np.uint64(11)
    return z.astype(np.float64) * _TO_UNIT


def _ints(name: str, a: object) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"uniform_draws: {name} must be integers, got dtype {arr.dtype}")
    return arr


def uniform_draws(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Float64 draws in ``[0, 1)``, one per (seed, position) pair (numpy broadcasting).

    Args:
        seeds: integers in ``[0, 2**63)`` (a request's ``SamplingParams.seed``).
        positions: integers ``>= 0``: the sequence position of the token being sampled.

    Returns:
        float64 array of the broadcast shape; multiples of ``2**-53``.
    """
    s, p = _ints("seeds", seeds), _ints("positions", positions)
    if s.size and (int(s.min()) < 0 or int(s.max()) >= 2**63):
        raise ValueError(f"uniform_draws: seeds must be in [0, 2**63), got range [{s.min()}, {s.max()}]")
    if p.size and int(p.min()) < 0:
        raise ValueError(f"uniform_draws: positions must be >= 0, got min {p.min()}")
    s, p = np.broadcast_arrays(s, p)
    return draws_unchecked(s.reshape(-1), p.reshape(-1)).reshape(s.shape)  # 1-D: never numpy scalars


def _signed(c: np.uint64) -> int:
    """The int64 with the bits of the uint64 ``c`` (torch has no wrapping uint64 arithmetic)."""
    v = int(c)
    return v - (1 << 64) if v >= 1 << 63 else v


_T_GOLDEN, _T_SEED_MUL, _T_M1, _T_M2 = (_signed(c) for c in (_GOLDEN, _SEED_MUL, _M1, _M2))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """The logical right shift of int64 bits (``>>`` on int64 is arithmetic: mask the sign copies)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def device_draws(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`uniform_draws` on the device: float64 ``[m]`` from int64 ``seeds`` and ``positions``
    ``[m]`` (no host read, so a position known only on the device keys its draw). The same
    (seed, position) gives the same number as the host function, bit for bit: int64
    multiplication wraps like uint64 (two's complement), shifts are made logical."""
    z = seeds * _T_SEED_MUL + (positions + 1) * _T_GOLDEN
    z = z ^ _shr(z, 30)
    z = z * _T_M1
    z = z ^ _shr(z, 27)
    z = z * _T_M2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).to(torch.float64) * _TO_UNIT
