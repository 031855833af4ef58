"""K-FAC's precision options against float64 oracles: loss scaling, factor and eigen storage dtypes,
the inverse method, training under torch.autocast (in one process and on two gloo ranks), and the
functional pieces."""

import math

import pytest
import torch
import torch.distributed as dist
from _distributed import run_on_ranks
from conftest import backend_device, triton_runs_here
from torch import nn

import tritonopt
from tritonopt.dist.kaisa import KAISAPreconditioner
from tritonopt.optim import functional as F
from tritonopt.optim import kfac_functional
from tritonopt.optim.kfac import KFACPreconditioner

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
STEPS, DECAY, DAMPING = 3, 0.8, 0.05


@pytest.fixture(autouse=True)
def reference_backend():
    with tritonopt.use_backend("reference"):
        yield


def make_layer_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4))


def make_batches():
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 6, generator=gen) * torch.linspace(0.2, 2.0, 6) for _ in range(STEPS)]
    ys = [torch.randint(0, 4, (16,), generator=gen) for _ in range(STEPS)]
    return xs, ys


def run_kfac(**kwargs):
    """``STEPS`` K-FAC steps on one Linear layer (no optimizer step).

    Returns the preconditioner, the last raw gradient, and per step the float64
    factors and the elementwise bound ``|X|^T |X| / n`` of each statistic's terms.
    """
    model = make_layer_model()
    kfac = KFACPreconditioner(model, factor_decay=DECAY, damping=DAMPING, kl_clip=None, **kwargs)
    seen = {}

    def record(module, inputs, output):
        seen["x"] = inputs[0].detach().double()
        output.register_hook(lambda grad: seen.__setitem__("g", grad.detach().double()))

    model[0].register_forward_hook(record)
    a = torch.eye(7, dtype=torch.float64)
    g = torch.eye(4, dtype=torch.float64)
    history = []
    xs, ys = make_batches()
    for x, y in zip(xs, ys):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        raw = kfac.layers[0].grad_matrix().double()
        kfac.step()
        xa = torch.cat([seen["x"], torch.ones(len(x), 1, dtype=torch.float64)], 1)
        a = DECAY * a + (1 - DECAY) * xa.T @ xa / len(x)
        g = DECAY * g + (1 - DECAY) * seen["g"].T @ seen["g"] / len(x)
        terms = (xa.abs().T @ xa.abs() / len(x), seen["g"].abs().T @ seen["g"].abs() / len(x))
        history.append(((a, g), terms))
    return kfac, raw, history


def stored_factor_bound(history, which, u):
    """Elementwise bound of ``|stored factor - float64 factor|`` after the last step.

    Each update rounds once to the storage dtype (``u``) and adds float32 error:
    the statistic's sum of ``n`` products (``n u32 |X|^T|X| / n``) and the fold
    (``2 u32``); errors of earlier steps decay with the factor.
    """
    u32, rows = UNIT_ROUNDOFF[torch.float32], 16
    total = 0
    for k in range(len(history)):
        (factors, terms) = history[-1 - k]
        step_error = (u + 2 * u32) * factors[which].abs() + (1 - DECAY) * rows * u32 * terms[which]
        total = total + DECAY**k * step_error
    return total


def norm2(m):
    return torch.linalg.matrix_norm(m, ord=2).item()


def eigen_method_bound(history, raw, p64, u_factor, u_eigen):
    """``||P - P64||_F`` bound for the eigen method (prediv), from the math (see the README).

    Factors perturbed by E (storage and float32, :func:`stored_factor_bound`, and
    eigh's backward error ``n u32 ||F||``): ``||dP|| <= ||dK|| ||P|| / damping`` with
    ``K = A (x) G + damping I`` and ``||dK|| <= (||A|| + 2 e_A) 2 e_G + 2 e_A ||G||``
    (clamping at most doubles E). Eigen data rounded by ``u`` (storage, and the
    float32 products ``n u32``): the rotations are off by ``u sqrt(n)`` each and D
    by ``u`` relative: ``||dP|| <= (e_a + e_g)(||P|| + max(D) ||grad||) + u ||P||``
    (first order; doubled for the second-order terms).
    """
    (a, g), _ = history[-1]
    n = max(a.shape[0], g.shape[0])
    u32n = n * UNIT_ROUNDOFF[torch.float32]
    e_a = stored_factor_bound(history, 0, u_factor).norm().item() + u32n * a.norm().item()
    e_g = stored_factor_bound(history, 1, u_factor).norm().item() + u32n * g.norm().item()
    dk = (norm2(a) + 2 * e_a) * 2 * e_g + 2 * e_a * norm2(g)
    factor_term = dk * p64.norm().item() / DAMPING
    eigen_term = 0.0
    for u in (u_eigen, u32n):
        rotations = u * (math.sqrt(a.shape[0]) + math.sqrt(g.shape[0]))
        eigen_term += 2 * (rotations * (p64.norm().item() + raw.norm().item() / DAMPING) + u * p64.norm().item())
    return factor_term + eigen_term


