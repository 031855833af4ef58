"""What FOSI offers beyond the paper's update: float64 models, schedulers, weight decay and parameter
groups, a relative eigenvalue floor, the FOSI reference code's settings, attention models."""

import pytest
import torch
from _fosi_problems import flat, make_problem, set_grads, train, one_thread  # noqa: F401  (fixture)

import tritonopt
from tritonopt.optim.fosi import FOSI


def flat_grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def basis_of(opt):
    return torch.cat([s["eigenvectors"].reshape(s["eigenvectors"].shape[0], -1) for s in opt.state.values()], dim=1)


def dense_hessian(module, loss_of_output, inputs):
    """The float64 Hessian of ``loss_of_output(module(*inputs))`` w.r.t. the module's parameters, flattened
    in order (scaled-dot-product attention on its math backend, which has a double backward)."""
    params = dict(module.named_parameters())

    def loss_of(w):
        pieces, start = {}, 0
        for name, p in params.items():
            pieces[name] = w[start : start + p.numel()].view(p.shape)
            start += p.numel()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return loss_of_output(torch.func.functional_call(module, pieces, tuple(x.double() for x in inputs)))

    flat_params = torch.cat([p.detach().reshape(-1) for p in params.values()]).double()
    return torch.autograd.functional.hessian(loss_of, flat_params)


def adam_oracle(g2, state, lr, beta1, beta2, eps, step):
    state["m"] = beta1 * state["m"] + (1 - beta1) * g2
    state["v"] = beta2 * state["v"] + (1 - beta2) * g2 * g2
    m_hat = state["m"] / (1 - beta1**step)
    v_hat = state["v"] / (1 - beta2**step)
    return -lr * m_hat / (v_hat.sqrt() + eps)


def fosi_oracle(w, g, v, lam, ritz_scale, segments, *, alpha, floor, state, step):
    """Eqs. (11)-(12) with per-group hyperparameters, written out in float64.

    ``segments``: ``[(stop, lr, beta1, beta2, eps, weight_decay, rho)]``.
    """
    s = alpha / lam.abs().clamp_min(floor * ritz_scale)
    c = v @ g
    newton = -(v.T @ (s * c))
    g2 = g - v.T @ c
    u = torch.empty_like(g)
    decayed = w.clone()
    rho = torch.empty_like(g)
    start = 0
    for stop, lr, beta1, beta2, eps, weight_decay, factor in segments:
        part = {"m": state["m"][start:stop], "v": state["v"][start:stop]}
        u[start:stop] = adam_oracle(g2[start:stop], part, lr, beta1, beta2, eps, step)
        state["m"][start:stop], state["v"][start:stop] = part["m"], part["v"]
        decayed[start:stop] *= 1 - lr * weight_decay
        rho[start:stop] = factor
        start = stop
    return decayed + rho * newton + (u - v.T @ (v @ u))


# --------------------------------------------------------------------------- float64


def test_a_float64_model_keeps_float64_hessian_products():
    model, loss_fn = make_problem(dtype=torch.float64, sizes=(4, 6, 3))
    n = flat(model).numel()
    opt = FOSI(model.parameters(), k=3, l=1, num_lanczos_iters=n, ritz_rtol=0.0)
    with tritonopt.use_backend("reference"):
        opt.update_curvature(loss_fn)
    hessian = dense_hessian(model, lambda out: torch.nn.functional.cross_entropy(out, loss_fn.y), (loss_fn.x,))
    truth = torch.linalg.eigvalsh(hessian)
    expected = torch.cat([truth[:1], truth[-3:]])
    # m = n: Lanczos spans the whole space, so the Ritz values are the eigenvalues up to
    # float64 rounding (float32 products would leave errors near 1e-7 of the largest).
    assert torch.allclose(opt.eigenvalues, expected, rtol=0, atol=1e-10 * float(truth.abs().max()))
    assert basis_of(opt).dtype == torch.float64


