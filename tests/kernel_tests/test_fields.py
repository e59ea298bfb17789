"""store_fields / gather_fields: the Triton kernel and the CPU path against their torch references.

Payloads are random bit patterns viewed as each dtype, so floats carry NaNs with payloads,
-0.0, infinities and subnormals; every comparison is on the raw words. Buffers and outputs
start poisoned, so a row written by mistake, or one left unwritten, shows up.
"""

import pytest
import torch

from tfuture.kernels import cpu
from tfuture.kernels.fields import (
    as_words,
    gather_fields,
    gather_fields_ref,
    launch_gather_fields,
    launch_store_fields,
    store_fields,
    store_fields_ref,
)

from ._helpers import IMPLS, gen, impl_device, new_err

N_SLOTS = 257  # buffer rows: padding row 0 and slots 1..256
# Row blocks are at most 64 rows (fewer for wide fields): straddle 8 and 64, a prime, a large n.
SIZES = [0, 1, 2, 7, 8, 9, 63, 64, 65, 211]
DTYPES = {
    "int32": torch.int32,
    "int64": torch.int64,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float64": torch.float64,
}
# One field of each kind a speculative step keeps, plus a multi-dim one.
MIXED = [
    ((), torch.int32),  # accept_len
    ((), torch.int64),  # new_seq_len
    ((4,), torch.int64),  # draft_tokens
    ((4,), torch.float32),  # topk_probs
    ((6,), torch.bfloat16),  # hidden row
    ((2, 3), torch.float16),
]
WIDE = [((1030,), torch.bfloat16), ((3,), torch.int32)]  # 3 column chunks of 512
POISON = 0x5A


def bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: str) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: any bit pattern, NaN payloads and -0.0 included."""
    size = torch.empty(0, dtype=dtype).element_size()
    t = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=g).to(torch.uint8)
    t = (t & 1 if dtype == torch.bool else t).view(dtype)
    if dtype.is_floating_point and t.numel() >= 2:
        t.view(-1)[:2] = torch.tensor([-0.0, float("nan")])
    return t.to(device)


def payload(n: int, fields: list, g: torch.Generator, device: str) -> list[torch.Tensor]:
    return [bits((n, *shape) if shape else (n, 1), dt, g, device).view((n, *shape)) for shape, dt in fields]


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(-1).view(torch.uint8).fill_(POISON)
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_words(a), as_words(b))


def slots_for(kind: str, n: int, g: torch.Generator, device: str):
    """``(slots, negated)``: distinct slots as a range, a tensor (int32/int64) or placeholders;
    ``kind="bad"`` mixes in slots outside the map (0, past the end, negative, huge)."""
    if kind == "range":
        return range(5, 5 + n), False
    perm = (torch.randperm(N_SLOTS - 1, generator=g)[:n] + 1).to(device)
    if kind == "bad" and n:
        perm[: min(n, 4)] = torch.tensor([0, N_SLOTS, -4, 2**40], device=device)[: min(n, 4)]
    if kind == "int32":
        return perm.to(torch.int32), False
    return (-perm, True) if kind == "placeholders" else (perm, False)


def store(impl, buffers, slots, values, negated, err):
    if impl.startswith("cpu"):
        return cpu.store_fields(buffers, slots, values, negated, err, in_range=impl == "cpu_in_range")
    return store_fields(buffers, slots, values, negated=negated, err=err)


def gather(impl, buffers, slots, out, negated, err):
    if impl.startswith("cpu"):
        return cpu.gather_fields(buffers, slots, out, negated, err, in_range=impl == "cpu_in_range")
    return gather_fields(buffers, slots, out=out, negated=negated, err=err)


def check_roundtrip(impl, fields, n, kind, seed, device):
    """Store then gather (into poisoned outputs, and into fresh ones), each against the reference."""
    g = gen(seed)
    bufs = [poisoned((N_SLOTS, *s), dt, device) for s, dt in fields]
    # Cloned as words: a bool clone would turn the poison bytes into 1.
    ref_bufs = [as_words(b).clone().view(b.dtype) for b in bufs]
    values = payload(n, fields, g, device)
    slots, negated = slots_for(kind, n, g, device)
    err, err_ref = new_err(device), new_err(device)
    store(impl, bufs, slots, values, negated, err)
    store_fields_ref(ref_bufs, slots, values, negated=negated, err=err_ref)
    assert all(same_bits(b, r) for b, r in zip(bufs, ref_bufs, strict=True))
    assert torch.equal(err, err_ref)

    want = gather_fields_ref(bufs, slots, negated=negated, err=err_ref)
    outs = [poisoned(tuple(v.shape), v.dtype, device) for v in values]
    got = gather(impl, bufs, slots, outs, negated, err)
    assert all(gt is o for gt, o in zip(got, outs, strict=True))
    assert all(same_bits(o, w) for o, w in zip(outs, want, strict=True))
    assert torch.equal(err, err_ref)
    fresh = gather(impl, bufs, slots, None, negated, None)
    assert all(same_bits(f, w) for f, w in zip(fresh, want, strict=True))
    if kind != "bad":
        assert all(same_bits(w, v) for w, v in zip(want, values, strict=True))
        assert err.tolist() == [0, 0]


def mixed_cases():
    # cpu_in_range: the CPU path as launch_store_fields / launch_gather_fields run it, trusting
    # the caller's slots (so never given bad ones).
    for impl in [*IMPLS, "cpu_in_range"]:
        for kind in ["range", "int64", "int32", "placeholders", "bad"][: 4 if impl == "cpu_in_range" else 5]:
            for n in SIZES:
                yield pytest.param(impl, kind, n, id=f"{impl}-{kind}-n{n}")


@pytest.mark.parametrize(("impl", "kind", "n"), list(mixed_cases()))
def test_mixed_fields_match_reference(impl, kind, n, device):
    check_roundtrip(impl, MIXED, n, kind, n * 7 + len(kind), impl_device(impl, device))


@pytest.mark.parametrize("n", [1, 9, 17], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("kind", ["range", "bad"])
@pytest.mark.parametrize("impl", IMPLS)
def test_wide_field_matches_reference(impl, kind, n, device):
    check_roundtrip(impl, WIDE, n, kind, n, impl_device(impl, device))


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (1,), (3,), (33,)], ids=["scalar", "w1", "w3", "w33"])
@pytest.mark.parametrize("impl", IMPLS)
def test_every_dtype_and_width(impl, name, shape, device):
    check_roundtrip(
        impl, [(shape, DTYPES[name])], 17, "int64", len(name) + len(shape), impl_device(impl, device)
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_payload_rows_and_zero_width(impl, device):
    device = impl_device(impl, device)
    big = bits((9, 8), torch.float32, gen(3), device)
    bufs = [poisoned((N_SLOTS, 3), torch.float32, device), poisoned((N_SLOTS, 0), torch.int64, device)]
    vals = [big[:, 2:5], torch.empty((9, 0), dtype=torch.int64, device=device)]
    store(impl, bufs, range(1, 10), vals, False, None)
    assert same_bits(bufs[0][1:10], big[:, 2:5].contiguous())
    assert gather(impl, bufs, range(1, 10), None, False, None)[1].shape == (9, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_width_fields_still_flag_bad_slots(impl, device):
    # Nothing to copy, but a slot outside the map is still counted.
    device = impl_device(impl, device)
    bufs = [torch.empty((N_SLOTS, 0), dtype=torch.int64, device=device)]
    slots = torch.tensor([3, 0, N_SLOTS + 2], device=device)
    for call in (store, gather):
        err = new_err(device)
        arg = [torch.empty((3, 0), dtype=torch.int64, device=device)]
        call(impl, bufs, slots, arg, False, err)
        assert err.tolist() == [2, -(N_SLOTS + 2)]


def test_references_follow_the_contract():
    """The oracles themselves, against the contract written out by hand."""
    buf = torch.full((5, 2), 9.0)
    vals = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    err = new_err("cpu")
    store_fields_ref([buf], torch.tensor([-2, 0, -7]), [vals], negated=True, err=err)
    assert buf.tolist() == [[9, 9], [9, 9], [1, 2], [9, 9], [9, 9]] and err.tolist() == [2, -7]
    (got,) = gather_fields_ref([buf], torch.tensor([2, 5, 0]), err=err)
    assert got.tolist() == [[1, 2], [0, 0], [0, 0]] and err.tolist() == [4, -7]


def test_unchecked_launchers_match_checked(device):
    g = gen(4)
    bufs = [poisoned((N_SLOTS, *s), dt, device) for s, dt in MIXED]
    values = payload(6, MIXED, g, device)
    slots, _ = slots_for("int64", 6, g, device)
    launch_store_fields(bufs, -slots, values, True, None)
    got = launch_gather_fields(bufs, slots, None, False, None)
    assert all(same_bits(a, b) for a, b in zip(got, gather_fields(bufs, slots), strict=True))
    assert all(same_bits(a, v) for a, v in zip(got, values, strict=True))
    empty = launch_gather_fields(bufs, range(3, 3), None, False, None)
    assert [tuple(t.shape) for t in empty] == [(0, *s) for s, _ in MIXED]


def test_kernel_input_validation(device):
    buf = torch.zeros((N_SLOTS, 4), dtype=torch.float32, device=device)
    val = torch.zeros((2, 4), dtype=torch.float32, device=device)
    slots = torch.tensor([1, 2], device=device)
    cases = [
        (TypeError, "dtype torch.float32, got torch.float16", [buf], slots, [val.half()]),
        (ValueError, r"shape \('n', 4\), got \(2, 3\)", [buf], slots, [val[:, :3]]),
        (ValueError, "one row per slot", [buf], slots[:1], [val]),
        (ValueError, "2-D", [buf], slots[None], [val]),
        (ValueError, "dtype torch.int32 or torch.int64, got torch.float32", [buf], slots.float(), [val]),
        (TypeError, "must be a torch.Tensor", [buf], slots, [val.tolist()]),
        (ValueError, "one tensor per buffer", [buf, buf], slots, [val]),
        (ValueError, "meta", [buf], slots, [torch.zeros((2, 4), device="meta")]),
        (ValueError, "contiguous", [buf.t()], slots, [val]),
        (ValueError, r"slots must lie in \[1, 256\]", [buf], range(0, 2), [val]),
        (ValueError, "contiguous rows", [buf[:, :2].contiguous()], range(1, 3), [val[:, ::2]]),
        (TypeError, "1, 2, 4 or 8 bytes", [buf.to(torch.complex128)], slots, [val.to(torch.complex128)]),
    ]
    for exc, msg, bufs, s, vals in cases:
        with pytest.raises(exc, match=msg):
            store_fields(bufs, s, vals)
    with pytest.raises(ValueError, match="one row per slot"):
        gather_fields([buf], slots, out=[val[:1]])
    with pytest.raises(ValueError, match="non-empty sequence"):
        gather_fields([], slots)
