"""``ef_topk`` and ``densify_blocks``: declarations (kernels and reference: :mod:`tritonopt.kernels.ef_topk`)."""

from __future__ import annotations

import torch

from tritonopt._ops._registry import define_op
from tritonopt._validation import (
    FLOAT_DTYPES,
    check_disjoint,
    check_int,
    check_same_device,
    check_tensor,
)
from tritonopt.kernels import ef_topk as _kernels

__all__ = ["ef_topk", "densify_blocks"]


@define_op("ef_topk", mutates_args=("error",))
def ef_topk(grad: torch.Tensor, error: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise Top-k with error feedback; ``error`` is updated in place.

    Args:
        grad: ``[num_blocks, block_size]``, float32, float16 or bfloat16, contiguous.
        error: same shape, float32, contiguous, on grad's device; the error-feedback buffer.
        k: entries kept per block, ``1 <= k <= block_size``.

    Returns:
        ``(indices, values)``, each ``[num_blocks, k]``: ``indices`` (int32) are the
        positions within each block, ascending; ``values`` (float32) are
        ``a = error + grad`` at those positions.

    Per block, the ``k`` entries of largest ``|a|`` are selected, ties going to the
    lower position, and ``error`` becomes ``a`` with the selected entries set to
    zero, so ``densify_blocks(indices, values, block_size) + error_new`` equals
    ``error_old + grad`` exactly (``a`` is computed once, in float32).

    Non-finite entries: NaN ranks above ``±inf``, which ranks above every finite
    magnitude. They are selected first, leave ``error`` and appear in ``values``;
    those beyond the budget ``k`` stay in ``error``. Nothing is raised: callers
    that must not propagate them (the optimizers) check their inputs first.

    Raises:
        TypeError / ValueError: naming the offending argument, before anything is modified.
    """
    check_tensor("grad", grad, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("error", error, shape=grad.shape, dtypes=(torch.float32,))
    check_int("k", k, low=1, high=grad.shape[1])
    check_same_device("grad", grad, error=error)
    check_tensor("grad", grad, contiguous=True)
    check_tensor("error", error, updated_in_place=True)
    check_disjoint({"grad": grad, "error": error}, updated=("error",))


@ef_topk.register_fake
def _(grad, error, k):
    return grad.new_empty((grad.shape[0], k), dtype=torch.int32), grad.new_empty((grad.shape[0], k), dtype=torch.float32)


ef_topk.register_backends(triton=_kernels.ef_topk_triton, reference=_kernels.ef_topk_reference)


@define_op("densify_blocks", composite=True)
def densify_blocks(indices: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The dense ``[num_blocks, block_size]`` float32 tensor holding ``values`` at ``indices``.

    The inverse of :func:`ef_topk`'s compression; positions not listed are zero.
    ``indices`` is int32 or int64 ``[num_blocks, k]`` with entries in
    ``[0, block_size)``; ``values`` has its shape.
    """
    check_tensor("indices", indices, ndim=2, dtypes=(torch.int32, torch.int64))
    check_tensor("values", values, shape=indices.shape, dtypes=(*FLOAT_DTYPES, torch.float64))
    check_int("block_size", block_size, low=max(1, indices.shape[1]))
    check_same_device("indices", indices, values=values)
    # A value check reads the data: not while torch.compile traces (scatter_ still bounds-checks),
    # and not on meta tensors, which have none.
    if indices.numel() and indices.device.type != "meta" and not torch.compiler.is_compiling() and (
        int(indices.min()) < 0 or int(indices.max()) >= block_size
    ):
        raise ValueError(f"indices must lie in [0, {block_size})")


def _densify_blocks(indices: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
    dense = torch.zeros((indices.shape[0], block_size), dtype=torch.float32, device=values.device)
    return dense.scatter_(1, indices.long(), values.to(torch.float32))


densify_blocks.register_backends(reference=_densify_blocks)
