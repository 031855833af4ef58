"""GGT (full-matrix AdaGrad over a window) and its error-feedback sparse version (EFCP App. H, Alg. 4)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from tritonopt.optim._window_algebra import ggt_weights
from tritonopt.optim._windows import DenseWindow, SparseWindow
from tritonopt.optim.windowed import WindowedPreconditioner

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
    :mod:`tritonopt.optim._window_algebra`).

    Args:
        lr: learning rate (the published run uses 1.0 with a cosine schedule).
        ngrads: window size.
        eps: added to the square root of the eigenvalues (``1e-5`` published).
        momentum, weight_decay, max_update_norm, per_group_windows, track_error_norm,
            on_nonfinite: as :class:`tritonopt.optim.mfac.MFAC`.
    """

    ALGO = "ggt"
    WINDOW = DenseWindow
    WEIGHTS = staticmethod(ggt_weights)
    SCALE = "eps"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        ngrads: int = 100,
        eps: float = 1e-5,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        max_update_norm: Optional[float] = None,
        per_group_windows: bool = False,
        track_error_norm: bool = False,
        on_nonfinite: str = "skip",
    ):
        defaults = dict(lr=lr, ngrads=ngrads, eps=eps, momentum=momentum, weight_decay=weight_decay)
        defaults["max_update_norm"] = max_update_norm
        super().__init__(params, defaults, on_nonfinite, per_group_windows=per_group_windows,
                         track_error_norm=track_error_norm)


class SparseGGT(WindowedPreconditioner):
    r"""Sparse GGT (S-GGT): error feedback + blockwise Top-k + GGT on a sparse ring buffer.

    EFCP Algorithm 4 with blockwise Top-k: ``a = e + g``, ``c = TopK_per_block(a)``,
    ``e = a - c``; ``c`` is written into the ring buffer and preconditioned::

        s = SP(c);  dots[slot, :] = dots[:, slot] = s;  u = c / eps + LCG(z(dots, s))

    with ``z`` as in :class:`GGT`. At ``density=1`` it is :class:`GGT`.

    Args:
        lr, ngrads, eps, momentum, weight_decay, max_update_norm, per_group_windows,
            track_error_norm, on_nonfinite: as :class:`GGT`.
        density, block_size, error_feedback, values_dtype, error_dtype: as
            :class:`tritonopt.optim.mfac.SparseMFAC`.
    """

    ALGO = "sparse_ggt"
    WINDOW = SparseWindow
    WEIGHTS = staticmethod(ggt_weights)
    SCALE = "eps"

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
        error_dtype: torch.dtype = torch.float32,
        max_update_norm: Optional[float] = None,
        per_group_windows: bool = False,
        track_error_norm: bool = False,
        on_nonfinite: str = "skip",
    ):
        defaults = dict(
            lr=lr, density=density, ngrads=ngrads, eps=eps, block_size=block_size,
            momentum=momentum, weight_decay=weight_decay, error_feedback=error_feedback,
            values_dtype=values_dtype, error_dtype=error_dtype,
        )
        defaults["max_update_norm"] = max_update_norm
        super().__init__(params, defaults, on_nonfinite, per_group_windows=per_group_windows,
                         track_error_norm=track_error_norm)