def kron_solve(grad, a, g, damping):
    n = a.shape[0] * g.shape[0]
    fisher = torch.kron(a.T.contiguous(), g) + damping * torch.eye(n, dtype=torch.float64)
    return torch.linalg.solve(fisher, grad.T.reshape(-1)).reshape(a.shape[0], g.shape[0]).T


# --------------------------------------------------------------------------- storage dtypes


@pytest.mark.parametrize("factor_dtype,inv_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16),
])
def test_storage_dtypes_stay_within_their_bound_of_float64(factor_dtype, inv_dtype):
    kfac, raw, history = run_kfac(factor_dtype=factor_dtype, inv_dtype=inv_dtype)
    layer = kfac.layers[0]
    assert layer.a_factor.dtype == factor_dtype and layer.g_factor.dtype == factor_dtype
    assert all(t.dtype == inv_dtype for t in layer.eigen.values())
    (a64, g64), _ = history[-1]
    # The stored factors: one rounding per update, within a tight elementwise bound.
    for which, stored in ((0, layer.a_factor), (1, layer.g_factor)):
        deviation = (stored.double() - history[-1][0][which]).abs()
        assert (deviation <= stored_factor_bound(history, which, UNIT_ROUNDOFF[factor_dtype])).all()
    # The eigen data as stored give the preconditioned gradient up to float32 products.
    e = {k: v.double() for k, v in layer.eigen.items()}
    from_stored = e["qg"] @ ((e["qg"].T @ raw @ e["qa"]) * e["inv_denominator"]) @ e["qa"].T
    u32n = 7 * UNIT_ROUNDOFF[torch.float32]
    magnitudes = e["qg"].abs() @ ((e["qg"].abs().T @ raw.abs() @ e["qa"].abs()) * e["inv_denominator"].abs()) @ e["qa"].abs().T
    assert ((layer.grad_matrix().double() - from_stored).abs() <= 4 * u32n * magnitudes).all()
    # End to end against float64 K-FAC, within the a-priori bound the README states.
    p64 = kron_solve(raw, a64, g64, DAMPING)
    error = (layer.grad_matrix().double() - p64).norm().item()
    bound = eigen_method_bound(history, raw, p64, UNIT_ROUNDOFF[factor_dtype], UNIT_ROUNDOFF[inv_dtype])
    # Reported with `pytest -s` (the README quotes these relative figures).
    print(f"\nfactor_dtype={factor_dtype} inv_dtype={inv_dtype}: ||P - P64|| / ||P64|| = "
          f"{error / p64.norm().item():.2e}, bound {bound / p64.norm().item():.2e}")
    assert error <= bound, (error, bound)


def test_narrow_storage_halves_the_memory():
    wide = run_kfac()[0].memory_usage()
    narrow = run_kfac(factor_dtype=torch.bfloat16, inv_dtype=torch.float16)[0].memory_usage()
    assert narrow["factors"] * 2 == wide["factors"] and narrow["eigen"] * 2 == wide["eigen"]
    assert narrow["batch"] == wide["batch"], "statistics accumulate in float32"


# --------------------------------------------------------------------------- inverse method


