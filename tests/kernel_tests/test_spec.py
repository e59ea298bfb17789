"""prepare_spec_inputs: the Triton kernel and the CPU path against prepare_spec_inputs_ref."""

import pytest
import torch

from tfuture.kernels import cpu
from tfuture.kernels.spec import SpecInputs, launch_prepare_spec, prepare_spec_inputs, prepare_spec_inputs_ref

from ._helpers import DTYPES, IMPLS, gen, impl_device, new_err

N_SLOTS = 41
POISON = -999
# Row blocks are at most 64 rows (fewer for wide rows); a prime; a large non-power-of-two.
SIZES = [0, 1, 2, 17, 63, 64, 65, 130]


def slot_fields(k: int, g: torch.Generator, device: str) -> tuple[torch.Tensor, ...]:
    """(tokens, accept_len, new_seq_len, draft_tokens) for every slot."""
    tokens = torch.randint(0, 1000, (N_SLOTS, k + 1), generator=g)
    # Out-of-range accepted lengths on purpose: the kernel clamps them into the row.
    accept = torch.randint(-1, k + 3, (N_SLOTS,), generator=g).to(torch.int32)
    seq = torch.randint(0, 500, (N_SLOTS,), generator=g)
    drafts = torch.randint(0, 1000, (N_SLOTS, k), generator=g)
    return tuple(t.to(device) for t in (tokens, accept, seq, drafts))


def requests(n: int, dtype: torch.dtype, g: torch.Generator, device: str):
    """(last, seq_lens): placeholders of stored steps and concrete last tokens, plus (n > 2) two
    placeholders past the map, one of them the dtype's minimum."""
    slots = torch.randint(1, N_SLOTS, (n,), generator=g)
    concrete = torch.randint(0, 1000, (n,), generator=g)
    last = torch.where(torch.rand(n, generator=g) < 0.7, -slots, concrete)
    if n > 2:
        last[torch.randperm(n, generator=g)[:2]] = torch.tensor([-N_SLOTS, torch.iinfo(dtype).min])
    lens = torch.randint(1, 300, (n,), generator=g)
    return last.to(device=device, dtype=dtype), lens.to(device=device, dtype=dtype)


def poisoned_out(n_rows: int, k: int, device: str) -> SpecInputs:
    return SpecInputs(
        torch.full((n_rows, k + 1), POISON, device=device),
        torch.full((n_rows, k + 1), POISON, device=device),
        torch.full((n_rows,), POISON, device=device),
    )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("k", [0, 1, 3, 8], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("impl", IMPLS)
def test_prepare_spec_matches_reference(impl, n, k, dtype, device):
    device = impl_device(impl, device)
    g = gen(100 * k + n)
    fields = slot_fields(k, g, device)
    last, lens = requests(n, dtype, g, device)
    n_rows = n + 3
    out = poisoned_out(n_rows, k, device)
    err, err_ref = new_err(device), new_err(device)

    if impl == "cpu":
        cpu.prepare_spec(last, lens, fields, out, err)
    else:
        assert prepare_spec_inputs(last, lens, *fields, n_rows=n_rows, out=out, err=err) is out
    want = prepare_spec_inputs_ref(last, lens, *fields, n_rows=n_rows, err=err_ref)

    for a, b in zip(out, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(err, err_ref)
    assert err.tolist() == ([2, torch.iinfo(dtype).min] if n > 2 else [0, 0])


def test_reference_follows_the_contract():
    """The oracle itself: each row of the contract written out by hand."""
    tokens = torch.tensor([[0, 0, 0], [7, 8, 9], [4, 5, 6]])
    accept = torch.tensor([1, 2, 9], dtype=torch.int32)  # 9 is clamped to the row's 3 tokens
    seq = torch.tensor([1, 20, 30])
    drafts = torch.tensor([[0, 0], [11, 12], [13, 14]])
    last = torch.tensor([-1, 5, -2, -3, -4])
    err = new_err("cpu")
    got = prepare_spec_inputs_ref(
        last, torch.tensor([0, 6, 0, 0, 0]), tokens, accept, seq, drafts, n_rows=6, err=err
    )
    assert got.input_ids.tolist() == [[8, 11, 12], [5, 0, 0], [6, 13, 14], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert got.positions.tolist() == [[19, 20, 21], [5, 6, 7], [29, 30, 31], [0, 1, 2], [0, 1, 2], [0, 0, 0]]
    assert got.n_draft.tolist() == [2, 0, 2, 0, 0, 0]
    assert err.tolist() == [2, -4]


def test_launch_prepare_spec_allocates_without_out(device):
    g = gen(5)
    fields = slot_fields(2, g, device)
    last, lens = requests(9, torch.int64, g, device)
    got = launch_prepare_spec(last, lens, *fields, 12, None, None)
    for a, b in zip(got, prepare_spec_inputs_ref(last, lens, *fields, n_rows=12), strict=True):
        assert torch.equal(a, b)


def test_prepare_spec_validation(device):
    tokens, accept, seq, drafts = slot_fields(3, gen(1), device)
    last = torch.tensor([-1, 5], device=device)
    lens = torch.tensor([1, 7], device=device)
    with pytest.raises(ValueError, match="one entry per request"):
        prepare_spec_inputs(last, lens[:1], tokens, accept, seq, drafts)
    with pytest.raises(ValueError, match="one row per slot"):
        prepare_spec_inputs(last, lens, tokens[:5], accept, seq, drafts)
    with pytest.raises(ValueError, match=r"int32 or torch.int64, got torch.float32"):
        prepare_spec_inputs(last, lens, tokens, accept, seq.float(), drafts)
    with pytest.raises(TypeError, match=r"draft_tokens must be a torch\.Tensor, got list"):
        prepare_spec_inputs(last, lens, tokens, accept, seq, drafts.tolist())
    with pytest.raises(ValueError, match="n_rows must be >= len"):
        prepare_spec_inputs(last, lens, tokens, accept, seq, drafts, n_rows=1)
    with pytest.raises(ValueError, match=r"out.input_ids must have shape \(2, 4\)"):
        bad = SpecInputs(
            torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2)
        )
        prepare_spec_inputs(last, lens, tokens, accept, seq, drafts, out=bad)
