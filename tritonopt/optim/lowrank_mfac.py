"""LR-MFAC: M-FAC over a window of low-rank, error-feedback compressed gradients (EFCP sec. 3.2, App. I)."""

from __future__ import annotations

from typing import Iterable

import torch

from tritonopt._ops.lowrank import lowrank_ef, lowrank_frobenius_products
from tritonopt._runtime import nvtx_range
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._mfac_common import PackedGroup, WindowedPreconditioner, check_int, check_number
from tritonopt.optim._mfac_core import mfac_coefficients, update_dots

__all__ = ["LowRankMFAC"]


def _unfolded_shape(p: torch.Tensor) -> tuple[int, int]:
    """``[n, p]`` with ``n = shape[0]``; a 1-D tensor is ``[n, 1]`` (stored uncompressed)."""
    n = p.shape[0] if p.dim() else 1
    return n, (p.numel() // n if n else 0)


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

    Args:
        lr, ngrads, damp, momentum, weight_decay, on_nonfinite: as
            :class:`tritonopt.optim.mfac.MFAC`.
        rank: ``r``, the rank of each stored tensor (EFCP evaluates 1-8; 4 is used).
        seed: seeds the warm-start ``Q`` initialisation.
    """

    ALGO = "lowrank_mfac"
    ERROR_FEEDBACK = True
    FREEZE_BY_ZERO_ACCUMULATOR = False

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
        on_nonfinite: str = "skip",
    ):
        check_int("seed", seed, low=0)
        self._seed = seed
        defaults = dict(
            lr=lr, rank=rank, ngrads=ngrads, damp=damp, momentum=momentum, weight_decay=weight_decay
        )
        super().__init__(params, defaults, on_nonfinite)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        check_number("damp", group["damp"], low_open=True)
        check_int("rank", group["rank"])

    def _work_dtype(self, params):
        return torch.float32

    def _init_ring(self, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        m, rank = group["ngrads"], group["rank"]
        gen = torch.Generator().manual_seed(self._seed)
        for p in layout.tensors:
            state = self.state[p]
            n, cols = _unfolded_shape(p)
            compressed = p.dim() >= 2
            if "lowrank_q" not in state:
                f32 = dict(dtype=torch.float32)  # whatever torch's default dtype is
                q = (torch.randn((cols, rank), generator=gen, **f32) if compressed
                     else torch.zeros((1, rank), **f32))
                state["lowrank_q"] = q.to(p.device)
                state["ring_p"] = torch.zeros((m, n, rank), device=p.device, **f32)
                state["ring_q"] = torch.zeros((m, cols if compressed else 1, rank), device=p.device, **f32)
            expected = (m, n, rank)
            if tuple(state["ring_p"].shape) != expected:
                raise ValueError(
                    f"state 'ring_p' has shape {tuple(state['ring_p'].shape)}, expected {expected}; "
                    "were ngrads or rank changed?"
                )
        return {
            "dots": torch.zeros((m, m), dtype=torch.float64, device=layout.device),
            "ring_slot": 0,
            "ring_filled": 0,
        }

    def _direction(self, group: dict, packed: PackedGroup, ring: dict) -> torch.Tensor:
        damp = group["damp"]
        layout = packed.layout
        params = layout.tensors
        slot = self._advance(ring)
        m = ring["dots"].shape[0]
        products = torch.zeros(m, dtype=torch.float64, device=layout.device)
        grads, errors = layout.views(packed.grad), layout.views(packed.error)
        with nvtx_range("tritonopt/lowrank_mfac/compress"):
            for p, active, g, e in zip(params, packed.active, grads, errors):
                state = self.state[p]
                if not active:  # stores a zero row; its own state is left alone
                    state["ring_p"][slot].zero_()
                    state["ring_q"][slot].zero_()
                    continue
                n, cols = _unfolded_shape(p)
                if p.dim() >= 2:
                    factor_p, factor_q = lowrank_ef(g.view(n, cols), e.view(n, cols), state["lowrank_q"])
                    state["lowrank_q"].copy_(factor_q)
                else:
                    factor_p, factor_q = lowrank_ef(g.reshape(-1), e.reshape(-1), state["lowrank_q"])
                state["ring_p"][slot].copy_(factor_p)
                state["ring_q"][slot].copy_(factor_q)
        with nvtx_range("tritonopt/lowrank_mfac/sp"):
            for p in params:
                state = self.state[p]
                products += lowrank_frobenius_products(
                    state["ring_p"], state["ring_q"], state["ring_p"][slot], state["ring_q"][slot]
                ).double()
        with nvtx_range("tritonopt/lowrank_mfac/solve"):
            update_dots(ring["dots"], slot, products)
            weights = mfac_coefficients(ring["dots"], products, damp).to(torch.float32)
        direction = torch.zeros_like(packed.grad)
        with nvtx_range("tritonopt/lowrank_mfac/lcg"):
            for p, out in zip(params, layout.views(direction)):
                state = self.state[p]
                ring_p, ring_q = state["ring_p"], state["ring_q"]
                rank = ring_p.shape[2]
                n = ring_p.shape[1]
                # sum_j w_j P_j Q_j^T as one GEMM over the concatenated factors [n, m r] x [m r, p]
                left = (ring_p * weights.view(m, 1, 1)).permute(1, 0, 2).reshape(n, m * rank)
                right = ring_q.permute(1, 0, 2).reshape(ring_q.shape[1], m * rank)
                new = ring_p[slot] @ ring_q[slot].T / damp
                out.view(n, -1).copy_(new - left @ right.T)
        return direction
