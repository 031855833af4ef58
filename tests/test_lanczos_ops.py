"""Gram-Schmidt ops and single-process Lanczos: against dense float64 math and explicit Hessians."""

import math

import pytest
import torch
from conftest import backend_device, run_on_backend
from _helpers import BACKENDS, needs_triton
from hypothesis import given
from hypothesis import strategies as st

import tritonopt
from tritonopt.ops import gram_schmidt_coefficients, gram_schmidt_project, gram_schmidt_subtract
from tritonopt.optim.lanczos import (
    default_lanczos_iters,
    lanczos,
    make_hvp,
    ritz_vectors,
    select_ritz,
)


def orthonormal_rows(m, n, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))
    return q.T.contiguous().to(dtype)


def dense_projection(basis, h, rows):
    """Oracle: the exact orthogonal projection, in float64, via the normal equations."""
    d = basis[:rows].double()
    if rows == 0:
        return h.double().clone(), torch.zeros(0, dtype=torch.float64)
    coef = torch.linalg.solve(d @ d.T, d @ h.double())
    return h.double() - d.T @ coef, coef


# --------------------------------------------------------------------------- the op


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    m=st.integers(1, 12),
    n=st.integers(1, 1300),
    rows_fraction=st.floats(0.0, 1.0),
    passes=st.integers(1, 2),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_projection_matches_dense_float64(backend, m, n, rows_fraction, passes, dtype, seed):
    m = min(m, n)
    rows = round(rows_fraction * m)
    basis = orthonormal_rows(m, n, seed, dtype)
    h = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)
    h_before = h.clone()
    h_orth, coef, sq_norm = run_on_backend(backend, gram_schmidt_project, basis, h, rows, passes)
    expected, expected_coef = dense_projection(basis, h, rows)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    scale = max(1.0, float(h.double().norm()))
    assert h_orth.dtype == dtype and coef.shape == (rows,) and sq_norm.shape == ()
    assert torch.equal(h, h_before), "h must not be modified"
    assert (h_orth.double() - expected).abs().max() <= tol * scale
    assert (coef.double() - expected_coef).abs().amax().item() <= tol * scale if rows else True
    assert abs(float(sq_norm) - float(expected @ expected)) <= 10 * tol * scale**2
    # Rows beyond num_rows are never used: garbage there changes nothing.
    if rows < m:
        poisoned = basis.clone()
        poisoned[rows:] = float("nan")
        again, _, _ = run_on_backend(backend, gram_schmidt_project, poisoned, h, rows, passes)
        assert torch.equal(again, h_orth)