def test_inverse_method_solves_the_damped_factors_against_float64():
    kfac, raw, history = run_kfac(compute_method="inverse")
    layer = kfac.layers[0]
    assert set(layer.eigen) == {"a_inv", "g_inv"}
    (a64, g64), _ = history[-1]
    eye_a, eye_g = torch.eye(7, dtype=torch.float64), torch.eye(4, dtype=torch.float64)
    a_inv, g_inv = torch.linalg.inv(a64 + DAMPING * eye_a), torch.linalg.inv(g64 + DAMPING * eye_g)
    p64 = g_inv @ raw @ a_inv
    # Paper Eq. 14: (G + damping I) P (A + damping I) = grad.
    assert torch.allclose((g64 + DAMPING * eye_g) @ p64 @ (a64 + DAMPING * eye_a), raw, atol=1e-12)
    # fp32 inverses: backward error n u32 ||F + damping I|| each, amplified by the condition numbers.
    u32n = 7 * UNIT_ROUNDOFF[torch.float32]
    cond = norm2(a64 + DAMPING * eye_a) * norm2(a_inv) + norm2(g64 + DAMPING * eye_g) * norm2(g_inv)
    error = (layer.grad_matrix().double() - p64).norm().item()
    assert error <= 2 * u32n * cond * p64.norm().item()
    # It is a different damping from the eigen method's (paper Eq. 12 is not an identity).
    eigen_p = kron_solve(raw, a64, g64, DAMPING)
    assert (eigen_p - p64).norm() > 100 * error


def test_inverse_falls_back_to_the_eigendecomposition_when_cholesky_fails():
    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    indefinite = (q * torch.tensor([-1.0, 2.0, 3.0], dtype=torch.float64)) @ q.T  # not PD even with damping
    (inverse,) = F.kfac_inverses([indefinite.float()], 0.1)
    expected = (q / torch.tensor([0.1, 2.1, 3.1], dtype=torch.float64)) @ q.T  # eigenvalues clamped at 0
    assert torch.allclose(inverse.double(), expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- loss scaling


def amp_run(scaled: bool, grad_scaler_argument: bool):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=scaled)
    kfac = KFACPreconditioner(model, damping=0.01, grad_scaler=scaler if grad_scaler_argument else None)
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):
        x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        scaler.unscale_(opt)
        assert kfac.step()
        scaler.step(opt)
        scaler.update()
    return model, kfac


def test_grad_scaler_unscales_the_g_factors():
    plain_model, plain = amp_run(scaled=False, grad_scaler_argument=False)
    scaled_model, scaled = amp_run(scaled=True, grad_scaler_argument=True)
    # The loss scale is a power of two: unscaling is exact, the runs are the same bits.
    for p, q in zip(plain_model.parameters(), scaled_model.parameters()):
        assert torch.equal(p, q)
    for l1, l2 in zip(plain.layers, scaled.layers):
        assert torch.equal(l1.g_factor, l2.g_factor)
    with pytest.warns(RuntimeWarning, match="grad_scaler="):
        _, unaware = amp_run(scaled=True, grad_scaler_argument=False)
    ratio = unaware.layers[1].g_factor.trace() / plain.layers[1].g_factor.trace()
    assert ratio > 1e3, "without grad_scaler, G holds the squared loss scale"


def test_grad_scaler_may_be_a_function_and_is_checked():
    model = nn.Sequential(nn.Linear(3, 2))
    kfac = KFACPreconditioner(model, grad_scaler=lambda: 4.0)
    (model(torch.randn(5, 3)).sum() * 4).backward()
    kfac.step()
    with pytest.raises(TypeError, match="grad_scaler"):
        KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)), grad_scaler=2.0)
    bad = KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)), grad_scaler=lambda: 0.0)
    bad.model(torch.randn(5, 3)).sum().backward()  # the hook records it
    with pytest.raises(ValueError, match="scale is 0.0"):
        bad.step()


# --------------------------------------------------------------------------- autocast

PRECONDITIONERS = {"KFAC": KFACPreconditioner, "KAISA": KAISAPreconditioner}
AUTOCAST_STEPS = 4
# Relative Frobenius distance allowed between the first statistic under autocast and the float32
# run's. The forward rounds each activation and weight to half precision (bfloat16 u = 2^-8) and
# the backward each output gradient; a statistic entry sums products of two such values, so it is
# off by about u relative (3.2e-3 measured for bfloat16, 4.2e-4 for float16). 2^-6 is four
# bfloat16 units; a statistic holding the squared loss scale, or garbage, is far outside it. That
# the products themselves stay float32 is checked bit for bit (the first layer, and the ops).
AUTOCAST_FACTOR_TOLERANCE = 2.0**-6


