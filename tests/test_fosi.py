"""The FOSI optimizer: schedule, degenerate cases, guards, state_dict, Triton vs reference."""

import copy
import io
import warnings

import pytest
import torch
from conftest import triton_runs_here

import tritonopt
from tritonopt.optim.fosi import FOSI


def make_problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    x = torch.randn(64, 6, generator=gen)
    y = torch.randint(0, 3, (64,), generator=gen)
    loss_fn = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
    return model, loss_fn


def train(model, opt, loss_fn, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_k_plus_l_zero_and_warmup_equal_the_base_optimizer_exactly():
    runs = {}
    for name, kw in {
        "k0": dict(k=0, l=0),
        "warmup": dict(k=3, warmup_steps=100),  # no ESE within the run
    }.items():
        model, loss_fn = make_problem()
        opt = FOSI(model.parameters(), lr=1e-2, curvature_loss_fn=loss_fn, **kw)
        with tritonopt.use_backend("reference"):
            train(model, opt, loss_fn, 8)
        runs[name] = flat(model)
    assert torch.equal(runs["k0"], runs["warmup"])
    # ... and both equal torch.optim.Adam up to float rounding (different formula order).
    model, loss_fn = make_problem()
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, adam, loss_fn, 8)
    assert torch.allclose(runs["k0"], flat(model), rtol=1e-5, atol=1e-6)


def test_ese_schedule_and_hybrid_update():
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, k=3, l=1, warmup_steps=2, curvature_update_every=3,
               curvature_loss_fn=loss_fn, num_lanczos_iters=16)
    counts = []
    with tritonopt.use_backend("reference"):
        for _ in range(9):
            train(model, opt, loss_fn, 1)
            counts.append(opt.ese_count)
    # ESE before updates t = 2, 5, 8 (0-based).
    assert counts == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert opt.eigenvalues.shape == (4,)
    basis = torch.cat([s["eigenvectors"].reshape(4, -1) for s in opt.state.values()], dim=1)
    assert torch.allclose(basis @ basis.T, torch.eye(4), atol=1e-5)
    assert opt.last_lanczos["steps"] == 16


def test_one_step_geometry_on_the_optimizer():
    model, loss_fn = make_problem(1)
    opt = FOSI(model.parameters(), lr=1e-2, base="heavy_ball", k=4, alpha=0.5, curvature_loss_fn=loss_fn,
               curvature_update_every=1000, num_lanczos_iters=24)
    w0 = flat(model)
    with tritonopt.use_backend("reference"):
        opt.zero_grad()
        loss_fn().backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        opt.step()
    v = torch.cat([s["eigenvectors"].reshape(4, -1) for s in opt.state.values()], dim=1).double()
    delta = (flat(model) - w0).double()
    inside = v.T @ (v @ delta)
    expected_newton = -(v.T @ ((0.5 / opt.eigenvalues.abs()) * (v @ g.double())))
    assert torch.allclose(inside, expected_newton, atol=1e-5)
    g2 = g.double() - v.T @ (v @ g.double())
    assert torch.allclose(delta - inside, -0.01 * g2, atol=1e-6)  # first heavy-ball step on g2


def test_state_dict_round_trip_mid_run_is_bitwise():
    def build():
        model, loss_fn = make_problem(2)
        opt = FOSI(model.parameters(), lr=1e-2, k=2, l=1, warmup_steps=1, curvature_update_every=4,
                   curvature_loss_fn=loss_fn, num_lanczos_iters=12, g1_momentum=0.9, learning_rate_clip=3.0)
        return model, loss_fn, opt

    with tritonopt.use_backend("reference"):
        model, loss_fn, opt = build()
        train(model, opt, loss_fn, 6)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
        train(model, opt, loss_fn, 5)
        uninterrupted = flat(model)

        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        model2, loss_fn2, opt2 = build()
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
        assert opt2.eigenvalues.numel() == 3 and opt2.ese_count == 2
        for state in opt2.state.values():
            assert all(v.dtype == torch.float32 for v in state.values() if isinstance(v, torch.Tensor))
        train(model2, opt2, loss_fn2, 5)
    assert torch.equal(flat(model2), uninterrupted)


