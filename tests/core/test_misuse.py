"""Regression tests for the misuse holes of issue 13 in the core (maps, handles, kernels, fields).

One test (or one parametrized test) per row, named after it; each failed before its fix. The
kernel rows run both implementations: the Triton kernel (the interpreter on a CPU-only
machine) and the numpy path of ``tfuture.kernels.cpu``. A small Hypothesis test at the end
sweeps the same edges (dtype ranges, zero-request prepare, index dtypes) at random.
"""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tfuture import FutureError, FutureFields, FutureIndices, FutureMap, PreparedInputs
from tfuture.core.future_fields import FieldSpec
from tfuture.kernels import cpu
from tfuture.kernels._common import use_triton
from tfuture.kernels.resolve import launch_prepare, prepare_inputs, resolve_futures_, resolve_futures_ref
from tfuture.kernels.store import store_futures, store_futures_ref
from tfuture.testing.faults import FaultPlan

I32_MAX = 2**31 - 1
IMPLS = ["triton", "cpu"]


def i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def err0() -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64)


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which implementation the launchers dispatch to for CPU tensors."""
    if request.param == "triton":
        if not use_triton(torch.empty(0)):
            pytest.skip("the Triton path needs CUDA or TRITON_INTERPRET=1")
    else:
        for mod in ("resolve", "store"):
            monkeypatch.setattr(f"tfuture.kernels.{mod}.use_triton", lambda t: False)
    return request.param


def _outputs(tokens, prefix, n_rows, out_dtype):
    return PreparedInputs(
        torch.full((n_rows,), -777, dtype=out_dtype or tokens.dtype),
        torch.full((n_rows,), -777, dtype=torch.int64),
        torch.full((prefix.numel(),), -777, dtype=torch.int64),
    )


def cpu_prepare(tokens, seg, prefix, token_map, n_rows, err, out_dtype=None):
    """The launcher without checks on the numpy path, whatever TRITON_INTERPRET says."""
    out = _outputs(tokens, prefix, n_rows, out_dtype)
    with mock.patch("tfuture.kernels.resolve.use_triton", lambda t: False):
        return launch_prepare(tokens, seg, prefix, token_map, n_rows, out, err)


def kernel_prepare(tokens, seg, prefix, token_map, n_rows, err, out_dtype=None):
    """The launcher without checks: the Triton kernel under the interpreter (or on CUDA)."""
    if not use_triton(tokens):
        pytest.skip("the Triton path needs CUDA or TRITON_INTERPRET=1")
    out = _outputs(tokens, prefix, n_rows, out_dtype)
    return launch_prepare(tokens, seg, prefix, token_map, n_rows, out, err)


def assert_same(a: PreparedInputs, b: PreparedInputs) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), (a, b)


# D1: values that do not fit the map's (or the ids') dtype never wrap into a placeholder.


def test_d1_store_past_int32_into_an_int32_map_is_refused_on_cpu():
    fmap = FutureMap(4, device="cpu", dtype=torch.int32)
    fi = fmap.alloc(3)
    before = fmap.token_map.clone()
    with pytest.raises(ValueError, match=r"fit the FutureMap's torch.int32 .*got 2147483648"):
        fmap.store(fi, i64(1, 2**31, 3))
    with pytest.raises(ValueError, match=r"got -2147483649"):
        fmap.store(fi, i64(1, -(2**31) - 1, 3))
    assert torch.equal(fmap.token_map, before)
    fmap.store(fi, i64(1, I32_MAX, 3))  # the edge fits
    assert fmap.token_map[1:4].tolist() == [1, I32_MAX, 3]
    fmap.check()
    fmap.release(fi)
    assert fmap.in_use == 0


def test_d1_store_kernel_flags_values_past_an_int32_map(impl):
    token_map = torch.full((6,), 9, dtype=torch.int32)
    values = i64(5, 2**31, 2**40, -3, I32_MAX)
    err, err_ref = err0(), err0()
    store_futures(token_map, range(1, 6), values, err=err)
    want = torch.full((6,), 9, dtype=torch.int32)
    store_futures_ref(want, range(1, 6), values, err=err_ref)
    # Without the device flag 2**31 wrapped to -2**31: a placeholder nobody made.
    assert token_map.tolist() == want.tolist() == [9, 5, 0, 0, 0, I32_MAX]
    assert err.tolist() == err_ref.tolist() == [3, -3]


def test_d1_resolve_of_an_int64_map_into_int32_ids_never_wraps(impl):
    fmap = FutureMap(4, device="cpu", dtype=torch.int64)
    fi = fmap.alloc(3)
    fmap.store(fi, i64(2**31, 7, 2**40))
    ids = torch.tensor([-1, -2, 4, -3], dtype=torch.int32)
    assert fmap.resolve(ids).tolist() == [0, 7, 4, 0]
    with pytest.raises(FutureError, match="2 placeholder"):
        fmap.check()
    # The same through the raw kernel and its reference.
    ids, ref = torch.tensor([-1, -2, 4], dtype=torch.int32), torch.tensor([-1, -2, 4], dtype=torch.int32)
    err, err_ref = err0(), err0()
    resolve_futures_(ids, fmap.token_map, err=err)
    resolve_futures_ref(ref, fmap.token_map, err=err_ref)
    assert ids.tolist() == ref.tolist() == [0, 7, 4] and err.tolist() == err_ref.tolist() == [1, -1]
    # int64 ids hold every int64 token: nothing flagged.
    assert fmap.resolve(i64(-1, -3)).tolist() == [2**31, 2**40]
    fmap.check()
    fmap.release(fi)


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_d1_prepare_into_int32_input_ids_never_wraps(path):
    token_map = i64(0, 2**33, 11)
    tokens, seg, prefix = i64(-1, -2, 2**32 + 5, 3), i64(0, 4), i64(0)
    run = kernel_prepare if path == "triton" else cpu_prepare
    err = err0()
    got = run(tokens, seg, prefix, token_map, 5, err, out_dtype=torch.int32)
    assert got.input_ids.tolist() == [0, 11, 0, 3, 0]
    assert err.tolist() == [2, -1]  # the placeholder -1 (token 2**33) and the token 2**32 + 5


# D2: zero requests on the kernel path read nothing out of bounds and match the CPU path.


def test_d2_zero_requests_with_a_nonzero_seg_start():
    tokens, seg, prefix, token_map = i64(4, -1, 6), i64(5), torch.zeros(0, dtype=torch.int64), i64(0, 9)
    got_err, want_err = err0(), err0()
    got = kernel_prepare(tokens, seg, prefix, token_map, 4, got_err)
    want = cpu_prepare(tokens, seg, prefix, token_map, 4, want_err)
    assert_same(got, want)
    assert got.input_ids.tolist() == [4, 9, 6, 0] and got.positions.tolist() == [0, 0, 0, 0]
    assert got_err.tolist() == want_err.tolist() == [1, -5]  # seg_starts[0] != 0, flagged
    with pytest.raises(ValueError, match=r"seg_starts\[0\] must be 0, got 5"):
        prepare_inputs(tokens, seg, prefix, token_map)


# U4: numpy integers are ints; anything else is a TypeError that names it.


def test_u4_numpy_integers_are_accepted_where_an_int_is():
    tokens, seg, prefix, token_map = i64(3, -1), i64(0, 2), i64(4), i64(0, 8)
    res = prepare_inputs(tokens, seg, prefix, token_map, n_rows=np.int64(5))
    assert res.input_ids.tolist() == [3, 8, 0, 0, 0] and res.positions.tolist() == [4, 5, 0, 0, 0]
    plan = FaultPlan(raise_at={"forward": np.int64(3), "process": np.uint8(2)})
    assert plan.raise_at == {"forward": 3, "process": 2}
    assert all(type(v) is int for v in plan.raise_at.values())
    assert FieldSpec((np.int64(3),), torch.int32).shape == (3,)
    ff = FutureFields(FutureMap(2, device="cpu"), {"d": (np.int32(2), torch.int64)})
    assert ff.specs["d"].shape == (2,)


@pytest.mark.parametrize("bad", [2.5, "3", None, True], ids=["float", "str", "none", "bool"])
def test_u4_non_integers_are_type_errors_naming_the_type(bad):
    if bad is not None:
        with pytest.raises(TypeError, match=f"n_rows must be an int, got {type(bad).__name__}"):
            prepare_inputs(i64(1), i64(0, 1), i64(0), i64(0, 1), n_rows=bad)
    with pytest.raises(
        TypeError, match=rf"raise_at\['forward'\] must be a step number .*got {type(bad).__name__}"
    ):
        FaultPlan(raise_at={"forward": bad})


# U5: a uint8 keep is ambiguous (torch's old mask dtype): refused; big indices reported exactly.


@pytest.mark.parametrize(
    "make", [lambda: torch.tensor([1, 0, 1], dtype=torch.uint8), lambda: np.array([1, 0, 1], np.uint8)]
)
def test_u5_uint8_keep_is_refused(make):
    fmap = FutureMap(4, device="cpu")
    fi = fmap.alloc(3)
    with pytest.raises(TypeError, match="keep must be a bool mask or an int index tensor, got uint8"):
        fi.filter(make())
    fmap.release(fi)
    assert fmap.in_use == 0


def test_u5_uint64_index_is_reported_as_its_value():
    fmap = FutureMap(4, device="cpu")
    fi = fmap.alloc(3)
    with pytest.raises(ValueError, match=r"got 1\.\.9223372036854775808"):
        fi.filter(np.array([1, 2**63], dtype=np.uint64))
    assert fi.filter(np.array([2, 0], dtype=np.uint64)).slots.tolist() == [fi.slots[2], fi.slots[0]]
    assert fmap.in_use == 3


# U6 / U7: malformed segments. CPU tensors: a ValueError at the call. Unchecked (and on CUDA):
# both paths agree, flag each malformed request in err, and never write a negative position.

MALFORMED = {
    "non-monotone": (
        [0, 3, 1, 5],
        [0, 0, 0],
        r"non-decreasing, got seg_starts\[2\] = 1 < seg_starts\[1\] = 3",
    ),
    "negative-prefix": ([0, 2, 5], [4, -7], r"prefix_lens must be >= 0, got prefix_lens\[1\] = -7"),
    "nonzero-first": ([2, 3, 5], [0, 1], r"seg_starts\[0\] must be 0, got 2"),
    "negative-first": ([-2, 3, 5], [0, 1], r"seg_starts\[0\] must be 0, got -2"),
    "all-bad": ([3, 1, 0, 5], [-1, 2, -9], r"seg_starts\[0\] must be 0, got 3"),
}


@pytest.mark.parametrize(("seg", "prefix", "match"), MALFORMED.values(), ids=MALFORMED.keys())
def test_u6_u7_malformed_segments_are_refused_on_the_host(seg, prefix, match):
    tokens, token_map = i64(1, 2, 3, 4, 5), i64(0, 1)
    with pytest.raises(ValueError, match=match):
        prepare_inputs(tokens, i64(*seg), i64(*prefix), token_map)
    fmap = FutureMap(2, device="cpu", debug=True)
    with pytest.raises(ValueError, match=match):
        fmap.prepare_inputs(tokens, i64(*seg), i64(*prefix))
    fmap.check()


@pytest.mark.parametrize(("seg", "prefix", "match"), MALFORMED.values(), ids=MALFORMED.keys())
def test_u6_u7_both_paths_agree_and_flag_malformed_segments(seg, prefix, match):
    tokens, token_map = i64(1, -1, 3, 4, 5), i64(0, 7)
    seg_t, prefix_t = i64(*seg), i64(*prefix)
    errs = err0(), err0()
    got = kernel_prepare(tokens, seg_t, prefix_t, token_map, 6, errs[0])
    want = cpu_prepare(tokens, seg_t, prefix_t, token_map, 6, errs[1])
    assert_same(got, want)
    assert bool((got.positions >= 0).all()) and bool((got.last_rows >= 0).all())
    seg_len = np.diff(seg)
    n_bad = int(((seg_len < 0) | (np.array(prefix) < 0)).sum()) + int(seg[0] != 0)
    assert errs[0].tolist() == errs[1].tolist() and errs[0][0] == n_bad > 0
    # Without err nothing is counted, and the positions are the same.
    assert_same(kernel_prepare(tokens, seg_t, prefix_t, token_map, 6, None), got)


# U9: a map lives on a cpu or cuda device.


def test_u9_meta_device_is_refused_at_construction():
    with pytest.raises(ValueError, match="device must be a cpu or cuda device, got meta"):
        FutureMap(4, device="meta")
    with pytest.raises(TypeError, match=r"device must be a torch\.device or a str, got float"):
        FutureMap(4, device=1.5)  # type: ignore[arg-type]


# U11: an undeclared field's payload must match the handle's rows, as a declared one must.


def test_u11_empty_payload_for_a_non_empty_handle_raises_like_a_declared_field():
    fmap = FutureMap(4, device="cpu")
    ff = FutureFields(fmap)
    fi = fmap.alloc(2)
    with pytest.raises(ValueError, match=r"payload\['x'\] must have len\(fi\) = 2 rows .*got shape \(0, 3\)"):
        ff.store(fi, {"x": torch.empty(0, 3)})
    assert "x" not in ff
    ff.declare("x", ((3,), torch.float32))
    with pytest.raises(ValueError, match=r"payload\['x'\] must have shape \(2, 3\)"):
        ff.store(fi, {"x": torch.empty(0, 3)})
    # An empty handle's empty payload is still a no-op that declares nothing.
    empty = fmap.alloc(0)
    ff.store(empty, {"y": torch.empty(0, 5)})
    assert ff.names == ["x"]
    for h in (fi, empty):
        fmap.release(h)


# U12: out= is checked the same on both paths: int64 positions and last_rows, any 3 tensors.


def test_u12_int32_positions_out_is_refused(impl):
    out = PreparedInputs(i64(0, 0), torch.zeros(2, dtype=torch.int32), i64(0))
    with pytest.raises(ValueError, match=r"out\.positions must have dtype torch\.int64, got torch\.int32"):
        prepare_inputs(i64(1, 2), i64(0, 2), i64(2**40), i64(0, 1), out=out)
    out = PreparedInputs(i64(0, 0), i64(0, 0), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out\.last_rows must have dtype torch\.int64, got torch\.int32"):
        prepare_inputs(i64(1, 2), i64(0, 2), i64(2**40), i64(0, 1), out=out)


@pytest.mark.parametrize("as_type", [tuple, list], ids=["tuple", "list"])
def test_u12_a_plain_sequence_out_works_on_both_paths(impl, as_type):
    out = as_type([i64(9, 9, 9), i64(9, 9, 9), i64(9)])
    res = prepare_inputs(i64(1, -1), i64(0, 2), i64(2**40), i64(0, 5), n_rows=3, out=out)
    assert isinstance(res, PreparedInputs) and res.input_ids is out[0]
    assert res.input_ids.tolist() == [1, 5, 0] and res.positions.tolist() == [2**40, 2**40 + 1, 0]
    assert res.last_rows.tolist() == [1]
    # Through a debug map, which reads res.input_ids.
    fmap = FutureMap(2, device="cpu", debug=True)
    fi = fmap.alloc(1)
    fmap.store(fi, i64(5))
    res = fmap.prepare_inputs(
        i64(1, -1), i64(0, 2), i64(0), n_rows=3, out=as_type([i64(9, 9, 9), i64(9, 9, 9), i64(9)])
    )
    assert isinstance(res, PreparedInputs) and res.input_ids.tolist() == [1, 5, 0]


@pytest.mark.parametrize("bad", [[i64(0)] * 2, i64(0, 0, 0), 3], ids=["two", "tensor", "int"])
def test_u12_out_that_is_not_three_tensors_is_a_type_error(bad):
    with pytest.raises(TypeError, match=r"out must be a PreparedInputs \(or 3 tensors\)"):
        prepare_inputs(i64(1), i64(0, 1), i64(0), i64(0, 1), out=bad)


# Hypothesis: the same edges at random, so the next hole of this kind is found.

EDGES = [0, 1, I32_MAX, 2**31, 2**32 + 1, 2**62, -1, -(2**31), -(2**31) - 1]


@settings(max_examples=40, deadline=None)
@given(
    map_dtype=st.sampled_from([torch.int32, torch.int64]),
    tok_dtype=st.sampled_from([torch.int32, torch.int64]),
    ids_dtype=st.sampled_from([torch.int32, torch.int64]),
    values=st.lists(
        st.one_of(st.sampled_from(EDGES), st.integers(-(2**63), 2**63 - 1)), min_size=1, max_size=5
    ),
)
def test_property_dtype_ranges_store_then_resolve(map_dtype, tok_dtype, ids_dtype, values):
    info = torch.iinfo(tok_dtype)
    values = [min(max(v, info.min), info.max) for v in values]
    fmap = FutureMap(8, device="cpu", dtype=map_dtype)
    fi = fmap.alloc(len(values))
    tokens = torch.tensor(values, dtype=tok_dtype)
    fits_map = all(torch.iinfo(map_dtype).min <= v <= torch.iinfo(map_dtype).max for v in values)
    if not fits_map:
        with pytest.raises(ValueError, match="must fit the FutureMap"):
            fmap.store(fi, tokens)
        assert fmap.token_map.eq(0).all()
        fmap.release(fi)
        return
    fmap.store(fi, tokens)
    stored = [max(v, 0) for v in values]
    assert fmap.token_map[fi.slots.tolist()].tolist() == stored
    n_flagged = sum(v < 0 for v in values)
    ids = fi.placeholders(ids_dtype)
    fmap.resolve(ids)
    lim = torch.iinfo(ids_dtype)
    want = [v if lim.min <= v <= lim.max else 0 for v in stored]
    assert ids.tolist() == want
    n_flagged += sum(w != v for w, v in zip(want, stored, strict=True))
    assert int(fmap.err[0]) == n_flagged
    fmap.err.zero_()
    # The numpy path agrees with what the kernel (or the dispatch here) did.
    ids2, err = fi.placeholders(ids_dtype), err0()
    cpu.resolve_(ids2, fmap.token_map, err)
    assert ids2.tolist() == want
    fmap.release(fi)
    assert fmap.in_use == 0


@settings(max_examples=40, deadline=None)
@given(
    seg=st.lists(st.integers(-3, 8), min_size=1, max_size=5),
    prefix=st.lists(st.integers(-3, 2**40), max_size=4),
    n_tokens=st.integers(0, 6),
    pad=st.integers(0, 3),
    tok_dtype=st.sampled_from([torch.int32, torch.int64]),
    out_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_property_prepare_paths_agree_on_any_segments(seg, prefix, n_tokens, pad, tok_dtype, out_dtype):
    seg = seg[: len(prefix) + 1]
    prefix = prefix[: len(seg) - 1]
    seg_t, prefix_t = i64(*seg), i64(*prefix)
    # Odd rows: slot 1 (2**40, past an int32 output); even rows: a token past int32 if it fits.
    big = 2**31 if tok_dtype == torch.int64 else 0
    tokens = torch.tensor([(-1 if r % 2 else big + r) for r in range(n_tokens)], dtype=tok_dtype)
    token_map = i64(0, 2**40)
    n_rows = n_tokens + pad
    errs = err0(), err0()
    got = kernel_prepare(tokens, seg_t, prefix_t, token_map, n_rows, errs[0], out_dtype)
    want = cpu_prepare(tokens, seg_t, prefix_t, token_map, n_rows, errs[1], out_dtype)
    assert_same(got, want)
    assert errs[0].tolist() == errs[1].tolist()
    assert bool((got.positions >= 0).all()) and bool((got.last_rows >= 0).all())
    if not prefix:
        assert not got.positions.any()  # zero requests: no row has an owner
    well_formed = (
        seg[0] == 0 and all(b >= a for a, b in itertools.pairwise(seg)) and min(prefix, default=0) >= 0
    )
    if not well_formed:
        # No rows and no requests: nothing is launched, so nothing is flagged.
        assert errs[0][0] > 0 or max(n_rows, len(prefix)) == 0
        with pytest.raises(ValueError):
            prepare_inputs(tokens, seg_t, prefix_t, token_map, n_rows=n_rows)


INDEX_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64]
TORCH_INDEX_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 6),
    picks=st.lists(st.integers(-8, 2**64 - 1), max_size=4),
    dtype=st.sampled_from([*INDEX_DTYPES, *TORCH_INDEX_DTYPES, np.uint8, torch.uint8]),
)
def test_property_filter_with_any_index_dtype(n, picks, dtype):
    fmap = FutureMap(8, device="cpu")
    fi = fmap.alloc(n)
    is_torch = isinstance(dtype, torch.dtype)
    info = torch.iinfo(dtype) if is_torch else np.iinfo(dtype)
    picks = [p for p in picks if info.min <= p <= info.max]
    keep = torch.tensor(picks, dtype=dtype) if is_torch else np.array(picks, dtype=dtype)
    if dtype in (np.uint8, torch.uint8):
        with pytest.raises(TypeError, match="got uint8"):
            fi.filter(keep)
    elif any(not -n <= p < n for p in picks):
        with pytest.raises(ValueError, match=rf"got {min(picks)}\.\.{max(picks)}"):
            fi.filter(keep)
    else:
        sub = fi.filter(keep)
        assert isinstance(sub, FutureIndices) and sub.slots.tolist() == [fi.slots[p] for p in picks]
        fmap.release(sub)
    fmap.release(fi)
    assert fmap.in_use == 0
