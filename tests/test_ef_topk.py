"""ef_topk: the Triton kernel against the reference, and both against the op's contract."""

import math

import pytest
import torch
from conftest import backend_device, run_on_backend, triton_runs_here
from _helpers import BACKENDS, needs_triton
from hypothesis import given
from hypothesis import strategies as st

from tritonopt.kernels.ef_topk import SPLIT_MIN_TILE, ef_topk_reference, ef_topk_triton
from tritonopt.ops import densify_blocks, ef_topk


GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["normal", "ties", "zeros", "signed_zeros", "denormal", "wide"]


def make_row_data(kind, shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(shape, generator=gen)
    elif kind == "ties":  # few distinct magnitudes, both signs: many ties at the threshold
        x = torch.randint(-3, 4, shape, generator=gen).float()
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "signed_zeros":
        x = torch.where(torch.rand(shape, generator=gen) < 0.5, -0.0, 0.0)
    elif kind == "denormal":
        x = torch.randn(shape, generator=gen) * 1e-41
    else:  # magnitudes over many binades
        x = torch.randn(shape, generator=gen) * torch.exp2(
            torch.randint(-60, 60, shape, generator=gen).float()
        )
    return x.to(dtype)


def run(backend, grad, error, k):
    """ef_topk on ``backend`` (on the GPU for Triton where there is one); ``error`` updated in place."""
    return run_on_backend(backend, ef_topk, grad, error, k)


def run_kernel(grad, error, k, **launch):
    """The Triton launcher called directly, on the device Triton runs on; ``error`` updated in place."""
    target = backend_device("triton")
    moved = error.to(target)
    indices, values = ef_topk_triton(grad.to(target), moved, k, **launch)
    error.copy_(moved)
    return indices.cpu(), values.cpu()


def canonical_bits(x):
    """int32 bit patterns with -0.0 read as +0.0 (the sum below cannot keep a zero's sign)."""
    return torch.where(x == 0, torch.zeros_like(x), x).view(torch.int32)


def assert_contract(grad, error_old, error_new, k, indices, values):
    """The op's documented contract, checked row by row without the reference."""
    a = error_old + grad.to(torch.float32)
    num_blocks, block_size = a.shape
    assert indices.dtype == torch.int32 and values.dtype == torch.float32
    assert indices.shape == values.shape == (num_blocks, k)
    # Ranking key, exact in float64: NaN above inf above every finite magnitude.
    magnitude = a.abs().double()
    magnitude = torch.where(torch.isinf(a), torch.full_like(magnitude, 1e300), magnitude)
    magnitude = torch.where(torch.isnan(a), torch.full_like(magnitude, 1e301), magnitude)
    for b in range(num_blocks):
        idx = indices[b].long()
        assert bool((idx[1:] > idx[:-1]).all()), "indices ascending and distinct"
        assert 0 <= int(idx.min()) and int(idx.max()) < block_size
        chosen = torch.zeros(block_size, dtype=torch.bool)
        chosen[idx] = True
        if k < block_size:
            lowest_kept = magnitude[b][chosen].min()
            highest_left = magnitude[b][~chosen].max()
            assert lowest_kept >= highest_left, "a true Top-k"
            # Tie rule: entries at the threshold are taken from the lowest positions.
            at_threshold = (magnitude[b] == lowest_kept).nonzero().flatten()
            taken = chosen[at_threshold]
            assert not bool((~taken[:-1] & taken[1:]).any()), "ties go to the lower position"
        assert torch.equal(values[b].view(torch.int32), a[b][idx].view(torch.int32))
        assert bool((error_new[b][chosen] == 0).all())
        kept_error = error_new[b][~chosen]
        assert torch.equal(canonical_bits(kept_error), canonical_bits(a[b][~chosen]))
    # Error feedback invariant, bitwise up to the sign of zero; NaN payloads included.
    rebuilt = densify_blocks(indices, values, block_size) + error_new
    assert torch.equal(canonical_bits(rebuilt), canonical_bits(a))


@given(
    num_blocks=st.integers(1, 5),
    block_size=st.integers(1, 300),
    k_fraction=st.floats(0.0, 1.0),
    grad_kind=st.sampled_from(KINDS),
    error_kind=st.sampled_from(KINDS),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_matches_reference_bitwise(
    num_blocks, block_size, k_fraction, grad_kind, error_kind, grad_dtype, seed
):
    if not triton_runs_here():
        pytest.skip("Triton cannot run here")
    k = max(1, min(block_size, round(k_fraction * block_size)))
    grad = make_row_data(grad_kind, (num_blocks, block_size), seed, grad_dtype)
    error = make_row_data(error_kind, (num_blocks, block_size), seed + 1)
    error_triton, error_reference = error.clone(), error.clone()
    idx_t, val_t = run("triton", grad, error_triton, k)
    idx_r, val_r = run("reference", grad, error_reference, k)
    assert torch.equal(idx_t, idx_r)
    assert torch.equal(val_t.view(torch.int32), val_r.view(torch.int32))
    assert torch.equal(error_triton.view(torch.int32), error_reference.view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    num_blocks=st.integers(1, 4),
    block_size=st.integers(1, 200),
    k_fraction=st.floats(0.0, 1.0),
    grad_kind=st.sampled_from(KINDS),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_contract_holds(backend, num_blocks, block_size, k_fraction, grad_kind, grad_dtype, seed):
    k = max(1, min(block_size, round(k_fraction * block_size)))
    grad = make_row_data(grad_kind, (num_blocks, block_size), seed, grad_dtype)
    error_old = make_row_data("normal", (num_blocks, block_size), seed + 7)
    error_new = error_old.clone()
    indices, values = run(backend, grad, error_new, k)
    assert_contract(grad, error_old, error_new, k, indices, values)


@needs_triton
@pytest.mark.parametrize("kernel", ["resident", "split"])
@given(
    num_blocks=st.integers(1, 3),
    tile_log2=st.integers(3, 5),  # 8 to 32: several tiles a row and a partial last one, as at any size
    tiles=st.floats(1.01, 9.0),
    chunk_tiles=st.integers(1, 3),  # the split path: several programs a row, a partial last chunk
    k_fraction=st.floats(0.0, 1.0),
    kind=st.sampled_from(KINDS),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_tiled_kernels_match_reference(kernel, num_blocks, tile_log2, tiles, chunk_tiles, k_fraction, kind,
                                       grad_dtype, seed):
    """Rows longer than one tile take the resident-keys kernel, or past ``max_resident`` the
    split path (a radix select over several programs a row); force each with a small tile (the
    split path's smallest, ``SPLIT_MIN_TILE``)."""
    tile = 2**tile_log2 if kernel == "resident" else SPLIT_MIN_TILE
    block_size = int(tile * tiles)
    k = max(1, min(block_size, round(k_fraction * block_size)))
    grad = make_row_data(kind, (num_blocks, block_size), seed, grad_dtype)
    error = make_row_data("ties", (num_blocks, block_size), seed + 3)
    error_triton, error_reference = error.clone(), error.clone()
    max_resident = 16 * tile if kernel == "resident" else tile
    idx_t, val_t = run_kernel(grad, error_triton, k, max_tile=tile, max_resident=max_resident,
                              split_chunk=chunk_tiles * tile)
    idx_r, val_r = ef_topk_reference(grad, error_reference, k)
    assert torch.equal(idx_t, idx_r)
    assert torch.equal(val_t.view(torch.int32), val_r.view(torch.int32))
    assert torch.equal(error_triton.view(torch.int32), error_reference.view(torch.int32))


@needs_triton
def test_split_path_selects_across_many_chunks():
    """Rows over 20 programs each: one with four magnitudes, NaN and -inf, whose k-th largest is
    shared by entries in every chunk, and one of distinct magnitudes. The ties kept are the
    lowest positions, whichever chunk holds them."""
    tile, chunk_tiles, chunks = SPLIT_MIN_TILE, 1, 20
    block_size = tile * chunk_tiles * chunks - 5
    gen = torch.Generator().manual_seed(11)
    grad = torch.stack([torch.randint(-2, 2, (block_size,), generator=gen).float(),
                        torch.randn(block_size, generator=gen)])
    grad[0, ::371] = float("nan")
    grad[0, 5::293] = float("-inf")
    for k in (block_size // 3, block_size - 1):
        error_triton, error_reference = torch.zeros_like(grad), torch.zeros_like(grad)
        idx_t, val_t = run_kernel(grad, error_triton, k, max_tile=tile, max_resident=tile,
                                  split_chunk=chunk_tiles * tile)
        idx_r, val_r = ef_topk_reference(grad, error_reference, k)
        assert torch.equal(idx_t, idx_r), k
        assert torch.equal(val_t.view(torch.int32), val_r.view(torch.int32)), k
        assert torch.equal(error_triton.view(torch.int32), error_reference.view(torch.int32)), k


@pytest.mark.parametrize("backend", BACKENDS)
class TestEdgeCases:
    def test_k_equals_one(self, backend):
        grad = torch.tensor([[0.5, -3.0, 2.0, 3.0], [0.0, 0.0, -1.0, 0.5]])
        error = torch.zeros_like(grad)
        indices, values = run(backend, grad, error, 1)
        assert indices.tolist() == [[1], [2]]  # |-3| ties |3|: the lower position wins
        assert values.tolist() == [[-3.0], [-1.0]]
        assert error.tolist() == [[0.5, 0.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.5]]

    def test_k_equals_block_size_keeps_everything(self, backend):
        grad = torch.randn(3, 17)
        error = torch.randn(3, 17)
        a = error + grad
        indices, values = run(backend, grad, error, 17)
        assert torch.equal(indices, torch.arange(17, dtype=torch.int32).expand(3, 17))
        assert torch.equal(values, a)
        assert not bool(error.any())

    def test_one_block(self, backend):
        grad = torch.tensor([[1.0, -5.0, 4.0, 0.0, 2.0]])
        error = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0]])
        indices, values = run(backend, grad, error, 2)
        assert indices.tolist() == [[1, 2]]
        assert values.tolist() == [[-5.0, 4.5]]
        assert error.tolist() == [[1.0, 0.0, 0.0, 0.0, 2.0]]

    def test_all_zero_rows_take_the_first_positions(self, backend):
        grad = torch.zeros(2, 9)
        error = torch.zeros(2, 9)
        indices, values = run(backend, grad, error, 3)
        assert indices.tolist() == [[0, 1, 2]] * 2
        assert not bool(values.any()) and not bool(error.any())

    def test_all_equal_magnitudes_take_the_first_positions(self, backend):
        grad = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0, -2.0]])
        error = torch.zeros_like(grad)
        indices, values = run(backend, grad, error, 4)
        assert indices.tolist() == [[0, 1, 2, 3]]
        assert values.tolist() == [[2.0, -2.0, 2.0, -2.0]]
        assert error.tolist() == [[0.0, 0.0, 0.0, 0.0, 2.0, -2.0]]

    def test_negative_zero_ties_with_positive_zero(self, backend):
        grad = torch.tensor([[-0.0, 0.0, -0.0, 1.0, 0.0]])
        error = torch.zeros_like(grad)
        indices, values = run(backend, grad, error, 3)
        assert indices.tolist() == [[0, 1, 3]]
        assert values[0, 2].item() == 1.0

    def test_empty_batch_of_blocks(self, backend):
        grad = torch.zeros(0, 8)
        error = torch.zeros(0, 8)
        indices, values = run(backend, grad, error, 2)
        assert indices.shape == values.shape == (0, 2)

    def test_low_precision_grad_is_added_in_float32(self, backend):
        grad = torch.tensor([[1.0, 3.0, -2.0, 0.25]], dtype=torch.bfloat16)
        error = torch.tensor([[1e-3, 0.0, -1e-3, 0.0]])
        a = error + grad.float()
        indices, values = run(backend, grad, error, 2)
        assert indices.tolist() == [[1, 2]]
        assert torch.equal(values, a[:, [1, 2]])

    def test_nonfinite_rank_first_nan_above_inf(self, backend):
        row = [0.0, 1.0, math.inf, 5.0, -2.0, math.nan, 7.0, -math.inf]
        grad = torch.tensor([row])
        for k, expected in [(1, [5]), (2, [2, 5]), (3, [2, 5, 7]), (4, [2, 5, 6, 7])]:
            error = torch.zeros_like(grad)
            indices, values = run(backend, grad, error, k)
            assert indices.tolist() == [expected], k
            # Selected non-finite entries leave the error buffer; the rest stay.
            assert not bool(torch.isnan(error).any()), k
            left_inf = [i for i in (2, 7) if i not in expected]
            assert sorted(torch.isinf(error[0]).nonzero().flatten().tolist()) == left_inf
        error = torch.zeros_like(grad)
        _, values = run(backend, grad, error, 2)
        assert math.isinf(values[0, 0].item()) and math.isnan(values[0, 1].item())

    def test_same_inputs_same_bits(self, backend):
        grad = make_row_data("ties", (4, 64), 11)
        error = make_row_data("normal", (4, 64), 12)
        e1, e2 = error.clone(), error.clone()
        i1, v1 = run(backend, grad, e1, 5)
        i2, v2 = run(backend, grad, e2, 5)
        assert torch.equal(i1, i2) and torch.equal(v1, v2) and torch.equal(e1, e2)


