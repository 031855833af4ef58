"""The Gram-Schmidt ops of Lanczos: validation, registration and dispatch.

``tritonopt::gram_schmidt_project`` (the fused single-process projection),
``tritonopt::gram_schmidt_coefficients`` and ``tritonopt::gram_schmidt_subtract``
(its two halves, for a distributed run with an ``all_reduce`` between them).
Kernels and references live in :mod:`tritonopt.kernels.lanczos`.
"""

from __future__ import annotations

import torch

from tritonopt._runtime import nvtx_range, select_backend
from tritonopt.kernels import lanczos as _kernels

__all__ = ["gram_schmidt_coefficients", "gram_schmidt_project", "gram_schmidt_subtract"]

_DTYPES = (torch.float32, torch.float64)
MAX_PASSES = 3


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must satisfy {low} <= {name} <= {high}, got {value}")


def _check_basis_and_vector(basis, h) -> None:
    if not isinstance(basis, torch.Tensor):
        raise TypeError(f"basis must be a torch.Tensor, got {type(basis).__name__}")
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    if basis.dim() != 2:
        raise ValueError(f"basis must be 2-D [m, n], got shape {tuple(basis.shape)}")
    if h.dim() != 1 or h.shape[0] != basis.shape[1]:
        raise ValueError(
            f"h must be 1-D with basis.shape[1]={basis.shape[1]} entries, got shape {tuple(h.shape)}"
        )
    if basis.dtype not in _DTYPES:
        raise TypeError(f"basis must be float32 or float64, got {basis.dtype}")
    if h.dtype != basis.dtype:
        raise TypeError(f"h must have basis's dtype {basis.dtype}, got {h.dtype}")
    if h.device != basis.device:
        raise ValueError(f"h is on {h.device} but basis is on {basis.device}")
    if not basis.is_contiguous():
        raise ValueError("basis must be contiguous (row-major, one basis vector per row)")
    if not h.is_contiguous():
        raise ValueError("h must be contiguous (call .contiguous())")


def _check_project_args(basis, h, num_rows, passes) -> None:
    _check_basis_and_vector(basis, h)
    _check_int("num_rows", num_rows, 0, basis.shape[0])
    _check_int("passes", passes, 1, MAX_PASSES)


def _check_coefficients_args(basis, h, num_rows) -> None:
    _check_basis_and_vector(basis, h)
    _check_int("num_rows", num_rows, 0, basis.shape[0])


def _check_subtract_args(basis, h, coef) -> None:
    _check_basis_and_vector(basis, h)
    if not isinstance(coef, torch.Tensor):
        raise TypeError(f"coef must be a torch.Tensor, got {type(coef).__name__}")
    if coef.dim() != 1 or coef.shape[0] > basis.shape[0]:
        raise ValueError(
            f"coef must be 1-D with at most basis.shape[0]={basis.shape[0]} entries, "
            f"got shape {tuple(coef.shape)}"
        )
    if coef.dtype != basis.dtype:
        raise TypeError(f"coef must have basis's dtype {basis.dtype}, got {coef.dtype}")
    if coef.device != basis.device:
        raise ValueError(f"coef is on {coef.device} but basis is on {basis.device}")
    if not coef.is_contiguous():
        raise ValueError("coef must be contiguous")


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("tritonopt::gram_schmidt_project", mutates_args=())
def _project_op(
    basis: torch.Tensor, h: torch.Tensor, num_rows: int, passes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_project_args(basis, h, num_rows, passes)
    with nvtx_range("tritonopt/lanczos/gram_schmidt"):
        if select_backend(basis.device) == "triton":
            return _kernels.gram_schmidt_project_triton(basis, h, num_rows, passes)
        return _kernels.gram_schmidt_project_reference(basis, h, num_rows, passes)


@_project_op.register_fake
def _project_fake(basis, h, num_rows, passes):
    _check_project_args(basis, h, num_rows, passes)
    return torch.empty_like(h), basis.new_empty((num_rows,)), basis.new_empty(())


@torch.library.custom_op("tritonopt::gram_schmidt_coefficients", mutates_args=())
def _coefficients_op(basis: torch.Tensor, h: torch.Tensor, num_rows: int) -> torch.Tensor:
    _check_coefficients_args(basis, h, num_rows)
    with nvtx_range("tritonopt/lanczos/gs_coefficients"):
        if select_backend(basis.device) == "triton":
            return _kernels.gram_schmidt_coefficients_triton(basis, h, num_rows)
        return _kernels.gram_schmidt_coefficients_reference(basis, h, num_rows)


@_coefficients_op.register_fake
def _coefficients_fake(basis, h, num_rows):
    _check_coefficients_args(basis, h, num_rows)
    return basis.new_empty((num_rows,))


@torch.library.custom_op("tritonopt::gram_schmidt_subtract", mutates_args=())
def _subtract_op(
    basis: torch.Tensor, h: torch.Tensor, coef: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_subtract_args(basis, h, coef)
    with nvtx_range("tritonopt/lanczos/gs_subtract"):
        if select_backend(basis.device) == "triton":
            return _kernels.gram_schmidt_subtract_triton(basis, h, coef)
        return _kernels.gram_schmidt_subtract_reference(basis, h, coef)


@_subtract_op.register_fake
def _subtract_fake(basis, h, coef):
    _check_subtract_args(basis, h, coef)
    return torch.empty_like(h), h.new_empty(())


# --------------------------------------------------------------------------- public


def gram_schmidt_project(
    basis: torch.Tensor, h: torch.Tensor, num_rows: int, passes: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Orthogonalise ``h`` against the first ``num_rows`` rows of ``basis`` (Lanczos, FOSI Alg. 1 line 8).

    Args:
        basis: ``[m, n]`` float32 or float64, contiguous; row ``j`` is a basis
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
    _check_project_args(basis, h, num_rows, passes)
    return torch.ops.tritonopt.gram_schmidt_project(basis, h, num_rows, passes)


def gram_schmidt_coefficients(basis: torch.Tensor, h: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``basis[:num_rows] @ h`` (``[num_rows]``): the first half of one Gram-Schmidt pass.

    On a row shard of a distributed basis this is the local partial of the
    coefficients (DHO2 Alg. 2 line 9, before the ``all_reduce``). Same argument
    rules as :func:`gram_schmidt_project`.
    """
    _check_coefficients_args(basis, h, num_rows)
    return torch.ops.tritonopt.gram_schmidt_coefficients(basis, h, num_rows)


def gram_schmidt_subtract(
    basis: torch.Tensor, h: torch.Tensor, coef: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h - basis[:len(coef)]^T coef, its squared norm)``: the second half of a pass.

    On a row shard this is DHO2 Alg. 2 line 10 plus the local term of line 12.
    ``coef`` has at most ``m`` entries, basis's dtype and device. ``h`` is not modified.
    """
    _check_subtract_args(basis, h, coef)
    return torch.ops.tritonopt.gram_schmidt_subtract(basis, h, coef)
