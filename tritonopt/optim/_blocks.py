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


class BlockLayout:
    """Where each tensor of ``tensors`` lives in a padded ``[num_blocks, block_size]`` buffer.

    ``block_size`` is capped at the total element count, so a group smaller
    than one block is a single unpadded block.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], block_size: int):
        if not tensors:
            raise ValueError("a block layout needs at least one tensor")
        self.tensors = tuple(tensors)
        self.numels = tuple(t.numel() for t in self.tensors)
        self.total = sum(self.numels)
        if self.total == 0:
            raise ValueError("a block layout needs at least one element")
        self.block_size = min(block_size, self.total)
        self.num_blocks = cdiv(self.total, self.block_size)
        self.device = self.tensors[0].device
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
            for start, n, t in zip(self.offsets, self.numels, self.tensors)
        ]

    def pack(self, sources: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Copy ``sources`` (shaped like the layout's tensors) into ``buffer``; padding is untouched."""
        flat = [s.reshape(-1) for s in sources]
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
