"""Dense M-FAC and sparse M-FAC with error feedback (EFCP, Modoranu et al. 2024, sec. 2.2, 3.1, Alg. 1)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from tritonopt.optim._window_algebra import mfac_weights
from tritonopt.optim._windows import DenseWindow, SparseWindow
from tritonopt.optim.windowed import WindowedPreconditioner

__all__ = ["MFAC", "SparseMFAC"]


class MFAC(WindowedPreconditioner):
    r"""Dense M-FAC: the inverse empirical Fisher of the last ``ngrads`` gradients, applied to the gradient.

    With the window ``G`` (``[m, d]``, ``m = ngrads``, rows not yet written are
    zero) and ``F = damp * I + (1/m) G^T G`` (EFCP eq. 2; ``1/m`` also while the
    window fills, as published), every step::

        G[slot] = g;  slot = (slot + 1) % m          # ring buffer, oldest row replaced
        s = G g                                       # SP
        dots[slot, :] = dots[:, slot] = s             # Gram matrix G G^T, float64
        w = (damp * m * I + dots)^{-1} s / damp       # Cholesky solve, float64
        u = g / damp - w @ G                          # LCG:  u = F^{-1} g
        theta = (1 - lr * weight_decay) * theta - lr * (momentum * v + u)

    The state holds ``4 * m * d`` bytes for the window (float32; float64 when every
    parameter is float64); :meth:`expected_state_bytes` gives the total before any
    step, and a window that cannot fit in the device's memory is refused at
    construction.

    Args:
        params: parameters or parameter groups (groups may override every
            hyperparameter but ``on_nonfinite``).
        lr: learning rate. Large ``damp`` makes the step SGD with rate ``lr / damp``.
        ngrads: window size ``m``.
        damp: dampening ``lambda > 0``. If training diverges, increase it.
        momentum: ``v = momentum * v + u`` (no dampening), in ``[0, 1)``.
        weight_decay: decoupled, ``theta *= 1 - lr * weight_decay``.
        max_update_norm: clip the preconditioned update ``u`` to this norm
            (the EFCP ASDL runs clip at 10); ``None`` (default) does not clip.
            Shared by all groups of one window.
        per_group_windows: one window per parameter group instead of one over
            all parameters (see :mod:`tritonopt.optim.windowed`).
        track_error_norm: keep ``||e|| / ||g||`` of each step for
            :meth:`error_norm_ratios` (two extra reductions per step).
        on_nonfinite: ``"skip"`` (warn, change nothing, count in
            :attr:`skipped_steps`) or ``"raise"`` (``FloatingPointError``) when a
            gradient holds NaN or inf.
    """

    ALGO = "mfac"
    WINDOW = DenseWindow
    WEIGHTS = staticmethod(mfac_weights)
    SCALE = "damp"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        ngrads: int = 1024,
        damp: float = 1e-5,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        max_update_norm: Optional[float] = None,
        per_group_windows: bool = False,
        track_error_norm: bool = False,
        on_nonfinite: str = "skip",
    ):
        defaults = dict(lr=lr, ngrads=ngrads, damp=damp, momentum=momentum, weight_decay=weight_decay)
        defaults["max_update_norm"] = max_update_norm
        super().__init__(params, defaults, on_nonfinite, per_group_windows=per_group_windows,
                         track_error_norm=track_error_norm)


class SparseMFAC(WindowedPreconditioner):
    r"""Sparse M-FAC (S-MFAC): error feedback + blockwise Top-k + M-FAC on a sparse ring buffer.

    EFCP Algorithm 1 with the M-FAC preconditioner (sec. 3.1). Each group is one
    vector cut into blocks of ``block_size`` (the last one zero-padded); every step::

        a = e + g                                  # error feedback
        c = TopK_per_block(a)                      # k = ceil(density * block_size) per block
        e = a - c
        ring[slot] = c                             # sparse_ring_insert, O(k)
        s = SP(c);  dots[slot, :] = dots[:, slot] = s
        w = (damp * m * I + dots)^{-1} s / damp    # float64
        u = c / damp - LCG(w)                      # = F^{-1} c, F built from the compressed rows
        theta = (1 - lr * weight_decay) * theta - lr * (momentum * v + u)

    The compressed accumulator ``c``, not ``g``, is preconditioned (as in the
    paper's code). At ``density=1`` the error stays zero and the optimizer is
    dense :class:`MFAC`. ``error_feedback=False`` keeps ``e = 0`` (plain Top-k,
    the ablation the paper reports as much worse).

    State: indices (int32) and values (``values_dtype``) ``[num_blocks, m, k]``,
    the error ``e`` (float32, ``4 * d_padded`` bytes), ``dots`` (``8 m^2``), and a
    momentum buffer when ``momentum > 0``: about ``m * k * 8 + 4 d`` bytes
    against dense M-FAC's ``4 m d``.

    Args:
        lr, ngrads, damp, momentum, weight_decay, max_update_norm, per_group_windows,
        track_error_norm, on_nonfinite: as :class:`MFAC`.
        density: fraction of each block kept, in ``(0, 1]``.
        block_size: Top-k block length (a group smaller than one block is one block).
        error_feedback: keep the compression error and feed it back (default True).
        values_dtype: ``torch.float32`` or ``torch.bfloat16`` for the stored values
            (with bfloat16, ``c`` is the rounded row and the rounding error joins ``e``).
        error_dtype: ``torch.float32`` or ``torch.bfloat16`` for the stored error
            (bfloat16 halves its memory; each step's residual is rounded once).
    """

    ALGO = "sparse_mfac"
    WINDOW = SparseWindow
    WEIGHTS = staticmethod(mfac_weights)
    SCALE = "damp"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        density: float = 0.01,
        ngrads: int = 1024,
        damp: float = 1e-5,
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
            lr=lr, density=density, ngrads=ngrads, damp=damp, block_size=block_size,
            momentum=momentum, weight_decay=weight_decay, error_feedback=error_feedback,
            values_dtype=values_dtype, error_dtype=error_dtype,
        )
        defaults["max_update_norm"] = max_update_norm
        super().__init__(params, defaults, on_nonfinite, per_group_windows=per_group_windows,
                         track_error_norm=track_error_norm)
