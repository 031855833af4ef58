"""FOSI's gradient-difference Hessian-vector products (the default on sharded parameters) on plain tensors."""

from __future__ import annotations

import math

import pytest
import torch
from _fosi_problems import make_problem, one_thread, train  # noqa: F401 (one_thread: a fixture)

from tritonopt.optim import FOSI
from tritonopt.optim.lanczos import DifferenceHVP, difference_step, make_hvp, start_vector


class _Counting:
    def __init__(self, loss_fn):
        self.loss_fn, self.calls = loss_fn, 0

    def __call__(self):
        self.calls += 1
        return self.loss_fn()


def _params_and_vector(dtype=torch.float64):
    model, loss = make_problem(0, dtype, batch=16)
    params = list(model.parameters())
    return params, loss, start_vector(sum(p.numel() for p in params), 5).to(dtype)


@pytest.mark.parametrize("scheme, rtol", [("central", 1e-8), ("forward", 1e-5)])
def test_difference_products_approach_the_double_backward_ones(scheme, rtol):
    # float64, unit v, eps = difference_step's: the central quotient errs by O(eps^2) ~ 1e-11 (u^(2/3)), the
    # forward one by O(eps) ~ 1e-8 (u^(1/2)), each times the loss's third derivatives (of order 1 here);
    # a missing factor or sign would be off by order 1.
    params, loss, v = _params_and_vector()
    exact = make_hvp(params, loss)(v)
    norm = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in params))
    hvp = DifferenceHVP(params, loss, torch.float64, scheme=scheme, eps=difference_step(scheme, torch.float64, norm))
    assert float((hvp(v) - exact).norm()) <= rtol * float(exact.norm())


def test_difference_products_leave_weights_and_gradients_as_they_were():
    params, loss, v = _params_and_vector()
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    grads = [p.grad for p in params]
    weights = [p.detach().clone() for p in params]
    counting = _Counting(loss)
    central = DifferenceHVP(params, counting, torch.float64, scheme="central", eps=1e-4)
    central(v)
    central(v)
    central.close()
    assert counting.calls == 4  # two gradients per product
    counting.calls = 0
    forward = DifferenceHVP(params, counting, torch.float64, scheme="forward", eps=1e-6)
    forward(v)
    forward(v)
    assert counting.calls == 3  # g(w) once, then one per product
    assert all(torch.equal(p.detach(), w) for p, w in zip(params, weights))  # restored exactly, not w + e - e
    assert all(p.grad is g for p, g in zip(params, grads))  # plain tensors: autograd.grad touches no .grad


def test_difference_step_is_the_balanced_one():
    u64 = 2.0**-53
    assert difference_step("central", torch.float64, 3.0) == pytest.approx(u64 ** (1 / 3) * 4.0, rel=1e-15)
    assert difference_step("forward", torch.float32, 0.0) == pytest.approx(math.sqrt(2.0**-24), rel=1e-15)
    with pytest.raises(FloatingPointError, match="norm is not finite"):
        difference_step("central", torch.float32, math.inf)
    with pytest.raises(ValueError, match="scheme must be one of"):
        difference_step("backward", torch.float32, 1.0)


@pytest.mark.parametrize("method", ["central_difference", "forward_difference"])
def test_fosi_with_difference_products_finds_the_double_backward_spectrum(method):
    # The same ESE (same start vector) on a float64 model: the Ritz values agree to the products' accuracy.
    found = {}
    for hvp in ("double_backward", method):
        model, loss = make_problem(0, torch.float64)
        opt = FOSI(model.parameters(), lr=0.01, k=3, curvature_loss_fn=loss, num_lanczos_iters=12, hvp=hvp)
        train(model, opt, loss, 1)
        found[hvp] = opt.all_eigenvalues
    assert torch.allclose(found[method], found["double_backward"], rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(hvp="finite_difference"), "hvp"),
    (dict(hvp="central_difference", hvp_eps=0.0), "hvp_eps"),
    (dict(hvp_eps=math.nan), "hvp_eps"),
    (dict(hvp="double_backward", hvp_eps=1e-3), "takes none"),
])
def test_fosi_refuses_bad_product_settings(kwargs, match):
    model, _ = make_problem(0)
    with pytest.raises(ValueError, match=match):
        FOSI(model.parameters(), **kwargs)


def test_difference_products_refuse_a_bad_step():
    params, loss, _ = _params_and_vector()
    for eps in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            DifferenceHVP(params, loss, torch.float64, scheme="central", eps=eps)