def test_a_float64_model_is_updated_in_float64_with_groups_and_a_scheduler():
    model, loss_fn = make_problem(dtype=torch.float64)
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    opt = FOSI([{"params": first, "lr": 2e-2, "weight_decay": 0.1},
                {"params": rest, "betas": (0.8, 0.99), "eps": 1e-6}],
               lr=1e-2, k=3, alpha=0.3, num_lanczos_iters=40, warmup_steps=1, curvature_update_every=100,
               curvature_loss_fn=loss_fn)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 1.0, lambda t: 0.5 ** t])
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 1, scheduler)  # warm-up step; group 1's lr halves
        w0 = flat(model)
        state = {"m": torch.cat([s["exp_avg"].reshape(-1) for s in opt.state.values()]).clone(),
                 "v": torch.cat([s["exp_avg_sq"].reshape(-1) for s in opt.state.values()]).clone()}
        set_grads(model, loss_fn)
        g = flat_grad(model)
        opt.step()  # the ESE, then the first hybrid step
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(t.dtype == torch.float64 for s in opt.state.values() for t in s.values())
    split = sum(p.numel() for p in first)
    segments = [(split, 2e-2, 0.9, 0.999, 1e-8, 0.1, 1.0), (w0.numel(), 5e-3, 0.8, 0.99, 1e-6, 0.0, 0.5)]
    expected = fosi_oracle(w0, g, basis_of(opt), opt.eigenvalues, opt.ritz_scale, segments, alpha=0.3,
                           floor=opt.config.eigenvalue_floor, state=state, step=2)
    step_size = (expected - w0).abs().max()
    # float64 throughout: agreement to rounding (a float32 pass would leave ~1e-7 of the step).
    assert (flat(model) - expected).abs().max() <= 1e-12 * step_size


# --------------------------------------------------------------------------- the learning rate drives the Newton step


def test_the_newton_step_follows_a_scheduler_and_lr_zero_moves_nothing():
    model, loss_fn = make_problem(1)
    opt = FOSI(model.parameters(), lr=1e-2, base="sgd", k=3, alpha=0.5, num_lanczos_iters=24,
               curvature_update_every=1000, curvature_loss_fn=loss_fn)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: [1.0, 0.5, 0.0][min(t, 2)])
    in_span = []
    with tritonopt.use_backend("reference"):
        for _ in range(3):
            w0 = flat(model).double()
            set_grads(model, loss_fn)
            g = flat_grad(model).double()
            opt.step()
            scheduler.step()
            v = basis_of(opt).double()
            newton = -(opt.newton_scale(opt.eigenvalues) * (v @ g))
            in_span.append((v @ (flat(model).double() - w0), newton))
    full, half, zero = in_span
    assert torch.allclose(full[0], full[1], rtol=1e-4, atol=1e-7)
    assert torch.allclose(half[0], 0.5 * half[1], rtol=1e-4, atol=1e-7)
    assert torch.equal(zero[0], torch.zeros_like(zero[0]))  # lr = 0: nothing moves at all


def test_parameter_groups_with_equal_settings_are_one_group():
    out = []
    for split in (False, True):
        model, loss_fn = make_problem(2)
        params = list(model.parameters())
        groups = [{"params": params[:2]}, {"params": params[2:]}] if split else params
        opt = FOSI(groups, lr=1e-2, k=3, g1_momentum=0.5, warmup_steps=1, curvature_update_every=3,
                   num_lanczos_iters=16, curvature_loss_fn=loss_fn)
        with tritonopt.use_backend("reference"):
            train(model, opt, loss_fn, 5)
        out.append(flat(model))
    assert torch.equal(out[0], out[1])