def make_conv_model():
    torch.manual_seed(2)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def autocast_run(preconditioner, dtype=None, *, scaled=False, backend="reference", device=torch.device("cpu")):
    """``AUTOCAST_STEPS`` steps of the README's loop over SGD on one batch on ``device``, the forward
    under ``torch.autocast(device.type, dtype)`` (none when ``dtype`` is None), with a ``GradScaler``
    passed as ``grad_scaler=`` when ``scaled``. Returns the model, the preconditioner, the losses and
    the factors after the first step."""
    model = make_conv_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, enabled=scaled)
    kfac = PRECONDITIONERS[preconditioner](model, damping=0.03, inv_update_steps=2, lr=0.1,
                                           grad_scaler=scaler if scaled else None)
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(16, 2, 6, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    x, y = x.to(device), y.to(device)
    losses, first = [], None
    with tritonopt.use_backend(backend):
        for step in range(AUTOCAST_STEPS):
            opt.zero_grad()
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(model(x), y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            assert kfac.step()
            scaler.step(opt)
            scaler.update()
            if step == 0:
                first = [(l.a_factor.clone(), l.g_factor.clone()) for l in kfac.layers]
    return model, kfac, losses, first


def relative_distance(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def first_statistic(factor, decay=0.95):
    """This step's ``X^T X / n`` from the factor after the first update, ``decay I + (1 - decay) S``."""
    return (factor.double() - decay * torch.eye(factor.shape[0], dtype=torch.float64)) / (1 - decay)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("preconditioner", list(PRECONDITIONERS))
def test_kfac_and_kaisa_train_under_autocast_with_float32_factors(preconditioner, dtype, scaled):
    model, kfac, losses, first = autocast_run(preconditioner, dtype, scaled=scaled)
    _, _, _, float32_first = autocast_run(preconditioner)
    assert losses[-1] < losses[0]
    assert all(p.isfinite().all() for p in model.parameters())
    for layer in kfac.layers:
        assert layer.a_factor.dtype == layer.g_factor.dtype == torch.float32
        assert layer.a_factor.isfinite().all() and layer.g_factor.isfinite().all()
    # The first layer sees the float32 input: its A is the float32 run's, bit for bit.
    assert torch.equal(first[0][0], float32_first[0][0])
    for factor, float32_factor in zip(sum(first, ()), sum(float32_first, ())):
        assert relative_distance(first_statistic(factor), first_statistic(float32_factor)) <= AUTOCAST_FACTOR_TOLERANCE


def test_a_power_of_two_loss_scale_changes_nothing_under_bfloat16_autocast():
    # bfloat16 has float32's exponent range: scaling by 2^16 and unscaling are exact.
    plain_model, plain, _, _ = autocast_run("KFAC", torch.bfloat16)
    scaled_model, scaled, _, _ = autocast_run("KFAC", torch.bfloat16, scaled=True)
    for p, q in zip(plain_model.parameters(), scaled_model.parameters()):
        assert torch.equal(p, q)
    for l1, l2 in zip(plain.layers, scaled.layers):
        assert torch.equal(l1.g_factor, l2.g_factor)


@pytest.mark.skipif(not triton_runs_here(), reason="Triton cannot run here")
def test_the_triton_backend_gives_the_reference_factors_under_autocast():
    device = backend_device("triton")  # both runs there: the same autocast forward, only the ops differ
    _, reference, _, _ = autocast_run("KFAC", torch.bfloat16, device=device)
    _, triton, _, _ = autocast_run("KFAC", torch.bfloat16, backend="triton", device=device)
    for l1, l2 in zip(reference.layers, triton.layers):
        assert torch.allclose(l1.a_factor, l2.a_factor, rtol=1e-4, atol=1e-6)
        assert torch.allclose(l1.g_factor, l2.g_factor, rtol=1e-4, atol=1e-6)


def test_the_reference_ops_compute_in_float32_under_autocast():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, 5, generator=gen)
    q = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=torch.float64))[0].float()
    qa, qg, grad = q, q[:4, :4].contiguous(), torch.randn(4, 6, generator=gen)
    da, dg = torch.rand(6, generator=gen), torch.rand(4, generator=gen)
    expected_factor = torch.zeros(6, 6)
    tritonopt.ops.kfac_factor_update(expected_factor, x, 0.0, append_bias=True)
    expected_p = tritonopt.ops.eigenbasis_precondition(grad, qa, da, qg, dg, 0.1)
    expected_inverse = F.kfac_precondition(grad, {"a_inv": qa, "g_inv": qg}, damping=0.1)
    q4 = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=torch.float64))[0]
    indefinite = ((q4 * torch.tensor([-2.0, 1.0, 2.0, 3.0], dtype=torch.float64)) @ q4.T).float()
    assert torch.linalg.cholesky_ex(indefinite + 0.1 * torch.eye(4)).info != 0  # the eigen fallback runs
    (expected_fallback,) = F.kfac_inverses([indefinite], 0.1)
    for dtype in (torch.bfloat16, torch.float16):
        factor = torch.zeros(6, 6)
        with torch.autocast("cpu", dtype=dtype):
            tritonopt.ops.kfac_factor_update(factor, x, 0.0, append_bias=True)
            p = tritonopt.ops.eigenbasis_precondition(grad, qa, da, qg, dg, 0.1)
            inverse = F.kfac_precondition(grad, {"a_inv": qa, "g_inv": qg}, damping=0.1)
            (fallback,) = F.kfac_inverses([indefinite], 0.1)
        assert torch.equal(factor, expected_factor)
        assert p.dtype == torch.float32 and torch.equal(p, expected_p)
        assert inverse.dtype == torch.float32 and torch.equal(inverse, expected_inverse)
        assert fallback.dtype == torch.float32 and torch.equal(fallback, expected_fallback)


