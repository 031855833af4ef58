"""``lowrank_ef`` and ``lowrank_frobenius_products``: declarations.

Math, kernels and reference: :mod:`tritonopt.kernels.lowrank`.
"""

from __future__ import annotations

import torch

from tritonopt._ops._registry import define_op
from tritonopt._validation import FLOAT_DTYPES, check_disjoint, check_same_device, check_tensor
from tritonopt.kernels import lowrank as _kernels
# Its Gram-Schmidt thresholds, for the optimizers that run the same orthogonalisation over shards.
from tritonopt.kernels.lowrank import DEPENDENT_TOLERANCE, GRAM_SCHMIDT_EPS  # noqa: F401

__all__ = ["lowrank_ef", "lowrank_frobenius_products"]


# On CUDA tensors the cuBLAS reference runs unless Triton is forced: on an H100 the kernel ran at
# 0.60-0.92x the speed of the torch composite (perf/results/nvidia-h100-80gb-hbm3/lowrank.csv).
@define_op("lowrank_ef", mutates_args=("error",), nvtx="tritonopt/lowrank/compress",
           cuda_default="reference")
def lowrank_ef(grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        ``P Q^T``), float32; ``P Q^T`` approximates ``A = error + grad``. A 1-D
        ``grad`` passes through exactly: ``P = [grad, 0, ...]``, ``Q = [[1, 0, ...]]``
        (EFCP App. I).
    """
    check_tensor("grad", grad, ndim=(1, 2), dtypes=FLOAT_DTYPES)
    check_tensor("error", error, shape=grad.shape, dtypes=(torch.float32,))
    check_tensor("q", q, dtypes=(torch.float32,))
    expected_rows = 1 if grad.dim() == 1 else grad.shape[1]
    if q.dim() != 2 or q.shape[0] != expected_rows or q.shape[1] < 1:
        raise ValueError(
            f"q must be [{expected_rows}, rank] with rank >= 1 (p = grad.shape[1]; 1 for a 1-D grad), "
            f"got shape {tuple(q.shape)}"
        )
    check_same_device("grad", grad, error=error, q=q)
    check_tensor("grad", grad, contiguous=True)
    check_tensor("q", q, contiguous=True)
    check_tensor("error", error, updated_in_place=True)
    check_disjoint({"grad": grad, "error": error, "q": q}, updated=("error",))


@lowrank_ef.register_fake
def _(grad, error, q):
    q_rows = 1 if grad.dim() == 1 else grad.shape[1]
    return (
        grad.new_empty((grad.shape[0], q.shape[1]), dtype=torch.float32),
        grad.new_empty((q_rows, q.shape[1]), dtype=torch.float32),
    )


lowrank_ef.register_backends(triton=_kernels.lowrank_ef_triton, reference=_kernels.lowrank_ef_reference)


@define_op("lowrank_frobenius_products", composite=True)
def lowrank_frobenius_products(
    ring_p: torch.Tensor, ring_q: torch.Tensor, p: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """``<P_j Q_j^T, P Q^T>_F = sum((P_j^T P) * (Q_j^T Q))`` for every stored pair ``j`` (``[m]``).

    ``ring_p``: ``[m, n, r]``, ``ring_q``: ``[m, p, r]``; ``p``: ``[n, r]``, ``q``: ``[p, r]``;
    one floating dtype. Costs ``O(m r^2 (n + p))`` instead of the ``O(m n p)`` of the dense product.
    """
    for name, t in (("ring_p", ring_p), ("ring_q", ring_q), ("p", p), ("q", q)):
        check_tensor(name, t)
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    check_same_device("ring_p", ring_p, ring_q=ring_q, p=p, q=q)
    if len({t.dtype for t in (ring_p, ring_q, p, q)}) != 1:
        raise TypeError("ring_p, ring_q, p and q must share one dtype")
    if ring_p.dim() != 3 or ring_q.dim() != 3 or ring_p.shape[0] != ring_q.shape[0]:
        raise ValueError("ring_p and ring_q must be [m, n, r] and [m, p, r] with the same m")
    if p.shape != ring_p.shape[1:] or q.shape != ring_q.shape[1:]:
        raise ValueError(
            f"p and q must be {tuple(ring_p.shape[1:])} and {tuple(ring_q.shape[1:])}, "
            f"got {tuple(p.shape)} and {tuple(q.shape)}"
        )


def _frobenius_products(ring_p, ring_q, p, q):
    left = torch.matmul(ring_p.transpose(1, 2), p)  # [m, r, r]
    right = torch.matmul(ring_q.transpose(1, 2), q)
    return (left * right).sum(dim=(1, 2))


lowrank_frobenius_products.register_backends(reference=_frobenius_products)
