"""Per-request sampling parameters: :class:`SamplingParams`, its packed int64 row, and checks.

A packed row is ``PARAM_WORDS`` int64 words: the float fields as float64 bit patterns
(``np.float64(x).view(np.int64)``), then ``top_k`` and ``seed`` as plain int64. A table of rows
(``[n_reqs, PARAM_WORDS]`` int64) travels with a batch and is read on the host by the sampler's
``plan``; only what the device needs for a step is copied to it.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "GREEDY_BELOW",
    "PARAM_WORDS",
    "SEED_LIMIT",
    "SamplingParams",
    "check_packed_params",
    "pack_params",
    "unpack_params",
]

# Word of each field in a packed row. Words 0..5 hold float64 bit patterns, 6..7 int64.
TEMPERATURE, TOP_P, MIN_P, FREQUENCY, PRESENCE, REPETITION, TOP_K, SEED = range(8)
PARAM_WORDS = 8
N_FLOATS = 6
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
# A temperature below this samples greedily (as vLLM does): x / T would overflow to inf and the
# softmax to NaN long before T reaches the smallest float.
GREEDY_BELOW = 1e-5
SEED_LIMIT = 2**63
# Closed bounds of the float words (what _FLOAT_RULES say, as numbers): > 0 is >= the smallest
# positive float, finite is <= the largest.
_TINY, _BIG = float(np.nextafter(0.0, 1.0)), float(np.finfo(np.float64).max)
_LOWER = np.array([0.0, _TINY, 0.0, -_BIG, -_BIG, _TINY])
_UPPER = np.array([_BIG, 1.0, 1.0, _BIG, _BIG, _BIG])


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SamplingParams.{name} must be a float, got {type(value).__name__} {value!r}")
    return float(value)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


# The sampler computes in float32 for float16/bfloat16/float32 logits: every parameter must keep
# its meaning there (no overflow to inf, no underflow to 0, no inf / inf = NaN), so the ranges
# stop well inside float32's.
MAX_TEMPERATURE = 1e6
MIN_TOP_P = 1e-30
MAX_PENALTY = 1e6
# (field, what is expected, test) for the float fields; the tests take numpy arrays or floats.
_FLOAT_RULES: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    (
        "temperature",
        f"a float in [0, {MAX_TEMPERATURE:g}] (0 = greedy)",
        lambda x: (x >= 0) & (x <= MAX_TEMPERATURE),
    ),
    (
        "top_p",
        f"a float in [{MIN_TOP_P:g}, 1] (1 = off; for greedy use temperature 0)",
        lambda x: (x >= MIN_TOP_P) & (x <= 1),
    ),
    ("min_p", "a float in [0, 1]", lambda x: (x >= 0) & (x <= 1)),
    (
        "frequency_penalty",
        f"a float in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
        lambda x: (x >= -MAX_PENALTY) & (x <= MAX_PENALTY),
    ),
    (
        "presence_penalty",
        f"a float in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
        lambda x: (x >= -MAX_PENALTY) & (x <= MAX_PENALTY),
    ),
    (
        "repetition_penalty",
        f"a float in [{1 / MAX_PENALTY:g}, {MAX_PENALTY:g}] (1 = off)",
        lambda x: (x >= 1 / MAX_PENALTY) & (x <= MAX_PENALTY),
    ),
)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples. Defaults: greedy, no filter, no penalty.

    Attributes:
        temperature: ``0`` (or anything below ``GREEDY_BELOW`` = 1e-5) is greedy (argmax);
            else logits are divided by it. Finite, ``>= 0``.
        top_k: keep the ``top_k`` most likely tokens; ``0`` = off, ``1`` = greedy. ``>= 0``.
        top_p: keep the smallest set of most likely tokens whose probability sums to ``>=
            top_p`` (the top token always stays). In ``(0, 1]``; ``1`` = off.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's. In
            ``[0, 1]``; ``0`` = off.
        seed: the request's random stream: the draw for the token at sequence position ``pos``
            is ``uniform_draws(seed, pos)``, so the same (seed, position) samples the same token
            in any batch, sync or overlapped. ``0 <= seed < 2**63``.
        frequency_penalty: subtracted once per earlier occurrence of a token in the outputs.
        presence_penalty: subtracted once from every token that occurs in the outputs.
        repetition_penalty: tokens seen in the prompt or outputs get ``logit / r`` when the
            logit is positive, ``logit * r`` otherwise; ``> 0``, ``1`` = off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name, expected, ok in _FLOAT_RULES:
            value = _real(name, getattr(self, name))
            if not bool(ok(value)):
                raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
            object.__setattr__(self, name, value)
        top_k, seed = _integer("top_k", self.top_k), _integer("seed", self.seed)
        if top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {top_k}")
        if not 0 <= top_k < SEED_LIMIT:
            raise ValueError(f"SamplingParams.top_k must fit in int64, got {top_k}")
        if not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"SamplingParams.seed must be an int in [0, 2**63), got {seed}")
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "seed", seed)

    @property
    def greedy(self) -> bool:
        """True when the request always takes the argmax of its (penalised, masked) logits."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when a frequency, presence or repetition penalty is on (needs a history row)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    def pack(self) -> np.ndarray:
        """``[PARAM_WORDS]`` int64: the float fields' float64 bit patterns, then top_k, seed."""
        row = np.empty(PARAM_WORDS, dtype=np.int64)
        row[:N_FLOATS] = np.array([getattr(self, f) for f in FLOAT_FIELDS], dtype=np.float64).view(np.int64)
        row[TOP_K], row[SEED] = self.top_k, self.seed
        return row


