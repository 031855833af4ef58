"""Sparse ring buffer ops (SP, LCG, insertion) against the densified buffer in float64."""

import pytest
import torch
from conftest import run_on_backend
from _helpers import BACKENDS, needs_triton
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonopt
from tritonopt.ops import densify_ring, sparse_lcg, sparse_ring_insert, sparse_sp
from tritonopt.ops import ef_topk


def random_ring(num_blocks, m, k, block_size, filled, values_dtype=torch.float32, seed=0):
    """A buffer whose first ``filled`` rows hold distinct random positions per block; the rest are zero."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.zeros((num_blocks, m, k), dtype=torch.int32)
    values = torch.zeros((num_blocks, m, k))
    for b in range(num_blocks):
        for r in range(filled):
            indices[b, r] = torch.randperm(block_size, generator=gen)[:k].sort().values.int()
            values[b, r] = torch.randn(k, generator=gen)
    return indices, values.to(values_dtype)


def dense_oracle(indices, values, block_size):
    """Row r of G written out entry by entry in float64 (independent of densify_ring)."""
    num_blocks, m, k = indices.shape
    dense = torch.zeros((m, num_blocks * block_size), dtype=torch.float64)
    for b in range(num_blocks):
        for r in range(m):
            for j in range(k):
                dense[r, b * block_size + int(indices[b, r, j])] += float(values[b, r, j])
    return dense


ring_cases = st.tuples(
    st.integers(1, 3),  # num_blocks
    st.integers(1, 5),  # m
    st.integers(1, 20),  # block_size
    st.floats(0.0, 1.0),  # fraction kept
    st.floats(0.0, 1.0),  # fraction of rows filled
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**16),
)


def unpack(case):
    num_blocks, m, block_size, keep, fill, dtype, seed = case
    k = max(1, round(keep * block_size))
    filled = round(fill * m)
    return num_blocks, m, k, block_size, filled, dtype, seed


def tolerance(values):
    # fp32 accumulation in any order (the GPU's reduction tree differs from the CPU's)
    return dict(rtol=1e-5, atol=1e-5 * max(1.0, float(values.float().abs().sum())))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15)
@given(case=ring_cases)
def test_sp_and_lcg_match_the_dense_buffer(backend, case):
    num_blocks, m, k, block_size, filled, dtype, seed = unpack(case)
    indices, values = random_ring(num_blocks, m, k, block_size, filled, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn((num_blocks, block_size), generator=gen)
    w = torch.randn(m, generator=gen)
    dense = dense_oracle(indices, values, block_size)
    products = run_on_backend(backend, sparse_sp, indices, values, x)
    combination = run_on_backend(backend, sparse_lcg, indices, values, w, block_size)
    assert products.dtype == torch.float32 and products.shape == (m,)
    assert combination.dtype == torch.float32 and combination.shape == (num_blocks, block_size)
    torch.testing.assert_close(products.double(), dense @ x.double().view(-1), **tolerance(values))
    torch.testing.assert_close(
        combination.double().view(-1), w.double() @ dense, **tolerance(values)
    )
    # Rows never written contribute nothing, whatever their weight.
    assert not bool(products[filled:].any())
    w_unfilled = w.clone()
    w_unfilled[:filled] = 0
    assert not bool(run_on_backend(backend, sparse_lcg, indices, values, w_unfilled, block_size).any())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_from_ef_topk_with_a_padded_last_block(backend):
    # 50 entries in blocks of 16: the last block is padded with zeros, as BlockLayout does.
    num_blocks, block_size, k, m = 4, 16, 3, 4
    gen = torch.Generator().manual_seed(7)
    indices = torch.zeros((num_blocks, m, k), dtype=torch.int32)
    values = torch.zeros((num_blocks, m, k))
    error = torch.zeros(num_blocks, block_size)
    for slot in range(m + 2):  # wraps around
        grad = torch.zeros(num_blocks * block_size)
        grad[:50] = torch.randn(50, generator=gen)
        idx, val = run_on_backend(backend, ef_topk, grad.view(num_blocks, block_size), error, k)
        run_on_backend(backend, sparse_ring_insert, indices, values, slot % m, idx, val)
    x = torch.randn((num_blocks, block_size), generator=gen)
    w = torch.randn(m, generator=gen)
    products = run_on_backend(backend, sparse_sp, indices, values, x)
    combination = run_on_backend(backend, sparse_lcg, indices, values, w, block_size)
    dense = dense_oracle(indices, values, block_size)
    torch.testing.assert_close(products.double(), dense @ x.double().view(-1), **tolerance(values))
    torch.testing.assert_close(combination.double().view(-1), w.double() @ dense, **tolerance(values))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "num_blocks, m, k, block_size",
    [(1, 1, 1, 1), (1, 1, 7, 7), (2, 1, 5, 5), (1, 3, 1, 9)],
    ids=["scalar", "m1-full-density", "blocks-full-density", "k1"],
)
def test_edge_shapes(backend, num_blocks, m, k, block_size):
    indices, values = random_ring(num_blocks, m, k, block_size, filled=m, seed=3)
    x = torch.randn(num_blocks, block_size)
    w = torch.randn(m)
    dense = dense_oracle(indices, values, block_size)
    products = run_on_backend(backend, sparse_sp, indices, values, x)
    combination = run_on_backend(backend, sparse_lcg, indices, values, w, block_size)
    torch.testing.assert_close(products.double(), dense @ x.double().view(-1), **tolerance(values))
    torch.testing.assert_close(combination.double().view(-1), w.double() @ dense, **tolerance(values))


@needs_triton
def test_k_longer_than_one_chunk():
    from tritonopt.kernels import sparse_ring as kernels

    # k = 40 > a chunk of 16: the kernels loop over chunks of each row; LCG zeroes its
    # 48-entry output block in tiles of 16 (the last row block is then partly stale memory).
    indices, values = random_ring(2, 3, 40, 48, filled=3, seed=11)
    x, w = torch.randn(2, 48), torch.randn(3)
    dense = dense_oracle(indices, values, 48)
    old = kernels.MAX_BLOCK_K, kernels.ZERO_TILE
    kernels.MAX_BLOCK_K = kernels.ZERO_TILE = 16
    try:
        products = run_on_backend("triton", sparse_sp, indices, values, x)
        combination = run_on_backend("triton", sparse_lcg, indices, values, w, 48)
    finally:
        kernels.MAX_BLOCK_K, kernels.ZERO_TILE = old
    torch.testing.assert_close(products.double(), dense @ x.double().view(-1), **tolerance(values))
    torch.testing.assert_close(combination.double().view(-1), w.double() @ dense, **tolerance(values))


@needs_triton
@given(
    num_blocks=st.integers(1, 2),
    m=st.integers(1, 5),
    slice_log2=st.integers(3, 5),  # 8 to 32 positions a program
    slices=st.floats(1.0, 6.0),  # several programs a block, a partial last one
    keep=st.floats(0.0, 1.0),
    fill=st.floats(0.0, 1.0),
    values_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    outside=st.booleans(),
    narrow=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25)
def test_sliced_lcg_adds_rows_in_slot_order_like_the_cpu_reference(num_blocks, m, slice_log2, slices, keep, fill,
                                                                  values_dtype, outside, narrow, seed):
    """Ascending rows over a long block: each slice's program adds its share of every row, in slot
    order, so every position sees the reference's additions in the reference's order."""
    from conftest import backend_device

    from tritonopt.kernels.sparse_ring import sparse_lcg_reference, sparse_lcg_triton

    slice_size = 2**slice_log2
    block_size = max(2, int(slice_size * slices))
    k = max(1, round(keep * block_size))
    indices, values = random_ring(num_blocks, m, k, block_size, filled=round(fill * m), values_dtype=values_dtype,
                                  seed=seed)
    if outside and k >= 2:  # out-of-block positions, still ascending: before and after the block
        indices[0, 0, 0], indices[0, 0, -1] = -3, block_size + 2
    if narrow:  # int16 positions, as the optimizers store them for blocks up to 32768
        indices = indices.to(torch.int16)
    w = torch.randn(m, generator=torch.Generator().manual_seed(seed + 1))
    target = backend_device("triton")
    sliced = sparse_lcg_triton(indices.to(target), values.to(target), w.to(target), block_size, True,
                               slice_size=slice_size, sliced_from=1).cpu()
    assert torch.equal(sliced, sparse_lcg_reference(indices, values, w, block_size))


@needs_triton
@pytest.mark.parametrize("weight", [0.5, float("inf"), float("nan")])
def test_sliced_lcg_skips_rows_never_written_only_where_they_add_nothing(weight):
    """Rows never written (zeros at position 0) fall into the first slice: skipped there with a finite
    weight (they add +-0), still added with a non-finite one, whose 0 * inf makes the reference NaN."""
    from conftest import backend_device

    from tritonopt.kernels.sparse_ring import sparse_lcg_reference, sparse_lcg_triton

    indices, values = random_ring(1, 4, 6, 80, filled=2, seed=4)  # rows 2 and 3 never written
    w = torch.tensor([0.25, -1.5, weight, 2.0])
    target = backend_device("triton")
    sliced = sparse_lcg_triton(indices.to(target), values.to(target), w.to(target), 80, True, slice_size=16,
                               sliced_from=1).cpu()
    expected = sparse_lcg_reference(indices, values, w, 80)
    assert torch.equal(sliced.isnan(), expected.isnan()) and bool(expected[0, 0].isnan()) == (weight != 0.5)
    assert torch.equal(sliced.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("backend", BACKENDS)
def test_lcg_of_ascending_rows_is_the_same_and_the_promise_is_a_bool(backend):
    indices, values = random_ring(2, 4, 6, 20, filled=3, seed=3)
    w = torch.randn(4)
    assert torch.equal(run_on_backend(backend, sparse_lcg, indices, values, w, 20, ascending=True),
                       run_on_backend(backend, sparse_lcg, indices, values, w, 20))
    with pytest.raises(TypeError, match="ascending"):
        sparse_lcg(indices, values, w, 20, ascending="yes")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lcg_is_deterministic(backend):
    indices, values = random_ring(3, 6, 5, 12, filled=6, seed=5)
    w = torch.randn(6)
    first = run_on_backend(backend, sparse_lcg, indices, values, w, 12)
    second = run_on_backend(backend, sparse_lcg, indices, values, w, 12)
    assert torch.equal(first, second)


@needs_triton
def test_triton_lcg_adds_rows_in_slot_order_like_the_cpu_reference():
    # Bitwise on a GPU too: the kernel is compiled without FMA contraction, so each
    # step rounds w * v, then the sum, as the CPU reference's index_add_ does.
    indices, values = random_ring(2, 5, 4, 10, filled=5, seed=9)
    w = torch.randn(5)
    triton_out = run_on_backend("triton", sparse_lcg, indices, values, w, 10)
    reference_out = run_on_backend("reference", sparse_lcg, indices, values, w, 10)
    assert torch.equal(triton_out, reference_out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16])
def test_insert_replaces_exactly_one_row(backend, values_dtype):
    indices, values = random_ring(3, 4, 2, 8, filled=4, values_dtype=values_dtype, seed=2)
    before_i, before_v = indices.clone(), values.clone()
    new_i = torch.tensor([[0, 5], [1, 2], [7, 3]], dtype=torch.int32)
    new_v = torch.randn(3, 2)
    run_on_backend(backend, sparse_ring_insert, indices, values, 2, new_i, new_v)
    others = [0, 1, 3]
    assert torch.equal(indices[:, others], before_i[:, others])
    assert torch.equal(values[:, others], before_v[:, others])
    assert torch.equal(indices[:, 2], new_i)
    if values_dtype == torch.float32:
        assert torch.equal(values[:, 2], new_v)
    else:  # the interpreter truncates where torch rounds: at most one bf16 ulp apart
        ulp = new_v.abs() * 2.0**-7
        assert bool(((values[:, 2].float() - new_v).abs() <= ulp).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_insert_is_idempotent_and_tuning_does_not_copy_the_ring(backend):
    from tritonopt.kernels import sparse_ring as kernels

    # Autotuning a kernel with restore_value clones the named tensors before every
    # timed run; for the insert that is the whole ring buffer (GBs at real sizes).
    # The insert needs no restore: writing the same row twice gives the same buffer.
    assert not getattr(kernels._ring_insert_kernel, "restore_value", [])
    indices, values = random_ring(3, 4, 2, 8, filled=4, seed=6)
    new_i = torch.tensor([[0, 5], [1, 2], [7, 3]], dtype=torch.int32)
    new_v = torch.randn(3, 2)
    run_on_backend(backend, sparse_ring_insert, indices, values, 1, new_i, new_v)
    once_i, once_v = indices.clone(), values.clone()
    run_on_backend(backend, sparse_ring_insert, indices, values, 1, new_i, new_v)
    assert torch.equal(indices, once_i) and torch.equal(values, once_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int16_ring_gives_the_int32_results(backend):
    indices, values = random_ring(3, 4, 5, 40, filled=3, seed=11)
    narrow = indices.to(torch.int16)
    x = torch.randn(3, 40)
    w = torch.randn(4)
    assert torch.equal(run_on_backend(backend, sparse_sp, narrow, values, x),
                       run_on_backend(backend, sparse_sp, indices, values, x))
    assert torch.equal(run_on_backend(backend, sparse_lcg, narrow, values, w, 40),
                       run_on_backend(backend, sparse_lcg, indices, values, w, 40))
    new_i = torch.randint(0, 40, (3, 5), dtype=torch.int16)
    new_v = torch.randn(3, 5)
    run_on_backend(backend, sparse_ring_insert, narrow, values, 3, new_i, new_v)
    assert narrow.dtype == torch.int16 and torch.equal(narrow[:, 3], new_i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_insert_refuses_indices_of_another_dtype(backend):
    indices, values = random_ring(2, 3, 2, 8, filled=1)
    with pytest.raises(TypeError, match="new_indices must be int16"):
        run_on_backend(backend, sparse_ring_insert, indices.to(torch.int16), values, 0,
                       torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_block_positions_contribute_nothing(backend):
    indices, values = random_ring(2, 3, 4, 10, filled=3, seed=5)
    inside = dense_oracle(indices, values, 10)
    indices[0, 1, 2] = 10  # one past the block: the layout's contract says such an entry is ignored
    indices[1, 0, 0] = 37
    values_in = values.clone()
    values_in[0, 1, 2] = 0
    values_in[1, 0, 0] = 0
    expected = dense_oracle(torch.where(values_in == 0, 0, indices), values_in, 10)
    x = torch.randn(2, 10)
    w = torch.randn(3)
    products = run_on_backend(backend, sparse_sp, indices, values, x)
    combination = run_on_backend(backend, sparse_lcg, indices, values, w, 10)
    torch.testing.assert_close(products.double(), expected @ x.double().view(-1), **tolerance(values))
    torch.testing.assert_close(combination.double().view(-1), w.double() @ expected, **tolerance(values))
    assert not torch.allclose(expected, inside)  # the test moved real entries out


def test_densify_ring_matches_the_oracle():
    indices, values = random_ring(2, 3, 4, 9, filled=2, seed=4)
    torch.testing.assert_close(densify_ring(indices, values, 9).double(), dense_oracle(indices, values, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_reference_at_real_size(values_dtype):
    # ResNet-18-like slice: 64 blocks of 16384, m = 1024, 1 % density.
    num_blocks, m, block_size, k = 64, 1024, 16384, 164
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.rand((num_blocks, m, block_size), device="cuda", generator=gen)
    indices = keys.topk(k, dim=2).indices.sort(dim=2).values.int()
    del keys
    values = torch.randn((num_blocks, m, k), device="cuda", generator=gen).to(values_dtype)
    x = torch.randn((num_blocks, block_size), device="cuda", generator=gen)
    w = torch.randn(m, device="cuda", generator=gen)
    with tritonopt.use_backend("triton"):
        products = sparse_sp(indices, values, x)
        first = sparse_lcg(indices, values, w, block_size)
        second = sparse_lcg(indices, values, w, block_size)
    with tritonopt.use_backend("reference"):
        expected_products = sparse_sp(indices, values, x.double().float())
        expected = sparse_lcg(indices, values, w, block_size)
    assert torch.equal(first, second)
    torch.testing.assert_close(products, expected_products, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-3)
