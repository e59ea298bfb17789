"""SamplingParams validation, packing, and the checks of a user's packed table."""

from __future__ import annotations

import numpy as np
import pytest

from tfuture.sampling import PARAM_WORDS, SamplingParams, check_packed_params, pack_params, unpack_params

BAD_VALUES = [
    ("temperature", -0.5, ValueError),
    ("temperature", float("nan"), ValueError),
    ("temperature", float("inf"), ValueError),
    ("temperature", "0.7", TypeError),
    ("temperature", True, TypeError),
    ("top_k", -1, ValueError),
    ("top_k", 2.0, TypeError),
    ("top_k", True, TypeError),
    ("top_k", 2**63, ValueError),
    ("top_p", 0.0, ValueError),
    ("top_p", 1.5, ValueError),
    ("top_p", -0.1, ValueError),
    ("top_p", float("nan"), ValueError),
    ("min_p", -0.01, ValueError),
    ("min_p", 1.01, ValueError),
    ("seed", -1, ValueError),
    ("seed", 2**63, ValueError),
    ("seed", True, TypeError),
    ("seed", 3.0, TypeError),
    ("seed", None, TypeError),
    ("frequency_penalty", float("inf"), ValueError),
    ("frequency_penalty", float("nan"), ValueError),
    ("presence_penalty", float("-inf"), ValueError),
    ("repetition_penalty", 0.0, ValueError),
    ("repetition_penalty", -1.2, ValueError),
    ("repetition_penalty", float("inf"), ValueError),
]


@pytest.mark.parametrize(("field", "value", "error"), BAD_VALUES)
def test_bad_value_names_field_and_value(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    msg = str(info.value)
    assert field in msg and repr(value)[:6].strip("'") in msg, msg


def test_good_values_and_properties() -> None:
    p = SamplingParams(temperature=1, top_k=np.int64(5), top_p=0.5, min_p=1, seed=2**63 - 1)
    assert p.temperature == 1.0 and type(p.temperature) is float and type(p.top_k) is int
    assert not p.greedy and not p.has_penalties
    assert SamplingParams().greedy and SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=2.0, top_k=1).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties
    assert SamplingParams(presence_penalty=2).has_penalties


def test_pack_unpack_round_trip() -> None:
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=2**63 - 1),
        SamplingParams(
            temperature=1.3, seed=12345, frequency_penalty=-2.0, presence_penalty=1.5, repetition_penalty=1.25
        ),
        SamplingParams(temperature=1e-300, top_p=1e-30, min_p=1.0, repetition_penalty=1e-6),
    ]
    table = pack_params(params)
    assert table.dtype == np.int64 and table.shape == (4, PARAM_WORDS)
    assert np.array_equal(table[1], params[1].pack())
    assert unpack_params(table) == params
    assert check_packed_params(table, 4) is table
    assert pack_params([]).shape == (0, PARAM_WORDS)
    with pytest.raises(TypeError, match=r"SamplingParams.*dict at index 1"):
        pack_params([SamplingParams(), {}])  # type: ignore[list-item]


def _set_float(table: np.ndarray, row: int, col: int, value: float) -> None:
    table[row, col] = np.array(value, dtype=np.float64).view(np.int64)


@pytest.mark.parametrize(
    ("col", "value", "field"),
    [
        (0, -1.0, "temperature"),
        (0, float("nan"), "temperature"),
        (0, float("inf"), "temperature"),
        (1, 0.0, "top_p"),
        (1, 1.0000001, "top_p"),
        (2, 2.0, "min_p"),
        (3, float("nan"), "frequency_penalty"),
        (4, float("inf"), "presence_penalty"),
        (5, 0.0, "repetition_penalty"),
        (6, -3, "top_k"),
        (7, -1, "seed"),
    ],
)
def test_check_packed_params_names_row_field_value(col: int, value: float, field: str) -> None:
    table = pack_params([SamplingParams(temperature=0.5, seed=i) for i in range(4)])
    if col < 6:
        _set_float(table, 2, col, value)
    else:
        table[2, col] = int(value)
    with pytest.raises(ValueError) as info:
        check_packed_params(table, 4)
    msg = str(info.value)
    assert "row 2" in msg and field in msg and str(value) in msg, msg


def test_check_packed_params_type_and_shape() -> None:
    table = pack_params([SamplingParams()] * 3)
    with pytest.raises(TypeError, match=r"int64 numpy array.*got float64 array"):
        check_packed_params(table.astype(np.float64), 3)
    with pytest.raises(TypeError, match="got list"):
        check_packed_params(table.tolist(), 3)
    with pytest.raises(ValueError, match=r"shape \(4, 8\).*got \(3, 8\)"):
        check_packed_params(table, 4)
    with pytest.raises(ValueError, match=r"got \(24,\)"):
        check_packed_params(table.reshape(-1), 3)
    assert check_packed_params(np.empty((0, PARAM_WORDS), np.int64), 0).shape == (0, PARAM_WORDS)
