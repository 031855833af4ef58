"""The FOSI optimizer: schedule, degenerate cases, geometry, guards, Triton vs reference."""

import copy
import warnings

import pytest
import torch
from _fosi_problems import flat, make_problem, train, one_thread  # noqa: F401  (fixture)
from conftest import backend_device, triton_runs_here

import tritonopt
from tritonopt.optim.fosi import FOSI


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


@pytest.mark.parametrize("warmup, expected", [(2, [0, 0, 1, 1, 1, 2, 2, 2, 3]), (None, [0, 0, 1, 1, 1, 2, 2, 2, 3]),
                                              (0, [1, 1, 1, 2, 2, 2, 3, 3, 3])])
def test_ese_schedule_and_hybrid_update(warmup, expected):
    # warmup_steps=None is the FOSI reference code's convention (first ESE when count + 1 = T):
    # with T = 3 it is warmup_steps = 2.
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, k=3, l=1, warmup_steps=warmup, curvature_update_every=3,
               curvature_loss_fn=loss_fn, num_lanczos_iters=16)
    counts = []
    with tritonopt.use_backend("reference"):
        for _ in range(9):
            train(model, opt, loss_fn, 1)
            counts.append(opt.ese_count)
    assert counts == expected
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


@pytest.mark.skipif(not triton_runs_here(), reason="Triton cannot run here")
def test_triton_and_reference_paths_agree():
    out = {}
    device = backend_device("triton")  # both runs there: the same forward and backward, only the ops differ
    for backend in ("reference", "triton"):
        model, loss_fn = make_problem(3)
        model.to(device)  # in place: the loss holds the same module
        loss_fn.x, loss_fn.y = loss_fn.x.to(device), loss_fn.y.to(device)
        opt = FOSI(model.parameters(), lr=1e-2, k=3, warmup_steps=1, curvature_update_every=3,
                   curvature_loss_fn=loss_fn, num_lanczos_iters=12, lanczos_dtype=torch.float32)
        with tritonopt.use_backend(backend):
            train(model, opt, loss_fn, 5)
        out[backend] = [t.cpu() for t in (flat(model), opt.eigenvalues, opt.state_dict()["state"][0]["exp_avg"])]
    for x, y in zip(out["reference"], out["triton"]):
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


def state_snapshot(opt):
    state = copy.deepcopy(opt.state_dict())
    return state["state"], state["fosi"]


def assert_same_state(a, b):
    (state_a, fosi_a), (state_b, fosi_b) = a, b
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for name, value in state_a[key].items():
            assert torch.equal(value, state_b[key][name]), name
    for key, value in fosi_a.items():
        other = fosi_b[key]
        assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key


def test_overflowing_update_is_undone_under_either_policy():
    # Ritz values near 1e-30 with no floor: alpha / lambda overflows float32 in the Newton step.
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, k=2, alpha=1e10, num_lanczos_iters=8, eigenvalue_floor=0.0,
               ritz_rtol=0.0, on_nonfinite="raise", warmup_steps=1, curvature_update_every=1000,
               curvature_loss_fn=lambda: 1e-30 * loss_fn())
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 1)
        before, state_before = flat(model), state_snapshot(opt)
        opt.zero_grad()
        loss_fn().backward()
        with pytest.raises(FloatingPointError, match="NaN or inf"):
            opt.step()
        assert torch.equal(flat(model), before)
        assert_same_state(state_snapshot(opt), state_before)
        opt.on_nonfinite = "skip"
        with pytest.warns(RuntimeWarning, match="undone"):
            opt.step()
        assert torch.equal(flat(model), before) and opt.skipped_steps == 1
        assert_same_state(state_snapshot(opt), state_before)


@pytest.mark.parametrize("base", ["adam", "heavy_ball"])
def test_huge_finite_gradient_changes_nothing(base):
    # 1e25 is finite in float32, but its square (Adam's second moment) is not.
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, base=base, k=2, curvature_loss_fn=loss_fn, num_lanczos_iters=8)
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 2)
        before, state_before = flat(model), state_snapshot(opt)
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
            assert_same_state(state_snapshot(opt), state_before)
        # Training goes on from an uncorrupted state.
        train(model, opt, loss_fn, 2)
        assert torch.isfinite(flat(model)).all()


def test_nonfinite_curvature_keeps_parameters_finite():
    model, loss_fn = make_problem()
    bad_loss = lambda: loss_fn() * float("inf")  # noqa: E731
    opt = FOSI(model.parameters(), lr=1e-2, k=2, curvature_loss_fn=bad_loss, num_lanczos_iters=8)
    with tritonopt.use_backend("reference"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, loss_fn, 2)
    assert any("curvature estimation failed" in str(w.message) for w in caught)
    assert torch.isfinite(flat(model)).all() and opt.eigenvalues.numel() == 0


def test_a_curvature_loss_that_ignores_the_parameters_is_named():
    model, loss_fn = make_problem()
    other, other_loss = make_problem(1)  # e.g. a copy's loss still closing over the original model
    opt = FOSI(model.parameters(), lr=1e-2, k=2, num_lanczos_iters=8)
    with pytest.raises(ValueError, match="does not depend on the optimizer's parameters"):
        opt.update_curvature(other_loss)


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
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(curvature_update_every=0), "curvature_update_every"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(lanczos_dtype=torch.float16), "lanczos_dtype"),
        (dict(reorth_passes=0), "reorth_passes"),
        (dict(eigenvalue_floor=2.0), "eigenvalue_floor"),
        (dict(paper_exact=True, g1_momentum=0.9), "paper_exact"),
        (dict(on_nonfinite="ignore"), "on_nonfinite"),
        (dict(curvature_loss_fn=3), "curvature_loss_fn"),
    ],
)
def test_bad_hyperparameters_are_named(kwargs, match):
    model, _ = make_problem()
    with pytest.raises((TypeError, ValueError), match=match):
        FOSI(model.parameters(), **kwargs)


def test_partial_gradients_are_rejected():
    model, loss_fn = make_problem()
    opt = FOSI(model.parameters(), lr=1e-2, k=0)
    loss_fn().backward()
    model[0].weight.grad = None
    with pytest.raises(RuntimeError, match="every trainable parameter"):
        opt.step()
