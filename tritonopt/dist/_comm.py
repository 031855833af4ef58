"""``torch.distributed`` collectives that count the bytes each rank moves.

Every distributed layer of tritonopt issues its collectives through a
:class:`CountingCommunicator`, so tests and benchmarks can check the papers'
communication formulas. Each call names a ``label`` (what the collective is
for, e.g. ``"factor_allreduce"``); counts are kept per label.

What is counted, per rank (payload bytes, independent of the algorithm the
backend uses underneath):

================  ==============================  ================================
collective        ``bytes_sent``                  ``bytes_received``
================  ==============================  ================================
all_reduce        the tensor                      the tensor
broadcast         the tensor on ``src``, else 0   the tensor off ``src``, else 0
all_gather        the input                       the output less this rank's input
all_to_all        the input less the self chunk   the output less the self chunk
isend / irecv     the tensor (isend)              the tensor (irecv)
================  ==============================  ================================

Every tensor handed to a collective must be contiguous (a non-contiguous
tensor raises ``ValueError``: NCCL and gloo would silently copy or fail).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist


@dataclass
class CollectiveStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _require_contiguous(label: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{label}: {name} must be contiguous for a collective")


class CountingCommunicator:
    """Thin wrappers over ``torch.distributed`` collectives with per-label byte counters.

    ``group`` is the default process group of every call (None: the world);
    each call may pass another. Asynchronous calls return the backend's work
    handle; bytes are counted when the collective is issued.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self._stats: dict[str, CollectiveStats] = defaultdict(CollectiveStats)

    # ------------------------------------------------------------ accounting

    def _record(self, label: str, sent: int, received: int) -> None:
        stats = self._stats[label]
        stats.calls += 1
        stats.bytes_sent += sent
        stats.bytes_received += received

    def stats(self) -> dict[str, CollectiveStats]:
        """Counters per label (a copy)."""
        return {label: CollectiveStats(**vars(s)) for label, s in self._stats.items()}

    def total_bytes(self, direction: str = "received") -> int:
        if direction not in ("sent", "received"):
            raise ValueError(f"direction must be 'sent' or 'received', got {direction!r}")
        return sum(getattr(s, f"bytes_{direction}") for s in self._stats.values())

    def reset(self) -> None:
        self._stats.clear()

    # ------------------------------------------------------------ collectives

    def _group(self, group):
        return self.group if group is None else group

    def all_reduce(self, tensor, *, label: str, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _require_contiguous(label, tensor=tensor)
        self._record(label, _nbytes(tensor), _nbytes(tensor))
        return dist.all_reduce(tensor, op=op, group=self._group(group), async_op=async_op)

    def broadcast(self, tensor, src: int, *, label: str, group=None, async_op=False):
        """Broadcast from global rank ``src``."""
        _require_contiguous(label, tensor=tensor)
        is_source = dist.get_rank() == src
        self._record(label, _nbytes(tensor) if is_source else 0, 0 if is_source else _nbytes(tensor))
        return dist.broadcast(tensor, src=src, group=self._group(group), async_op=async_op)

    def all_gather_into_tensor(self, output, input, *, label: str, group=None, async_op=False):
        _require_contiguous(label, output=output, input=input)
        world = dist.get_world_size(self._group(group))
        if output.numel() != input.numel() * world:
            raise ValueError(
                f"{label}: output must hold world_size={world} times the input's "
                f"{input.numel()} elements, got {output.numel()}"
            )
        self._record(label, _nbytes(input), _nbytes(output) - _nbytes(input))
        # Newer torch renames the collective and deprecates the old name; older torch has only the old one.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output, input, group=self._group(group), async_op=async_op)

    def all_to_all_single(
        self,
        output,
        input,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        *,
        label: str,
        group=None,
        async_op=False,
    ):
        """``dist.all_to_all_single``; split sizes count rows of dim 0, as there."""
        _require_contiguous(label, output=output, input=input)
        group = self._group(group)
        world, me = dist.get_world_size(group), dist.get_rank(group)
        row_in = _nbytes(input) // max(input.shape[0], 1) if input.dim() else _nbytes(input)
        row_out = _nbytes(output) // max(output.shape[0], 1) if output.dim() else _nbytes(output)
        self_in = (
            input_split_sizes[me] * row_in if input_split_sizes else _nbytes(input) // world
        )
        self_out = (
            output_split_sizes[me] * row_out if output_split_sizes else _nbytes(output) // world
        )
        self._record(label, _nbytes(input) - self_in, _nbytes(output) - self_out)
        return dist.all_to_all_single(
            output,
            input,
            output_split_sizes=list(output_split_sizes) if output_split_sizes else None,
            input_split_sizes=list(input_split_sizes) if input_split_sizes else None,
            group=group,
            async_op=async_op,
        )

    # ------------------------------------------------------------ point to point

    def isend(self, tensor, dst: int, *, label: str, group=None, tag: int = 0):
        """``dist.isend`` to global rank ``dst``; returns the work handle."""
        _require_contiguous(label, tensor=tensor)
        self._record(label, _nbytes(tensor), 0)
        return dist.isend(tensor, dst=dst, group=self._group(group), tag=tag)

    def irecv(self, tensor, src: int, *, label: str, group=None, tag: int = 0):
        """``dist.irecv`` from global rank ``src`` into ``tensor``; returns the work handle."""
        _require_contiguous(label, tensor=tensor)
        self._record(label, 0, _nbytes(tensor))
        return dist.irecv(tensor, src=src, group=self._group(group), tag=tag)