def pack_params(params: Sequence[SamplingParams]) -> np.ndarray:
    """``[len(params), PARAM_WORDS]`` int64: one packed row per request, in order."""
    table = np.empty((len(params), PARAM_WORDS), dtype=np.int64)
    floats = np.empty((len(params), N_FLOATS), dtype=np.float64)
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"pack_params expects SamplingParams, got {type(p).__name__} at index {i}")
        floats[i] = (p.temperature, p.top_p, p.min_p, p.frequency_penalty, p.presence_penalty,
                     p.repetition_penalty)  # fmt: skip
        table[i, TOP_K], table[i, SEED] = p.top_k, p.seed
    table[:, :N_FLOATS] = floats.view(np.int64)
    return table


def unpack_params(table: np.ndarray) -> list[SamplingParams]:
    """The :class:`SamplingParams` of each row of a packed ``[n, PARAM_WORDS]`` int64 table."""
    table = check_packed_params(table, len(table) if isinstance(table, np.ndarray) and table.ndim else -1)
    floats = np.ascontiguousarray(table[:, :N_FLOATS]).view(np.float64)
    return [
        SamplingParams(**dict(zip(FLOAT_FIELDS, map(float, f), strict=True)), top_k=int(k), seed=int(s))
        for f, k, s in zip(floats, table[:, TOP_K], table[:, SEED], strict=True)
    ]


def check_packed_params(a: object, n: int) -> np.ndarray:
    """``a`` if it is a valid packed table of ``n`` requests, else a ``TypeError``/``ValueError``.

    ``a`` must be a ``[n, PARAM_WORDS]`` int64 numpy array whose rows decode to valid
    :class:`SamplingParams` values; the error names the first bad row, its field, what was
    expected and what came.
    """
    if not isinstance(a, np.ndarray) or a.dtype != np.int64:
        got = f"{a.dtype} array" if isinstance(a, np.ndarray) else type(a).__name__
        raise TypeError(f"packed sampling params must be an int64 numpy array (pack_params), got {got}")
    if a.shape != (n, PARAM_WORDS):
        raise ValueError(
            f"packed sampling params must have shape ({n}, {PARAM_WORDS}) (one row per request), "
            f"got {a.shape}"
        )
    if n == 0:
        return a
    floats = a[:, :N_FLOATS].view(np.float64)  # same item size: a view on any strides
    # Fast path (every step): every float inside its closed bounds (NaN fails both tests).
    inside = (floats >= _LOWER) & (floats <= _UPPER)
    if np.count_nonzero(inside) == inside.size and not np.count_nonzero(a[:, TOP_K:] < 0):
        return a
    for col, (name, expected, ok) in enumerate(_FLOAT_RULES):
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~ok(floats[:, col]))
        if bad.size:
            row = int(bad[0])
            raise ValueError(
                f"packed sampling params row {row}: {name} must be {expected}, got {floats[row, col]!r}"
            )
    for col, name, expected in ((TOP_K, "top_k", "an int >= 0"), (SEED, "seed", "an int in [0, 2**63)")):
        bad = np.flatnonzero(a[:, col] < 0)
        if bad.size:
            row = int(bad[0])
            raise ValueError(
                f"packed sampling params row {row}: {name} must be {expected}, got {a[row, col]}"
            )
    return a