@needs_triton
@given(
    m=st.integers(1, 20),
    n=st.integers(1, 2100),
    rows_fraction=st.floats(0.0, 1.0),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_halves_triton_match_reference(m, n, rows_fraction, dtype, seed):
    rows = round(rows_fraction * m)
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(m, n, generator=gen, dtype=dtype)
    h = torch.randn(n, generator=gen, dtype=dtype)
    out = {}
    for backend in ("triton", "reference"):
        coef = run_on_backend(backend, gram_schmidt_coefficients, basis, h, rows)
        out[backend] = (coef, *run_on_backend(backend, gram_schmidt_subtract, basis, h, coef))
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(out["triton"], out["reference"]):
        # Sums of n products: tolerance relative to the sum of magnitudes (GPU reduction order).
        assert a.shape == b.shape
        assert torch.allclose(a, b, rtol=rtol, atol=rtol * math.sqrt(n) * 10 * max(1.0, float(b.abs().amax()) if b.numel() else 1.0))


@needs_triton
@pytest.mark.parametrize("n", [1037, 2048])
def test_padded_row_stride_gives_the_same_bits(n):
    """A basis whose rows start every multiple of 16 elements (a [:, :n] view of a wider,
    NaN-filled buffer, so its loads vectorise) gives the projection the contiguous basis gives;
    the public op takes such a view."""
    target = backend_device("triton")
    basis = orthonormal_rows(6, n, n, torch.float32)
    h = torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
    padded = torch.full((6, -(-n // 16) * 16 + 16), float("nan"), device=target)[:, :n]
    padded.copy_(basis)
    with tritonopt.use_backend("triton"):
        got = [t.cpu() for t in gram_schmidt_project(padded, h.to(target), 5, 2)]
    expected, _ = dense_projection(basis, h, 5)
    # The float32 bound of test_projection_matches_dense_float64.
    assert (got[0].double() - expected).abs().max() <= 2e-5 * max(1.0, float(h.double().norm()))
    if n % 16 == 0:  # both row strides are multiples of 16: the same compiled code, the same bits
        with tritonopt.use_backend("triton"):
            contiguous = gram_schmidt_project(basis.to(target), h.to(target), 5, 2)
        for a, b in zip(got, contiguous):
            assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_cgs2_restores_orthogonality_in_float32(backend):
    # Nearly dependent h: one CGS pass leaves a residual far from orthogonal in fp32.
    n, m = 2000, 8
    basis = orthonormal_rows(m, n, 3, torch.float32)
    h = (basis.double().T @ torch.linspace(1, 2, m, dtype=torch.float64) * 1e4).float()
    h += 1e-3 * torch.randn(n, generator=torch.Generator().manual_seed(4))
    once, _, _ = run_on_backend(backend, gram_schmidt_project, basis, h, m, 1)
    twice, _, _ = run_on_backend(backend, gram_schmidt_project, basis, h, m, 2)
    cos_once = (basis.double() @ once.double()).abs().max() / once.double().norm()
    cos_twice = (basis.double() @ twice.double()).abs().max() / twice.double().norm()
    assert cos_twice < 1e-4
    assert cos_once > 10 * cos_twice


def tiny_mlp_problem():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 30), torch.nn.Tanh(), torch.nn.Linear(30, 10)).double()
    x = torch.randn(64, 10, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (64,), generator=gen)
    params = list(model.parameters())

    def loss_fn():
        return torch.nn.functional.cross_entropy(model(x), y)

    shapes = [p.shape for p in params]

    def flat_loss(w):
        pieces, start = [], 0
        for s in shapes:
            numel = math.prod(s)
            pieces.append(w[start : start + numel].view(s))
            start += numel
        out = torch.func.functional_call(model, dict(zip([n for n, _ in model.named_parameters()], pieces)), (x,))
        return torch.nn.functional.cross_entropy(out, y)

    w0 = torch.cat([p.detach().reshape(-1) for p in params])
    hessian = torch.autograd.functional.hessian(flat_loss, w0, vectorize=True)
    return params, loss_fn, hessian


@pytest.fixture(scope="module")
def mlp():
    return tiny_mlp_problem()


def test_hvp_matches_explicit_hessian(mlp):
    params, loss_fn, hessian = mlp
    hvp = make_hvp(params, loss_fn)
    v = torch.randn(hessian.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # make_hvp returns float32 (the FOSI update's precision).
    assert torch.allclose(hvp(v).double(), hessian @ v, rtol=1e-5, atol=1e-6)


def test_lanczos_ritz_values_match_eigh_of_explicit_hessian(mlp):
    params, loss_fn, hessian = mlp
    n = hessian.shape[0]
    hvp_fp64 = lambda v: hessian @ v  # noqa: E731
    k, l = 10, 3
    with tritonopt.use_backend("reference"):  # 80 iterations: the interpreter is too slow here
        result = lanczos(hvp_fp64, n, 80, dtype=torch.float64, passes=2)
    values, u_sel = select_ritz(result.tridiag, k, l, ritz_rtol=0.0)
    truth = torch.linalg.eigvalsh(hessian)
    expected = torch.cat([truth[:l], truth[-k:]])
    # Clustered spectrum at init: the 13 extreme values converge to ~3e-6 with m = 80
    # (neighbouring eigenvalues are ~1e-3 apart, so this still pins each one).
    assert torch.allclose(values, expected, atol=1e-4 * float(truth.abs().max()))
    # Orthogonality of D and the tridiagonal consistency D H D^T = B.
    d = result.basis
    assert (d @ d.T - torch.eye(d.shape[0], dtype=torch.float64)).abs().max() < 1e-12
    assert (d @ hessian @ d.T - result.tridiag).abs().max() < 1e-10
    # Ritz vectors converge for the top eigenvalues: |cos| with the true eigenvectors ~ 1.
    vecs = ritz_vectors(d, u_sel).double()
    true_vecs = torch.linalg.eigh(hessian).eigenvectors[:, -3:]
    cos = (vecs[-3:] @ true_vecs).abs().diagonal()
    assert bool((cos > 0.999).all())


def test_lanczos_on_a_quadratic_with_known_spectrum():
    n, k, l = 400, 4, 2
    gen = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    spectrum = torch.cat([torch.tensor([-3.0, -2.0]), torch.linspace(0.1, 1.0, n - 6, dtype=torch.float64),
                          torch.tensor([5.0, 6.0, 8.0, 10.0])]).double()
    a = (q * spectrum) @ q.T
    m = default_lanczos_iters(k, l, n)
    assert m == max(4 * (k + l), math.ceil(2 * math.log(n)))
    for dtype, passes, tol in ((torch.float64, 2, 1e-9), (torch.float32, 2, 1e-4)):
        result = lanczos(lambda v: (a @ v.double()).to(v.dtype), n, m, dtype=dtype, passes=passes)
        values, _ = select_ritz(result.tridiag, k, l)
        assert torch.allclose(values, torch.tensor([-3.0, -2.0, 5.0, 6.0, 8.0, 10.0], dtype=torch.float64), atol=tol * 10)
        d = result.basis.double()
        orth = (d @ d.T - torch.eye(m, dtype=torch.float64)).abs().max()
        assert orth < (1e-12 if dtype == torch.float64 else 1e-5)
        assert result.basis.stride(0) % 16 == 0  # n = 400 is padded only if needed; rows start aligned


def test_the_basis_rows_start_aligned_for_any_length():
    for n in (17, 30, 33):
        result = lanczos(lambda v: v * torch.arange(1, n + 1, dtype=v.dtype), n, 6)
        assert result.basis.shape[1] == n and result.basis.stride(0) % 16 == 0 and result.basis.stride(1) == 1


def test_float32_single_pass_loses_orthogonality_that_cgs2_keeps():
    n = 600
    spectrum = torch.logspace(-4, 3, n, dtype=torch.float64)  # wide spectrum: fast Ritz convergence
    hvp = lambda v: (spectrum * v.double()).to(v.dtype)  # noqa: E731
    errors = {}
    for passes in (1, 2):
        with tritonopt.use_backend("reference"):  # an algorithm property; the interpreter is slow at m = 60
            d = lanczos(hvp, n, 60, dtype=torch.float32, passes=passes).basis.double()
        errors[passes] = float((d @ d.T - torch.eye(d.shape[0], dtype=torch.float64)).abs().max())
    assert errors[2] < 1e-5
    assert errors[1] > 3 * errors[2]


def test_breakdown_on_low_rank_operator_stops_without_nan():
    n = 50
    u = torch.randn(n, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    a = u @ u.T  # rank 3: the Krylov space is exhausted after <= 4 vectors
    result = lanczos(lambda v: a @ v, n, 20)
    assert result.breakdown and result.steps <= 4
    assert torch.isfinite(result.basis).all() and torch.isfinite(result.tridiag).all()
    values, _ = select_ritz(result.tridiag, 3, 2)
    assert torch.allclose(values.sort().values, torch.linalg.eigvalsh(a)[-3:], rtol=1e-8)
    # m is clamped to n, and a zero operator breaks down at once.
    zero = lanczos(lambda v: torch.zeros_like(v), 5, 20)
    assert zero.steps == 1 and zero.breakdown
    assert select_ritz(zero.tridiag, 2, 0)[0].numel() == 0


def test_lanczos_is_deterministic_per_seed():
    a = torch.diag(torch.arange(1.0, 41.0, dtype=torch.float64))
    r1 = lanczos(lambda v: a @ v, 40, 10, seed=3)
    r2 = lanczos(lambda v: a @ v, 40, 10, seed=3)
    r3 = lanczos(lambda v: a @ v, 40, 10, seed=4)
    assert torch.equal(r1.tridiag, r2.tridiag) and not torch.equal(r1.tridiag, r3.tridiag)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, m", [(1_000_003, 96), (10_000_000, 40)])
def test_gpu_gram_schmidt_at_real_sizes(dtype, n, m):
    basis = orthonormal_rows(m, 4096, 0, torch.float64).repeat(1, n // 4096 + 1)[:, :n]
    basis = (basis / basis.norm(dim=1, keepdim=True)).to(dtype).cuda().contiguous()
    h = torch.randn(n, dtype=dtype, device="cuda")
    for rows in (1, m // 2, m):
        with tritonopt.use_backend("triton"):
            got = gram_schmidt_project(basis, h, rows, 2)
        with tritonopt.use_backend("reference"):
            ref = gram_schmidt_project(basis, h, rows, 2)
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        assert torch.allclose(got[0], ref[0], atol=tol * float(h.norm()))
        assert torch.allclose(got[1], ref[1], atol=tol * float(h.norm()))
