"""The K-FAC custom ops: validation, registration and dispatch.

``tritonopt::kfac_factor_update``, ``tritonopt::eigenbasis_precondition``,
``tritonopt::eigenbasis_precondition_prediv``, ``tritonopt::triu_pack`` and
``tritonopt::triu_unpack``. Kernels and references live in
:mod:`tritonopt.kernels.kfac` (its docstring states the math and the layouts).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tritonopt._runtime import nvtx_range, select_backend
from tritonopt.kernels import kfac as _kernels

__all__ = [
    "eigen_inv_denominator",
    "eigenbasis_precondition",
    "eigenbasis_precondition_prediv",
    "kfac_factor_update",
    "triu_pack",
    "triu_unpack",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _require_number(name: str, value, *, low: float | None = None, high: float | None = None,
                    low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")


def _require_precision(precision) -> None:
    if precision not in _kernels.PRECISIONS:
        raise ValueError(f"precision must be one of {_kernels.PRECISIONS}, got {precision!r}")


def _same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view one storage (conservative: any shared storage counts)."""
    if not a.numel() or not b.numel() or torch.compiler.is_compiling():
        return False  # while torch.compile traces, tensors have no address; the op re-checks at run time
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- factor update


def _check_factor_update_args(factor, x, decay, append_bias, scale, precision, *, check_overlap=True):
    _require_tensor("factor", factor)
    _require_tensor("x", x)
    _require_number("decay", decay, low=0.0, high=1.0)
    if not isinstance(append_bias, bool):
        raise TypeError(f"append_bias must be a bool, got {type(append_bias).__name__}")
    _require_number("scale", scale)
    _require_precision(precision)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [n, in_dim], got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError("x must have at least one row (n >= 1)")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    dim = x.shape[1] + int(append_bias)
    if factor.shape != (dim, dim):
        raise ValueError(
            f"factor must be [{dim}, {dim}] (x's {x.shape[1]} columns"
            f"{' + the bias column' if append_bias else ''}), got {tuple(factor.shape)}"
        )
    if factor.dtype != torch.float32:
        raise TypeError(f"factor must be float32, got {factor.dtype}")
    _same_device("factor", factor, x=x)
    if not factor.is_contiguous():
        raise ValueError("factor must be contiguous: it is updated in place")
    if factor.requires_grad:
        raise ValueError("factor must not require grad: it is updated in place")
    if check_overlap and _overlaps(factor, x):
        raise ValueError("factor and x must not share memory: factor is updated in place")


@torch.library.custom_op("tritonopt::kfac_factor_update", mutates_args=("factor",))
def _kfac_factor_update_op(
    factor: torch.Tensor, x: torch.Tensor, decay: float, append_bias: bool, scale: float, precision: str
) -> None:
    _check_factor_update_args(factor, x, decay, append_bias, scale, precision)
    with nvtx_range("tritonopt/kfac/factor_update"):
        if select_backend(factor.device) == "triton":
            _kernels.kfac_factor_update_triton(factor, x, decay, append_bias, scale, precision)
        else:
            _kernels.kfac_factor_update_reference(factor, x, decay, append_bias, scale)


@_kfac_factor_update_op.register_fake
def _kfac_factor_update_fake(factor, x, decay, append_bias, scale, precision):
    _check_factor_update_args(factor, x, decay, append_bias, scale, precision, check_overlap=False)


