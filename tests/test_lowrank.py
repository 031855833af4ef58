"""Low-rank power iteration with error feedback: identities, orthogonality, convergence, backends."""

import pytest
import torch
from conftest import run_on_backend
from _helpers import BACKENDS, needs_triton
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonopt
from tritonopt.ops import lowrank_ef, lowrank_frobenius_products


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=10)
@given(
    n=st.integers(1, 24), cols=st.integers(1, 40), rank=st.integers(1, 5),
    grad_dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16),
)
def test_error_feedback_identity_and_orthogonality(backend, n, cols, rank, grad_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, cols, generator=gen).to(grad_dtype)
    error = 0.1 * torch.randn(n, cols, generator=gen)
    q = torch.randn(cols, rank, generator=gen)
    accumulator = error.double() + grad.double()
    p, q_new = run_on_backend(backend, lowrank_ef, grad, error, q)
    assert p.shape == (n, rank) and q_new.shape == (cols, rank)
    scale = float(accumulator.abs().max()) + 1e-6
    torch.testing.assert_close(
        p.double() @ q_new.double().T + error.double(), accumulator, rtol=0, atol=1e-5 * scale * rank
    )
    # Columns are orthonormal, or zero where A Q had nothing left (rank > min(n, cols)).
    gram = p.double().T @ p.double()
    norms = torch.diagonal(gram)
    assert bool(((norms - 1).abs() < 1e-4).logical_or(norms < 1e-4).all())
    off = gram - torch.diag(norms)
    assert float(off.abs().max()) < 1e-4
    # Q is the back-projection of A on P, so the error is orthogonal to P's span.
    torch.testing.assert_close(p.double().T @ error.double(), torch.zeros(rank, cols, dtype=torch.float64),
                               rtol=0, atol=1e-4 * scale * max(n, cols))


