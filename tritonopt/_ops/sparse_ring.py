"""The sparse ring-buffer ops ``sparse_sp``, ``sparse_lcg``, ``sparse_ring_insert`` and ``densify_ring``.

Declarations only; the kernels, the references and the buffer layout
(block-major ``[num_blocks, m, k]``) are in :mod:`tritonopt.kernels.sparse_ring`.
"""

from __future__ import annotations

import torch

from tritonopt._ops._registry import define_op
from tritonopt._validation import check_bool, check_disjoint, check_int, check_same_device, check_tensor
from tritonopt.kernels import sparse_ring as _kernels

__all__ = ["sparse_sp", "sparse_lcg", "sparse_ring_insert", "densify_ring"]

_VALUE_DTYPES = (torch.float32, torch.bfloat16)
_INDEX_DTYPES = (torch.int16, torch.int32)


def _check_ring(indices: torch.Tensor, values: torch.Tensor, *, updated_in_place: bool = False) -> None:
    check_tensor("indices", indices, ndim=3, dtypes=_INDEX_DTYPES)
    check_tensor("values", values, shape=indices.shape, dtypes=_VALUE_DTYPES)
    check_same_device("indices", indices, values=values)
    check_tensor("indices", indices, contiguous=True, updated_in_place=updated_in_place)
    check_tensor("values", values, contiguous=True, updated_in_place=updated_in_place)


@define_op("sparse_sp", nvtx="tritonopt/sparse_ring/sp")
def sparse_sp(indices: torch.Tensor, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Scalar products of a dense vector with every row of a sparse ring buffer.

    ``SP(x)[r] = sum_{b, j} values[b, r, j] * x[b, indices[b, r, j]]``, i.e. ``G @ x``
    for the dense rows ``G`` the buffer stands for (EFCP sec. 3.1, "SP").

    Args:
        indices: ``[num_blocks, m, k]`` int16 (for blocks of at most 32768) or
            int32, positions within each block.
        values: ``[num_blocks, m, k]`` float32 or bfloat16.
        x: ``[num_blocks, block_size]`` float32 (the vector, cut into blocks).

    Returns:
        ``[m]`` float32. Rows never written (all zero) give 0; an entry whose index
        lies outside ``[0, block_size)`` adds nothing. Deterministic.
    """
    _check_ring(indices, values)
    num_blocks, _, k = indices.shape
    check_tensor("x", x, ndim=2)
    if x.shape[0] != num_blocks:
        raise ValueError(f"x must be [num_blocks={num_blocks}, block_size], got shape {tuple(x.shape)}")
    if x.shape[1] < max(1, k):
        raise ValueError(f"x's block_size (dim 1) must be >= max(1, k={k}), got {x.shape[1]}")
    check_tensor("x", x, dtypes=(torch.float32,), contiguous=True)
    check_same_device("indices", indices, x=x)


@sparse_sp.register_fake
def _(indices, values, x):
    return x.new_empty((indices.shape[1],), dtype=torch.float32)


sparse_sp.register_backends(triton=_kernels.sparse_sp_triton, reference=_kernels.sparse_sp_reference)


@define_op("sparse_lcg", nvtx="tritonopt/sparse_ring/lcg")
def sparse_lcg(indices: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, block_size: int,
               ascending: bool = False) -> torch.Tensor:
    """Linear combination of the rows of a sparse ring buffer, as a dense vector.

    ``LCG(w)[b, i] = sum_r w[r] * sum_{j: indices[b, r, j] = i} values[b, r, j]``,
    i.e. ``w @ G`` (EFCP sec. 3.1, "LCG").

    Args:
        indices, values: the buffer, ``[num_blocks, m, k]`` (see :func:`sparse_sp`).
        weights: ``[m]`` float32, one per row.
        block_size: length of each block, ``>= k``.
        ascending: the caller's promise that within every block of every row the
            positions are in non-decreasing order, as :func:`ef_topk` writes them, and that a
            row whose positions are all 0 (``k >= 2``) holds only zeros, as a row never
            written does. It lets the Triton path spread a long
            block over many programs (a whole model as one block, 65536 positions or
            more); the result is the same. It is not checked, as that would read the
            whole buffer: with rows out of order the result is wrong.

    Returns:
        ``[num_blocks, block_size]`` float32. The Triton path adds rows in slot
        order without atomics: the same inputs give the same bits on every run.
        An entry whose index lies outside ``[0, block_size)`` adds nothing.
    """
    _check_ring(indices, values)
    check_tensor("weights", weights, shape=(indices.shape[1],), dtypes=(torch.float32,), contiguous=True)
    check_same_device("indices", indices, weights=weights)
    check_int("block_size", block_size, low=max(1, indices.shape[2]))
    check_bool("ascending", ascending)


@sparse_lcg.register_fake
def _(indices, values, weights, block_size, ascending=False):
    return values.new_empty((indices.shape[0], block_size), dtype=torch.float32)


sparse_lcg.register_backends(triton=_kernels.sparse_lcg_triton, reference=_kernels.sparse_lcg_reference)


@define_op("sparse_ring_insert", mutates_args=("indices", "values"), nvtx="tritonopt/sparse_ring/insert")
def sparse_ring_insert(
    indices: torch.Tensor, values: torch.Tensor, slot: int, new_indices: torch.Tensor, new_values: torch.Tensor
) -> None:
    """Replace row ``slot`` of the buffer with one ``ef_topk`` result, in place (``O(k)`` writes).

    Args:
        indices, values: the buffer ``[num_blocks, m, k]``, updated in place.
        slot: the row to overwrite, ``0 <= slot < m``.
        new_indices: ``[num_blocks, k]`` in the buffer's index dtype (int16 or int32);
            new_values: ``[num_blocks, k]`` float32 (rounded to the buffer's dtype when it
            is bfloat16).
    """
    _check_ring(indices, values, updated_in_place=True)
    num_blocks, m, k = indices.shape
    check_int("slot", slot, low=0, high=m - 1)
    check_tensor("new_indices", new_indices, shape=(num_blocks, k), dtypes=(indices.dtype,), contiguous=True)
    check_tensor("new_values", new_values, shape=(num_blocks, k), dtypes=(torch.float32,), contiguous=True)
    check_same_device("indices", indices, new_indices=new_indices, new_values=new_values)
    check_disjoint(
        {"indices": indices, "values": values, "new_indices": new_indices, "new_values": new_values},
        updated=("indices", "values"),
    )


@sparse_ring_insert.register_fake
def _(indices, values, slot, new_indices, new_values):
    return None


sparse_ring_insert.register_backends(
    triton=_kernels.sparse_ring_insert_triton, reference=_kernels.sparse_ring_insert_reference
)


@define_op("densify_ring", composite=True)
def densify_ring(indices: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The dense ``[m, num_blocks * block_size]`` matrix ``G`` the buffer stands for (float32).

    For tests and inspection (it allocates ``m * d`` floats).
    """
    _check_ring(indices, values)
    check_int("block_size", block_size, low=max(1, indices.shape[2]))
    if indices.numel() and indices.device.type != "meta" and not torch.compiler.is_compiling() and not bool(
        ((indices >= 0) & (indices < block_size)).all()
    ):
        raise ValueError(f"indices must lie in [0, block_size={block_size})")


densify_ring.register_backends(reference=_kernels.densify_ring)
