"""The ``m x m`` algebra of the windowed preconditioners: the Gram matrix and the combination weights.

Every windowed preconditioner applies ``u = x / scale + z @ G`` to a vector
``x``, with ``G`` the window (``[m, d]``) and ``z`` (``[m]``) computed here in
float64 from the Gram matrix ``dots = G G^T`` and the products ``s = G x``:
:func:`mfac_weights` for M-FAC (``scale`` = the dampening), :func:`ggt_weights`
for GGT (``scale`` = eps).

M-FAC (Frantar et al. 2021; EFCP sec. 2.2, eq. 2). With ``m`` stored gradients
``G`` (``[m, d]``, unwritten rows zero) and dampening ``lam``, the empirical
Fisher is ``F = lam * I + (1/m) * G^T G`` (``1/m`` with the window size, also
while the buffer fills). By Woodbury::

    F^{-1} x = x / lam - G^T w,     w = (lam * m * I + G G^T)^{-1} (G x) / lam

so one IHVP is an SP (``s = G x``), an ``m x m`` SPD solve and an LCG (``w @ G``).
The dynamic algorithm of the paper (no-pivot LU of ``G G^T / lam + m I``, then a
triangular recursion) gives the same ``w``; the tests check both against an
explicit inverse. The solve runs in float64 through a Cholesky factorisation,
on CPU and GPU alike.

GGT (Agarwal et al. 2019; EFCP App. H), window ``G`` as above::

    u = ((G^T G)^{1/2} + eps I)^{-1} x
      = x / eps + G^T V diag(delta_i / lambda_i) V^T (G x),
    G G^T = V diag(lambda) V^T,   sigma_i = sqrt(lambda_i),
    delta_i = 1 / (sigma_i + eps) - 1 / eps = -sigma_i / (eps (sigma_i + eps))

so one GGT step is also one SP, an ``m x m`` ``eigh`` and one LCG. Eigen-directions
with ``lambda_i <= m * 2.2e-16 * max(lambda)`` are outside the span of the
stored gradients to working precision and are dropped (the reference code adds
a ``1e-6`` jitter instead, which depends on the gradients' scale).
"""

from __future__ import annotations

import math

import torch

_FLOAT64_EPS = torch.finfo(torch.float64).eps


def update_gram(dots: torch.Tensor, slot: int, products: torch.Tensor) -> None:
    """Row and column ``slot`` of the Gram matrix become ``products`` (the new row's SP)."""
    products = products.to(dots.dtype)
    dots[slot, :] = products
    dots[:, slot] = products


def fold_new_row(weights: torch.Tensor, slot: int, scale: float) -> torch.Tensor:
    """``w = z + e_slot / scale`` (float64, in place): ``x / scale + z @ G`` as one combination ``w @ G``.

    ``x`` is row ``slot`` of ``G``: folding its term into the float64 weights avoids
    the cancellation of two float32 vectors of size ``1 / scale``.
    """
    weights[slot] += 1.0 / scale
    return weights


def unfolded_shape(p: torch.Tensor) -> tuple[int, int]:
    """``[n, p]`` with ``n = shape[0]``; a 1-D tensor is ``[n, 1]`` (stored uncompressed), a 0-D one ``[1, 1]``."""
    if p.dim() == 0:
        return 1, 1
    return p.shape[0], math.prod(p.shape[1:])


def mfac_coefficients(dots: torch.Tensor, products: torch.Tensor, damp: float) -> torch.Tensor:
    """``w = (damp * m * I + dots)^{-1} products / damp`` in float64.

    ``dots`` is ``G G^T`` (``[m, m]``), ``products`` is ``G x`` (``[m]``).
    """
    m = dots.shape[0]
    system = dots.to(torch.float64) + (damp * m) * torch.eye(m, dtype=torch.float64, device=dots.device)
    rhs = products.to(torch.float64).unsqueeze(1)
    factor, info = torch.linalg.cholesky_ex(system)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, factor).squeeze(1) / damp
    # The Gram matrix is assembled from rounded scalar products, so with a tiny
    # damp it can be indefinite by a rounding error. The exact system's spectrum
    # is bounded below by damp * m: solve in its eigenbasis with that bound.
    eigenvalues, eigenvectors = torch.linalg.eigh(system)
    eigenvalues = eigenvalues.clamp_min(damp * m)
    return (eigenvectors @ ((eigenvectors.T @ rhs).squeeze(1) / eigenvalues)) / damp


def mfac_weights(dots: torch.Tensor, products: torch.Tensor, damp: float) -> torch.Tensor:
    """``z = -w``: M-FAC's ``F^{-1} x = x / damp + z @ G`` (see :func:`mfac_coefficients`)."""
    return mfac_coefficients(dots, products, damp).neg_()


def ggt_weights(dots: torch.Tensor, products: torch.Tensor, eps: float) -> torch.Tensor:
    """``z`` with ``((G^T G)^{1/2} + eps I)^{-1} x = x / eps + z @ G``, from ``dots = G G^T``, ``products = G x``."""
    m = dots.shape[0]
    eigenvalues, eigenvectors = torch.linalg.eigh(dots.to(torch.float64))
    threshold = m * _FLOAT64_EPS * eigenvalues.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    keep = eigenvalues > threshold
    lam = torch.where(keep, eigenvalues, torch.ones_like(eigenvalues))
    sigma = lam.sqrt()
    scale = torch.where(keep, -1.0 / (eps * sigma * (sigma + eps)), torch.zeros_like(sigma))
    return eigenvectors @ (scale * (eigenvectors.T @ products.to(torch.float64)))
