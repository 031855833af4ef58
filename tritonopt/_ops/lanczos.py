"""The Gram-Schmidt ops of Lanczos: declarations (kernels and references: :mod:`tritonopt.kernels.lanczos`).

``gram_schmidt_project`` (the fused single-process projection),
``gram_schmidt_coefficients`` and ``gram_schmidt_subtract`` (its two halves, for
a distributed run with an ``all_reduce`` between them).
"""

from __future__ import annotations

import torch

from tritonopt._ops._registry import define_op
from tritonopt._validation import check_int, check_row_major, check_same_device, check_tensor
from tritonopt.kernels import lanczos as _kernels

__all__ = ["gram_schmidt_coefficients", "gram_schmidt_project", "gram_schmidt_subtract"]

_DTYPES = (torch.float32, torch.float64)
MAX_PASSES = 3


def _check_basis_and_vector(basis, h) -> None:
    check_tensor("basis", basis)
    check_tensor("h", h)
    check_tensor("basis", basis, ndim=2)
    if h.dim() != 1 or h.shape[0] != basis.shape[1]:
        raise ValueError(f"h must be 1-D with basis.shape[1]={basis.shape[1]} entries, got shape {tuple(h.shape)}")
    check_tensor("basis", basis, dtypes=_DTYPES)
    if h.dtype != basis.dtype:
        raise TypeError(f"h must have basis's dtype {basis.dtype}, got {h.dtype}")
    check_same_device("basis", basis, h=h)
    check_row_major("basis", basis)
    check_tensor("h", h, contiguous=True)


@define_op("gram_schmidt_project", nvtx="tritonopt/lanczos/gram_schmidt")
def gram_schmidt_project(
    basis: torch.Tensor, h: torch.Tensor, num_rows: int, passes: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Orthogonalise ``h`` against the first ``num_rows`` rows of ``basis`` (Lanczos, FOSI Alg. 1 line 8).

    Args:
        basis: ``[m, n]`` float32 or float64, row-major (rows may be padded, e.g. the
            ``[:, :n]`` view of an ``[m, ceil16(n)]`` buffer); row ``j`` is a basis
            vector (rows ``0..num_rows-1`` are assumed orthonormal).
        h: ``[n]``, basis's dtype and device, contiguous. Not modified.
        num_rows: how many leading rows take part, ``0 <= num_rows <= m``; the
            other rows are never read.
        passes: rounds of classical Gram-Schmidt: 1 (CGS, the paper) or 2
            (CGS2, the FOSI reference code; needed in float32), at most 3.

    Returns:
        ``(h_orth, coef, sq_norm)``: ``h_orth = h - D^T coef`` after all passes,
        ``coef`` (``[num_rows]``) the coefficients summed over the passes
        (``coef = D h`` in exact arithmetic), and ``sq_norm = ||h_orth||^2``
        (0-d), all in basis's dtype.

    Raises:
        TypeError / ValueError: naming the offending argument.
    """
    _check_basis_and_vector(basis, h)
    check_int("num_rows", num_rows, low=0, high=basis.shape[0])
    check_int("passes", passes, low=1, high=MAX_PASSES)


@gram_schmidt_project.register_fake
def _(basis, h, num_rows, passes=2):
    return torch.empty_like(h), basis.new_empty((num_rows,)), basis.new_empty(())


gram_schmidt_project.register_backends(
    triton=_kernels.gram_schmidt_project_triton, reference=_kernels.gram_schmidt_project_reference
)


@define_op("gram_schmidt_coefficients", nvtx="tritonopt/lanczos/gs_coefficients")
def gram_schmidt_coefficients(basis: torch.Tensor, h: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``basis[:num_rows] @ h`` (``[num_rows]``): the first half of one Gram-Schmidt pass.

    On a row shard of a distributed basis this is the local partial of the
    coefficients (DHO2 Alg. 2 line 9, before the ``all_reduce``). Same argument
    rules as :func:`gram_schmidt_project`.
    """
    _check_basis_and_vector(basis, h)
    check_int("num_rows", num_rows, low=0, high=basis.shape[0])


@gram_schmidt_coefficients.register_fake
def _(basis, h, num_rows):
    return basis.new_empty((num_rows,))


gram_schmidt_coefficients.register_backends(
    triton=_kernels.gram_schmidt_coefficients_triton, reference=_kernels.gram_schmidt_coefficients_reference
)


@define_op("gram_schmidt_subtract", nvtx="tritonopt/lanczos/gs_subtract")
def gram_schmidt_subtract(
    basis: torch.Tensor, h: torch.Tensor, coef: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h - basis[:len(coef)]^T coef, its squared norm)``: the second half of a pass.

    On a row shard this is DHO2 Alg. 2 line 10 plus the local term of line 12.
    ``coef`` has at most ``m`` entries, basis's dtype and device. ``h`` is not modified.
    """
    _check_basis_and_vector(basis, h)
    check_tensor("coef", coef)
    if coef.dim() != 1 or coef.shape[0] > basis.shape[0]:
        raise ValueError(
            f"coef must be 1-D with at most basis.shape[0]={basis.shape[0]} entries, got shape {tuple(coef.shape)}"
        )
    if coef.dtype != basis.dtype:
        raise TypeError(f"coef must have basis's dtype {basis.dtype}, got {coef.dtype}")
    check_same_device("basis", basis, coef=coef)
    check_tensor("coef", coef, contiguous=True)


@gram_schmidt_subtract.register_fake
def _(basis, h, coef):
    return torch.empty_like(h), h.new_empty(())


gram_schmidt_subtract.register_backends(
    triton=_kernels.gram_schmidt_subtract_triton, reference=_kernels.gram_schmidt_subtract_reference
)