def kfac_factor_update(
    factor: torch.Tensor,
    x: torch.Tensor,
    decay: float,
    *,
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
        factor: ``[dim, dim]`` float32 contiguous, ``dim = x.shape[1] + append_bias``.
            Only its upper triangle is read; it is written symmetric to the last bit.
            Not read at all when ``decay == 0``.
        x: ``[n, in_dim]``, float32/float16/bfloat16, any strides; products
            accumulate in fp32.
        decay: in ``[0, 1]``.
        precision: matrix-unit precision on the GPU (``"tf32x3"``, ``"ieee"``, ``"tf32"``).

    Raises:
        TypeError / ValueError: naming the offending argument, before anything is modified.
    """
    _check_factor_update_args(factor, x, decay, append_bias, scale, precision)
    torch.ops.tritonopt.kfac_factor_update(factor, x, float(decay), append_bias, float(scale), precision)


# --------------------------------------------------------------------------- preconditioning


def _check_precondition_common(grad, qa, qg, precision):
    _require_tensor("grad", grad)
    _require_tensor("qa", qa)
    _require_tensor("qg", qg)
    _require_precision(precision)
    if grad.dim() != 2:
        raise ValueError(f"grad must be 2-D [g_dim, a_dim], got shape {tuple(grad.shape)}")
    g_dim, a_dim = grad.shape
    if qa.shape != (a_dim, a_dim):
        raise ValueError(f"qa must be [{a_dim}, {a_dim}] (grad's columns), got {tuple(qa.shape)}")
    if qg.shape != (g_dim, g_dim):
        raise ValueError(f"qg must be [{g_dim}, {g_dim}] (grad's rows), got {tuple(qg.shape)}")
    for name, t in (("grad", grad), ("qa", qa), ("qg", qg)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    _same_device("grad", grad, qa=qa, qg=qg)


def _check_precondition_args(grad, qa, da, qg, dg, damping, precision):
    _check_precondition_common(grad, qa, qg, precision)
    _require_tensor("da", da)
    _require_tensor("dg", dg)
    _require_number("damping", damping, low=0.0, low_open=True)
    g_dim, a_dim = grad.shape
    if da.shape != (a_dim,):
        raise ValueError(f"da must be [{a_dim}] (grad's columns), got {tuple(da.shape)}")
    if dg.shape != (g_dim,):
        raise ValueError(f"dg must be [{g_dim}] (grad's rows), got {tuple(dg.shape)}")
    for name, t in (("da", da), ("dg", dg)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    _same_device("grad", grad, da=da, dg=dg)


@torch.library.custom_op("tritonopt::eigenbasis_precondition", mutates_args=())
def _eigenbasis_precondition_op(
    grad: torch.Tensor, qa: torch.Tensor, da: torch.Tensor, qg: torch.Tensor, dg: torch.Tensor,
    damping: float, precision: str,
) -> torch.Tensor:
    _check_precondition_args(grad, qa, da, qg, dg, damping, precision)
    with nvtx_range("tritonopt/kfac/precondition"):
        if select_backend(grad.device) == "triton":
            return _kernels.eigenbasis_precondition_triton(
                grad, qa, qg, da=da, dg=dg, damping=damping, precision=precision
            )
        return _kernels.eigenbasis_precondition_reference(grad, qa, qg, da=da, dg=dg, damping=damping)


@_eigenbasis_precondition_op.register_fake
def _eigenbasis_precondition_fake(grad, qa, da, qg, dg, damping, precision):
    _check_precondition_args(grad, qa, da, qg, dg, damping, precision)
    return grad.new_empty(grad.shape, dtype=torch.float32)


def eigenbasis_precondition(
    grad: torch.Tensor,
    qa: torch.Tensor,
    da: torch.Tensor,
    qg: torch.Tensor,
    dg: torch.Tensor,
    damping: float,
    *,
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
        precision: GPU matrix-unit precision; ``"tf32x3"`` (default) keeps fp32
            accuracy, plain ``"tf32"`` does not (see :mod:`tritonopt.kernels.kfac`).

    Returns:
        ``P``, float32, ``[g_dim, a_dim]``. Every input may be float32, float16 or
        bfloat16 (upcast on load); arithmetic is fp32.
    """
    _check_precondition_args(grad, qa, da, qg, dg, damping, precision)
    return torch.ops.tritonopt.eigenbasis_precondition(grad, qa, da, qg, dg, float(damping), precision)


def _check_prediv_args(grad, qa, qg, inv_denominator, precision):
    _check_precondition_common(grad, qa, qg, precision)
    _require_tensor("inv_denominator", inv_denominator)
    if inv_denominator.shape != grad.shape:
        raise ValueError(
            f"inv_denominator must have grad's shape {tuple(grad.shape)}, got "
            f"{tuple(inv_denominator.shape)}"
        )
    if inv_denominator.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"inv_denominator must be float32, float16 or bfloat16, got {inv_denominator.dtype}")
    _same_device("grad", grad, inv_denominator=inv_denominator)


@torch.library.custom_op("tritonopt::eigenbasis_precondition_prediv", mutates_args=())
def _eigenbasis_precondition_prediv_op(
    grad: torch.Tensor, qa: torch.Tensor, qg: torch.Tensor, inv_denominator: torch.Tensor, precision: str
) -> torch.Tensor:
    _check_prediv_args(grad, qa, qg, inv_denominator, precision)
    with nvtx_range("tritonopt/kfac/precondition"):
        if select_backend(grad.device) == "triton":
            return _kernels.eigenbasis_precondition_triton(
                grad, qa, qg, inv_denominator=inv_denominator, precision=precision
            )
        return _kernels.eigenbasis_precondition_reference(grad, qa, qg, inv_denominator=inv_denominator)


@_eigenbasis_precondition_prediv_op.register_fake
def _eigenbasis_precondition_prediv_fake(grad, qa, qg, inv_denominator, precision):
    _check_prediv_args(grad, qa, qg, inv_denominator, precision)
    return grad.new_empty(grad.shape, dtype=torch.float32)


def eigenbasis_precondition_prediv(
    grad: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    inv_denominator: torch.Tensor,
    *,
    precision: str = _kernels.DEFAULT_PRECISION,
) -> torch.Tensor:
    """Eigenbasis preconditioning with the precomputed reciprocal (KAISA paper sec. 4.4).

    ``P = QG [(QG^T grad QA) * D] QA^T`` with ``D = eigen_inv_denominator(dg, da, damping)``
    computed once per eigendecomposition. Shapes and dtypes as
    :func:`eigenbasis_precondition`; ``inv_denominator`` is ``[g_dim, a_dim]``.
    """
    _check_prediv_args(grad, qa, qg, inv_denominator, precision)
    return torch.ops.tritonopt.eigenbasis_precondition_prediv(grad, qa, qg, inv_denominator, precision)