def test_a_group_added_mid_run_joins_the_vector_with_zero_state():
    model, loss_fn = make_problem(2)
    params = list(model.parameters())
    for p in params[2:]:
        p.requires_grad_(False)
    opt = FOSI(params[:2], lr=1e-2, k=3, warmup_steps=0, curvature_update_every=4, num_lanczos_iters=16,
               curvature_loss_fn=loss_fn)
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 2)
        kept = {name: t.clone() for name, t in opt.state[params[0]].items()}
        for p in params[2:]:
            p.requires_grad_(True)
        opt.add_param_group({"params": params[2:], "lr": 5e-3})
        set_grads(model, loss_fn)
        opt.step()
        assert torch.equal(opt.state[params[2]]["eigenvectors"], torch.zeros_like(opt.state[params[2]]["eigenvectors"]))
        assert not torch.equal(opt.state[params[0]]["exp_avg"], kept["exp_avg"])  # it stepped on
        assert torch.equal(opt.state[params[0]]["eigenvectors"], kept["eigenvectors"])
        train(model, opt, loss_fn, 2)  # the ESE before update 4 spans every parameter
    v = basis_of(opt).double()
    assert opt.ese_count == 2 and torch.allclose(v @ v.T, torch.eye(3, dtype=torch.float64), atol=1e-5)
    assert v[:, -sum(p.numel() for p in params[2:]):].abs().max() > 0