@pytest.mark.skipif(not triton_runs_here(), reason="Triton cannot run here")
def test_triton_and_reference_paths_agree():
    backend = "triton"
    out = {}
    for b in ("reference", backend):
        model, loss_fn = make_problem(3)
        opt = FOSI(model.parameters(), lr=1e-2, k=3, warmup_steps=1, curvature_update_every=3,
                   curvature_loss_fn=loss_fn, num_lanczos_iters=12, lanczos_dtype=torch.float32)
        with tritonopt.use_backend(b):
            train(model, opt, loss_fn, 5)
        out[b] = (flat(model), opt.eigenvalues, opt.state_dict()["state"][0]["exp_avg"])
    for x, y in zip(out["reference"], out[backend]):
        assert torch.allclose(x.double(), y.double(), rtol=1e-4, atol=1e-5)


def test_nonfinite_gradients_skip_or_raise_before_any_change():
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, k=2, curvature_loss_fn=loss_fn, num_lanczos_iters=8)
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 2)
        before = (flat(model), copy.deepcopy(opt.state_dict()))
        opt.zero_grad()
        loss_fn().backward()
        next(model.parameters()).grad[0, 0] = float("nan")
        with pytest.warns(RuntimeWarning, match="NaN or inf"):
            opt.step()
        assert opt.skipped_steps == 1 and torch.equal(flat(model), before[0])
        after = opt.state_dict()
        for pid, state in before[1]["state"].items():
            for name, value in state.items():
                assert torch.equal(after["state"][pid][name], value), name
        assert after["fosi"]["base_step"] == before[1]["fosi"]["base_step"]
        strict = FOSI(model.parameters(), lr=1e-2, on_nonfinite="raise")
        with pytest.raises(FloatingPointError):
            strict.step()
        assert torch.equal(flat(model), before[0])


def _state_snapshot(opt):
    state = copy.deepcopy(opt.state_dict())
    return state["state"], state["fosi"]["base_step"]


def _assert_same_state(a, b):
    (state_a, step_a), (state_b, step_b) = a, b
    assert step_a == step_b and state_a.keys() == state_b.keys()
    for key in state_a:
        for name, value in state_a[key].items():
            other = state_b[key][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, name


def test_overflowing_update_is_undone_under_either_policy():
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, k=2, curvature_loss_fn=loss_fn, num_lanczos_iters=8,
               eigenvalue_floor=0.0, on_nonfinite="raise")
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 1)
        opt.eigenvalues = torch.full_like(opt.eigenvalues, 1e-45)  # alpha / lambda overflows
        opt.all_eigenvalues = opt.eigenvalues.clone()
        before, state_before = flat(model), _state_snapshot(opt)
        opt.zero_grad()
        loss_fn().backward()
        with pytest.raises(FloatingPointError, match="NaN or inf"):
            opt.step()
        assert torch.equal(flat(model), before)
        _assert_same_state(_state_snapshot(opt), state_before)
        opt.on_nonfinite = "skip"
        with pytest.warns(RuntimeWarning, match="undone"):
            opt.step()
        assert torch.equal(flat(model), before) and opt.skipped_steps == 1
        _assert_same_state(_state_snapshot(opt), state_before)


@pytest.mark.parametrize("base", ["adam", "heavy_ball"])
def test_huge_finite_gradient_changes_nothing(base):
    # 1e25 is finite in float32, but its square (Adam's second moment) is not.
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, base=base, k=2, curvature_loss_fn=loss_fn,
               num_lanczos_iters=8)
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 2)
        before, state_before = flat(model), _state_snapshot(opt)
        opt.zero_grad()
        loss_fn().backward()
        for p in model.parameters():
            p.grad.mul_(1e25 / p.grad.abs().max().clamp_min(1e-30))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if base == "adam":
            assert opt.skipped_steps == 1 and any("undone" in str(w.message) for w in caught)
        assert torch.isfinite(flat(model)).all()
        if opt.skipped_steps:
            assert torch.equal(flat(model), before)
            _assert_same_state(_state_snapshot(opt), state_before)
        # Training goes on from an uncorrupted state.
        train(model, opt, loss_fn, 2)
        assert torch.isfinite(flat(model)).all()