KAISA_WORLD = 2


def kaisa_autocast_on_ranks(rank, world_size):
    """Each rank trains on its half of the batch under bfloat16 autocast, and under float16 autocast
    with a GradScaler, averaging the gradients as DDP does."""
    out = {}
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(16, 2, 6, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    shard = slice(rank * 8, rank * 8 + 8)
    with tritonopt.use_backend("reference"):
        for name, dtype, scaled in (("bf16", torch.bfloat16, False), ("fp16_scaler", torch.float16, True)):
            model = make_conv_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            scaler = torch.amp.GradScaler("cpu", enabled=scaled)
            kaisa = KAISAPreconditioner(model, grad_worker_fraction=0.5, damping=0.03, inv_update_steps=2,
                                        lr=0.1, g_batch_scale=True, grad_scaler=scaler if scaled else None)
            losses, accepted = [], []
            for _ in range(AUTOCAST_STEPS):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=dtype):
                    loss = nn.functional.cross_entropy(model(x[shard]), y[shard])
                losses.append(loss.item())
                scaler.scale(loss).backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
                scaler.unscale_(opt)
                accepted.append(kaisa.step())
                scaler.step(opt)
                scaler.update()
            out[name] = {
                "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "losses": losses, "accepted": accepted,
                "factor_dtypes": {str(t.dtype) for l in kaisa.layers for t in (l.a_factor, l.g_factor)},
                "factors_finite": all(bool(t.isfinite().all()) for l in kaisa.layers
                                      for t in (l.a_factor, l.g_factor)),
            }
    return out


@pytest.fixture(scope="module")
def kaisa_autocast_results():
    return run_on_ranks(KAISA_WORLD, kaisa_autocast_on_ranks, timeout=300)


@pytest.mark.parametrize("name", ["bf16", "fp16_scaler"])
def test_kaisa_trains_under_autocast_on_two_ranks(kaisa_autocast_results, name):
    runs = [result[name] for result in kaisa_autocast_results]
    for run in runs:
        assert run["accepted"] == [True] * AUTOCAST_STEPS
        assert run["factor_dtypes"] == {"torch.float32"} and run["factors_finite"]
        assert run["params"].isfinite().all()
    assert torch.equal(runs[0]["params"], runs[1]["params"])
    assert sum(run["losses"][-1] for run in runs) < sum(run["losses"][0] for run in runs)


