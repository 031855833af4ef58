"""The K-FAC ops: declarations (kernels, references and layouts: :mod:`tritonopt.kernels.kfac`).

``kfac_factor_update``, ``eigenbasis_precondition``, ``eigenbasis_precondition_prediv``,
``eigen_inv_denominator``, ``triu_pack`` and ``triu_unpack``.
"""

from __future__ import annotations

from typing import Optional

import torch

from tritonopt._ops._registry import define_op
from tritonopt._validation import (
    FLOAT_DTYPES,
    check_bool,
    check_choice,
    check_disjoint,
    check_float,
    check_int,
    check_row_major,
    check_same_device,
    check_tensor,
    dtype_names,
)
from tritonopt.kernels import kfac as _kernels

__all__ = [
    "eigen_inv_denominator",
    "eigenbasis_precondition",
    "eigenbasis_precondition_prediv",
    "kfac_factor_update",
    "triu_pack",
    "triu_unpack",
]


def _check_dtype_argument(dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be torch.{dtype_names(FLOAT_DTYPES)}, got {dtype!r}")


# --------------------------------------------------------------------------- factor update


# On CUDA tensors these products run their cuBLAS reference unless Triton is forced: on an H100
# the kernels ran at 0.06-0.76x (factor update) and 0.26-1.04x (preconditioning) the speed of the
# torch composite (perf/results/nvidia-h100-80gb-hbm3/kfac.csv).
@define_op("kfac_factor_update", mutates_args=("factor",), nvtx="tritonopt/kfac/factor_update",
           cuda_default="reference")
def kfac_factor_update(
    factor: torch.Tensor,
    x: torch.Tensor,
    decay: float,
    append_bias: bool = False,
    scale: float = 1.0,
    precision: str = _kernels.DEFAULT_PRECISION,
) -> None:
    """Fused K-FAC running average, in place: ``factor <- decay * factor + (1 - decay) X^T X / n``.

    ``X = scale * [x, 1]`` with ``append_bias`` (the bias column of ones is implicit,
    never materialised), else ``scale * x``; ``n = x.shape[0]`` (KAISA paper sec. 2.1.2).
    For a Linear layer ``x`` is the input reshaped to ``[n, in_features]`` (A factor)
    or the output gradient ``[n, out_features]`` (G factor); for a Conv2d layer the
    unfolded patches ``[N * S, C_in * kh * kw]`` or the output gradient
    ``[N * S, C_out]``, with ``scale = 1 / S`` (S output positions), as the
    reference implementation does.

    Args:
        factor: ``[dim, dim]`` float32, row-major, ``dim = x.shape[1] + append_bias``. Rows
            may be padded: the ``[:, :dim]`` view of a ``[dim, stride]`` buffer with ``stride``
            a multiple of 4 (K-FAC's layout, :func:`tritonopt.optim.kfac_functional.factor_buffer`)
            loads in vectors on a GPU whatever ``dim`` is.
            Only its upper triangle is read; it is written symmetric to the last bit.
            Not read at all when ``decay == 0``.
        x: ``[n, in_dim]``, float32/float16/bfloat16, any strides; products
            accumulate in fp32.
        decay: in ``[0, 1]``.
        precision: matrix-unit precision on the GPU (``"tf32x3"``, ``"ieee"``, ``"tf32"``).

    Raises:
        TypeError / ValueError: naming the offending argument, before anything is modified.
    """
    check_tensor("factor", factor)
    check_tensor("x", x)
    check_float("decay", decay, low=0.0, high=1.0)
    check_bool("append_bias", append_bias)
    check_float("scale", scale)
    check_choice("precision", precision, _kernels.PRECISIONS)
    check_tensor("x", x, ndim=2)
    if x.shape[0] == 0:
        raise ValueError("x must have at least one row (n >= 1)")
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    dim = x.shape[1] + int(append_bias)
    if factor.shape != (dim, dim):
        raise ValueError(
            f"factor must be [{dim}, {dim}] (x's {x.shape[1]} columns"
            f"{' + the bias column' if append_bias else ''}), got {tuple(factor.shape)}"
        )
    check_tensor("factor", factor, dtypes=(torch.float32,))
    check_same_device("factor", factor, x=x)
    check_row_major("factor", factor, updated_in_place=True)
    check_disjoint({"factor": factor, "x": x}, updated=("factor",))


@kfac_factor_update.register_fake
def _(factor, x, decay, append_bias=False, scale=1.0, precision=_kernels.DEFAULT_PRECISION):
    return None


def _factor_update_reference(factor, x, decay, append_bias=False, scale=1.0, precision=None):
    _kernels.kfac_factor_update_reference(factor, x, decay, append_bias, scale)


def _factor_update_triton(factor, x, decay, append_bias=False, scale=1.0, precision=_kernels.DEFAULT_PRECISION):
    _kernels.kfac_factor_update_triton(factor, x, decay, append_bias, scale, precision)


kfac_factor_update.register_backends(triton=_factor_update_triton, reference=_factor_update_reference)


# --------------------------------------------------------------------------- preconditioning


def _check_eigenbases(grad, qa, qg, precision) -> None:
    check_tensor("grad", grad)
    check_tensor("qa", qa)
    check_tensor("qg", qg)
    check_choice("precision", precision, _kernels.PRECISIONS)
    check_tensor("grad", grad, ndim=2)
    g_dim, a_dim = grad.shape
    if qa.shape != (a_dim, a_dim):
        raise ValueError(f"qa must be [{a_dim}, {a_dim}] (grad's columns), got {tuple(qa.shape)}")
    if qg.shape != (g_dim, g_dim):
        raise ValueError(f"qg must be [{g_dim}, {g_dim}] (grad's rows), got {tuple(qg.shape)}")
    for name, t in (("grad", grad), ("qa", qa), ("qg", qg)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES)
    check_same_device("grad", grad, qa=qa, qg=qg)


@define_op("eigenbasis_precondition", nvtx="tritonopt/kfac/precondition", cuda_default="reference")
def eigenbasis_precondition(
    grad: torch.Tensor,
    qa: torch.Tensor,
    da: torch.Tensor,
    qg: torch.Tensor,
    dg: torch.Tensor,
    damping: float,
    precision: str = _kernels.DEFAULT_PRECISION,
) -> torch.Tensor:
    """K-FAC eigenbasis preconditioning (KAISA paper Eq. 15-17).

    ``P = QG [(QG^T grad QA) / (dG dA^T + damping)] QA^T``, which equals
    ``(A (x) G + damping I)^-1 vec(grad)`` for ``A = QA diag(dA) QA^T`` and
    ``G = QG diag(dG) QG^T`` (column-major ``vec``); equivalently ``P`` solves
    ``G P A + damping P = grad``.

    Args:
        grad: ``[g_dim, a_dim]`` (weight gradient as 2-D, bias gradient as the last column).
        qa, da: eigenvectors (columns) ``[a_dim, a_dim]`` and eigenvalues ``[a_dim]`` of A.
        qg, dg: the same for G, ``[g_dim, g_dim]`` and ``[g_dim]``.
        damping: ``> 0``, added to the products of eigenvalues.
        precision: GPU matrix-unit precision of the kernel; ``"tf32x3"`` (default) keeps fp32
            accuracy, plain ``"tf32"`` does not (see :mod:`tritonopt.kernels.kfac`). The
            reference, which CUDA tensors run unless Triton is forced, computes in full fp32.

    Returns:
        ``P``, float32, ``[g_dim, a_dim]``. Every input may be float32, float16 or
        bfloat16 (upcast on load); arithmetic is fp32.
    """
    _check_eigenbases(grad, qa, qg, precision)
    check_tensor("da", da)
    check_tensor("dg", dg)
    check_float("damping", damping, low=0.0, low_open=True)
    g_dim, a_dim = grad.shape
    if da.shape != (a_dim,):
        raise ValueError(f"da must be [{a_dim}] (grad's columns), got {tuple(da.shape)}")
    if dg.shape != (g_dim,):
        raise ValueError(f"dg must be [{g_dim}] (grad's rows), got {tuple(dg.shape)}")
    check_tensor("da", da, dtypes=FLOAT_DTYPES)
    check_tensor("dg", dg, dtypes=FLOAT_DTYPES)
    check_same_device("grad", grad, da=da, dg=dg)


@eigenbasis_precondition.register_fake
def _(grad, qa, da, qg, dg, damping, precision=_kernels.DEFAULT_PRECISION):
    return grad.new_empty(grad.shape, dtype=torch.float32)


eigenbasis_precondition.register_backends(
    triton=lambda grad, qa, da, qg, dg, damping, precision=_kernels.DEFAULT_PRECISION: (
        _kernels.eigenbasis_precondition_triton(grad, qa, da, qg, dg, damping, precision)
    ),
    reference=lambda grad, qa, da, qg, dg, damping, precision=None: (
        _kernels.eigenbasis_precondition_reference(grad, qa, da, qg, dg, damping)
    ),
)


@define_op("eigenbasis_precondition_prediv", nvtx="tritonopt/kfac/precondition", cuda_default="reference")
def eigenbasis_precondition_prediv(
    grad: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    inv_denominator: torch.Tensor,
    precision: str = _kernels.DEFAULT_PRECISION,
) -> torch.Tensor:
    """Eigenbasis preconditioning with the precomputed reciprocal (KAISA paper sec. 4.4).

    ``P = QG [(QG^T grad QA) * D] QA^T`` with ``D = eigen_inv_denominator(dg, da, damping)``
    computed once per eigendecomposition. Shapes and dtypes as
    :func:`eigenbasis_precondition`; ``inv_denominator`` is ``[g_dim, a_dim]``.
    """
    _check_eigenbases(grad, qa, qg, precision)
    check_tensor("inv_denominator", inv_denominator)
    if inv_denominator.shape != grad.shape:
        raise ValueError(
            f"inv_denominator must have grad's shape {tuple(grad.shape)}, got {tuple(inv_denominator.shape)}"
        )
    check_tensor("inv_denominator", inv_denominator, dtypes=FLOAT_DTYPES)
    check_same_device("grad", grad, inv_denominator=inv_denominator)


@eigenbasis_precondition_prediv.register_fake
def _(grad, qa, qg, inv_denominator, precision=_kernels.DEFAULT_PRECISION):
    return grad.new_empty(grad.shape, dtype=torch.float32)


eigenbasis_precondition_prediv.register_backends(
    triton=lambda grad, qa, qg, inv_denominator, precision=_kernels.DEFAULT_PRECISION: (
        _kernels.eigenbasis_precondition_prediv_triton(grad, qa, qg, inv_denominator, precision)
    ),
    reference=lambda grad, qa, qg, inv_denominator, precision=None: (
        _kernels.eigenbasis_precondition_prediv_reference(grad, qa, qg, inv_denominator)
    ),
)


@define_op("eigen_inv_denominator", composite=True)
def eigen_inv_denominator(dg: torch.Tensor, da: torch.Tensor, damping: float) -> torch.Tensor:
    """``D = 1 / (dG dA^T + damping)``, ``[g_dim, a_dim]`` float32 (KAISA paper sec. 4.4).

    An outer product and a reciprocal, computed once per eigendecomposition: a
    plain torch expression (no kernel needed).
    """
    check_tensor("dg", dg, dtypes=FLOAT_DTYPES)
    check_tensor("da", da, dtypes=FLOAT_DTYPES)
    check_float("damping", damping, low=0.0, low_open=True)
    if dg.dim() != 1 or da.dim() != 1:
        raise ValueError(f"dg and da must be 1-D, got shapes {tuple(dg.shape)} and {tuple(da.shape)}")
    check_same_device("dg", dg, da=da)


eigen_inv_denominator.register_backends(reference=_kernels.eigen_inv_denominator_reference)


# --------------------------------------------------------------------------- triangle packing


@define_op("triu_pack", nvtx="tritonopt/kfac/triu_pack")
def triu_pack(matrix: torch.Tensor, dtype: Optional[torch.dtype] = None, scale: float = 1.0) -> torch.Tensor:
    """The upper triangle of ``scale * matrix``, row by row, as a flat ``[d(d+1)/2]`` tensor.

    Entry ``(i, j)``, ``j >= i``, lands at ``i*d - i*(i-1)/2 + (j - i)``. Scaling is
    done in fp32 and the result cast once to ``dtype`` (default: the matrix's), so a
    factor can be packed to half precision for communication (KAISA paper sec. 4.3).
    ``matrix`` may have any strides; rows padded as K-FAC pads its factors load in vectors.
    """
    check_tensor("matrix", matrix)
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"matrix must be square 2-D, got shape {tuple(matrix.shape)}")
    check_tensor("matrix", matrix, dtypes=FLOAT_DTYPES)
    if dtype is not None:
        _check_dtype_argument(dtype)
    check_float("scale", scale)


