"""K-FAC ops: factor update, eigenbasis preconditioning, triangle pack/unpack.

Oracles are float64 dense math written here (a Kronecker-product solve, X^T X),
independent of the kernels and references under test.
"""

import pytest
import torch
from conftest import backend_device, run_on_backend
from _helpers import BACKENDS, needs_triton
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonopt
from tritonopt import ops
from tritonopt.kernels import kfac as kernels

LOW_PRECISION = [torch.float16, torch.bfloat16]


def spd(dim, seed, condition=1e3, dtype=torch.float64):
    """A symmetric positive-definite matrix with eigenvalues spread over ``condition``."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    values = torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), dim, dtype=torch.float64)
    return ((q * values) @ q.T).to(dtype)


def kron_solve(grad, a, g, damping):
    """``(A (x) G + damping I)^-1 vec(grad)`` by a dense float64 solve (column-major vec)."""
    a, g, grad = a.double(), g.double(), grad.double()
    n = a.shape[0] * g.shape[0]
    fisher = torch.kron(a.T.contiguous(), g) + damping * torch.eye(n, dtype=torch.float64)
    vec = grad.T.reshape(-1)
    return torch.linalg.solve(fisher, vec).reshape(a.shape[0], g.shape[0]).T


def eig32(m):
    d, q = torch.linalg.eigh(m.float())
    return q.contiguous(), d.clamp(min=0)


# --------------------------------------------------------------------------- factor update


def direct_factor(old, x, decay, append_bias, scale):
    xs = x.double()
    if append_bias:
        xs = torch.cat([xs, torch.ones(xs.shape[0], 1, dtype=torch.float64)], 1)
    xs = xs * scale
    return decay * old.double() + (1 - decay) * xs.T @ xs / x.shape[0]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12)
@given(
    n=st.integers(1, 40),
    in_dim=st.integers(1, 40),
    append_bias=st.booleans(),
    decay=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    scale=st.sampled_from([1.0, 0.25, 3.0]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    transposed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_factor_update_matches_direct_computation(
    backend, n, in_dim, append_bias, decay, scale, dtype, transposed, seed
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(in_dim, n, generator=gen).T if transposed else torch.randn(n, in_dim, generator=gen)
    x = x.to(dtype)
    dim = in_dim + append_bias
    old = spd(dim, seed, condition=10, dtype=torch.float32)
    factor = old.clone()
    run_on_backend(backend, ops.kfac_factor_update, factor, x, decay, append_bias=append_bias, scale=scale)
    expected = direct_factor(old, x.float(), decay, append_bias, scale)
    # fp32 accumulation over n rows (GPU: tf32x3, any order).
    tol = 1e-5 * (expected.abs().max().item() + 1) * max(1, n) ** 0.5
    assert (factor.double() - expected).abs().max().item() <= tol
    assert torch.equal(factor, factor.T), "symmetric to the last bit"


@needs_triton
@settings(max_examples=10)
@given(n=st.integers(1, 70), in_dim=st.integers(1, 50), append_bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_factor_update_triton_many_tiles(n, in_dim, append_bias, seed):
    """A 16-wide tile forces several triangle tiles (and the pid -> tile mapping) on tiny shapes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_dim, generator=gen)
    dim = in_dim + append_bias
    old = torch.randn(dim, dim, generator=gen)
    old = old + old.T
    ours, ref = old.clone().to(backend_device("triton")), old.clone()
    kernels.kfac_factor_update_triton(ours, x.to(ours.device), 0.7, append_bias, 0.5, block=16)
    ours = ours.cpu()
    kernels.kfac_factor_update_reference(ref, x, 0.7, append_bias, 0.5)
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, ours.T)


