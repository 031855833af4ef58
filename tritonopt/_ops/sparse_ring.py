"""The sparse ring-buffer ops: ``sparse_sp``, ``sparse_lcg`` and ``sparse_ring_insert``.

Kernels, references and the buffer layout (block-major ``[num_blocks, m, k]``)
are documented in :mod:`tritonopt.kernels.sparse_ring`.
"""

from __future__ import annotations

import torch

from tritonopt._runtime import nvtx_range, select_backend
from tritonopt.kernels import sparse_ring as _kernels

__all__ = ["sparse_sp", "sparse_lcg", "sparse_ring_insert", "densify_ring"]

_VALUE_DTYPES = (torch.float32, torch.bfloat16)


def _check_ring(indices: torch.Tensor, values: torch.Tensor) -> None:
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if indices.dim() != 3:
        raise ValueError(
            f"indices must be 3-D [num_blocks, m, k], got shape {tuple(indices.shape)}"
        )
    if values.shape != indices.shape:
        raise ValueError(
            f"values must have indices' shape {tuple(indices.shape)}, got {tuple(values.shape)}"
        )
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32, got {indices.dtype}")
    if values.dtype not in _VALUE_DTYPES:
        raise TypeError(f"values must be float32 or bfloat16, got {values.dtype}")
    if values.device != indices.device:
        raise ValueError(f"values are on {values.device} but indices are on {indices.device}")
    if not indices.is_contiguous():
        raise ValueError("indices must be contiguous")
    if not values.is_contiguous():
        raise ValueError("values must be contiguous")


