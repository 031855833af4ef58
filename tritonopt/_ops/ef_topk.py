"""The ``tritonopt::ef_topk`` custom op: validation, registration and dispatch.

Kernels and the reference live in :mod:`tritonopt.kernels.ef_topk`.
"""

from __future__ import annotations

import torch

from tritonopt._runtime import nvtx_range, select_backend
from tritonopt.kernels import ef_topk as _ef_topk_kernels

__all__ = ["ef_topk", "densify_blocks"]

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _memory_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_ef_topk_args(
    grad: torch.Tensor, error: torch.Tensor, k: int, *, check_overlap: bool = True
) -> None:
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    if not isinstance(error, torch.Tensor):
        raise TypeError(f"error must be a torch.Tensor, got {type(error).__name__}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if grad.dim() != 2:
        raise ValueError(f"grad must be 2-D [num_blocks, block_size], got shape {tuple(grad.shape)}")
    if error.shape != grad.shape:
        raise ValueError(
            f"error must have grad's shape {tuple(grad.shape)}, got {tuple(error.shape)}"
        )
    if grad.dtype not in _GRAD_DTYPES:
        raise TypeError(f"grad must be float32, float16 or bfloat16, got {grad.dtype}")
    if error.dtype != torch.float32:
        raise TypeError(f"error must be float32, got {error.dtype}")
    block_size = grad.shape[1]
    if not 1 <= k <= block_size:
        raise ValueError(f"k must satisfy 1 <= k <= block_size={block_size}, got k={k}")
    if error.device != grad.device:
        raise ValueError(f"error is on {error.device} but grad is on {grad.device}")
    if not grad.is_contiguous():
        raise ValueError("grad must be contiguous (call .contiguous())")
    if not error.is_contiguous():
        raise ValueError("error must be contiguous: it is updated in place")
    if error.requires_grad:
        raise ValueError("error must not require grad: it is updated in place")
    # While torch.compile traces, tensors are fake and have no address; the op re-checks at run time.
    if check_overlap and grad.numel() and error.numel() and not torch.compiler.is_compiling():
        g_start, g_end = _memory_span(grad)
        e_start, e_end = _memory_span(error)
        if g_start < e_end and e_start < g_end:
            raise ValueError("grad and error must not share memory: error is updated in place")


@torch.library.custom_op("tritonopt::ef_topk", mutates_args=("error",))
def _ef_topk_op(grad: torch.Tensor, error: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_ef_topk_args(grad, error, k)
    with nvtx_range("tritonopt/ef_topk"):
        if select_backend(grad.device) == "triton":
            return _ef_topk_kernels.ef_topk_triton(grad, error, k)
        return _ef_topk_kernels.ef_topk_reference(grad, error, k)


@_ef_topk_op.register_fake
def _ef_topk_fake(grad, error, k):
    _check_ef_topk_args(grad, error, k, check_overlap=False)  # fake tensors have no storage
    num_blocks = grad.shape[0]
    indices = grad.new_empty((num_blocks, k), dtype=torch.int32)
    values = grad.new_empty((num_blocks, k), dtype=torch.float32)
    return indices, values


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
    _check_ef_topk_args(grad, error, k)  # before the dispatcher's own, terser, type checks
    return torch.ops.tritonopt.ef_topk(grad, error, k)


def densify_blocks(indices: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The dense ``[num_blocks, block_size]`` float32 tensor holding ``values`` at ``indices``.

    The inverse of :func:`ef_topk`'s compression; positions not listed are zero.
    """
    if not isinstance(indices, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise TypeError("indices and values must be torch.Tensors")
    if indices.dim() != 2 or indices.shape != values.shape:
        raise ValueError(
            f"indices and values must be 2-D of one shape, got {tuple(indices.shape)} "
            f"and {tuple(values.shape)}"
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < indices.shape[1]:
        raise ValueError(f"block_size must be an int >= k={indices.shape[1]}, got {block_size!r}")
    # A value check cannot be traced by torch.compile; scatter_ still bounds-checks there.
    if indices.numel() and not torch.compiler.is_compiling() and (
        int(indices.min()) < 0 or int(indices.max()) >= block_size
    ):
        raise ValueError(f"indices must lie in [0, {block_size})")
    dense = torch.zeros(
        (indices.shape[0], block_size), dtype=torch.float32, device=values.device
    )
    return dense.scatter_(1, indices.long(), values.to(torch.float32))