# --------------------------------------------------------------------------- functional pieces


def test_kl_clip_scale_matches_float64_and_survives_products_beyond_float32():
    gen = torch.Generator().manual_seed(5)
    ps = [torch.randn(3, 4, generator=gen) * 1e30, torch.randn(2, 2, generator=gen)]
    gs = [torch.randn(3, 4, generator=gen) * 1e20, torch.randn(2, 2, generator=gen)]
    inners = F.kfac_inner_products(ps, gs)
    expected = [(p.double() * g.double()).sum().item() for p, g in zip(ps, gs)]
    assert inners.dtype == torch.float64 and inners.tolist() == pytest.approx(expected, rel=1e-12)
    nu = F.kfac_kl_clip_scale(inners, lr=0.5, kl_clip=1e-3)
    assert nu.dtype == torch.float64
    assert nu.item() == pytest.approx(math.sqrt(1e-3 / abs(sum(expected))) / 0.5, rel=1e-12)
    zero = F.kfac_inner_products([torch.zeros(2, 2)], [torch.zeros(2, 2)])
    assert F.kfac_kl_clip_scale(zero, lr=0.5, kl_clip=1e-3).item() == 1.0
    assert F.kfac_kl_clip_scale(inners, lr=0.0, kl_clip=1e-3).item() == 1.0
    assert F.kfac_kl_clip_scale(inners, lr=0.5, kl_clip=None) is None
    # An inner product is finite exactly when its layer's P and gradient are.
    nan = torch.tensor([[float("nan")]])
    assert F.kfac_inner_products([nan, torch.ones(1, 1)], [torch.ones(1, 1)] * 2).isfinite().tolist() == [False, True]


def test_kl_clip_scale_on_the_host_is_the_device_one_within_its_last_bits():
    # The optimizer reads the inner products' sum in its one host sync and computes nu there.
    # torch's CPU sqrt may miss the correctly rounded root by one unit in the last place, which
    # the division by lr can carry into a second; with each side's own rounding: 3 units at most.
    gen = torch.Generator().manual_seed(11)
    sums = torch.cat([torch.randn(400, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -40, 40, (400,), generator=gen), torch.tensor([0.0, -0.0, 1e-300, -1e300])])
    for lr, kl_clip in ((0.1, 1e-3), (3.0, 1e-6), (1e-4, 10.0)):
        for s in sums.tolist():
            device = F.kfac_kl_clip_scale(torch.tensor([s], dtype=torch.float64), lr=lr, kl_clip=kl_clip).item()
            host = F.kl_clip_scale_of_sum(s, lr=lr, kl_clip=kl_clip)
            assert abs(host - device) <= 3 * math.ulp(device), (s, lr, kl_clip, host, device)
    assert F.kl_clip_scale_of_sum(0.0, lr=0.5, kl_clip=1e-3) == 1.0
    assert F.kl_clip_scale_of_sum(5.0, lr=0.0, kl_clip=1e-3) == 1.0
    assert F.kl_clip_scale_of_sum(5.0, lr=0.5, kl_clip=None) is None
    assert F.kl_clip_scale_of_sum(-4.0, lr=0.5, kl_clip=1.0) == 1.0  # sqrt(1/4)/0.5 = 1, clamped at 1


def test_an_unclipped_step_writes_the_preconditioned_gradient_bit_for_bit():
    # nu = 1: the gradients are P itself, not P rounded through float64.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    kfac = KFACPreconditioner(model, kl_clip=1e30, damping=0.1)
    torch.nn.functional.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
    grads = {i: layer.grad_matrix() for i, layer in enumerate(kfac.layers)}
    assert kfac.step()
    assert kfac.last_kl_scale.item() == 1.0
    for i, layer in enumerate(kfac.layers):
        expected = F.kfac_precondition(grads[i], layer.eigen, damping=0.1)
        assert torch.equal(layer.grad_matrix(), expected)


