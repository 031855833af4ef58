"""A float64 bound on how far two FOSI runs that sum over coordinates in other orders can end apart.

The runs of ``tests/test_fsdp2.py``: FOSI (Adam base, one ESE before the first
update by central-difference Hessian-vector products of the mean squared error of
``Linear(5, 13), Tanh, Linear(13, 3)`` on a fixed batch, then ``steps`` updates
with given gradients), once on sharded parameters and once on plain ones. Both
perform the same float64 operations on the same values except that every sum over
coordinates (a dot product, a norm, a Gram-Schmidt coefficient) is formed in
another order: one sum, or each rank's partial sum then an all-reduce. So they
differ only by rounding, and every operation's result errs from the exact one by
at most its rounding bound ``b`` (Higham, with ``u = 2^-53``):

* a sum or dot product of ``n`` terms, in any order: ``gamma_n sum |terms|``;
* one operation (``+ - * /``, ``sqrt``): ``u |result|``; ``tanh``: ``4 u |result|``
  (PyTorch's vectorised tanh is within 1 ulp: ``4 u`` allows 2);
* ``eigh`` of the ``m x m`` tridiagonal ``B``: the exact decomposition of ``B + E``
  with ``|E_jk| <= m u ||B||_2`` (a backward-stable eigensolver, its growth
  constant taken as ``m``).

:func:`fosi_bound` replays the whole computation in float64, the exact arithmetic
standing in for both runs, with a zero perturbation ``delta`` added after each of
those operations: the gradient's forward and backward (PyTorch's ``addmm``,
``tanh``, ``mse_loss`` and ``tanh`` backward, ``mm`` and ``sum``), the shifted
weights ``w +- eps v`` and the difference quotient, the step ``eps`` from
``||w||``, Lanczos (``B[i, i] = h . v``, both Gram-Schmidt passes, the norm, the
division), ``eigh``, the Ritz vectors and their scales, and each update (``V g``,
the Newton term, Adam's moments and step, the projection, the sum into ``w``).
To first order each run's parameters are then off by ``J delta`` with
``|delta| <= b``, so the runs differ by at most ``|J| (2 b)``, ``J`` the Jacobian
of the final parameters with respect to every perturbation. The bound doubles
that for the second-order terms and for the association orders of the fused
kernels (an FMA rounds once where the replay counts two). The Ritz selection is
taken as in the replay (the kept values are far from the others here). The
gradients given to the updates and the Lanczos start vector are the same in both
runs, bit for bit, and carry no perturbation.
"""

from __future__ import annotations

import math

import torch

U = 2.0**-53  # float64 unit roundoff
F64 = torch.float64


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


class _Perturbations:
    """Zero tensors added after each rounded operation (``rounded``), with their bounds."""

    def __init__(self):
        self.deltas: list[torch.Tensor] = []
        self.bounds: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        delta = torch.zeros_like(x, requires_grad=True)
        self.deltas.append(delta)
        self.bounds.append(torch.as_tensor(bound, dtype=F64).detach().expand_as(x).clone())
        return x + delta


def _gradient(rounded, w1, b1, w2, b2, x, y):
    """The mean squared error's gradient of ``Linear, Tanh, Linear`` as PyTorch forms it, each result rounded."""
    (batch, inputs), hidden, outputs = x.shape, w1.shape[0], w2.shape[0]
    a_ = lambda t: t.detach().abs()  # noqa: E731
    z = rounded(x @ w1.T + b1, gamma(inputs + 1) * (a_(x) @ a_(w1).T + a_(b1)))
    a = torch.tanh(z)
    a = rounded(a, 4 * U * a_(a))
    out = rounded(a @ w2.T + b2, gamma(hidden + 1) * (a_(a) @ a_(w2).T + a_(b2)))
    diff = rounded(out - y, U * a_(out - y))
    norm = torch.tensor(2.0 / (batch * outputs), dtype=F64)
    norm = rounded(norm, U * norm)
    g_out = rounded(norm * diff, U * a_(norm * diff))
    g_w2 = rounded(g_out.T @ a, gamma(batch) * (a_(g_out).T @ a_(a)))
    g_b2 = rounded(g_out.sum(0), gamma(batch) * a_(g_out).sum(0))
    g_a = rounded(g_out @ w2, gamma(outputs) * (a_(g_out) @ a_(w2)))
    square = rounded(a * a, U * a_(a * a))
    slope = rounded(1 - square, U * a_(1 - square))
    g_z = rounded(g_a * slope, U * a_(g_a * slope))
    g_w1 = rounded(g_z.T @ x, gamma(batch) * (a_(g_z).T @ a_(x)))
    g_b1 = rounded(g_z.sum(0), gamma(batch) * a_(g_z).sum(0))
    return torch.cat([g_w1.reshape(-1), g_b1, g_w2.reshape(-1), g_b2])


def _dot(rounded, a, b):
    n = a.shape[-1]
    return rounded(a @ b, gamma(n) * (a.detach().abs() @ b.detach().abs()))