def test_load_state_dict_validates_before_changing_anything():
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, k=2, curvature_loss_fn=loss_fn, num_lanczos_iters=8)
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 2)
    good = copy.deepcopy(opt.state_dict())
    fresh_model, _ = make_problem()
    fresh = FOSI(fresh_model.parameters(), lr=5e-2, k=2)
    bad = copy.deepcopy(good)
    bad["fosi"]["eigenvalues"] = bad["fosi"]["eigenvalues"][:1]
    with pytest.raises(ValueError, match="eigenvalues"):
        fresh.load_state_dict(bad)
    bad = copy.deepcopy(good)
    del bad["fosi"]["base_step"]
    with pytest.raises(ValueError, match="base_step"):
        fresh.load_state_dict(bad)
    assert fresh.param_groups[0]["lr"] == 5e-2 and not fresh.state and fresh.eigenvalues.numel() == 0
    fresh.load_state_dict(good)
    assert fresh.param_groups[0]["lr"] == 1e-2 and fresh.eigenvalues.numel() == 2


def test_nonfinite_curvature_keeps_parameters_finite():
    model, loss_fn = make_problem()
    bad_loss = lambda: loss_fn() * float("inf")  # noqa: E731
    opt = FOSI(model.parameters(), lr=1e-2, k=2, curvature_loss_fn=bad_loss, num_lanczos_iters=8)
    with tritonopt.use_backend("reference"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, loss_fn, 2)
    assert any("curvature estimation failed" in str(w.message) for w in caught)
    assert torch.isfinite(flat(model)).all() and opt.eigenvalues.numel() == 0


def test_tiny_model_breakdown_and_zero_ritz_values_are_guarded():
    # n = 3 < m: Lanczos is clamped to n; a loss that is linear in one coordinate has a
    # zero eigenvalue, which must be dropped rather than inverted.
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    loss_fn = lambda: 2.0 * w[0] ** 2 + 0.5 * w[1] ** 2 + w[2]  # noqa: E731
    opt = FOSI([w], lr=0.1, base="sgd", k=2, l=1, alpha=1.0, curvature_loss_fn=loss_fn)
    with tritonopt.use_backend("reference"):
        train(torch.nn.Identity(), opt, loss_fn, 3)
    assert torch.isfinite(w).all()
    assert sorted(opt.eigenvalues.tolist()) == pytest.approx([1.0, 4.0])
    assert float(w[0].detach()) == pytest.approx(0.0, abs=1e-6) and float(w[1].detach()) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(base="lion"), "base"),
        (dict(k=-1), "k must be"),
        (dict(k=60, l=10), "k \\+ l"),
        (dict(alpha=float("nan")), "alpha"),
        (dict(lr=-1.0), "lr"),
        (dict(betas=(0.9, 1.0)), "betas\\[1\\]"),
        (dict(curvature_update_every=0), "curvature_update_every"),
        (dict(lanczos_dtype=torch.float16), "lanczos_dtype"),
        (dict(reorth_passes=0), "reorth_passes"),
        (dict(on_nonfinite="ignore"), "on_nonfinite"),
        (dict(curvature_loss_fn=3), "curvature_loss_fn"),
    ],
)
def test_bad_hyperparameters_are_named(kwargs, match):
    model, _ = make_problem()
    with pytest.raises((TypeError, ValueError), match=match):
        FOSI(model.parameters(), **kwargs)


def test_partial_gradients_and_second_groups_are_rejected():
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, k=0)
    loss_fn().backward()
    model[0].weight.grad = None
    with pytest.raises(RuntimeError, match="every trainable parameter"):
        opt.step()
    with pytest.raises(ValueError, match="one parameter group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