@needs_triton
@pytest.mark.parametrize("block_size, k", [(4096, 41), (10000, 100)])  # row kernel; resident keys
def test_larger_blocks_match_reference(block_size, k):
    grad = make_row_data("normal", (8, block_size), 1)
    error = make_row_data("ties", (8, block_size), 2)
    error_triton, error_reference = error.clone(), error.clone()
    idx_t, val_t = run_kernel(grad, error_triton, k)
    idx_r, val_r = ef_topk_reference(grad, error_reference, k)
    assert torch.equal(idx_t, idx_r) and torch.equal(val_t, val_r)
    assert torch.equal(error_triton, error_reference)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("num_blocks, block_size", [(4096, 4096), (512, 41728), (33, 100003)])
def test_gpu_matches_reference(num_blocks, block_size, grad_dtype):
    k = math.ceil(block_size / 100)
    grad = make_row_data("normal", (num_blocks, block_size), 1, grad_dtype).cuda()
    error = make_row_data("ties", (num_blocks, block_size), 2).cuda()
    error_triton, error_reference = error.clone(), error.clone()
    idx_t, val_t = ef_topk_triton(grad, error_triton, k)
    idx_r, val_r = ef_topk_reference(grad, error_reference, k)
    assert torch.equal(idx_t, idx_r) and torch.equal(val_t, val_r)
    assert torch.equal(error_triton, error_reference)