def test_running_average_leaves_the_old_factor_alone():
    old = torch.eye(3) * 2
    stat = torch.full((3, 3), 4.0)
    new = F.kfac_running_average(old, stat, 0.75, out=stat)
    assert new is stat and torch.equal(old, torch.eye(3) * 2)
    assert torch.equal(new, 0.75 * torch.eye(3) * 2 + 0.25 * torch.full((3, 3), 4.0))
    first = F.kfac_running_average(None, torch.zeros(2, 2), 0.5)
    assert torch.equal(first, 0.5 * torch.eye(2))


def test_batched_running_averages_equal_the_single_ones_bit_for_bit():
    gen = torch.Generator().manual_seed(5)
    padded = kfac_functional.factor_buffer(130)
    padded.copy_(torch.rand(130, 130, generator=gen))
    factors = [None, torch.rand(3, 3, generator=gen).to(torch.bfloat16), padded]
    statistics = [torch.rand(d, d, generator=gen) for d in (2, 3, 130)]
    originals = [None if f is None else f.clone() for f in factors]
    expected = [F.kfac_running_average(f, s.clone(), 0.93) for f, s in zip(factors, statistics)]
    scratch = [s.clone() for s in statistics]
    got = F.kfac_running_averages(factors, scratch, 0.93, out=scratch)
    assert all(g is s for g, s in zip(got, scratch))
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert all(f is None or torch.equal(f, o) for f, o in zip(factors, originals))  # the old factors untouched
    with pytest.raises(ValueError, match="out has 1 tensors for 3 statistics"):
        F.kfac_running_averages(factors, statistics, 0.5, out=statistics[:1])
    with pytest.raises(ValueError, match="got 2 factors for 3 statistics"):
        F.kfac_running_averages(factors[:2], statistics, 0.5)


def test_the_float32_probes_clear_finite_tensors_and_leave_overflow_to_the_exact_ones():
    finite = [torch.eye(3), 2 * torch.eye(2)]
    probe = kfac_functional.statistics_finiteness_probe(finite)
    assert probe.dtype == torch.float64 and probe.item() == 7.0
    poisoned = [torch.eye(3), torch.tensor([[1.0, 0.0], [0.0, float("nan")]])]
    assert not kfac_functional.statistics_finiteness_probe(poisoned).isfinite()
    parts = [torch.arange(6.0).reshape(2, 3), torch.tensor([[7.0]]).to(torch.bfloat16)]
    probe = kfac_functional.float32_finiteness_probe(parts)
    assert probe.dtype == torch.float64 and probe.item() == 22.0
    assert not kfac_functional.float32_finiteness_probe([torch.ones(2), torch.tensor([float("inf")])]).isfinite()
    # Finite entries whose float32 sum overflows: the probe says "ask", all_finite answers.
    huge = torch.full((4,), torch.finfo(torch.float32).max)
    assert not kfac_functional.float32_finiteness_probe([huge]).isfinite()
    assert F.all_finite([huge]) == [True]


def test_float32_inner_products_are_the_float64_ones_rounded_and_flag_overflow():
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(5, 7, generator=gen), torch.randn(3, 2, generator=gen)]
    gs = [torch.randn(5, 7, generator=gen), torch.randn(3, 2, generator=gen)]
    fast = F.kfac_inner_products_float32(ps, gs)
    exact = F.kfac_inner_products(ps, gs)
    assert fast.dtype == torch.float32 and fast.shape == (2,)
    # A float32 dot of n terms is within n u sum |p g| of the exact one.
    bounds = [35 * 2.0**-24 * (p.double() * g.double()).abs().sum().item() for p, g in zip(ps, gs)]
    assert all(abs(f - e) <= b for f, e, b in zip(fast.tolist(), exact.tolist(), bounds))
    # Finite but too large for float32's products: not finite here, finite in float64.
    big_p, big_g = [ps[0] * 1e30], [gs[0] * 1e20]
    assert not F.kfac_inner_products_float32(big_p, big_g).isfinite().any()
    assert F.kfac_inner_products(big_p, big_g).isfinite().all()
    nan = torch.tensor([[float("nan")]])
    assert F.kfac_inner_products_float32([nan, torch.ones(1, 1)], [torch.ones(1, 1)] * 2).isfinite().tolist() == [
        False, True]
    for inner_products in (F.kfac_inner_products_float32, F.kfac_inner_products):
        with pytest.raises(ValueError, match="got 1 preconditioned gradients for 2 gradients"):
            inner_products(ps[:1], gs)
        with pytest.raises(ValueError, match="at least one layer"):
            inner_products([], [])
        with pytest.raises(ValueError, match=r"layer 1: P is \(3, 2\) but grad is \(2, 3\)"):
            inner_products(ps, [gs[0], gs[1].T])
    with pytest.raises(TypeError, match="layer 0: P and grad must be float32, got torch.bfloat16"):
        F.kfac_inner_products_float32([ps[0].to(torch.bfloat16)], gs[:1])