def _check_block_size(block_size: int, k: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < max(1, k):
        raise ValueError(f"block_size must be >= max(1, k={k}), got {block_size}")


def _check_sp_args(indices, values, x) -> None:
    _check_ring(indices, values)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    num_blocks, _, k = indices.shape
    if x.dim() != 2 or x.shape[0] != num_blocks:
        raise ValueError(
            f"x must be 2-D [num_blocks={num_blocks}, block_size], got shape {tuple(x.shape)}"
        )
    if x.shape[1] < max(1, k):
        raise ValueError(f"x's block_size (dim 1) must be >= max(1, k={k}), got {x.shape[1]}")
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if x.device != indices.device:
        raise ValueError(f"x is on {x.device} but indices are on {indices.device}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")


def _check_lcg_args(indices, values, weights, block_size) -> None:
    _check_ring(indices, values)
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
    m = indices.shape[1]
    if weights.shape != (m,):
        raise ValueError(f"weights must have shape ({m},) (one per row), got {tuple(weights.shape)}")
    if weights.dtype != torch.float32:
        raise TypeError(f"weights must be float32, got {weights.dtype}")
    if weights.device != indices.device:
        raise ValueError(f"weights are on {weights.device} but indices are on {indices.device}")
    if not weights.is_contiguous():
        raise ValueError("weights must be contiguous")
    _check_block_size(block_size, indices.shape[2])


def _check_insert_args(indices, values, slot, new_indices, new_values) -> None:
    _check_ring(indices, values)
    num_blocks, m, k = indices.shape
    if isinstance(slot, bool) or not isinstance(slot, int):
        raise TypeError(f"slot must be an int, got {type(slot).__name__}")
    if not 0 <= slot < m:
        raise ValueError(f"slot must satisfy 0 <= slot < m={m}, got {slot}")
    if not isinstance(new_indices, torch.Tensor) or not isinstance(new_values, torch.Tensor):
        raise TypeError("new_indices and new_values must be torch.Tensors")
    if new_indices.shape != (num_blocks, k):
        raise ValueError(
            f"new_indices must have shape ({num_blocks}, {k}), got {tuple(new_indices.shape)}"
        )
    if new_values.shape != (num_blocks, k):
        raise ValueError(
            f"new_values must have shape ({num_blocks}, {k}), got {tuple(new_values.shape)}"
        )
    if new_indices.dtype != torch.int32:
        raise TypeError(f"new_indices must be int32, got {new_indices.dtype}")
    if new_values.dtype != torch.float32:
        raise TypeError(f"new_values must be float32, got {new_values.dtype}")
    for name, t in (("new_indices", new_indices), ("new_values", new_values)):
        if t.device != indices.device:
            raise ValueError(f"{name} is on {t.device} but indices are on {indices.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if indices.requires_grad or values.requires_grad:
        raise ValueError("indices and values must not require grad: they are updated in place")


# --------------------------------------------------------------------------- SP


@torch.library.custom_op("tritonopt::sparse_sp", mutates_args=())
def _sparse_sp_op(indices: torch.Tensor, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _check_sp_args(indices, values, x)
    with nvtx_range("tritonopt/sparse_ring/sp"):
        if select_backend(x.device) == "triton":
            return _kernels.sparse_sp_triton(indices, values, x)
        return _kernels.sparse_sp_reference(indices, values, x)


@_sparse_sp_op.register_fake
def _sparse_sp_fake(indices, values, x):
    _check_sp_args(indices, values, x)
    return x.new_empty((indices.shape[1],), dtype=torch.float32)


def sparse_sp(indices: torch.Tensor, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Scalar products of a dense vector with every row of a sparse ring buffer.

    ``SP(x)[r] = sum_{b, j} values[b, r, j] * x[b, indices[b, r, j]]``, i.e. ``G @ x``
    for the dense rows ``G`` the buffer stands for (EFCP sec. 3.1, "SP").

    Args:
        indices: ``[num_blocks, m, k]`` int32, positions within each block.
        values: ``[num_blocks, m, k]`` float32 or bfloat16.
        x: ``[num_blocks, block_size]`` float32 (the vector, cut into blocks).

    Returns:
        ``[m]`` float32. Rows never written (all zero) give 0. Deterministic.
    """
    _check_sp_args(indices, values, x)
    return torch.ops.tritonopt.sparse_sp(indices, values, x)


# --------------------------------------------------------------------------- LCG


@torch.library.custom_op("tritonopt::sparse_lcg", mutates_args=())
def _sparse_lcg_op(
    indices: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, block_size: int
) -> torch.Tensor:
    _check_lcg_args(indices, values, weights, block_size)
    with nvtx_range("tritonopt/sparse_ring/lcg"):
        if select_backend(values.device) == "triton":
            return _kernels.sparse_lcg_triton(indices, values, weights, block_size)
        return _kernels.sparse_lcg_reference(indices, values, weights, block_size)


@_sparse_lcg_op.register_fake
def _sparse_lcg_fake(indices, values, weights, block_size):
    _check_lcg_args(indices, values, weights, block_size)
    return values.new_empty((indices.shape[0], block_size), dtype=torch.float32)


def sparse_lcg(
    indices: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Linear combination of the rows of a sparse ring buffer, as a dense vector.

    ``LCG(w)[b, i] = sum_r w[r] * sum_{j: indices[b, r, j] = i} values[b, r, j]``,
    i.e. ``w @ G`` (EFCP sec. 3.1, "LCG").

    Args:
        indices, values: the buffer, ``[num_blocks, m, k]`` (see :func:`sparse_sp`).
        weights: ``[m]`` float32, one per row.
        block_size: length of each block, ``>= k``.

    Returns:
        ``[num_blocks, block_size]`` float32. The Triton path adds rows in slot
        order without atomics: the same inputs give the same bits on every run.
    """
    _check_lcg_args(indices, values, weights, block_size)
    return torch.ops.tritonopt.sparse_lcg(indices, values, weights, block_size)


# --------------------------------------------------------------------------- insertion


@torch.library.custom_op("tritonopt::sparse_ring_insert", mutates_args=("indices", "values"))
def _sparse_ring_insert_op(
    indices: torch.Tensor,
    values: torch.Tensor,
    slot: int,
    new_indices: torch.Tensor,
    new_values: torch.Tensor,
) -> None:
    _check_insert_args(indices, values, slot, new_indices, new_values)
    with nvtx_range("tritonopt/sparse_ring/insert"):
        if select_backend(values.device) == "triton":
            _kernels.sparse_ring_insert_triton(indices, values, slot, new_indices, new_values)
        else:
            _kernels.sparse_ring_insert_reference(indices, values, slot, new_indices, new_values)


@_sparse_ring_insert_op.register_fake
def _sparse_ring_insert_fake(indices, values, slot, new_indices, new_values):
    _check_insert_args(indices, values, slot, new_indices, new_values)


def sparse_ring_insert(
    indices: torch.Tensor,
    values: torch.Tensor,
    slot: int,
    new_indices: torch.Tensor,
    new_values: torch.Tensor,
) -> None:
    """Replace row ``slot`` of the buffer with one ``ef_topk`` result, in place (``O(k)`` writes).

    Args:
        indices, values: the buffer ``[num_blocks, m, k]``, updated in place.
        slot: the row to overwrite, ``0 <= slot < m``.
        new_indices: ``[num_blocks, k]`` int32; new_values: ``[num_blocks, k]``
            float32 (rounded to the buffer's dtype when it is bfloat16).
    """
    _check_insert_args(indices, values, slot, new_indices, new_values)
    torch.ops.tritonopt.sparse_ring_insert(indices, values, slot, new_indices, new_values)


# --------------------------------------------------------------------------- densify


def densify_ring(indices: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The dense ``[m, num_blocks * block_size]`` matrix ``G`` the buffer stands for (float32).

    For tests and inspection (it allocates ``m * d`` floats).
    """
    _check_ring(indices, values)
    _check_block_size(block_size, indices.shape[2])
    if indices.numel() and not bool(((indices >= 0) & (indices < block_size)).all()):
        raise ValueError(f"indices must lie in [0, block_size={block_size})")
    return _kernels.densify_ring(indices, values, block_size)
