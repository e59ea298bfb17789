"""Packed token bitmasks: the layout (against xgrammar), the Triton kernel and the CPU path against
apply_token_bitmask_ref, the argument checks, and the host check for rows that allow nothing.

Logits live inside a fenced buffer (sentinel columns on both sides of every row), rows that no
bitmask row names hold a sentinel, and an allowed logit may be a NaN with a payload: every
comparison is bit for bit, so a write past the vocabulary, into the wrong row, or a rounded
allowed logit shows up.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfuture.kernels import cpu_bitmask
from tfuture.kernels._field_layout import as_words
from tfuture.kernels.bitmask import (
    FLOAT_DTYPES,
    apply_token_bitmask_,
    apply_token_bitmask_ref,
    bitmask_words,
    empty_bitmask_rows,
    launch_apply_token_bitmask_,
    pack_bool_mask,
    unpack_bitmask,
)

from ._helpers import IMPLS, gen, impl_device

VOCABS = [1, 31, 32, 33, 1000]
FENCE = 3
POISON = 777.0


def apply(impl: str, logits, bitmask, rows=None, *, checked: bool = True) -> None:
    if impl == "cpu":
        cpu_bitmask.apply_token_bitmask(logits, bitmask, rows)
    elif checked:
        apply_token_bitmask_(logits, bitmask, rows)
    else:
        launch_apply_token_bitmask_(logits, bitmask, rows)


def random_bitmask(m: int, vocab: int, g: torch.Generator, p_allow: float = 0.5) -> torch.Tensor:
    """A packed bitmask, each token allowed with probability ``p_allow``; padding bits random too
    (a grammar library may leave them set: nothing past the vocabulary may be written for them)."""
    w = bitmask_words(vocab)
    allow = torch.rand(m, 32 * w, generator=g) < p_allow
    allow[:, vocab:] = torch.rand(m, 32 * w - vocab, generator=g) < 0.5
    return pack_bool_mask(allow)


def fenced_logits(n: int, vocab: int, dtype: torch.dtype, device: str, g: torch.Generator):
    """``(logits, backing)``: ``[n, vocab]`` random logits (a few NaNs with a payload) as a strided
    view into ``[n, vocab + 2 * FENCE]`` whose fence columns hold ``POISON``."""
    backing = torch.full((n, vocab + 2 * FENCE), POISON, dtype=dtype)
    logits = backing[:, FENCE : FENCE + vocab]
    logits.copy_(torch.randn(n, vocab, generator=g).to(dtype))
    words = as_words(logits)
    nan_payload = as_words(torch.tensor(float("nan"), dtype=dtype)) | 5
    words[torch.rand(n, vocab, generator=g) < 0.01] = nan_payload
    backing = backing.to(device)
    return backing[:, FENCE : FENCE + vocab], backing


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(as_words(a.cpu()), as_words(b.cpu()))


# ---- layout ---------------------------------------------------------------------------------


def test_bitmask_words():
    assert [bitmask_words(v) for v in (1, 31, 32, 33, 64, 65, 152064)] == [1, 1, 1, 2, 2, 3, 4752]
    assert bitmask_words(np.int64(33)) == 2
    with pytest.raises(ValueError, match="vocab must be >= 1, got 0"):
        bitmask_words(0)
    with pytest.raises(TypeError, match="vocab must be an int, got float"):
        bitmask_words(32.0)


@pytest.mark.parametrize("vocab", VOCABS)
def test_pack_unpack_round_trip(vocab):
    mask = np.random.default_rng(vocab).random((6, vocab)) < 0.5
    mask[0], mask[1] = True, False
    packed = pack_bool_mask(mask)
    packed_t = pack_bool_mask(torch.from_numpy(mask))
    w = bitmask_words(vocab)
    assert packed.dtype == np.int32 and packed.shape == (6, w)
    assert packed_t.dtype == torch.int32 and tuple(packed_t.shape) == (6, w)
    assert np.array_equal(packed, packed_t.numpy())
    # Padding bits past the vocabulary are 0, even in a row that allows everything.
    tail = vocab % 32
    if tail:
        assert not (packed[:, -1].view(np.uint32) >> np.uint32(tail)).any()
    assert (packed[1] == 0).all()
    got = unpack_bitmask(packed, vocab)
    got_t = unpack_bitmask(packed_t, vocab)
    assert got.dtype == np.bool_ and got.shape == (6, vocab) and np.array_equal(got, mask)
    assert got_t.dtype == torch.bool and torch.equal(got_t, torch.from_numpy(mask))


@pytest.mark.parametrize("token", [0, 1, 30, 31, 32, 63, 64, 999])
def test_pack_one_token_sets_one_bit(token):
    # The layout written out: token j is bit j % 32 (bit 0 least significant) of word j // 32.
    mask = np.zeros((1, 1000), dtype=bool)
    mask[0, token] = True
    want = np.zeros((1, bitmask_words(1000)), dtype=np.int64)
    want[0, token // 32] = 1 << (token % 32)
    want = want.astype(np.uint32).view(np.int32)  # bit 31 is the int32 sign bit
    assert np.array_equal(pack_bool_mask(mask), want)
    assert torch.equal(pack_bool_mask(torch.from_numpy(mask)), torch.from_numpy(want))


def test_pack_unpack_empty_batch_and_bad_input():
    assert pack_bool_mask(np.zeros((0, 40), dtype=bool)).shape == (0, 2)
    assert tuple(pack_bool_mask(torch.zeros((0, 40), dtype=torch.bool)).shape) == (0, 2)
    assert tuple(unpack_bitmask(torch.zeros((0, 2), dtype=torch.int32), 40).shape) == (0, 40)
    with pytest.raises(ValueError, match="mask must have dtype bool, got uint8"):
        pack_bool_mask(np.zeros((2, 40), dtype=np.uint8))
    with pytest.raises(ValueError, match="mask must be 2-D"):
        pack_bool_mask(torch.zeros(40, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be a numpy array or a torch\.Tensor, got list"):
        pack_bool_mask([[True]])
    with pytest.raises(ValueError, match=r"ceil\(40 / 32\) = 2 int32 words per row, got 3"):
        unpack_bitmask(np.zeros((2, 3), dtype=np.int32), 40)
    with pytest.raises(ValueError, match="bitmask must have dtype int32, got int64"):
        unpack_bitmask(torch.zeros((2, 2), dtype=torch.int64), 40)


def test_layout_matches_xgrammar_grammar_matcher():
    # A real grammar fills the bitmask; our unpack reads exactly the tokens it allows.
    xgr = pytest.importorskip("xgrammar")
    vocab = ["<eos>", "a", "b", "ab", "ba", "c", "aab"] + [f"t{i}" for i in range(40)]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[0])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar('root ::= "ab" "c"'))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    allowed = []
    for token in (1, 2, 5):  # "a", "b", "c"
        matcher.fill_next_token_bitmask(bitmask)
        allowed.append(unpack_bitmask(bitmask, info.vocab_size)[0].nonzero().flatten().tolist())
        assert matcher.accept_token(token)
    assert allowed == [[1, 3], [2], [5]]  # {"a", "ab"}, {"b"}, {"c"}
    logits = torch.zeros(1, info.vocab_size)
    matcher.reset()
    matcher.fill_next_token_bitmask(bitmask)
    apply_token_bitmask_(logits, bitmask)
    assert (logits[0] == 0).nonzero().flatten().tolist() == [1, 3]


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 4097])
@pytest.mark.parametrize("with_rows", [False, True], ids=["all_rows", "indices"])
def test_apply_matches_xgrammar(vocab, with_rows):
    xgr = pytest.importorskip("xgrammar")
    g = gen(vocab)
    n = 6
    full = random_bitmask(n, vocab, g)
    logits = torch.randn(n, vocab, generator=g)
    theirs = logits.clone()
    # xgrammar 0.2.9's CPU kernel writes past the row at vocab 1 (our apply, its torch one agree).
    backend = "torch_native" if vocab == 1 else "cpu"
    if with_rows:
        rows = torch.tensor([4, 1, 2])
        # xgrammar's indices name logits rows and bitmask rows alike; ours take the bitmask rows.
        xgr.apply_token_bitmask_inplace(theirs, full, indices=rows.tolist(), backend=backend)
        ours, bitmask = logits.clone(), full[rows]
    else:
        xgr.apply_token_bitmask_inplace(theirs, full, backend=backend)
        ours, bitmask, rows = logits.clone(), full, None
    apply_token_bitmask_(ours, bitmask, rows)
    assert same_bits(ours, theirs)
    assert same_bits(apply_token_bitmask_ref(logits, bitmask, rows), theirs)


def test_reference_follows_the_contract():
    """The oracle itself, against the contract written out by hand."""
    logits = torch.arange(3 * 40, dtype=torch.float32).view(3, 40)
    bitmask = torch.tensor([[0b101, 0], [-1, 0b1], [0, 0]], dtype=torch.int32)
    inf = float("-inf")
    out = apply_token_bitmask_ref(logits, bitmask)
    assert out[0].tolist() == [0.0, inf, 2.0] + [inf] * 37
    assert out[1].tolist() == logits[1, :33].tolist() + [inf] * 7
    assert out[2].tolist() == [inf] * 40
    # rows: bitmask row i masks logits row rows[i]; a row named twice gets the union.
    out = apply_token_bitmask_ref(logits, bitmask[:2], torch.tensor([2, 2]))
    assert torch.equal(out[:2], logits[:2])
    assert out[2].tolist() == [80.0, inf, 82.0] + [inf] * 37
    assert torch.equal(logits, torch.arange(3 * 40, dtype=torch.float32).view(3, 40))


# ---- the kernel and the CPU path against the reference ----------------------------------------

ROWS = {
    "all": None,
    "subset": [3, 0],
    "duplicate": [1, 4, 1],
}


@pytest.mark.parametrize("rows_kind", list(ROWS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("vocab", [1, 33, 2100])
@pytest.mark.parametrize("impl", IMPLS)
def test_apply_matches_reference(impl, vocab, dtype, rows_kind, device):
    device = impl_device(impl, device)
    g = gen(vocab + len(rows_kind))
    n = 5
    logits, backing = fenced_logits(n, vocab, dtype, device, g)
    rows = None if ROWS[rows_kind] is None else torch.tensor(ROWS[rows_kind], device=device)
    m = n if rows is None else rows.numel()
    bitmask = random_bitmask(m, vocab, g, p_allow=0.3)
    bitmask[0, 0] &= ~1  # token 0 of the first bitmask row is banned: the case is never vacuous
    bitmask = bitmask.to(device)
    before = backing.clone()
    want = apply_token_bitmask_ref(logits, bitmask, rows)

    apply(impl, logits, bitmask, rows)

    assert same_bits(logits, want)
    # The fence columns are untouched, and so is every row no bitmask row names.
    assert same_bits(backing[:, :FENCE], before[:, :FENCE])
    assert same_bits(backing[:, FENCE + vocab :], before[:, FENCE + vocab :])
    if rows is not None:
        untouched = sorted(set(range(n)) - set(rows.tolist()))
        assert same_bits(logits[untouched], before[untouched, FENCE : FENCE + vocab])
    assert bool(torch.isneginf(logits).any())


@pytest.mark.parametrize("impl", IMPLS)
def test_apply_unchecked_skips_rows_outside_the_logits(impl, device):
    # launch_apply_token_bitmask_ trusts its caller; a row outside [0, n) is still never written.
    device = impl_device(impl, device)
    g = gen(5)
    logits, backing = fenced_logits(3, 70, torch.float32, device, g)
    rows = torch.tensor([-1, 2, 3, -(2**40)], device=device)
    bitmask = random_bitmask(4, 70, g).to(device)
    want = apply_token_bitmask_ref(logits, bitmask, rows)
    before = backing.clone()
    apply(impl, logits, bitmask, rows, checked=False)
    assert same_bits(logits, want)
    assert same_bits(backing[:2], before[:2]) and not same_bits(backing[2], before[2])


@pytest.mark.parametrize("impl", IMPLS)
def test_apply_empty_is_noop(impl, device):
    device = impl_device(impl, device)
    logits = torch.randn(3, 40, device=device)
    before = logits.clone()
    apply(
        impl,
        logits,
        torch.zeros((0, 2), dtype=torch.int32, device=device),
        torch.zeros(0, dtype=torch.int64, device=device),
    )
    apply_token_bitmask_(
        torch.zeros((0, 40), device=device), torch.zeros((0, 2), dtype=torch.int32, device=device)
    )
    apply_token_bitmask_(
        torch.zeros((2, 0), device=device), torch.zeros((2, 0), dtype=torch.int32, device=device)
    )
    assert same_bits(logits, before)


@pytest.mark.parametrize("impl", IMPLS)
def test_apply_all_banned_row_is_all_minus_inf(impl, device):
    # Sampling such a row would pick token 0 silently: the caller checks empty_bitmask_rows first.
    device = impl_device(impl, device)
    logits = torch.randn(2, 50, device=device)
    bitmask = torch.tensor([[0, 0], [0, 1 << 17]], dtype=torch.int32, device=device)  # row 1: token 49
    apply(impl, logits, bitmask)
    assert bool(torch.isneginf(logits[0]).all()) and bool(torch.isneginf(logits[1, :49]).all())
    assert not bool(torch.isinf(logits[1, 49]))
    assert empty_bitmask_rows(bitmask.cpu()).tolist() == [0]
    assert empty_bitmask_rows(bitmask.cpu(), 49).tolist() == [0, 1]


# ---- bad input ------------------------------------------------------------------------------


def _f32(*shape, device="cpu"):
    return torch.zeros(shape, device=device)


def _i32(*shape, device="cpu"):
    return torch.full(shape, -1, dtype=torch.int32, device=device)


BAD_CALLS = [
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(4, 2, device=d).to(torch.int64)),
        ValueError,
        r"bitmask must have dtype torch\.int32, got torch\.int64",
        id="bitmask-int64",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(4, 2, device=d).to(torch.bool)),
        ValueError,
        r"bitmask must have dtype torch\.int32, got torch\.bool",
        id="bool-mask-as-bitmask",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(4, 3, device=d)),
        ValueError,
        r"ceil\(40 / 32\) = 2 int32 words per row, got 3 \(shape \(4, 3\)\)",
        id="wide-W",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(4, 1, device=d)),
        ValueError,
        r"ceil\(40 / 32\) = 2 int32 words per row, got 1",
        id="narrow-W",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(8, device=d)),
        ValueError,
        r"bitmask must be 2-D \[m, ceil\(V / 32\)\], got a 1-D tensor of shape \(8,\)",
        id="1d-bitmask",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x.view(4, 2, 20), _i32(4, 2, device=d)),
        ValueError,
        r"logits must be 2-D \[n, V\], got a 3-D tensor of shape \(4, 2, 20\)",
        id="3d-logits",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x.to(torch.int64), _i32(4, 2, device=d)),
        ValueError,
        r"logits must have dtype torch\.float32, .*, got torch\.int64",
        id="int-logits",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x.t(), _i32(40, 1, device=d)),
        ValueError,
        r"logits must have contiguous rows \(stride\(1\) == 1\), got strides \(1, 40\)",
        id="transposed-logits",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(2, 4, device=d)[:, ::2].t().contiguous().t()),
        ValueError,
        r"bitmask must have contiguous rows \(stride\(1\) == 1\), got strides \(1, 2\)",
        id="strided-bitmask",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(3, 2, device=d)),
        ValueError,
        r"bitmask must have one row per logits row \(4\) when rows is None, got 3",
        id="row-count",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(2, 2, device=d), torch.tensor([0, 4], device=d)),
        ValueError,
        r"rows must lie in \[0, 3\] \(logits rows\), got 4",
        id="row-past-end",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(2, 2, device=d), torch.tensor([-1, 2], device=d)),
        ValueError,
        r"rows must lie in \[0, 3\] \(logits rows\), got -1",
        id="negative-row",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(2, 2, device=d), torch.tensor([0, 1, 2], device=d)),
        ValueError,
        r"rows must have one entry per bitmask row \(2\), got 3",
        id="rows-length",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(2, 2, device=d), torch.tensor([0.0, 1.0], device=d)),
        ValueError,
        r"rows must have dtype torch\.int32 or torch\.int64, got torch\.float32",
        id="float-rows",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, _i32(4, 2, device="meta")),
        ValueError,
        r"bitmask is on meta but logits is on",
        id="bitmask-foreign-device",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(
            x, _i32(1, 2, device=d), torch.zeros(1, dtype=torch.int64, device="meta")
        ),
        ValueError,
        r"rows is on meta but logits is on",
        id="rows-foreign-device",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x, [[-1, -1]] * 4),  # type: ignore[arg-type]
        TypeError,
        r"bitmask must be a torch\.Tensor, got list",
        id="list-bitmask",
    ),
    pytest.param(
        lambda d, x: apply_token_bitmask_(x.cpu().numpy(), _i32(4, 2, device=d)),
        TypeError,
        r"logits must be a torch\.Tensor, got ndarray",
        id="numpy-logits",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), BAD_CALLS)
def test_apply_rejects_bad_arguments_and_writes_nothing(call, exc, match, device):
    logits = torch.randn(4, 40, device=device)
    before = logits.clone()
    with pytest.raises(exc, match=match):
        call(device, logits)
    assert same_bits(logits, before)


# ---- rows that allow nothing ----------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_empty_bitmask_rows(vocab, kind):
    g = np.random.default_rng(vocab)
    w = bitmask_words(vocab)
    words = g.integers(-(2**31), 2**31, size=(9, w), dtype=np.int64).astype(np.int32)
    words[:, 0] |= 1  # the random rows allow token 0 at least
    words[[1, 5]] = 0
    # Row 2: only padding bits past the vocabulary are set (none when vocab fills its words).
    words[2] = 0
    if vocab % 32:
        words[2, -1] = np.int32(np.uint32(0xFFFFFFFF << (vocab % 32) & 0xFFFFFFFF).view(np.int32))
    words[3] = 0
    words[3, (vocab - 1) // 32] = np.uint32(1 << ((vocab - 1) % 32)).view(np.int32)  # the last token
    words[4] = 0
    words[4, 0] = 1  # token 0
    bitmask = words if kind == "numpy" else torch.from_numpy(words)
    # Without vocab every bit counts, the padding bits of row 2 included.
    with_padding = [1, 5] if vocab % 32 else [1, 2, 5]
    got = empty_bitmask_rows(bitmask, vocab)
    assert got.dtype == np.int64 and got.tolist() == [1, 2, 5]
    assert empty_bitmask_rows(bitmask).tolist() == with_padding
    # The answer equals a plain scan of the unpacked rows.
    assert got.tolist() == np.flatnonzero(~unpack_bitmask(words, vocab).any(axis=1)).tolist()


def test_empty_bitmask_rows_shorter_vocab_and_bad_input():
    words = np.zeros((3, 4), dtype=np.int32)
    words[0, 3] = 1  # token 96
    words[1, 0] = 1 << 5  # token 5
    assert empty_bitmask_rows(words, 96).tolist() == [0, 2]
    assert empty_bitmask_rows(words, 97).tolist() == [2]
    assert empty_bitmask_rows(words, 5).tolist() == [0, 1, 2]
    assert empty_bitmask_rows(np.zeros((0, 4), dtype=np.int32), 100).tolist() == []
    with pytest.raises(ValueError, match=r"vocab must lie in \[1, 128\] for 4 words, got 129"):
        empty_bitmask_rows(words, 129)
    with pytest.raises(ValueError, match="bitmask must have dtype int32, got int64"):
        empty_bitmask_rows(words.astype(np.int64))
    with pytest.raises(ValueError, match="bitmask must be 2-D"):
        empty_bitmask_rows(words[0])
    with pytest.raises(TypeError, match="checks the host bitmask; got a tensor on meta"):
        empty_bitmask_rows(torch.zeros((3, 4), dtype=torch.int32, device="meta"))


@pytest.mark.gpu
def test_empty_bitmask_rows_refuses_a_cuda_tensor():
    with pytest.raises(TypeError, match="got a tensor on cuda"):
        empty_bitmask_rows(torch.zeros((3, 4), dtype=torch.int32, device="cuda"))
