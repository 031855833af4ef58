"""LR-MFAC: M-FAC over a window of low-rank, error-feedback compressed gradients (EFCP sec. 3.2, App. I)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from tritonopt._validation import check_int
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._packed import PackedGroup
from tritonopt.optim._sharding import DTensor, is_row_sharded, is_sharded, rows_placements
from tritonopt.optim._window_algebra import mfac_weights, unfolded_shape
from tritonopt.optim._windows import LowRankWindow
from tritonopt.optim.windowed import WindowedPreconditioner

__all__ = ["LowRankMFAC"]


class LowRankMFAC(WindowedPreconditioner):
    r"""M-FAC whose window stores each gradient as per-tensor rank-``r`` factors (EFCP's LR-MFAC).

    Per tensor ``l`` (unfolded to ``[n_l, p_l]``), every step::

        (P_l, Q_l) = lowrank_ef(g_l, e_l, Q_l)     # e += g; P = GS(e Q); Q = e^T P; e -= P Q^T
        ring_p_l[slot], ring_q_l[slot] = P_l, Q_l   # O(r (n_l + p_l)) per tensor
        s[j] = sum_l <P_{l,j} Q_{l,j}^T, P_l Q_l^T>_F = sum_l sum((P_{l,j}^T P_l) * (Q_{l,j}^T Q_l))
        dots[slot, :] = dots[:, slot] = s;   w = (damp m I + dots)^{-1} s / damp
        u_l = P_l Q_l^T / damp - sum_j w_j P_{l,j} Q_{l,j}^T
        theta = (1 - lr * weight_decay) * theta - lr * (momentum * v + u)

    The scalar products add the per-tensor Frobenius products, so the
    preconditioner sees the whole (compressed) gradient and keeps cross-layer
    correlations (the paper's "global" LR-MFAC). 1-D tensors (biases, norm
    scales) are stored exactly and get no error feedback (EFCP App. I).

    The EFCP code applies momentum as ``v = mu v + (1 - mu) u`` and an L2 decay;
    here the family's shared convention applies (``v = mu v + u``, decoupled decay).

    State per parameter: ``error`` (float32, shaped like the parameter), ``lowrank_q``
    (``[p_l, r]`` warm start, initialised from ``randn`` with ``seed``),
    ``ring_p`` ``[m, n_l, r]``, ``ring_q`` ``[m, p_l, r]`` (``[m, 1, r]`` and
    ``[m, 1, r]`` for 1-D tensors), ``step``; per group (first parameter):
    ``dots``, ``ring_slot``, ``ring_filled``. Memory ``4 m r sum_l (n_l + p_l)``
    bytes for the window.

    Sharded parameters (FSDP2's ``Shard(0)`` and ``Replicate()`` DTensors, on a 1-D
    mesh or along the shard dimension of a 2-D HSDP one): each rank keeps its rows
    of ``error`` and ``ring_p`` and the whole ``lowrank_q`` and ``ring_q``; the power iteration's sums over rows are all-reduced (see
    :meth:`LowRankWindow.compress_row_sharded <tritonopt.optim._windows.LowRankWindow.compress_row_sharded>`),
    and the result equals the unsharded optimizer's up to the order of the float32 sums.

    Args:
        lr, ngrads, damp, momentum, weight_decay, max_update_norm, per_group_windows,
            track_error_norm, on_nonfinite: as :class:`tritonopt.optim.mfac.MFAC`.
        rank: ``r``, the rank of each stored tensor (EFCP evaluates 1-8; 4 is used).
        seed: seeds the warm-start ``Q`` initialisation.
    """

    ALGO = "lowrank_mfac"
    WINDOW = LowRankWindow
    WEIGHTS = staticmethod(mfac_weights)
    SCALE = "damp"
    FREEZE_BY_ZERO_ACCUMULATOR = False
    SHARDING_REFUSAL = None

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        rank: int = 4,
        ngrads: int = 1024,
        damp: float = 1e-5,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        max_update_norm: Optional[float] = None,
        per_group_windows: bool = False,
        track_error_norm: bool = False,
        on_nonfinite: str = "skip",
    ):
        check_int("seed", seed, low=0)
        self._seed = seed
        defaults = dict(
            lr=lr, rank=rank, ngrads=ngrads, damp=damp, momentum=momentum, weight_decay=weight_decay
        )
        defaults["max_update_norm"] = max_update_norm
        super().__init__(params, defaults, on_nonfinite, per_group_windows=per_group_windows,
                         track_error_norm=track_error_norm)

    def _initial_window(self, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        return LowRankWindow.initial_state(self.state, group, layout, dtype, seed=self._seed)

    def _packed_group(self, index: int, groups: list[dict], params: list[torch.Tensor]) -> PackedGroup:
        packed = super()._packed_group(index, groups, params)
        packed.shards = self._shards  # the window's power iteration sums over the ranks' rows
        return packed

    def _resharded_layout(self, name: str, value: torch.Tensor, p) -> Optional[bool]:
        if name != "ring_p":
            return super()._resharded_layout(name, value, p)
        laid_out = value.dim() == 3 and value.shape[1] == unfolded_shape(p)[0]
        if is_sharded(value):
            return laid_out and is_row_sharded(p) and list(value.placements) == rows_placements(p, 1)
        return laid_out

    def _sharded_state(self, saved_state: dict) -> dict:
        """As the base class's, with each ``Shard(0)`` tensor's ``ring_p`` (its rows, ``[m, n_a, r]``) shown as
        the rank's part of an ``[m, n, r]`` DTensor, so that ``torch.distributed.checkpoint`` saves every
        rank's rows. ``lowrank_q``, ``ring_q`` and ``dots`` are the same on every rank and stay plain."""
        shown = super()._sharded_state(saved_state)
        params = [p for group in self.param_groups for p in group["params"]]
        for key, entry in shown.items():
            p, ring_p = params[key], entry.get("ring_p")
            if isinstance(ring_p, torch.Tensor) and is_row_sharded(p):
                shape = (ring_p.shape[0], p.shape[0], ring_p.shape[2])
                entry["ring_p"] = DTensor.from_local(ring_p.clone(), p.device_mesh, rows_placements(p, 1),
                                                     run_check=False, shape=shape,
                                                     stride=(shape[1] * shape[2], shape[2], 1))
        return shown