def test_the_kl_scale_is_applied_in_float32_and_in_float64_below_its_normal_range():
    gen = torch.Generator().manual_seed(8)
    ps = [torch.randn(4, 3, generator=gen), torch.randn(2, 2, generator=gen)]
    nu = 0.3
    scaled = [p.clone() for p in ps]
    F.kfac_scale_preconditioned(scaled, nu)
    # float32 arithmetic, as kfac-pytorch applies its scale: nu rounded to float32, one product.
    nu32 = torch.tensor(nu, dtype=torch.float32)
    assert all(torch.equal(s, p * nu32) for s, p in zip(scaled, ps))
    # nu below float32's normal range (a huge P) would lose its digits: float64, rounded once.
    huge = [p * 1e38 for p in ps]
    tiny = 1e-39
    scaled = [h.clone() for h in huge]
    F.kfac_scale_preconditioned(scaled, tiny)
    assert all(torch.equal(s, (h.double() * tiny).float()) for s, h in zip(scaled, huge))
    assert not all(torch.equal(s, h * torch.tensor(tiny, dtype=torch.float32)) for s, h in zip(scaled, huge))
    F.kfac_scale_preconditioned([], 0.5)  # nothing to scale
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"KL clip's factor must lie in \[0, 1\]"):
            F.kfac_scale_preconditioned([ps[0].clone()], bad)


def test_eigendecompose_clamps_and_keeps_the_bases_in_eighs_layout():
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(6)))
    f = (q * torch.tensor([-1e-7, 1.0, 2.0, 3.0])) @ q.T
    (d,) = F.kfac_eigendecompose([(f + f.T) / 2])
    assert d.values.min() == 0 and d.vectors.stride() == (1, 4)  # no transposing copy
    laid_out = kfac_functional.eigenbasis_layout(d.vectors.contiguous())
    assert laid_out.stride() == (1, 4) and torch.equal(laid_out, d.vectors)
    assert torch.allclose((d.vectors * d.values) @ d.vectors.T, f, atol=1e-5)
    assert F.all_finite([torch.ones(2), None, torch.tensor([float("nan")])]) == [True, True, False]
    both_infinities = torch.tensor([float("inf"), -float("inf")])
    huge = torch.full((4,), torch.finfo(torch.float32).max)  # finite, its float32 sum is not
    assert F.all_finite([both_infinities, huge]) == [False, True]


@pytest.mark.parametrize("poison", ["none", "nan", "inf", "-inf", "overflow", "inf_times_zero"])
def test_a_statistic_trace_is_finite_exactly_when_the_statistic_is(poison):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, generator=gen)
    if poison == "nan":
        x[2, 3] = float("nan")
    elif poison in ("inf", "-inf"):
        x[4, 1] = float(poison)
    elif poison == "overflow":  # finite inputs whose products overflow float32
        x[:, 2] *= 1e20
    elif poison == "inf_times_zero":  # inf * 0 puts NaN off the diagonal
        x[:, 1] = 0.0
        x[0, 3] = float("inf")
    statistic = F.kfac_accumulate_statistic(None, x, 0, append_bias=True)
    probe = kfac_functional.gram_finiteness_probes([statistic, torch.eye(3)])
    assert probe.dtype == torch.float64
    assert probe.isfinite().tolist() == [bool(statistic.isfinite().all()), True]
    assert probe.isfinite().all().item() == (poison == "none")