@needs_triton
def test_triton_matches_reference():
    gen = torch.Generator().manual_seed(3)
    grad, error = torch.randn(45, 70, generator=gen), torch.randn(45, 70, generator=gen)
    q = torch.randn(70, 4, generator=gen)
    error_t, error_r = error.clone(), error.clone()
    p_t, q_t = run_on_backend("triton", lowrank_ef, grad, error_t, q)
    p_r, q_r = run_on_backend("reference", lowrank_ef, grad, error_r, q)
    torch.testing.assert_close(p_t, p_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(q_t, q_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(error_t, error_r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_dimensional_tensors_pass_through(backend):
    grad = torch.randn(9)
    error = torch.zeros(9)
    p, q = run_on_backend(backend, lowrank_ef, grad, error, torch.zeros(1, 3))
    assert torch.equal(p[:, 0], grad) and not bool(p[:, 1:].any())
    assert torch.equal(q, torch.tensor([[1.0, 0.0, 0.0]]))
    assert not bool(error.any())
    assert torch.equal(p @ q.T, grad[:, None])


@pytest.mark.parametrize("backend", BACKENDS)
def test_exactly_low_rank_input_is_reconstructed(backend):
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(20, 2, generator=gen) @ torch.randn(2, 30, generator=gen)
    error = torch.zeros(20, 30)
    p, q = run_on_backend(backend, lowrank_ef, a, error, torch.randn(30, 3, generator=gen))
    torch.testing.assert_close(p @ q.T, a, rtol=1e-4, atol=1e-4)
    assert float(error.abs().max()) < 1e-4


def test_warm_started_iterations_converge_to_the_truncated_svd():
    gen = torch.Generator().manual_seed(2)
    u, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(25, 25, generator=gen))
    singular = torch.tensor([10.0, 6.0, 3.0] + [0.5 ** i for i in range(22)])
    matrix = (u[:, :25] * singular) @ v.T
    q = torch.randn(25, 2, generator=gen)
    for _ in range(40):  # no error feedback: a fresh zero error each time
        p, q = lowrank_ef(matrix, torch.zeros(30, 25), q)
    best = (u[:, :2] * singular[:2]) @ v[:, :2].T
    torch.testing.assert_close(p @ q.T, best, rtol=1e-3, atol=1e-3)
    # The span of P is the top-2 left singular subspace.
    projector = u[:, :2] @ u[:, :2].T
    torch.testing.assert_close(projector @ p, p, rtol=1e-3, atol=1e-3)


def test_frobenius_identity():
    gen = torch.Generator().manual_seed(4)
    ring_p, ring_q = torch.randn(5, 7, 3, generator=gen), torch.randn(5, 11, 3, generator=gen)
    p, q = torch.randn(7, 3, generator=gen), torch.randn(11, 3, generator=gen)
    got = lowrank_frobenius_products(ring_p, ring_q, p, q)
    expected = torch.stack([(ring_p[j] @ ring_q[j].T * (p @ q.T)).sum() for j in range(5)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_matches_reference_at_size():
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(4096, 4608, device="cuda", generator=gen)
    error = torch.randn(4096, 4608, device="cuda", generator=gen)
    q = torch.randn(4608, 4, device="cuda", generator=gen)
    error_t, error_r = error.clone(), error.clone()
    with tritonopt.use_backend("triton"):
        p_t, q_t = lowrank_ef(grad, error_t, q)
    with tritonopt.use_backend("reference"):
        p_r, q_r = lowrank_ef(grad, error_r, q)
    torch.testing.assert_close(p_t, p_r, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(error_t, error_r, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_p_is_the_orthonormalised_projection_of_the_warm_start(backend):
    # Modified Gram-Schmidt of A q equals the Q factor of a QR decomposition with R_ii > 0.
    gen = torch.Generator().manual_seed(6)
    grad, error = torch.randn(12, 9, generator=gen), torch.randn(12, 9, generator=gen)
    q = torch.randn(9, 3, generator=gen)
    a = error.double() + grad.double()
    basis, r = torch.linalg.qr(a @ q.double())
    basis = basis * torch.sign(torch.diagonal(r))
    p, q_new = run_on_backend(backend, lowrank_ef, grad, error, q)
    torch.testing.assert_close(p.double(), basis, rtol=0, atol=1e-5)
    torch.testing.assert_close(q_new.double(), a.T @ basis, rtol=0, atol=1e-4)
    torch.testing.assert_close(error.double(), a - basis @ (a.T @ basis).T, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_zero_column_keeps_the_warm_start(backend):
    # A zero (or rank-1) accumulator leaves columns of P at zero; Q must keep the warm
    # start there, or those columns stay zero in every later iteration.
    gen = torch.Generator().manual_seed(8)
    q0 = torch.randn(9, 3, generator=gen)
    p, q1 = run_on_backend(backend, lowrank_ef, torch.zeros(10, 9), torch.zeros(10, 9), q0)
    assert not bool(p.any())
    assert torch.equal(q1, q0)
    rank_one = torch.outer(torch.randn(10, generator=gen), torch.randn(9, generator=gen))
    error = torch.zeros(10, 9)
    p, q2 = run_on_backend(backend, lowrank_ef, rank_one, error, q1)
    torch.testing.assert_close(p @ q2.T + error, rank_one, rtol=0, atol=1e-5)
    assert torch.equal(p[:, 1:], torch.zeros(10, 2))
    assert torch.equal(q2[:, 1:], q0[:, 1:])
    p, _ = run_on_backend(backend, lowrank_ef, torch.randn(10, 9, generator=gen), torch.zeros(10, 9), q2)
    torch.testing.assert_close(p.T @ p, torch.eye(3), rtol=0, atol=1e-5)


def test_residual_grid_fits_cuda_launch_limits():
    from tritonopt.kernels.lowrank import residual_grid

    # A [2, 5M] tensor: 78,125 column tiles, more than the 65,535 allowed on grid axis 1.
    grid = residual_grid(2, 5_000_000, 32, 64)
    assert len(grid) == 1 and grid[0] == 78_125