def fosi_bound(theta0: torch.Tensor, shapes, batch, grads, *, lr: float, k: int, num_lanczos_iters: int,
               alpha: float, seed: int = 0, betas=(0.9, 0.999), adam_eps: float = 1e-8, eigenvalue_floor: float = 1e-3,
               passes: int = 2):
    """``(replayed parameters, bound)``: the replay's final parameters (float64, flat) and, per coordinate, the
    bound on how far two runs can end apart (see the module docstring).

    ``theta0``: the initial parameters, flat in ``shapes`` order (``W1, b1, W2, b2``);
    ``batch``: the curvature loss's ``(x, y)``; ``grads``: each update's gradient, flat.
    """
    from tritonopt.optim.lanczos import start_vector

    rounded = _Perturbations()
    n = theta0.numel()
    sizes = [math.prod(s) for s in shapes]

    def unflat(flat):
        return [piece.reshape(s) for piece, s in zip(flat.split(sizes), shapes)]

    def gradient(theta):
        return _gradient(rounded, *unflat(theta), *batch)

    # The step of the central differences: u^(1/3) (1 + ||w||).
    squared = _dot(rounded, theta0, theta0)
    norm = rounded(squared.sqrt(), U * squared.sqrt())
    one_plus = rounded(1 + norm, U * (1 + norm))
    step = rounded(U ** (1 / 3) * one_plus, U * U ** (1 / 3) * one_plus)

    def hvp(v):
        shift = rounded(v * step, U * (v * step).abs())
        plus = rounded(theta0 + shift, U * (theta0 + shift).abs())
        minus = rounded(theta0 - shift, U * (theta0 - shift).abs())
        difference = gradient(plus) - gradient(minus)
        difference = rounded(difference, U * difference.abs())
        product = difference / (2 * step)
        return rounded(product, U * product.abs())

    m = num_lanczos_iters
    basis = [start_vector(n, seed)]
    diagonal, off = [], []
    for i in range(m):
        v = basis[i]
        h = hvp(v)
        diagonal.append(_dot(rounded, h, v))
        if i == m - 1:
            break
        rows = torch.stack(basis)
        for _ in range(passes):
            coef = _dot(rounded, rows, h)
            h = rounded(h - coef @ rows, gamma(i + 2) * (h.abs() + coef.abs() @ rows.abs()).detach())
        squared = _dot(rounded, h, h)
        beta = rounded(squared.sqrt(), U * squared.sqrt())
        off.append(beta)
        basis.append(rounded(h / beta, U * (h / beta).abs()))
    rows = torch.stack(basis)
    tridiag = torch.diag(torch.stack(diagonal)) + torch.diag(torch.stack(off), 1) + torch.diag(torch.stack(off), -1)
    backward_error = m * U * torch.linalg.matrix_norm(tridiag.detach(), ord=2)
    lower = rounded(torch.tril(tridiag), torch.tril(torch.full((m, m), float(backward_error), dtype=F64)))
    values, vectors = torch.linalg.eigh(lower + torch.tril(lower, -1).T)
    chosen, chosen_vectors = values[m - k:], vectors[:, m - k:]  # the k largest, ascending
    scale = values.detach().abs().max()
    magnitude = torch.maximum(chosen.abs(), eigenvalue_floor * scale)
    newton_scale = rounded(alpha / magnitude, U * (alpha / magnitude).abs())
    eigenvectors = _dot(rounded, chosen_vectors.T, rows)  # U_sel^T D: m terms per entry

    theta, first, second = theta0.clone(), torch.zeros(n, dtype=F64), torch.zeros(n, dtype=F64)
    beta1, beta2 = betas
    for t, g in enumerate(grads, start=1):
        coef = _dot(rounded, eigenvectors, g)
        scaled = rounded(newton_scale * coef, U * (newton_scale * coef).abs())
        newton = _dot(rounded, scaled, eigenvectors)
        inside = _dot(rounded, coef, eigenvectors)
        g2 = rounded(g - inside, U * (g - inside).abs())
        # Adam as fosi_base_step forms it in float64 (lerp, addcmul, sqrt, two divisions, a product).
        first = rounded(first + (1 - beta1) * (g2 - first), gamma(3) * (first.abs() + g2.abs()).detach())
        second = rounded(beta2 * second + (1 - beta2) * g2 * g2, gamma(4) * (beta2 * second + g2 * g2).detach())
        denominator = second.sqrt() / math.sqrt(1 - beta2**t) + adam_eps
        denominator = rounded(denominator, gamma(3) * denominator.abs())
        update = first / denominator * (-lr / (1 - beta1**t))
        update = rounded(update, gamma(2) * update.abs())
        projected = _dot(rounded, _dot(rounded, eigenvectors, update), eigenvectors)
        kept = rounded(update - projected, U * (update - projected).abs())
        total = rounded(kept - newton, U * (kept - newton).abs())
        theta = rounded(theta + total, U * (theta + total).abs())

    jacobians = torch.autograd.grad(theta, rounded.deltas, grad_outputs=torch.eye(n, dtype=F64),
                                    is_grads_batched=True, allow_unused=True)
    first_order = sum((jac.abs() * (2 * b)).reshape(n, -1).sum(dim=1)
                      for jac, b in zip(jacobians, rounded.bounds) if jac is not None)
    return theta.detach(), 2 * first_order
