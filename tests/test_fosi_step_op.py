"""The fused FOSI step op: Triton vs reference, geometric invariants, degenerate cases, bad inputs."""

import pytest
import torch
from conftest import backend_device, run_on_backend, triton_runs_here
from _helpers import BACKENDS
from hypothesis import given
from hypothesis import strategies as st

import tritonopt
from tritonopt.ops import fosi_step


def problem(n, r, seed):
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(n, max(r, 1), generator=gen, dtype=torch.float64))[0].T[:r]
    return dict(
        w=torch.randn(n, generator=gen),
        g=torch.randn(n, generator=gen),
        basis=basis.float().contiguous(),
        scale=(torch.rand(r, generator=gen) + 0.2),
        a=torch.rand(n, generator=gen) * 0.1,
        b=torch.rand(n, generator=gen) * 0.01,
    )


def run(backend, p, base, **kw):
    w, a, b = p["w"].clone(), p["a"].clone(), p["b"].clone()
    run_on_backend(backend, fosi_step, w, p["g"], p["basis"], p["scale"], base=base, state_a=a, state_b=b, **kw)
    return w, a, b


def base_only(p, base, lr, beta1, beta2, eps, step, g):
    """Independent oracle of the base optimizers (float64)."""
    a, b = p["a"].double(), p["b"].double()
    g = g.double()
    if base == "adam":
        a = beta1 * a + (1 - beta1) * g
        b = beta2 * b + (1 - beta2) * g * g
        u = -lr / (1 - beta1**step) * a / (b.sqrt() / (1 - beta2**step) ** 0.5 + eps)
    elif base == "heavy_ball":
        a = beta1 * a + g
        u = -lr * a
    else:
        u = -lr * g
    return u, a, b


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    n=st.integers(1, 1500),
    r=st.integers(0, 9),
    base=st.sampled_from(["adam", "heavy_ball", "sgd"]),
    base_scale=st.sampled_from([1.0, 2.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_step_matches_float64_formula(backend, n, r, base, base_scale, seed):
    r = min(r, n)
    p = problem(n, r, seed)
    hyper = dict(lr=0.05, beta1=0.9, beta2=0.99, eps=1e-8, step=3)
    w, a, b = run(backend, p, base, base_scale=base_scale, **hyper)
    v = p["basis"].double()
    g = p["g"].double()
    c = v @ g
    g2 = g - v.T @ c
    u, a_ref, b_ref = base_only(p, base, g=g2, **hyper)
    expected = p["w"].double() - v.T @ (p["scale"].double() * c) + base_scale * (u - v.T @ (v @ u))
    scale = 1.0 + float(expected.abs().max())
    assert (w.double() - expected).abs().max() <= 2e-5 * scale
    if base != "sgd":
        assert (a.double() - a_ref).abs().max() <= 1e-5
    if base == "adam":
        assert (b.double() - b_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometric_invariants_of_one_step(backend):
    n, r = 900, 6
    p = problem(n, r, 1)
    w, _, _ = run(backend, p, "adam", lr=0.01, step=1)
    v = p["basis"].double()
    g = p["g"].double()
    g1 = v.T @ (v @ g)
    g2 = g - g1
    assert torch.allclose(g1 + g2, g) and (v @ g2).abs().max() < 1e-6
    delta = w.double() - p["w"].double()
    delta1 = v.T @ (v @ delta)  # component in span(V): the Newton step
    delta2 = delta - delta1
    expected_delta1 = -(v.T @ (p["scale"].double() * (v @ g)))
    assert torch.allclose(delta1, expected_delta1, atol=1e-5)
    assert (v @ delta2).abs().max() < 1e-5  # the base step stays out of span(V)
    assert abs(float(delta1 @ delta2)) < 1e-5 * float(delta1.norm() * delta2.norm() + 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("base", ["adam", "heavy_ball", "sgd"])
def test_empty_basis_is_exactly_the_base_step(backend, base):
    p = problem(700, 0, 2)
    hyper = dict(lr=0.05, beta1=0.9, beta2=0.99, eps=1e-8, step=2)
    w, a, b = run(backend, p, base, **hyper)
    # The same float32 formulas in plain torch, written out here.
    g, a_ref, b_ref = p["g"], p["a"].clone(), p["b"].clone()
    if base == "adam":
        a_ref = a_ref * 0.9 + (1 - 0.9) * g
        b_ref = b_ref * 0.99 + (1 - 0.99) * (g * g)
        u = -(0.05 / (1 - 0.9**2)) * (a_ref / (b_ref.sqrt() / (1 - 0.99**2) ** 0.5 + 1e-8))
    elif base == "heavy_ball":
        a_ref = a_ref * 0.9 + g
        u = -0.05 * a_ref
    else:
        u = -0.05 * g
    if backend == "reference":  # same float32 operations in the same order: bitwise
        assert torch.equal(w, p["w"] + u)
        if base != "sgd":
            assert torch.equal(a, a_ref)
    else:
        # On a GPU the kernel contracts a * b + c into one FMA and lowers sqrt and
        # division to approximations within 2 ulp: the kernel's u is at most ten
        # operations of relative error <= 2 eps from exact (20 eps), the float32
        # formula above six roundings of eps / 2 (3 eps), and each side rounds
        # the sum w + u once (eps / 2 of |w| + |u| each).
        eps = torch.finfo(torch.float32).eps
        bound = eps * (24 * u.abs() + p["w"].abs())
        assert bool(((w - (p["w"] + u)).abs() <= bound).all())
        if base != "sgd":  # beta1 * a + c * g: two products and a sum, rounded apart or fused
            assert bool(((a - a_ref).abs() <= 2 * eps * (a_ref.abs() + g.abs())).all())


@pytest.mark.skipif(not triton_runs_here(), reason="Triton cannot run here")
@pytest.mark.parametrize("n", [1037, 2048])
def test_padded_basis_row_stride_gives_the_same_bits(n):
    """A basis whose rows start every multiple of 16 elements (a [:, :n] view of a wider,
    NaN-filled buffer, so its loads vectorise) gives the step the contiguous basis gives;
    the public op takes such a view."""
    target = backend_device("triton")
    p = {k: v.to(target) for k, v in problem(n, 5, 9).items()}
    padded = torch.full((5, -(-n // 16) * 16 + 16), float("nan"), device=target)[:, :n]
    padded.copy_(p["basis"])
    results = []
    for basis in (p["basis"], padded):
        w, a, b = p["w"].clone(), p["a"].clone(), p["b"].clone()
        with tritonopt.use_backend("triton"):
            fosi_step(w, p["g"], basis, p["scale"], base="adam", state_a=a, state_b=b, lr=0.01, step=2)
        results.append((w, a, b))
    # Row alignment may change the compiled layout, hence the order of the sums over
    # the basis: each result lies within test_step_matches_float64_formula's bound
    # (2e-5 * scale) of the float64 step, so within twice that of each other; bitwise
    # where both strides are multiples of 16 (the same compiled code).
    scale = 1.0 + float(results[0][0].abs().max())
    for x, y in zip(*results):
        assert bool(torch.isfinite(y).all())
        assert (x.double() - y.double()).abs().max() <= 4e-5 * scale
        if n % 16 == 0:
            assert torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alpha_zero_gives_no_newton_component(backend):
    p = problem(500, 4, 3)
    p["scale"] = torch.zeros(4)
    w, _, _ = run(backend, p, "sgd", lr=0.1)
    v = p["basis"].double()
    assert (v @ (w.double() - p["w"].double())).abs().max() < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_newton_step_solves_a_quadratic_in_the_subspace(backend):
    # f = 1/2 (w - w*)^T A (w - w*), A of rank r with exact eigenvectors V: one step with
    # alpha = 1 puts w on the minimiser within span(V).
    n, r = 400, 5
    p = problem(n, r, 4)
    v = p["basis"].double()
    lam = torch.tensor([1.0, 2.0, 5.0, 10.0, 50.0], dtype=torch.float64)
    w_star = torch.randn(n, dtype=torch.float64)
    grad = v.T @ (lam * (v @ (p["w"].double() - w_star)))
    w = p["w"].clone()
    a = torch.zeros(n)
    run_on_backend(backend, fosi_step, w, grad.float(), p["basis"], (1 / lam).float(), base="heavy_ball",
                   state_a=a, lr=0.1)
    assert (v @ (w.double() - w_star)).abs().max() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_g1_velocity_is_a_coefficient_space_momentum(backend):
    p = problem(300, 3, 5)
    vel = torch.tensor([1.0, -2.0, 0.5])
    w = p["w"].clone()
    run_on_backend(backend, fosi_step, w, p["g"], p["basis"], p["scale"], base="sgd", lr=0.0,
                   g1_velocity=vel, g1_decay=0.9, g1_gain=0.1)
    c = p["basis"] @ p["g"]
    expected_vel = 0.9 * torch.tensor([1.0, -2.0, 0.5]) + 0.1 * c
    assert torch.allclose(vel, expected_vel, atol=1e-6)
    assert torch.allclose(w, p["w"] - p["basis"].T @ (p["scale"] * expected_vel), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("n, r", [(1_000_003, 24), (20_000_000, 10)])
def test_gpu_triton_matches_reference_at_real_sizes(n, r):
    gen = torch.Generator(device="cuda").manual_seed(0)
    basis = torch.linalg.qr(torch.randn(n, r, device="cuda", generator=gen))[0].T.contiguous()
    g = torch.randn(n, device="cuda", generator=gen)
    out = {}
    for backend in ("triton", "reference"):
        w, a, b = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        with tritonopt.use_backend(backend):
            fosi_step(w, g, basis, torch.ones(r, device="cuda"), base="adam", state_a=a, state_b=b, lr=1e-3)
        out[backend] = (w, a, b)
    for x, y in zip(out["triton"], out["reference"]):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("r", [0, 4])
@pytest.mark.parametrize("base_scale", [1.0, 2.5])
def test_the_prepared_update_an_optimizer_runs_is_the_checked_one_bit_for_bit(r, base_scale):
    """FOSI's step calls the fused op prepared (no argument checks): the same bits as the public call."""
    from tritonopt.optim.functional import FOSIHyper, fosi_update

    p = problem(300, r, seed=5)
    outputs = []
    for prepared in (False, True):
        w, a, b = p["w"].clone(), p["a"].clone(), p["b"].clone()
        velocity = torch.full((r,), 0.3)
        for step in (1, 2):
            fosi_update(w, p["g"] * step, p["basis"], p["scale"], base="adam",
                        segments=[FOSIHyper(stop=300, lr=0.01, weight_decay=0.1)], step=step,
                        first_moment=a, second_moment=b, base_scale=base_scale,
                        g1_velocity=velocity if r else None, g1_decay=0.9, g1_gain=0.1, prepared=prepared)
        outputs.append((w, a, b, velocity))
    for checked, prepared in zip(*outputs):
        assert torch.equal(checked, prepared)
    with pytest.raises(ValueError, match="grad must be 1-D with 300 entries"):  # the public call checks
        fosi_update(p["w"].clone(), p["g"][:-1], p["basis"], p["scale"], base="adam",
                    segments=[FOSIHyper(stop=300, lr=0.01)], step=1, first_moment=p["a"].clone(),
                    second_moment=p["b"].clone())