def test_weight_decay_and_groups_equal_adamw_before_curvature():
    model, loss_fn = make_problem(3)
    params = list(model.parameters())
    opt = FOSI([{"params": params[:2], "lr": 2e-2, "weight_decay": 0.1},
                {"params": params[2:], "betas": (0.8, 0.99), "weight_decay": 0.01}], lr=1e-2, k=0)
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 8)
    reference, reference_loss = make_problem(3)
    ref_params = list(reference.parameters())
    adamw = [torch.optim.AdamW(ref_params[:2], lr=2e-2, weight_decay=0.1),
             torch.optim.AdamW(ref_params[2:], lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01)]
    for _ in range(8):
        set_grads(reference, reference_loss)
        for o in adamw:
            o.step()
    assert torch.allclose(flat(model), flat(reference), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- eigenvalue floor


def test_the_eigenvalue_floor_is_relative_so_the_newton_step_ignores_the_loss_scale():
    steps = {}
    for scale in (1.0, 1e-4):  # 1e-4: every Ritz value below 1e-3
        model, loss_fn = make_problem(4)
        scaled = lambda: scale * loss_fn()  # noqa: E731
        opt = FOSI(model.parameters(), lr=1e-2, base="sgd", k=4, alpha=0.5, num_lanczos_iters=24,
                   curvature_update_every=1000, curvature_loss_fn=scaled)
        w0 = flat(model).double()
        with tritonopt.use_backend("reference"):
            set_grads(model, scaled)
            opt.step()
        assert opt.eigenvalues.abs().max() < (1e-3 if scale < 1 else 1e3)
        steps[scale] = basis_of(opt).double() @ (flat(model).double() - w0)  # the Newton step's coefficients
    assert torch.allclose(steps[1e-4].abs(), steps[1.0].abs(), rtol=1e-3, atol=1e-8)


def test_the_floor_clamps_relative_to_the_largest_ritz_value():
    model, loss_fn = make_problem(4)
    opt = FOSI(model.parameters(), k=4, alpha=0.5, num_lanczos_iters=24, eigenvalue_floor=0.6)
    with tritonopt.use_backend("reference"):
        opt.update_curvature(loss_fn)
    magnitudes = opt.eigenvalues.abs()
    expected = 0.5 / magnitudes.clamp_min(0.6 * opt.ritz_scale)
    assert opt.ritz_scale == pytest.approx(float(magnitudes.max()))
    assert (magnitudes < 0.6 * opt.ritz_scale).any()  # the floor binds for some
    assert torch.equal(opt.newton_scale(opt.eigenvalues), expected)


# --------------------------------------------------------------------------- the FOSI reference code's settings


def reference_rule_run(model, loss_fn, opt, steps, *, base, lr, decay, clip, alpha, warmup, every, k):
    """Shadow ``opt`` with the FOSI reference code's update rule, written out in float64.

    The rule (hsivan/fosi, torch version): an ESE when ``count + 1 >= W`` and
    ``(count + 1 - W) % T == 0``; ``g1 = V^T V g``; a full-length velocity
    ``vel = momentum_func(g1, vel)``; ``newton = V^T (|1/lambda| * V vel)``;
    ``u = O(g - g1)`` projected out of span(V); ``w += b u - alpha newton``,
    ``b = clip(|lambda_max| / |lambda_(k)|, 1, clip)``. It takes ``V`` and
    ``lambda`` from ``opt`` (the same estimate) and ``opt``'s gradients.
    """
    w = flat(model).double()
    vel = torch.zeros_like(w)
    state = {"m": torch.zeros_like(w), "v": torch.zeros_like(w)}
    v = torch.zeros(0, w.numel(), dtype=torch.float64)
    lam = torch.zeros(0, dtype=torch.float64)
    b = 1.0
    for count in range(steps):
        set_grads(model, loss_fn)
        g = flat_grad(model).double()
        opt.step()
        if count + 1 >= warmup and (count + 1 - warmup) % every == 0:
            v, lam = basis_of(opt).double(), opt.eigenvalues.clone()
            b = min(max(float(lam[-1].abs() / lam[-k].abs()), 1.0), clip)
        g1 = v.T @ (v @ g)
        vel = (1 - decay) * g1 + decay * vel if base == "adam" else g1 + decay * vel
        newton = v.T @ ((1 / lam).abs() * (v @ vel))
        g2 = g - g1
        if base == "adam":
            u = adam_oracle(g2, state, lr, 0.9, 0.999, 1e-8, count + 1)
        else:
            state["m"] = decay * state["m"] + g2
            u = -lr * state["m"]
        u = u - v.T @ (v @ u)
        w = w + b * u - alpha * newton
    return w


@pytest.mark.parametrize("base, lr, clip", [("adam", 1e-2, 1.0), ("heavy_ball", 3e-2, 3.0)])
def test_the_reference_codes_defaults_reproduce_its_update_rule(base, lr, clip):
    # fosi_adam / fosi_momentum defaults: decay 0.9 (g1_momentum), alpha 0.1, learning_rate_clip
    # 1 (Adam) or 3 (momentum), Lanczos order 4 (k + l), warmup_w = None (first ESE at count
    # T - 1), no eigenvalue floor. T = 5 here (100 in the reference) to see two ESEs.
    k, every, steps = 3, 5, 14
    model, loss_fn = make_problem(5)
    opt = FOSI(model.parameters(), lr=lr, base=base, momentum=0.9, k=k, l=0, alpha=0.1, g1_momentum=0.9,
               learning_rate_clip=clip, num_lanczos_iters=4 * k, curvature_update_every=every, warmup_steps=None,
               eigenvalue_floor=0.0, ritz_rtol=0.0, curvature_loss_fn=loss_fn)
    with tritonopt.use_backend("reference"):
        expected = reference_rule_run(model, loss_fn, opt, steps, base=base, lr=lr, decay=0.9, clip=clip,
                                      alpha=0.1, warmup=every, every=every, k=k)
    assert opt.ese_count == 2
    travelled = (expected - flat(make_problem(5)[0]).double()).abs().max()
    assert (flat(model).double() - expected).abs().max() <= 1e-4 * travelled


# --------------------------------------------------------------------------- attention


def test_curvature_of_a_transformer_layer_with_scaled_dot_product_attention():
    # The fused CPU attention kernel has no double backward; the ESE runs the math backend.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=4, nhead=2, dim_feedforward=8, dropout=0.0,
                                             batch_first=True)
    x, target = torch.randn(3, 5, 4), torch.randn(3, 5, 4)

    def loss_fn():
        return ((layer(x) - target) ** 2).mean()

    opt = FOSI(layer.parameters(), lr=1e-3, k=2, num_lanczos_iters=60, warmup_steps=1,
               curvature_update_every=100, curvature_loss_fn=loss_fn)
    with tritonopt.use_backend("reference"):
        train(layer, opt, loss_fn, 2)  # the scheduled ESE runs inside the second step
        assert opt.ese_count == 1 and opt.eigenvalues.numel() == 2
        opt.update_curvature(loss_fn)

    hessian = dense_hessian(layer, lambda out: ((out - target.double()) ** 2).mean(), (x,))
    truth = torch.linalg.eigvalsh(hessian)
    # float32 Hessian products of a float32 model; the largest Ritz value converges first.
    assert float(opt.eigenvalues[-1]) == pytest.approx(float(truth[-1]), rel=1e-4)