@triu_pack.register_fake
def _(matrix, dtype=None, scale=1.0):
    return matrix.new_empty((_kernels.triu_numel(matrix.shape[0]),), dtype=dtype or matrix.dtype)


triu_pack.register_backends(
    triton=lambda matrix, dtype=None, scale=1.0: _kernels.triu_pack_triton(matrix, dtype or matrix.dtype, scale),
    reference=lambda matrix, dtype=None, scale=1.0: _kernels.triu_pack_reference(
        matrix, dtype or matrix.dtype, scale
    ),
)


@define_op("triu_unpack", nvtx="tritonopt/kfac/triu_unpack")
def triu_unpack(
    packed: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None, scale: float = 1.0
) -> torch.Tensor:
    """The symmetric ``[dim, dim]`` matrix whose upper triangle is ``scale * packed``.

    Inverse of :func:`triu_pack` (exact when no cast loses precision and ``scale``
    is 1); ``scale = 1 / world_size`` turns an all-reduced sum into a mean in the
    same pass. Result dtype: ``dtype`` (default: the packed tensor's).
    """
    check_tensor("packed", packed)
    check_int("dim", dim, low=0)
    if packed.dim() != 1 or packed.numel() != _kernels.triu_numel(dim):
        raise ValueError(
            f"packed must be 1-D with dim*(dim+1)/2 = {_kernels.triu_numel(dim)} elements, "
            f"got shape {tuple(packed.shape)}"
        )
    check_tensor("packed", packed, dtypes=FLOAT_DTYPES, contiguous=True)
    if dtype is not None:
        _check_dtype_argument(dtype)
    check_float("scale", scale)


@triu_unpack.register_fake
def _(packed, dim, dtype=None, scale=1.0):
    return packed.new_empty((dim, dim), dtype=dtype or packed.dtype)


triu_unpack.register_backends(
    triton=lambda packed, dim, dtype=None, scale=1.0: _kernels.triu_unpack_triton(
        packed, dim, dtype or packed.dtype, scale
    ),
    reference=lambda packed, dim, dtype=None, scale=1.0: _kernels.triu_unpack_reference(
        packed, dim, dtype or packed.dtype, scale
    ),
)