def eigen_inv_denominator(dg: torch.Tensor, da: torch.Tensor, damping: float) -> torch.Tensor:
    """``D = 1 / (dG dA^T + damping)``, ``[g_dim, a_dim]`` float32 (KAISA paper sec. 4.4).

    An outer product and a reciprocal, computed once per eigendecomposition: a
    plain torch expression (no kernel needed).
    """
    _require_tensor("dg", dg)
    _require_tensor("da", da)
    _require_number("damping", damping, low=0.0, low_open=True)
    if dg.dim() != 1 or da.dim() != 1:
        raise ValueError(f"dg and da must be 1-D, got shapes {tuple(dg.shape)} and {tuple(da.shape)}")
    _same_device("dg", dg, da=da)
    return _kernels.eigen_inv_denominator_reference(dg, da, damping)


# --------------------------------------------------------------------------- triangle pack


def _check_pack_args(matrix, dtype, scale):
    _require_tensor("matrix", matrix)
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"matrix must be square 2-D, got shape {tuple(matrix.shape)}")
    if matrix.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"matrix must be float32, float16 or bfloat16, got {matrix.dtype}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype!r}")
    _require_number("scale", scale)


@torch.library.custom_op("tritonopt::triu_pack", mutates_args=())
def _triu_pack_op(matrix: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    _check_pack_args(matrix, dtype, scale)
    with nvtx_range("tritonopt/kfac/triu_pack"):
        if select_backend(matrix.device) == "triton":
            return _kernels.triu_pack_triton(matrix, dtype, scale)
        return _kernels.triu_pack_reference(matrix, dtype, scale)


@_triu_pack_op.register_fake
def _triu_pack_fake(matrix, dtype, scale):
    _check_pack_args(matrix, dtype, scale)
    return matrix.new_empty((_kernels.triu_numel(matrix.shape[0]),), dtype=dtype)


def triu_pack(matrix: torch.Tensor, dtype: Optional[torch.dtype] = None, *, scale: float = 1.0) -> torch.Tensor:
    """The upper triangle of ``scale * matrix``, row by row, as a flat ``[d(d+1)/2]`` tensor.

    Entry ``(i, j)``, ``j >= i``, lands at ``i*d - i*(i-1)/2 + (j - i)``. Scaling is
    done in fp32 and the result cast once to ``dtype`` (default: the matrix's), so a
    factor can be packed to half precision for communication (KAISA paper sec. 4.3).
    ``matrix`` may have any strides.
    """
    dtype = matrix.dtype if dtype is None and isinstance(matrix, torch.Tensor) else dtype
    _check_pack_args(matrix, dtype, scale)
    return torch.ops.tritonopt.triu_pack(matrix, dtype, float(scale))


def _check_unpack_args(packed, dim, dtype, scale):
    _require_tensor("packed", packed)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise TypeError(f"dim must be an int >= 0, got {dim!r}")
    if packed.dim() != 1 or packed.numel() != _kernels.triu_numel(dim):
        raise ValueError(
            f"packed must be 1-D with dim*(dim+1)/2 = {_kernels.triu_numel(dim)} elements, "
            f"got shape {tuple(packed.shape)}"
        )
    if packed.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"packed must be float32, float16 or bfloat16, got {packed.dtype}")
    if not packed.is_contiguous():
        raise ValueError("packed must be contiguous")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype!r}")
    _require_number("scale", scale)


@torch.library.custom_op("tritonopt::triu_unpack", mutates_args=())
def _triu_unpack_op(packed: torch.Tensor, dim: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    _check_unpack_args(packed, dim, dtype, scale)
    with nvtx_range("tritonopt/kfac/triu_unpack"):
        if select_backend(packed.device) == "triton":
            return _kernels.triu_unpack_triton(packed, dim, dtype, scale)
        return _kernels.triu_unpack_reference(packed, dim, dtype, scale)


@_triu_unpack_op.register_fake
def _triu_unpack_fake(packed, dim, dtype, scale):
    _check_unpack_args(packed, dim, dtype, scale)
    return packed.new_empty((dim, dim), dtype=dtype)


def triu_unpack(
    packed: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None, *, scale: float = 1.0
) -> torch.Tensor:
    """The symmetric ``[dim, dim]`` matrix whose upper triangle is ``scale * packed``.

    Inverse of :func:`triu_pack` (exact when no cast loses precision and ``scale``
    is 1); ``scale = 1 / world_size`` turns an all-reduced sum into a mean in the
    same pass. Result dtype: ``dtype`` (default: the packed tensor's).
    """
    dtype = packed.dtype if dtype is None and isinstance(packed, torch.Tensor) else dtype
    _check_unpack_args(packed, dim, dtype, scale)
    return torch.ops.tritonopt.triu_unpack(packed, dim, dtype, float(scale))
