"""Parameters sharded over ranks as DTensors (``torch.distributed.fsdp.fully_shard``, FSDP2).

An FSDP2 model's parameters are DTensors on a 1-D device mesh: ``Shard(0)``
(each rank holds a slice of the rows, the last ranks fewer when the rows do not
divide, as ``torch.chunk`` cuts them) or ``Replicate()``. The packed core packs
each rank's local tensors (``p.to_local()``, ``p.grad.to_local()``) and writes
the updates into them; the process group is the mesh's. What the optimizers
need from here:

* :func:`shard_spec`: the mesh of a parameter list, or ``None`` for plain
  tensors, refusing what no optimizer here handles (mixed lists, several
  meshes, 2-D meshes, other placements);
* :func:`refuse_sharded`: the construction-time refusal of an optimizer that
  does not handle DTensors;
* :class:`ShardGroup`: the collectives a sharded optimizer runs, with the bytes
  they moved, and :meth:`ShardGroup.check_agree`, which makes ranks with another
  configuration fail naming the setting;
* :func:`local_coordinates`: where a rank's local coordinates sit in the whole
  vector, and which of them count in a sum over the ranks (a replicated
  parameter's on one rank only);
* the conversion of state between local tensors (what the optimizer keeps)
  and DTensors (what its ``state_dict`` shows, so that
  ``torch.distributed.checkpoint`` saves each rank's part).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch without DTensor: no parameter can be one
    DTensor = None
    Replicate = Shard = None


def is_sharded(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a DTensor (sharing its storage), or ``t`` itself."""
    return t.to_local() if is_sharded(t) else t


def as_like(local: torch.Tensor, p) -> torch.Tensor:
    """``local`` (shaped like ``p``'s local part) as a DTensor laid out as ``p``, sharing its storage; or ``local``
    itself when ``p`` is a plain tensor."""
    if not is_sharded(p):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _placement_name(p) -> str:
    return ", ".join(str(placement) for placement in p.placements)


