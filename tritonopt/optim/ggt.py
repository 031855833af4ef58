"""GGT (full-matrix AdaGrad over a window) and its error-feedback sparse version (EFCP App. H, Alg. 4)."""

from __future__ import annotations

from typing import Iterable

import torch

from tritonopt._ops.sparse_ring import sparse_lcg, sparse_sp
from tritonopt._runtime import nvtx_range
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._mfac_common import PackedGroup, WindowedPreconditioner, check_number
from tritonopt.optim._mfac_core import ggt_coefficients, update_dots
from tritonopt.optim.mfac import (
    check_sparse_group,
    compress_into_ring,
    dense_ring_state,
    insert_dense,
    sparse_ring_state,
)

__all__ = ["GGT", "SparseGGT"]


class GGT(WindowedPreconditioner):
    r"""GGT: ``((G^T G)^{1/2} + eps I)^{-1}`` applied to the gradient, ``G`` the last ``ngrads`` gradients.

    Agarwal et al. (2019), as used in EFCP App. H with ``beta1 = 0`` and
    ``beta2 = 1`` (the published runs; the window is not decayed). Every step::

        G[slot] = g;  s = G g;  dots[slot, :] = dots[:, slot] = s      # dots = G G^T, float64
        dots = V diag(lambda) V^T                                        # m x m eigh
        u = g / eps + z @ G,  z = V diag(-1 / (eps sigma (sigma + eps))) V^T s,  sigma = sqrt(lambda)
        theta = (1 - lr * weight_decay) * theta - lr * (momentum * v + u)

    which equals ``U diag(1/(sigma + eps) - 1/eps) U^T g + g / eps`` with
    ``U = G^T V diag(1/sigma)`` (the reference's form) without building ``U``.
    Directions with a numerically zero eigenvalue are dropped (see
    :mod:`tritonopt.optim._mfac_core`).

    Args:
        lr: learning rate (the published run uses 1.0 with a cosine schedule).
        ngrads: window size.
        eps: added to the square root of the eigenvalues (``1e-5`` published).
        momentum, weight_decay, on_nonfinite: as :class:`tritonopt.optim.mfac.MFAC`.
    """

    ALGO = "ggt"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        ngrads: int = 100,
        eps: float = 1e-5,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        on_nonfinite: str = "skip",
    ):
        defaults = dict(lr=lr, ngrads=ngrads, eps=eps, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults, on_nonfinite)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        check_number("eps", group["eps"], low_open=True)

    def _init_ring(self, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        return dense_ring_state(group, layout, dtype)

    def _direction(self, group: dict, packed: PackedGroup, ring: dict) -> torch.Tensor:
        eps = group["eps"]
        g = packed.grad.view(-1)
        window = ring["ring_grads"]
        products = insert_dense(self.ALGO, ring, self._advance(ring), g)
        with nvtx_range("tritonopt/ggt/solve"):
            weights = ggt_coefficients(ring["dots"], products, eps)
        with nvtx_range("tritonopt/ggt/lcg"):
            update = (g / eps).add_(weights.to(window.dtype) @ window)
        return update.view_as(packed.grad)


class SparseGGT(WindowedPreconditioner):
    r"""Sparse GGT (S-GGT): error feedback + blockwise Top-k + GGT on a sparse ring buffer.

    EFCP Algorithm 4 with blockwise Top-k: ``a = e + g``, ``c = TopK_per_block(a)``,
    ``e = a - c``; ``c`` is written into the ring buffer and preconditioned::

        s = SP(c);  dots[slot, :] = dots[:, slot] = s;  u = c / eps + LCG(z(dots, s))

    with ``z`` as in :class:`GGT`. At ``density=1`` it is :class:`GGT`.

    Args:
        lr, ngrads, eps, momentum, weight_decay, on_nonfinite: as :class:`GGT`.
        density, block_size, error_feedback, values_dtype: as
            :class:`tritonopt.optim.mfac.SparseMFAC`.
    """

    ALGO = "sparse_ggt"
    BLOCKWISE = True
    ERROR_FEEDBACK = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        density: float = 0.01,
        ngrads: int = 100,
        eps: float = 1e-5,
        block_size: int = 16384,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        error_feedback: bool = True,
        values_dtype: torch.dtype = torch.float32,
        on_nonfinite: str = "skip",
    ):
        defaults = dict(
            lr=lr, density=density, ngrads=ngrads, eps=eps, block_size=block_size,
            momentum=momentum, weight_decay=weight_decay, error_feedback=error_feedback,
            values_dtype=values_dtype,
        )
        super().__init__(params, defaults, on_nonfinite)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        check_number("eps", group["eps"], low_open=True)
        check_sparse_group(group)

    def _init_ring(self, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        return sparse_ring_state(group, layout)

    def _direction(self, group: dict, packed: PackedGroup, ring: dict) -> torch.Tensor:
        eps = group["eps"]
        compressed = compress_into_ring(self.ALGO, group, packed, ring, self._advance(ring))
        with nvtx_range("tritonopt/sparse_ggt/sp"):
            products = sparse_sp(ring["ring_indices"], ring["ring_values"], compressed.dense)
        with nvtx_range("tritonopt/sparse_ggt/solve"):
            update_dots(ring["dots"], compressed.slot, products)
            weights = ggt_coefficients(ring["dots"], products, eps)
        with nvtx_range("tritonopt/sparse_ggt/lcg"):
            combination = sparse_lcg(
                ring["ring_indices"], ring["ring_values"], weights.to(torch.float32),
                packed.layout.block_size,
            )
            return (compressed.dense / eps).add_(combination)
