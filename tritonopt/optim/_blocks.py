"""Packing a parameter group into one zero-padded ``[num_blocks, block_size]`` buffer.

Blockwise compressors see a group's parameters as one vector: the parameters,
flattened in group order, laid end to end, and cut into blocks of
``block_size``; the last block is zero-padded. Padding never maps back to a
parameter.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from tritonopt._runtime import cdiv
from tritonopt.optim._sharding import local_tensor


class BlockLayout:
    """Where each tensor of ``tensors`` lives in a padded ``[num_blocks, block_size]`` buffer.

    ``block_size`` is capped at the total element count, so a group smaller
    than one block is a single unpadded block. DTensors are laid out by their
    local part (``locals``, what ``views`` are shaped like). ``span`` (at least
    the local total) lengthens the blocked vector with zero padding: sharded
    windows give every rank the same buffer shape that way.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], block_size: int, *, span: Optional[int] = None):
        if not tensors:
            raise ValueError("a block layout needs at least one tensor")
        self.tensors = tuple(tensors)
        self.locals = tuple(local_tensor(t) for t in self.tensors)
        self.numels = tuple(t.numel() for t in self.locals)
        self.total = sum(self.numels)
        self.span = self.total if span is None else max(span, self.total)
        if self.span == 0:
            raise ValueError("a block layout needs at least one element")
        self.block_size = min(block_size, self.span)
        self.num_blocks = cdiv(self.span, self.block_size)
        self.device = self.locals[0].device
        offsets, start = [], 0
        for n in self.numels:
            offsets.append(start)
            start += n
        self.offsets = tuple(offsets)

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        return len(tensors) == len(self.tensors) and all(
            a is b for a, b in zip(tensors, self.tensors)
        )

    def zeros(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros((self.num_blocks, self.block_size), dtype=dtype, device=self.device)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buffer`` shaped like each tensor of the layout."""
        flat = buffer.view(-1)
        return [
            flat[start : start + n].view(t.shape)
            for start, n, t in zip(self.offsets, self.numels, self.locals)
        ]

    def pack(self, sources: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Copy ``sources`` (shaped like the layout's tensors) into ``buffer``; padding is untouched."""
        flat = [local_tensor(s).reshape(-1) for s in sources]
        if any(s.dtype != buffer.dtype for s in flat):
            flat = [s.to(buffer.dtype) for s in flat]
        torch.cat(flat, out=buffer.view(-1)[: self.total])


def kept_per_block(density: Optional[float], k: Optional[int], block_size: int) -> int:
    """Entries kept per block: ``k`` capped at the block, or ``ceil(density * block_size)``."""
    if k is not None:
        return min(k, block_size)
    # round() first so that e.g. 0.07 * 100 = 7.000000000000001 keeps 7, not 8.
    return max(1, math.ceil(round(density * block_size, 9)))


ROW_ALIGNMENT = 16  # elements: 64 bytes of float32, so every row starts on a vector-load boundary


def zeros_with_aligned_rows(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero ``[rows, cols]`` view of a ``[rows, ceil16(cols)]`` buffer.

    The ops that read a basis row by row (Gram-Schmidt, the FOSI step) take such
    views: with every row aligned, a GPU loads them in vectors rather than one
    element at a time. The padding stays zero and is never read.
    """
    stride = cdiv(cols, ROW_ALIGNMENT) * ROW_ALIGNMENT
    return torch.zeros((rows, stride), dtype=dtype, device=device)[:, :cols]
