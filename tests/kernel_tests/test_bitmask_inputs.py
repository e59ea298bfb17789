"""``unpack_bitmask`` takes a bitmask of any strides: empty (0 rows) numpy arrays and tensors,
whose strides may be 0, column-major ones, and size-1 dimensions with odd strides."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfuture.kernels.bitmask import pack_bool_mask, unpack_bitmask
from tfuture.steps.masks import check_mask
from tfuture.steps.samplers import ModelSamplePath

VOCAB = 70  # 3 words a row


def _empty_inputs() -> list[object]:
    from_numpy = torch.as_tensor(np.zeros((0, 3), dtype=np.int32))  # strides (0, 0)
    return [
        np.zeros((0, 3), dtype=np.int32),
        from_numpy,
        torch.from_numpy(np.empty((0, 3), dtype=np.int32)),
        torch.empty_strided((0, 3), (1, 0), dtype=torch.int32),
        torch.zeros((0, 3), dtype=torch.int32),
    ]


@pytest.mark.parametrize(
    "bitmask", _empty_inputs(), ids=["numpy", "as_tensor", "from_numpy", "strided", "zeros"]
)
def test_an_empty_bitmask_unpacks_to_an_empty_mask(bitmask):
    out = unpack_bitmask(bitmask, VOCAB)
    assert type(out) is type(bitmask) and tuple(out.shape) == (0, VOCAB)
    if isinstance(out, torch.Tensor):
        assert out.dtype == torch.bool and out.is_contiguous()
        assert (~out).shape == (0, VOCAB)  # usable as a mask
    else:
        assert out.dtype == np.bool_ and out.flags.c_contiguous


def _allowed(seed: int, rows: int) -> np.ndarray:
    return np.random.default_rng(seed).random((rows, VOCAB)) < 0.3


def test_column_major_and_odd_stride_bitmasks_unpack_like_contiguous_ones():
    allowed = _allowed(0, 4)
    packed = pack_bool_mask(allowed)
    fortran = np.asfortranarray(packed)
    assert not fortran.flags.c_contiguous
    assert (unpack_bitmask(fortran, VOCAB) == allowed).all()
    col_major = torch.from_numpy(packed).t().contiguous().t()
    assert col_major.stride(1) != 1
    assert torch.equal(unpack_bitmask(col_major, VOCAB), torch.from_numpy(allowed))
    # One word a row (vocab <= 32): a size-1 last dim whose stride is not 1 counts as contiguous.
    one = _allowed(1, 2)[:, :20]
    word = torch.from_numpy(pack_bool_mask(one))
    odd = torch.empty_strided((2, 1), (1, 2), dtype=torch.int32).copy_(word)
    assert odd.is_contiguous() and odd.stride(-1) != 1
    assert torch.equal(unpack_bitmask(odd, 20), torch.from_numpy(one))


def test_the_models_own_sample_takes_an_empty_numpy_bitmask():
    """The token step's path: the host mask check, then the model's sample on the stream."""
    mask = check_mask(np.zeros((0, 3), dtype=np.int32), np.zeros(0, dtype=np.int64), 0, VOCAB)

    def sample(logits, batch, bool_mask):
        assert bool_mask is not None and tuple(bool_mask.shape) == (0, VOCAB)
        return logits.masked_fill(~bool_mask, float("-inf")).argmax(dim=-1)

    tokens = ModelSamplePath(sample).sample(None, None, torch.zeros(0, VOCAB), None, mask)  # type: ignore[arg-type]
    assert tokens.shape == (0,)
