"""The bitmask apply with its logits fenced on every side, rows included.

``test_bitmask.py`` fences the columns of every logits row; here the logits are a view into a
buffer with sentinel rows above and below as well (and sentinel columns), so a write one row past
the end (an unchecked row ``n``, or token ``vocab`` of the last row) or one row before the start
lands in a sentinel and fails an assertion, instead of corrupting the heap. Both paths run
through the launchers (``_paths``).
"""

from __future__ import annotations

import pytest
import torch

from tfuture.kernels._field_layout import as_words
from tfuture.kernels.bitmask import (
    FLOAT_DTYPES,
    apply_token_bitmask_,
    apply_token_bitmask_ref,
    bitmask_words,
    launch_apply_token_bitmask_,
    pack_bool_mask,
)

from ._helpers import gen
from ._paths import PATHS, path_device

FENCE_ROWS, FENCE_COLS = 2, 3
SENTINEL = 777.0


def fenced(n: int, vocab: int, dtype: torch.dtype, device: str, g: torch.Generator):
    """``(logits, backing)``: random ``[n, vocab]`` logits inside sentinel rows and columns."""
    backing = torch.full((n + 2 * FENCE_ROWS, vocab + 2 * FENCE_COLS), SENTINEL, dtype=dtype)
    logits = backing[FENCE_ROWS : FENCE_ROWS + n, FENCE_COLS : FENCE_COLS + vocab]
    logits.copy_(torch.randn(n, vocab, generator=g).to(dtype))
    backing = backing.to(device)
    return backing[FENCE_ROWS : FENCE_ROWS + n, FENCE_COLS : FENCE_COLS + vocab], backing


def assert_fence(backing: torch.Tensor, n: int, vocab: int) -> None:
    """Every sentinel row and column still holds the sentinel, bit for bit."""
    want = as_words(torch.tensor(SENTINEL, dtype=backing.dtype)).item()
    words = as_words(backing.cpu())
    inside = torch.zeros(words.shape, dtype=torch.bool)
    inside[FENCE_ROWS : FENCE_ROWS + n, FENCE_COLS : FENCE_COLS + vocab] = True
    bad = (words != want) & ~inside
    assert not bool(bad.any()), f"wrote outside the logits at {bad.nonzero().tolist()[:6]}"


def bitmask_with_zero_padding(m: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Random allowed tokens, every padding bit 0 (``pack_bool_mask``'s), token 0 banned in row 0."""
    allow = torch.rand(m, vocab, generator=g) < 0.5
    allow[0, 0] = False
    return pack_bool_mask(allow)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(as_words(a.cpu()), as_words(b.cpu()))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("vocab", [1, 33, 50, 64, 2049])
@pytest.mark.parametrize("with_rows", [False, True], ids=["all_rows", "rows"])
@pytest.mark.parametrize("path", PATHS)
def test_apply_stays_inside_fenced_logits(path, with_rows, vocab, dtype, device, monkeypatch):
    # Padding bits are 0 (banned): a write of token `vocab` would hit the fence column, or the
    # next row's first logit.
    device = path_device(path, device, monkeypatch)
    g = gen(vocab * 7 + with_rows)
    n = 4
    logits, backing = fenced(n, vocab, dtype, device, g)
    rows = torch.tensor([3, 0, 3], device=device) if with_rows else None
    m = n if rows is None else 3
    bitmask = bitmask_with_zero_padding(m, vocab, g).to(device)
    want = apply_token_bitmask_ref(logits, bitmask, rows)
    apply_token_bitmask_(logits, bitmask, rows)
    assert same(logits, want)
    assert_fence(backing, n, vocab)


@pytest.mark.parametrize("vocab", [33, 50])
@pytest.mark.parametrize("path", PATHS)
def test_unchecked_rows_one_past_each_end_write_nothing(path, vocab, device, monkeypatch):
    # launch_apply_token_bitmask_ trusts its caller; rows n and -1 are still skipped on both paths.
    device = path_device(path, device, monkeypatch)
    g = gen(vocab)
    n = 3
    logits, backing = fenced(n, vocab, torch.float32, device, g)
    before = backing.clone()
    rows = torch.tensor([n, -1, 1], device=device)
    bitmask = torch.zeros((3, bitmask_words(vocab)), dtype=torch.int32, device=device)  # bans all
    launch_apply_token_bitmask_(logits, bitmask, rows)
    assert_fence(backing, n, vocab)
    assert same(logits[[0, 2]], before[FENCE_ROWS : FENCE_ROWS + n, FENCE_COLS : FENCE_COLS + vocab][[0, 2]])
    assert bool(torch.isneginf(logits[1]).all())


@pytest.mark.parametrize("path", PATHS)
def test_last_row_never_writes_past_the_vocab(path, device, monkeypatch):
    # The last row's token `vocab` would be the first word after the logits: here a fence column.
    device = path_device(path, device, monkeypatch)
    vocab, n = 40, 2
    logits, backing = fenced(n, vocab, torch.float32, device, gen(1))
    bitmask = torch.zeros((n, bitmask_words(vocab)), dtype=torch.int32, device=device)
    apply_token_bitmask_(logits, bitmask)
    assert bool(torch.isneginf(logits).all())
    assert_fence(backing, n, vocab)
