"""The ``tritonopt::lowrank_ef`` custom op: one warm-started power iteration with error feedback.

Math, kernels and reference: :mod:`tritonopt.kernels.lowrank`.
"""

from __future__ import annotations

import torch

from tritonopt._runtime import nvtx_range, select_backend
from tritonopt.kernels import lowrank as _kernels

__all__ = ["lowrank_ef", "lowrank_frobenius_products"]

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_lowrank_args(grad, error, q) -> None:
    for name, t in (("grad", grad), ("error", error), ("q", q)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if grad.dim() not in (1, 2):
        raise ValueError(f"grad must be 1-D or 2-D [n, p] (unfold it first), got shape {tuple(grad.shape)}")
    if error.shape != grad.shape:
        raise ValueError(f"error must have grad's shape {tuple(grad.shape)}, got {tuple(error.shape)}")
    if grad.dtype not in _GRAD_DTYPES:
        raise TypeError(f"grad must be float32, float16 or bfloat16, got {grad.dtype}")
    if error.dtype != torch.float32:
        raise TypeError(f"error must be float32, got {error.dtype}")
    if q.dtype != torch.float32:
        raise TypeError(f"q must be float32, got {q.dtype}")
    expected_rows = 1 if grad.dim() == 1 else grad.shape[1]
    if q.dim() != 2 or q.shape[0] != expected_rows or q.shape[1] < 1:
        raise ValueError(
            f"q must be [{expected_rows}, rank] with rank >= 1 (p = grad.shape[1]; 1 for a 1-D grad), "
            f"got shape {tuple(q.shape)}"
        )
    for name, t in (("error", error), ("q", q)):
        if t.device != grad.device:
            raise ValueError(f"{name} is on {t.device} but grad is on {grad.device}")
    for name, t in (("grad", grad), ("error", error), ("q", q)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if error.requires_grad:
        raise ValueError("error must not require grad: it is updated in place")


@torch.library.custom_op("tritonopt::lowrank_ef", mutates_args=("error",))
def _lowrank_ef_op(
    grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_lowrank_args(grad, error, q)
    with nvtx_range("tritonopt/lowrank/compress"):
        if select_backend(grad.device) == "triton":
            return _kernels.lowrank_ef_triton(grad, error, q)
        return _kernels.lowrank_ef_reference(grad, error, q)


@_lowrank_ef_op.register_fake
def _lowrank_ef_fake(grad, error, q):
    _check_lowrank_args(grad, error, q)
    rank = q.shape[1]
    q_rows = 1 if grad.dim() == 1 else grad.shape[1]
    return (
        grad.new_empty((grad.shape[0], rank), dtype=torch.float32),
        grad.new_empty((q_rows, rank), dtype=torch.float32),
    )


def lowrank_ef(
    grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``r`` compression of ``error + grad`` by one power iteration warm-started at ``q``.

    Args:
        grad: ``[n, p]`` (a tensor unfolded to its first dimension) or ``[n]``;
            float32, float16 or bfloat16, contiguous.
        error: same shape, float32: the error-feedback buffer, updated in place to
            ``error + grad - P Q^T`` (left unchanged for a 1-D ``grad``).
        q: ``[p, r]`` float32 warm start (``[1, r]`` for a 1-D grad, ignored).

    Returns:
        ``(P, Q)``: ``P`` ``[n, r]`` with orthonormal (or zero) columns and
        ``Q = A^T P`` ``[p, r]`` (the next warm start; where a column of ``P`` is
        zero, ``Q`` keeps the warm start's column, which adds nothing to
        ``P Q^T``), float32; ``P Q^T`` approximates ``A = error + grad``. A 1-D ``grad`` passes through exactly:
        ``P = [grad, 0, ...]``, ``Q = [[1, 0, ...]]`` (EFCP App. I).
    """
    _check_lowrank_args(grad, error, q)
    return torch.ops.tritonopt.lowrank_ef(grad, error, q)


def lowrank_frobenius_products(
    ring_p: torch.Tensor, ring_q: torch.Tensor, p: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """``<P_j Q_j^T, P Q^T>_F = sum((P_j^T P) * (Q_j^T Q))`` for every stored pair ``j`` (``[m]``).

    ``ring_p``: ``[m, n, r]``, ``ring_q``: ``[m, p, r]``; ``p``: ``[n, r]``, ``q``: ``[p, r]``.
    Costs ``O(m r^2 (n + p))`` instead of the ``O(m n p)`` of the dense product.
    """
    for name, t in (("ring_p", ring_p), ("ring_q", ring_q), ("p", p), ("q", q)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.device != ring_p.device:
            raise ValueError(f"{name} is on {t.device} but ring_p is on {ring_p.device}")
    if len({t.dtype for t in (ring_p, ring_q, p, q)}) != 1:
        raise TypeError("ring_p, ring_q, p and q must share one dtype")
    if ring_p.dim() != 3 or ring_q.dim() != 3 or ring_p.shape[0] != ring_q.shape[0]:
        raise ValueError("ring_p and ring_q must be [m, n, r] and [m, p, r] with the same m")
    if p.shape != ring_p.shape[1:] or q.shape != ring_q.shape[1:]:
        raise ValueError(
            f"p and q must be {tuple(ring_p.shape[1:])} and {tuple(ring_q.shape[1:])}, "
            f"got {tuple(p.shape)} and {tuple(q.shape)}"
        )
    left = torch.matmul(ring_p.transpose(1, 2), p)  # [m, r, r]
    right = torch.matmul(ring_q.transpose(1, 2), q)
    return (left * right).sum(dim=(1, 2))