@pytest.mark.parametrize("backend", BACKENDS)
def test_factor_update_reads_only_the_upper_triangle(backend):
    x = torch.randn(6, 5)
    upper = torch.triu(torch.randn(5, 5))
    a = upper + torch.triu(upper, 1).T
    b = upper + torch.tril(torch.full((5, 5), 1e30), -1)  # garbage below the diagonal
    run_on_backend(backend, ops.kfac_factor_update, a, x, 0.5)
    run_on_backend(backend, ops.kfac_factor_update, b, x, 0.5)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_factor_update_with_zero_decay_ignores_the_old_factor(backend):
    x = torch.randn(9, 4)
    factor = torch.full((5, 5), float("nan"))
    run_on_backend(backend, ops.kfac_factor_update, factor, x, 0.0, append_bias=True)
    xs = torch.cat([x, torch.ones(9, 1)], 1).double()
    assert torch.allclose(factor.double(), xs.T @ xs / 9, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_factor_update_decay_one_keeps_the_factor(backend):
    old = spd(6, 3, dtype=torch.float32)
    factor = old.clone()
    run_on_backend(backend, ops.kfac_factor_update, factor, torch.randn(4, 6), 1.0)
    assert torch.equal(factor, old)


# --------------------------------------------------------------------------- preconditioning


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prediv", [False, True])
@settings(max_examples=8)
@given(
    g_dim=st.integers(1, 20),
    a_dim=st.integers(1, 20),
    damping=st.sampled_from([1e-3, 3e-2, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_precondition_equals_dense_kronecker_solve(backend, prediv, g_dim, a_dim, damping, seed):
    a_factor = spd(a_dim, seed, condition=1e2)
    g_factor = spd(g_dim, seed + 1, condition=1e2)
    grad = torch.randn(g_dim, a_dim, generator=torch.Generator().manual_seed(seed + 2))
    qa, da = eig32(a_factor)
    qg, dg = eig32(g_factor)
    if prediv:
        inv = run_on_backend(backend, ops.eigen_inv_denominator, dg, da, damping)
        p = run_on_backend(backend, ops.eigenbasis_precondition_prediv, grad, qa, qg, inv)
    else:
        p = run_on_backend(backend, ops.eigenbasis_precondition, grad, qa, da, qg, dg, damping)
    assert p.dtype == torch.float32 and p.shape == grad.shape
    expected = kron_solve(grad, a_factor, g_factor, damping)
    # fp32 eigh + fp32 products: error ~ eps32 * ||grad|| / damping (rotations are orthogonal).
    tol = 2e-5 * grad.abs().max().item() / min(damping, 1.0) * (g_dim + a_dim) ** 0.5
    assert (p.double() - expected).abs().max().item() <= tol
    # The eigen form solves G P A + damping P = grad (paper Eq. 15-17).
    residual = g_factor @ p.double() @ a_factor + damping * p.double() - grad.double()
    assert residual.abs().max().item() <= 1e-4 * grad.abs().max().item() * (g_dim + a_dim) ** 0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_precondition_invariant_to_eigenvector_signs(backend):
    a_factor, g_factor = spd(7, 1), spd(5, 2)
    grad = torch.randn(5, 7)
    qa, da = eig32(a_factor)
    qg, dg = eig32(g_factor)
    flips_a = torch.where(torch.arange(7) % 2 == 0, -1.0, 1.0)
    flips_g = torch.where(torch.arange(5) % 3 == 0, -1.0, 1.0)
    p1 = run_on_backend(backend, ops.eigenbasis_precondition, grad, qa, da, qg, dg, 0.1)
    p2 = run_on_backend(backend, ops.eigenbasis_precondition, grad, (qa * flips_a).contiguous(), da,
                        (qg * flips_g).contiguous(), dg, 0.1)
    assert torch.allclose(p1, p2, atol=1e-5)


def test_undamped_limit_is_the_kronecker_inverse():
    a_factor, g_factor = spd(6, 4, condition=10), spd(4, 5, condition=10)
    grad = torch.randn(4, 6, dtype=torch.float64)
    qa, da = eig32(a_factor)
    qg, dg = eig32(g_factor)
    with tritonopt.use_backend("reference"):
        p = ops.eigenbasis_precondition(grad.float(), qa, da, qg, dg, 1e-7)
    expected = torch.linalg.solve(g_factor, grad) @ torch.linalg.inv(a_factor)  # paper Eq. 11
    assert torch.allclose(p.double(), expected, rtol=1e-3, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("prediv", [False, True])
@pytest.mark.parametrize("shape", [(9, 23), (33, 17), (1, 5)])
def test_precondition_triton_matches_reference_many_tiles(prediv, shape):
    g_dim, a_dim = shape
    a_factor, g_factor = spd(a_dim, 7), spd(g_dim, 8)
    grad = torch.randn(g_dim, a_dim)
    qa, da = eig32(a_factor)
    qg, dg = eig32(g_factor)
    if prediv:
        args = (grad, qa, qg, kernels.eigen_inv_denominator_reference(dg, da, 0.05))
        triton = kernels.eigenbasis_precondition_prediv_triton
        reference = kernels.eigenbasis_precondition_prediv_reference
    else:
        args = (grad, qa, da, qg, dg, 0.05)
        triton, reference = kernels.eigenbasis_precondition_triton, kernels.eigenbasis_precondition_reference
    target = backend_device("triton")
    ours = triton(*[a.to(target) if isinstance(a, torch.Tensor) else a for a in args], block=16).cpu()
    ref = reference(*args)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_precondition_low_precision_inputs_upcast(backend, dtype):
    a_factor, g_factor = spd(8, 11, condition=10), spd(6, 12, condition=10)
    grad = torch.randn(6, 8)
    qa, da = eig32(a_factor)
    qg, dg = eig32(g_factor)
    p = run_on_backend(backend, ops.eigenbasis_precondition, grad.to(dtype), qa.to(dtype), da, qg.to(dtype), dg, 0.1)
    expected = kron_solve(grad, a_factor, g_factor, 0.1)
    # Half-precision eigenvectors: about 1e-2 relative.
    assert (p.double() - expected).norm() <= 3e-2 * expected.norm()


def _round_to_tf32(t):
    """Round-to-nearest to a 10-bit mantissa, as TF32 tensor cores see their inputs."""
    bits = t.float().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def test_plain_tf32_would_break_the_tolerance_tf32x3_keeps():
    """Why the kernels default to tf32x3: TF32-rounded operands miss the fp32 tolerance."""
    damping = 1e-3
    a_factor, g_factor = spd(32, 21, condition=1e3), spd(24, 22, condition=1e3)
    grad = torch.randn(24, 32, generator=torch.Generator().manual_seed(3))
    qa, da = eig32(a_factor)
    qg, dg = eig32(g_factor)
    expected = kron_solve(grad, a_factor, g_factor, damping)
    tol = 2e-5 * grad.abs().max().item() / damping * (24 + 32) ** 0.5
    fp32 = kernels.eigenbasis_precondition_reference(grad, qa, da, qg, dg, damping)
    assert (fp32.double() - expected).abs().max().item() <= tol
    tf32 = kernels.eigenbasis_precondition_reference(
        _round_to_tf32(grad), _round_to_tf32(qa), da, _round_to_tf32(qg), dg, damping
    )
    assert (tf32.double() - expected).abs().max().item() > tol


# --------------------------------------------------------------------------- pack / unpack


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=10)
@given(dim=st.integers(0, 70), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(backend, dim, dtype, seed):
    m = torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    m = torch.triu(m) + torch.triu(m, 1).T
    packed = run_on_backend(backend, ops.triu_pack, m)
    back = run_on_backend(backend, ops.triu_unpack, packed, dim)
    assert packed.shape == (dim * (dim + 1) // 2,) and packed.dtype == dtype
    assert torch.equal(back, m)
    rows, cols = torch.triu_indices(dim, dim)
    assert torch.equal(packed, m[rows, cols])


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_casts_and_scales(backend):
    m = torch.randn(13, 13)
    # A non-contiguous input (moving it to a GPU keeps its strides).
    packed = run_on_backend(backend, ops.triu_pack, m.T, torch.float16, scale=0.5)
    back = run_on_backend(backend, ops.triu_unpack, packed, 13, torch.float32, scale=4.0)
    rows, cols = torch.triu_indices(13, 13)
    assert packed.dtype == torch.float16
    assert torch.allclose(packed.float(), (m.T * 0.5)[rows, cols], rtol=1e-3)
    upper = (m.T * 2.0)[rows, cols]
    assert torch.allclose(back[rows, cols], upper, rtol=1e-3) and torch.equal(back, back.T)


@needs_triton
def test_pack_triton_matches_reference_bitwise():
    # One rounded product and one cast per entry: the same bits on a GPU.
    m = torch.randn(45, 45)
    target = backend_device("triton")
    for dtype in (torch.float32, torch.float16):
        ours = kernels.triu_pack_triton(m.to(target), dtype, 0.3).cpu()
        ref = kernels.triu_pack_reference(m, dtype, 0.3)
        assert torch.equal(ours, ref)
        assert torch.equal(kernels.triu_unpack_triton(ours.to(target), 45, torch.float32, 2.0).cpu(),
                           kernels.triu_unpack_reference(ours, 45, torch.float32, 2.0))


# --------------------------------------------------------------------------- registration


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 257), (1024, 2049), (4096, 1025)])
def test_gpu_precondition_real_sizes_fp32_accuracy(shape):
    g_dim, a_dim = shape
    dev = torch.device("cuda")
    a_factor, g_factor = spd(a_dim, 1).to(dev), spd(g_dim, 2).to(dev)
    grad = torch.randn(g_dim, a_dim, device=dev)
    qa, da = eig32(a_factor)
    qg, dg = eig32(g_factor)
    with tritonopt.use_backend("triton"):  # on CUDA the op runs cuBLAS unless the kernel is forced
        p = ops.eigenbasis_precondition(grad, qa, da, qg, dg, 3e-3)
    qa64, qg64 = qa.double(), qg.double()
    expected = qg64 @ ((qg64.T @ grad.double() @ qa64) / (torch.outer(dg.double(), da.double()) + 3e-3)) @ qa64.T
    assert (p.double() - expected).norm() <= 1e-4 * expected.norm()


@pytest.mark.gpu
@pytest.mark.parametrize("n,in_dim", [(4096, 1024), (25088, 4607)])
def test_gpu_factor_update_real_sizes(n, in_dim):
    dev = torch.device("cuda")
    x = torch.randn(n, in_dim, device=dev, dtype=torch.bfloat16)
    factor = torch.eye(in_dim + 1, device=dev)
    with tritonopt.use_backend("triton"):  # on CUDA the op runs cuBLAS unless the kernel is forced
        ops.kfac_factor_update(factor, x, 0.95, append_bias=True)
    xs = torch.cat([x.double(), torch.ones(n, 1, device=dev, dtype=torch.float64)], 1)
    expected = 0.95 * torch.eye(in_dim + 1, device=dev, dtype=torch.float64) + 0.05 * xs.T @ xs / n
    assert torch.equal(factor, factor.T)
    assert (factor.double() - expected).abs().max() <= 1e-4 * expected.abs().max()
