"""The KV pool's bounds and layout, without a model: StepLayout.build over hand-made steps.

The boundary pair of ``max_len``: a step whose longest request reaches exactly ``max_len``
positions runs (its last key lands in the last cache position), one past it raises. Rows go back
on release; the attention mask is causal per request with each token seeing its own key.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tfuture.core.batch import ForwardBatch, HostMeta
from tfuture.models.kv_pool import KVPool, StepLayout

MAX_LEN, HEADS, HEAD_DIM = 4, 1, 2


def pool(n_rows: int = 2) -> KVPool:
    return KVPool(1, n_rows, MAX_LEN, HEADS, HEAD_DIM, dtype=torch.float32, device=torch.device("cpu"))


def step(prefix: list[int], seg: list[int], rids: list[int]) -> ForwardBatch:
    """A forward batch whose request ``q`` runs ``seg[q]`` tokens after ``prefix[q]`` cached ones."""
    prefix_a, seg_a, rid_a = (np.array(x, dtype=np.int64) for x in (prefix, seg, rids))
    n_tok, n = int(seg_a.sum()), seg_a.size
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(seg_a, out=starts[1:])
    positions = np.concatenate([np.arange(p, p + s) for p, s in zip(prefix, seg, strict=True)])
    last = starts[1:] - 1
    t = torch.from_numpy
    host = HostMeta(seg_a, prefix_a, rid_a, np.arange(n), n_tok, int(seg_a.max()))
    return ForwardBatch(
        0,
        torch.zeros(n_tok, dtype=torch.int64),
        t(positions),
        t(last),
        t(rid_a),
        t(prefix_a + seg_a),
        torch.arange(n),
        t(last),
        t(starts),
        host,
    )


def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def forward(kv: KVPool, batch: ForwardBatch) -> torch.Tensor:
    """One layer's attention over the step, keys and values = the token's position + 1."""
    layout = StepLayout.build(kv, batch)
    n_tok = batch.host.n_tokens
    kvals = (batch.positions[:n_tok].to(torch.float32) + 1)[None, None, :, None].expand(
        1, HEADS, n_tok, HEAD_DIM
    )
    q = torch.ones(1, HEADS, n_tok, HEAD_DIM)
    return layout.attend(0, q, kvals, kvals, attn)


def test_a_forward_reaching_exactly_max_len_runs_and_one_past_it_raises():
    kv = pool()
    forward(kv, step([0], [MAX_LEN - 1], [7]))
    out = forward(kv, step([MAX_LEN - 1], [1], [7]))  # positions 0..MAX_LEN-1: the whole cache
    assert out.shape == (1, 1, HEADS, HEAD_DIM)
    assert kv.k[0, kv.rows[7], MAX_LEN - 1, 0, 0] == MAX_LEN  # its key landed in the last position
    with pytest.raises(ValueError, match=f"reaches {MAX_LEN + 1} positions.*max_len={MAX_LEN}"):
        StepLayout.build(kv, step([MAX_LEN], [1], [7]))


def test_a_prefill_of_exactly_max_len_runs_and_one_longer_raises():
    kv = pool()
    layout = StepLayout.build(kv, step([0], [MAX_LEN], [3]))
    assert layout.kv_len == MAX_LEN
    with pytest.raises(ValueError, match=f"max_len={MAX_LEN}"):
        StepLayout.build(pool(), step([0], [MAX_LEN + 1], [3]))


def test_released_rows_are_taken_again():
    kv = pool(n_rows=1)
    StepLayout.build(kv, step([0], [2], [1]))
    assert kv.n_free == 0
    kv.release(np.array([1]))
    assert kv.n_free == 1 and 1 not in kv.rows
    StepLayout.build(kv, step([0], [2], [2]))  # the one row again, for another request
    assert kv.n_free == 0 and kv.rows == {2: 0}
    kv.release(np.array([5]))  # never ran here: ignored
    assert kv.n_free == 0


def test_the_mask_is_causal_and_each_token_sees_its_own_key():
    kv = pool()
    forward(kv, step([0], [1], [0]))  # request 0 has one token cached
    layout = StepLayout.build(kv, step([1, 0], [1, 3], [0, 1]))
    assert layout.kv_len == 3 and layout.width == 3
    mask = layout.mask[:, 0]
    # Request 0 (prefix 1, one token): its row sees keys 0 and 1.
    assert mask[0, 0].tolist() == [True, True, False]
    # Request 1 (a prefill of 3): row i sees keys 0..i.
    assert torch.equal(mask[1], torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_a_windowed_layer_sees_its_last_window_keys_only():
    """transformers' semantics: query ``i`` sees keys ``j`` with ``i - window < j <= i``."""
    kv = KVPool(2, 2, 8, HEADS, HEAD_DIM, dtype=torch.float32, device=torch.device("cpu"), windows=[None, 3])
    forward(kv, step([0], [2], [0]))  # request 0 has two tokens cached
    layout = StepLayout.build(kv, step([2, 0], [1, 5], [0, 1]))
    window = layout.windowed[3][:, 0]
    assert window[0, 0].tolist() == [True, True, True, False, False]  # position 2: keys 0..2
    expect = [[abs(i - j) < 3 and j <= i for j in range(5)] for i in range(5)]
    assert window[1].tolist() == expect
    # Padding rows of request 0 stand at its token, so no row is empty; the full mask is causal.
    assert window[0, 1:].tolist() == [window[0, 0].tolist()] * 4
    assert torch.equal(layout.mask[1, 0], torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    # Additive masks for eager attention: 0 where visible, the dtype's minimum elsewhere.
    additive = StepLayout.build(kv, step([3, 0], [1, 5], [0, 1]), additive=torch.float64).windowed[3]
    assert additive.dtype == torch.float64
    assert additive[0, 0, 0].tolist() == [torch.finfo(torch.float64).min] + [0.0] * 3 + [
        torch.finfo(torch.float64).min
    ]


def test_an_sdpa_step_attends_with_a_float_mask_that_rounds_as_the_bool_one():
    """What the adapter builds for SDPA: 0 where visible, -inf elsewhere, the mask SDPA itself
    makes from a bool one in every call; built once per step, the attention is bit for bit the same."""
    kv = pool(3)
    forward(kv, step([0, 0, 0], [2, 1, 1], [4, 5, 6]))
    batch = step([2, 1, 1], [1, 2, 1], [4, 5, 6])  # ragged: padding rows too
    boolean = StepLayout.build(kv, batch)
    floats = StepLayout.build(kv, batch, additive=torch.float32, fill=float("-inf"))
    assert torch.equal(floats.mask, torch.zeros(boolean.mask.shape).masked_fill(~boolean.mask, float("-inf")))
    n_tok = batch.host.n_tokens
    q = torch.randn(1, HEADS, n_tok, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    k = torch.randn(1, HEADS, n_tok, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    assert torch.equal(boolean.attend(0, q, k, k, attn), floats.attend(0, q, k, k, attn))


def test_window_and_value_shape_arguments():
    cpu = torch.device("cpu")
    kv = KVPool(3, 1, 8, 2, 6, dtype=torch.float32, device=cpu, value_shape=(2, 4), windows=[8, 2, None])
    assert kv.windows == (None, 2, None)  # a window of max_len never binds
    assert kv.k.shape == (3, 1, 8, 2, 6) and kv.v.shape == (3, 1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"one entry per layer \(3\), got 2"):
        KVPool(3, 1, 8, 2, 6, dtype=torch.float32, device=cpu, windows=[2, 2])
    with pytest.raises(ValueError, match=r"a layer's window must be None or an int >= 1, got 0"):
        KVPool(1, 1, 8, 2, 6, dtype=torch.float32, device=cpu, windows=[0])


class _CountOps(TorchDispatchMode):
    """Counts the aten ops run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_decode_step_attends_without_padding_and_writes_the_cache_with_one_index():
    kv = pool(3)
    forward(kv, step([0, 0, 0], [2, 3, 1], [4, 5, 6]))
    decode = step([2, 3, 1], [1, 1, 1], [4, 5, 6])
    layout = StepLayout.build(kv, decode)
    assert layout.dense
    assert not StepLayout.build(kv, step([2, 1], [1, 2], [4, 6])).dense
    k = torch.full((1, HEADS, 3, HEAD_DIM), 9.0)
    with _CountOps() as counted:
        out = layout.attend(0, torch.ones(1, HEADS, 3, HEAD_DIM), k, k, attn)
    # Packed rows are the padded rows: no zero-filled buffer, no scatter into it, no gather out;
    # rows 0, 1, 2 in order: the cache is read as a view, not gathered.
    assert layout.row_span == (0, 3)
    assert "new_zeros" not in counted.ops and "index_select" not in counted.ops
    assert "index_put_" not in counted.ops and counted.ops.count("index_copy_") == 2
    # The query, the new keys and the cached ones reach the attention as views: nothing is copied.
    assert not {"clone", "_to_copy", "copy_", "contiguous"} & set(counted.ops), counted.ops
    # The general path on the same step (rewriting the same keys) gives the same output.
    general = dataclasses.replace(layout, dense=False, row_span=None)
    assert torch.equal(out, general.attend(0, torch.ones(1, HEADS, 3, HEAD_DIM), k, k, attn))
    for pos, rid in ((2, 4), (3, 5), (1, 6)):
        assert torch.equal(kv.k[0, kv.rows[rid], pos], torch.full((HEADS, HEAD_DIM), 9.0))


def test_requests_out_of_row_order_attend_over_their_own_rows():
    kv = pool(3)
    forward(kv, step([0, 0, 0], [2, 3, 1], [4, 5, 6]))
    layout = StepLayout.build(kv, step([1, 2], [1, 1], [6, 4]))  # rows 2, 0
    with _CountOps() as counted:
        out = layout.attend(
            0, torch.ones(1, HEADS, 2, HEAD_DIM), *[torch.full((1, HEADS, 2, HEAD_DIM), 9.0)] * 2, attn
        )
    assert counted.ops.count("index_select") == 2
    # Request 6 sees keys 1 (position 0) and 9 (its new one); request 4 sees 1, 2 and 9.
    want = [(torch.tensor([1.0, 9.0]), torch.tensor([1.0, 9.0])), (torch.tensor([1.0, 2.0, 9.0]),) * 2]
    for q, (keys, vals) in enumerate(want):
        expect = (torch.softmax(keys * HEAD_DIM / HEAD_DIM**0.5, 0) * vals).sum()
        torch.testing.assert_close(out[0, q, 0], torch.full((HEAD_DIM,), float(expect)))


@pytest.mark.parametrize(("prefix", "width"), [([2, 3, 1], 1), ([0, 1, 0], 2)])
def test_a_dense_step_builds_the_layout_of_the_ragged_index_math_with_fewer_ops(prefix, width):
    from tfuture.models import kv_pool

    kv = pool(3)
    forward(kv, step([0, 0, 0], [2, 3, 1], [4, 5, 6]))
    batch = step(prefix, [width] * 3, [4, 5, 6])
    with _CountOps() as counted:
        layout = StepLayout.build(kv, batch)
    # No per-token request index (repeat_interleave over segment lengths) to gather with, no
    # clamping of padding columns (there are none).
    assert layout.dense and "index_select" not in counted.ops and "minimum" not in counted.ops
    assert "repeat_interleave" not in counted.ops
    n_tok = 3 * width
    tok_rows, pad_idx, pre, cols = kv_pool._ragged_index(batch, layout.req_rows, n_tok, width)
    assert torch.equal(layout.tok_rows, tok_rows) and torch.equal(layout.pad_idx, pad_idx)
    last_key = (pre[:, None] + cols)[:, None, :, None]
    assert torch.equal(layout.mask, torch.arange(layout.kv_len) <= last_key)
    assert torch.equal(layout.tok_flat, tok_rows * MAX_LEN + batch.positions[:n_tok])


def test_consecutive_rows_read_a_view_of_the_cache_equal_to_the_gather():
    kv = pool(4)
    forward(kv, step([0, 0, 0, 0], [2, 3, 1, 2], [4, 5, 6, 7]))  # rows 0, 1, 2, 3
    cases = (
        ([5, 6, 7], [3, 1, 2], (1, 4)),
        ([4, 6, 7], [2, 1, 2], None),  # rows 0, 2, 3: a gap
        ([6, 5, 7], [1, 3, 2], None),  # rows 2, 1, 3
        ([4, 6, 5, 7], [2, 1, 3, 2], None),  # rows 0, 2, 1, 3 cover 0..3, out of order
    )
    for rids, prefix, span in cases:
        n = len(rids)
        k = torch.arange(n * HEAD_DIM, dtype=torch.float32).view(1, HEADS, n, HEAD_DIM) / 5
        q = torch.arange(n * HEAD_DIM, dtype=torch.float32).view(1, HEADS, n, HEAD_DIM)
        layout = StepLayout.build(kv, step(prefix, [1] * n, rids))
        assert layout.row_span == span, rids
        got = layout.attend(0, q, k, k, attn)
        gathered = dataclasses.replace(layout, row_span=None, dense=False)
        assert torch.equal(got, gathered.attend(0, q, k, k, attn)), rids
        if span is None:  # what a view of rows first..first+n would have read instead
            wrong = dataclasses.replace(layout, row_span=(0, n))
            assert not torch.equal(got, wrong.attend(0, q, k, k, attn)), rids