@dataclass
class ShardSpec:
    """The mesh every DTensor parameter of an optimizer lives on (1-D: ``world`` ranks)."""

    mesh: object
    world: int
    rank: int

    def local_rows(self, rows: int, rank: int) -> int:
        """Rows of a ``Shard(0)`` dimension of ``rows`` on ``rank``, as ``torch.chunk`` (and FSDP2) cut them."""
        chunk = -(-rows // self.world) if rows else 0
        return max(0, min(chunk, rows - rank * chunk))

    def largest_local_numel(self, params: Sequence[torch.Tensor]) -> int:
        """The most elements any rank holds of ``params``: rank 0's, which gets the first, fullest chunks."""
        total = 0
        for p in params:
            if _is_row_sharded(p):
                total += self.local_rows(p.shape[0], 0) * math.prod(p.shape[1:])
            else:
                total += p.numel()
        return total


def _is_row_sharded(p) -> bool:
    return is_sharded(p) and isinstance(p.placements[0], Shard)


@dataclass
class Coordinates:
    """Where a rank's local coordinates of ``params`` (their local parts laid end to end) sit in the whole vector.

    The whole vector is every parameter flattened whole, in order, as an unsharded
    optimizer lays them out: ``total`` entries. ``indices`` (int64, one per local
    coordinate) are their positions there. ``counted`` (float64, 1 or 0 per local
    coordinate) makes each coordinate count once in a sum over the ranks: a
    ``Replicate()`` parameter, which every rank holds whole, counts on rank 0
    only. None when every local coordinate counts (no replicated parameter, or rank 0).
    """

    indices: torch.Tensor
    counted: Optional[torch.Tensor]
    total: int


def local_coordinates(params: Sequence[torch.Tensor], spec: ShardSpec) -> Coordinates:
    """The :class:`Coordinates` of this rank's parts of ``params`` (each ``Shard(0)`` or ``Replicate()``)."""
    indices, counted, start, replicated = [], [], 0, False
    for p in params:
        numel = p.numel()
        if _is_row_sharded(p):
            row = math.prod(p.shape[1:])
            chunk = -(-p.shape[0] // spec.world) if p.shape[0] else 0
            first = min(spec.rank * chunk, p.shape[0])
            rows = spec.local_rows(p.shape[0], spec.rank)
            indices.append(torch.arange(start + first * row, start + (first + rows) * row))
            counted.append(torch.ones(rows * row, dtype=torch.float64))
        else:
            indices.append(torch.arange(start, start + numel))
            counted.append(torch.full((numel,), 1.0 if spec.rank == 0 else 0.0, dtype=torch.float64))
            replicated = True
        start += numel
    once = torch.cat(counted)
    return Coordinates(torch.cat(indices), once if replicated and spec.rank != 0 else None, start)


def shard_spec(owner: str, params: Sequence[torch.Tensor]) -> Optional[ShardSpec]:
    """The mesh of ``params`` (all DTensors on one 1-D mesh, ``Shard(0)`` or ``Replicate()``), None for plain tensors.

    Anything else raises ``ValueError`` naming what is not supported.
    """
    sharded = [p for p in params if is_sharded(p)]
    if not sharded:
        return None
    if len(sharded) != len(params):
        raise ValueError(
            f"{owner} got DTensor parameters mixed with plain tensors: shard the whole model (fully_shard the "
            "root module too) or none of it, so that every rank steps the same vector"
        )
    mesh = sharded[0].device_mesh
    for p in sharded:
        if p.device_mesh != mesh:
            raise ValueError(f"{owner} needs all DTensor parameters on one device mesh, found {mesh} and "
                             f"{p.device_mesh}")
    if mesh.ndim != 1:
        raise ValueError(
            f"{owner} supports DTensor parameters on a 1-D device mesh (FSDP2's fully_shard), got a "
            f"{mesh.ndim}-D mesh {tuple(mesh.shape)}; 2-D (HSDP) meshes are not supported"
        )
    for p in sharded:
        placement = p.placements[0]
        if not (isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0)):
            raise ValueError(
                f"{owner} supports DTensor parameters sharded along their first dimension (Shard(0), as "
                f"fully_shard makes them) or replicated, got a parameter of shape {tuple(p.shape)} with "
                f"placement {_placement_name(p)}"
            )
    return ShardSpec(mesh=mesh, world=mesh.size(), rank=mesh.get_local_rank())


def refuse_sharded(owner: str, params: Sequence[torch.Tensor], why: str) -> None:
    """``ValueError`` when any of ``params`` is a DTensor: ``owner`` cannot step sharded parameters, ``why``."""
    if any(is_sharded(p) for p in params):
        raise ValueError(f"{owner} does not support DTensor (sharded, e.g. FSDP2 fully_shard) parameters: {why}")


KFAC_SHARDING_REFUSAL = (
    "its factors need each layer's whole inputs and output gradients, and a sharded layer's weight is split "
    "over the ranks; K-FAC and KAISA do not support FSDP2 models"
)


def _digest(value) -> int:
    """A 63-bit digest of ``repr(value)``: equal settings give equal digests on every rank."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class ShardGroup:
    """The collectives of a sharded optimizer over its mesh's process group, counted.

    ``bytes_all_reduced`` and ``all_reduce_calls`` count what :meth:`all_reduce`
    sent (each rank's tensor, in bytes); the agreement check is not counted.
    """

    spec: ShardSpec
    bytes_all_reduced: int = 0
    all_reduce_calls: int = 0
    group: object = field(default=None, repr=False)

    def __post_init__(self):
        self.group = self.spec.mesh.get_group()

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self.bytes_all_reduced += tensor.numel() * tensor.element_size()
        self.all_reduce_calls += 1
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def largest(self, value: torch.Tensor) -> float:
        """The largest ``value`` (a 0-d float tensor) over the ranks; NaN or inf on any rank gives inf everywhere."""
        value = value.reshape(1).to(torch.float32)
        # Every non-finite value becomes +inf: NaN would lose the MAX, and nan_to_num's default would read
        # an inf as the largest finite float, a "too large" gradient instead of a non-finite one.
        value = torch.where(value.isfinite(), value, torch.full_like(value, math.inf))
        return float(self.all_reduce(value, dist.ReduceOp.MAX))

    def largest_each(self, values: torch.Tensor) -> list[float]:
        """Each entry of ``values`` (1-D) maximised over the ranks in one all-reduce, in float64 (exact); NaN or inf
        on any rank gives inf everywhere."""
        values = values.reshape(-1).to(torch.float64)
        values = torch.where(values.isfinite(), values, torch.full_like(values, math.inf))
        return self.all_reduce(values, dist.ReduceOp.MAX).tolist()

    def check_agree(self, owner: str, settings: dict) -> None:
        """``ValueError`` on every rank, naming each differing setting and every rank's value, unless all agree.

        One all-gather of one 63-bit digest per setting; the values themselves travel only when some differ.
        """
        names = sorted(settings)
        mine = torch.tensor([_digest(settings[name]) for name in names], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.spec.world)]
        dist.all_gather(gathered, mine, group=self.group)
        differing = [name for i, name in enumerate(names) if any(int(g[i]) != int(mine[i]) for g in gathered)]
        if not differing:
            return
        values = [None] * self.spec.world
        dist.all_gather_object(values, {name: repr(settings[name]) for name in differing}, group=self.group)
        details = "; ".join(
            f"{name}: " + ", ".join(f"rank {r} has {values[r][name]}" for r in range(self.spec.world))
            for name in differing
        )
        raise ValueError(f"{owner}: the ranks of the mesh were given different settings ({details}); every rank "
                         "must build the same optimizer over the same model")


# ---------------------------------------------------------------------- state as DTensors


def _contiguous_stride(shape: Sequence[int]) -> tuple:
    stride, running = [], 1
    for size in reversed(tuple(shape)):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def like_param(local: torch.Tensor, p) -> torch.Tensor:
    """A copy of ``local`` (shaped like ``p``'s local part) as a DTensor laid out as ``p``.

    A copy: ``local`` is a view into a flat buffer, and ``torch.save`` cannot write a
    DTensor over a view at an offset.
    """
    return DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=_contiguous_stride(p.shape))


def like_param_rows(local: torch.Tensor, p) -> torch.Tensor:
    """A copy of ``local`` (``[r, *local shape of p]``: ``r`` vectors laid out like ``p``) as a ``[r, *p.shape]``
    DTensor: sharded along dimension 1 where ``p`` is ``Shard(0)``, replicated where ``p`` is."""
    placements = [Shard(1)] if _is_row_sharded(p) else list(p.placements)
    shape = (local.shape[0], *p.shape)
    return DTensor.from_local(local.clone(), p.device_mesh, placements, run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))


def rank_stacked(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``local`` (the same shape on every rank) as the rank-``r`` slice of a ``[world * n, ...]`` DTensor."""
    shape = (spec.world * local.shape[0], *local.shape[1:])
    return DTensor.from_local(local, spec.mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))
