"""KAISA's factor all-reduce: the layers' statistics averaged over the ranks, in buckets, overlapping backward.

Each factor-update step every rank holds, per layer, the mean over its
micro-batches of ``X^T X / n`` for A and G (float32 buffers). The ranks
average them with all-reduces of flat **buckets**:

* a bucket holds consecutive layers in reverse registration order (the order
  backward reaches them) up to ``bucket_cap_mb`` megabytes (a larger layer is a
  bucket of its own); per layer it carries the A and G statistics (full
  matrices, or their upper triangles with ``symmetry_aware``, paper sec. 4.3)
  in the communication dtype, and one **contribution count**: 1 from a rank
  whose passes reached the layer this step, 0 (with zero statistics) from one
  whose did not, so the mean is over the ranks that saw the layer;
* with overlap, a bucket's all-reduce starts asynchronously from the backward
  hook of its last layer to complete (after ``accumulation_steps`` micro-batches),
  as soon as every earlier bucket has started, so every rank starts the same
  buckets in the same order; ``finish()`` (in ``step()``) starts the rest, waits
  for all, and turns the sums back into means: ``sum / count``, mirrored from
  the upper triangle so the factors stay symmetric to the last bit;
* without overlap (``bucket_cap_mb=None``) one bucket holds every layer and is
  all-reduced in ``finish()``.

The bucket layout depends only on the layers, so every rank builds the same one.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from tritonopt.ops import triu_pack, triu_unpack
from tritonopt.optim.kfac_functional import factor_buffer
from tritonopt.optim.kfac import KFACLayer

__all__ = ["FactorReducer", "bucket_layers"]


def _statistic_numel(dim: int, symmetry_aware: bool) -> int:
    return dim * (dim + 1) // 2 if symmetry_aware else dim * dim


def bucket_layers(
    dims: Sequence[tuple[int, int]], bucket_cap_bytes: Optional[float], element_size: int, symmetry_aware: bool
) -> list[list[int]]:
    """Layer indices per bucket, reverse registration order; one bucket of all when the cap is None."""
    order = list(range(len(dims)))[::-1]
    if bucket_cap_bytes is None:
        return [order]
    buckets, current, size = [], [], 0
    for i in order:
        a, g = dims[i]
        nbytes = element_size * (_statistic_numel(a, symmetry_aware) + _statistic_numel(g, symmetry_aware) + 1)
        if current and size + nbytes > bucket_cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class FactorReducer:
    """Averages the factor statistics of ``layers`` over the ranks (see the module docstring).

    Args:
        layers: the preconditioner's layers.
        all_reduce: ``all_reduce(flat_tensor, async_op) -> work or None``, a SUM
            over the ranks (the caller's communicator, group and error handling).
        comm_dtype: dtype of the buckets (float32, float16 or bfloat16).
        symmetry_aware: send upper triangles.
        bucket_cap_mb: bucket size in megabytes, or None (one bucket, started in ``finish``).
        accumulation_steps: micro-batches per step; a layer is complete after this many.
    """

    def __init__(
        self,
        layers: Sequence[KFACLayer],
        all_reduce: Callable,
        *,
        comm_dtype: torch.dtype,
        symmetry_aware: bool,
        bucket_cap_mb: Optional[float],
        accumulation_steps: int,
    ):
        self.layers = list(layers)
        self.all_reduce = all_reduce
        self.comm_dtype = comm_dtype
        self.symmetry_aware = symmetry_aware
        self.overlap = bucket_cap_mb is not None
        self.accumulation_steps = accumulation_steps
        cap = None if bucket_cap_mb is None else bucket_cap_mb * 1024 * 1024
        dims = [(l.a_dim, l.g_dim) for l in self.layers]
        self.buckets = bucket_layers(dims, cap, torch.empty((), dtype=comm_dtype).element_size(), symmetry_aware)
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.reset()

    def reset(self) -> None:
        """Forget this step's buckets (after ``finish`` or a failed step)."""
        self._ready: set[int] = set()
        self._started: list[tuple[torch.Tensor, object]] = []
        self.problem: Optional[str] = None
        self.error: Optional[BaseException] = None

    @property
    def started_buckets(self) -> int:
        """How many of this step's buckets are under way."""
        return len(self._started)

    # ------------------------------------------------------------ packing

    def _pack(self, bucket: list[int]) -> torch.Tensor:
        pieces = []
        for i in bucket:
            layer = self.layers[i]
            present = layer.has_statistics
            for dim, stat in ((layer.a_dim, layer.a_batch), (layer.g_dim, layer.g_batch)):
                if not present:
                    pieces.append(torch.zeros(_statistic_numel(dim, self.symmetry_aware), dtype=self.comm_dtype,
                                              device=layer.weight.device))
                elif self.symmetry_aware:
                    pieces.append(triu_pack(stat, self.comm_dtype))
                else:
                    pieces.append(stat.reshape(-1).to(self.comm_dtype))
            pieces.append(torch.full((1,), float(present), dtype=self.comm_dtype, device=layer.weight.device))
        return torch.cat(pieces)

    def _unpack(self, bucket: list[int], flat: torch.Tensor, counts: list[float]) -> list[int]:
        reduced, offset = [], 0
        for i, count in zip(bucket, counts):
            layer = self.layers[i]
            chunks = []
            for dim in (layer.a_dim, layer.g_dim):
                n = _statistic_numel(dim, self.symmetry_aware)
                chunks.append((dim, flat[offset : offset + n]))
                offset += n
            offset += 1
            if count == 0:
                continue
            inverse_count = 1.0 / count
            for name, (dim, chunk) in zip(("a_batch", "g_batch"), chunks):
                if self.symmetry_aware:
                    mean = triu_unpack(chunk.contiguous(), dim, torch.float32, scale=inverse_count)
                else:
                    # The backend may sum (i, j) and (j, i) in different orders: mirror the upper
                    # triangle so the factors stay symmetric to the last bit.
                    summed = chunk.view(dim, dim).to(torch.float32)
                    mean = (torch.triu(summed) + torch.triu(summed, 1).T).mul_(inverse_count)
                buffer = getattr(layer, name)
                if buffer is None:  # no local statistic: a buffer in the factors' padded layout
                    buffer = factor_buffer(dim, device=mean.device)
                    setattr(layer, name, buffer)
                buffer.copy_(mean)
            reduced.append(i)
        return reduced

    def _count_positions(self, bucket: list[int]) -> list[int]:
        positions, offset = [], 0
        for i in bucket:
            layer = self.layers[i]
            offset += _statistic_numel(layer.a_dim, self.symmetry_aware) + _statistic_numel(layer.g_dim, self.symmetry_aware)
            positions.append(offset)
            offset += 1
        return positions

    # ------------------------------------------------------------ launching

    def _start(self, bucket: list[int]) -> None:
        flat = self._pack(bucket)
        self._started.append((flat, self.all_reduce(flat, async_op=True)))

    def layer_complete(self, index: int) -> None:
        """From a backward hook: ``index`` has its ``accumulation_steps`` micro-batches; start the
        buckets now complete. A layer completed twice is recorded in :attr:`problem`."""
        if not self.overlap or self.error is not None:
            return
        if self._bucket_of[index] < len(self._started) or index in self._ready:
            self.problem = (f"layer {self.layers[index].name!r} received more than accumulation_steps="
                            f"{self.accumulation_steps} micro-batches before step()")
            return
        self._ready.add(index)
        try:
            while len(self._started) < len(self.buckets) and all(
                i in self._ready for i in self.buckets[len(self._started)]
            ):
                self._start(self.buckets[len(self._started)])
        except BaseException as exc:  # raised again by finish(), outside the autograd engine
            self.error = exc

    def finish(self) -> list[int]:
        """Start the remaining buckets, wait for all, and write the means into the layers' buffers.

        Returns the indices of the layers some rank had statistics for. Every
        rank must call it on every factor-update step (it is a collective).
        """
        try:
            if self.error is not None:
                raise self.error
            while len(self._started) < len(self.buckets):
                self._start(self.buckets[len(self._started)])
            for _, work in self._started:
                if work is not None:
                    work.wait()
            flats = [flat for flat, _ in self._started]
            count_values = torch.cat([
                flat[self._count_positions(bucket)] for bucket, flat in zip(self.buckets, flats)
            ]).tolist()
            reduced, offset = [], 0
            for bucket, flat in zip(self.buckets, flats):
                reduced += self._unpack(bucket, flat, count_values[offset : offset + len(bucket)])
                offset += len(bucket)
            return sorted(reduced)
        finally:
            self._started = []
            self._ready = set()
