"""Parameters sharded over ranks as DTensors (``torch.distributed.fsdp.fully_shard``, FSDP2).

An FSDP2 model's parameters are DTensors on a 1-D device mesh: ``Shard(0)``
(each rank holds a slice of the rows, the last ranks fewer when the rows do not
divide, as ``torch.chunk`` cuts them) or ``Replicate()``. On a 2-D (HSDP) mesh,
``init_device_mesh(..., (R, S), mesh_dim_names=("replicate", "shard"))``, they
are ``(Replicate(), Shard(0))`` or ``(Replicate(), Replicate())``: the rows are
cut over the ``S`` ranks of the second (shard) dimension, and the ``R`` ranks of
the first (replicate) dimension that share a shard index hold the same shards.
FSDP2 averages the gradients over all ``R * S`` ranks, so the ranks of one
replica group see the same gradients and compute alike: every sum over
coordinates is taken over the shard dimension's ranks only, and ``world`` and
``rank`` (:class:`ShardSpec`) are along that dimension (a 1-D mesh is its own
shard dimension, with one replica). The packed core packs each rank's local
tensors (``p.to_local()``, ``p.grad.to_local()``) and writes the updates into
them. What the optimizers need from here:

* :func:`shard_spec`: the mesh of a parameter list, or ``None`` for plain
  tensors, refusing what no optimizer here handles (mixed lists, several
  meshes, meshes of 3 or more dimensions, a 2-D mesh sharded along its
  replicate dimension, other placements);
* :func:`refuse_sharded`: the construction-time refusal of an optimizer that
  does not handle DTensors;
* :class:`ShardGroup`: the collectives a sharded optimizer runs (over the shard
  dimension's process group), with the bytes they moved, and
  :meth:`ShardGroup.check_agree`, which makes ranks of the mesh (every replica
  group's too) with another configuration fail naming the setting;
* :func:`local_coordinates`: where a rank's local coordinates sit in the whole
  vector, and which of them count in a sum over the shard dimension's ranks (a
  replicated parameter's on one rank only);
* the conversion of state between local tensors (what the optimizer keeps)
  and DTensors on the parameters' mesh (what its ``state_dict`` shows, so that
  ``torch.distributed.checkpoint`` saves each rank's part; on a 2-D mesh
  replicated along the replicate dimension, so that it saves each shard once).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from tritonopt._distributed import CollectiveFailure, common_mesh, failure_message, group_timeout, is_dtensor

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch without DTensor: no parameter can be one
    DTensor = None
    Replicate = Shard = None


is_sharded = is_dtensor


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


def is_row_sharded(p) -> bool:
    """Whether ``p`` is a DTensor whose rows are cut over its mesh's shard dimension (the last one)."""
    return is_sharded(p) and isinstance(p.placements[-1], Shard)


def shard_world_of(t) -> int:
    """The number of ranks along the shard dimension (the last) of DTensor ``t``'s mesh."""
    if not is_sharded(t):
        raise ValueError(f"shard_world_of needs a DTensor, got {type(t).__name__}")
    mesh = t.device_mesh
    return mesh.size(mesh.ndim - 1)


def rows_placements(p, dim: int) -> list:
    """The placements of a tensor laid out like ``p`` whose dimension ``dim`` holds ``p``'s rows: ``p``'s, with a
    ``Shard(0)`` made ``Shard(dim)``."""
    if not is_sharded(p):
        raise ValueError(f"rows_placements needs a DTensor parameter, got {type(p).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"rows_placements: dim must be an int >= 0, got {dim!r}")
    return [Shard(dim) if isinstance(placement, Shard) else placement for placement in p.placements]


@dataclass
class ShardSpec:
    """The mesh every DTensor parameter of an optimizer lives on, and this rank's place on it.

    ``world`` and ``rank``: along the mesh's shard dimension, over which the
    parameters' rows are cut (a 1-D mesh's only dimension; an HSDP mesh's
    second, ``"shard"``). ``replicas`` and ``replica``: along its replicate
    dimension (an HSDP mesh's first; 1 and 0 on a 1-D mesh), whose ranks hold
    the same shards and compute alike.
    """

    mesh: object
    world: int
    rank: int
    replicas: int = 1
    replica: int = 0

    def local_rows(self, rows: int, rank: int) -> int:
        """Rows of a ``Shard(0)`` dimension of ``rows`` on ``rank``, as ``torch.chunk`` (and FSDP2) cut them."""
        chunk = -(-rows // self.world) if rows else 0
        return max(0, min(chunk, rows - rank * chunk))

    def largest_local_numel(self, params: Sequence[torch.Tensor]) -> int:
        """The most elements any rank holds of ``params``: rank 0's, which gets the first, fullest chunks."""
        total = 0
        for p in params:
            if is_row_sharded(p):
                total += self.local_rows(p.shape[0], 0) * math.prod(p.shape[1:])
            else:
                total += p.numel()
        return total


@dataclass
class Coordinates:
    """Where a rank's local coordinates of ``params`` (their local parts laid end to end) sit in the whole vector.

    The whole vector is every parameter flattened whole, in order, as an unsharded
    optimizer lays them out: ``total`` entries. ``indices`` (int64, one per local
    coordinate) are their positions there. ``counted`` (float64, 1 or 0 per local
    coordinate) makes each coordinate count once in a sum over the shard
    dimension's ranks: a ``Replicate()`` parameter, which every rank holds whole,
    counts on (shard) rank 0 only. None when every local coordinate counts (no
    replicated parameter, or rank 0).
    """

    indices: torch.Tensor
    counted: Optional[torch.Tensor]
    total: int


def local_coordinates(params: Sequence[torch.Tensor], spec: ShardSpec) -> Coordinates:
    """The :class:`Coordinates` of this rank's parts of ``params`` (each ``Shard(0)`` or ``Replicate()`` along the
    shard dimension)."""
    if not isinstance(spec, ShardSpec):
        raise ValueError(f"local_coordinates needs a ShardSpec, got {type(spec).__name__}")
    if not params:
        raise ValueError("local_coordinates needs at least one parameter")
    indices, counted, start, replicated = [], [], 0, False
    for p in params:
        numel = p.numel()
        if is_row_sharded(p):
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
    """The mesh of ``params``, None for plain tensors.

    Supported: all DTensors on one device mesh, either 1-D with each parameter
    ``Shard(0)`` or ``Replicate()`` (FSDP2's ``fully_shard``), or 2-D (HSDP) with
    each ``(Replicate(), Shard(0))`` or ``(Replicate(), Replicate())``: replicated
    along the first (replicate) dimension, sharded by rows or replicated along the
    second (shard) one. Anything else raises ``ValueError`` naming what is not
    supported.
    """
    mesh = common_mesh(owner, params)
    if mesh is None:
        return None
    sharded = list(params)
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"{owner} supports DTensor parameters on a 1-D device mesh (FSDP2's fully_shard) or a 2-D one "
            f"(HSDP: replicate, shard), got a {mesh.ndim}-D mesh {tuple(mesh.shape)}{_dim_names(mesh)}"
        )
    for p in sharded:
        *outer, placement = p.placements
        if any(not isinstance(other, Replicate) for other in outer):
            raise ValueError(
                f"{owner} supports DTensor parameters on a 2-D (HSDP) mesh that are replicated along its first "
                f"(replicate) dimension, as fully_shard makes them, got a parameter of shape {tuple(p.shape)} with "
                f"placements ({_placement_name(p)}) on the mesh {tuple(mesh.shape)}{_dim_names(mesh)}: a "
                f"placement other than Replicate() on the replicate dimension is not supported"
            )
        if not (isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0)):
            if mesh.ndim == 1:
                raise ValueError(
                    f"{owner} supports DTensor parameters sharded along their first dimension (Shard(0), as "
                    f"fully_shard makes them) or replicated, got a parameter of shape {tuple(p.shape)} with "
                    f"placement {_placement_name(p)}"
                )
            raise ValueError(
                f"{owner} supports DTensor parameters on a 2-D (HSDP) mesh sharded along their first dimension "
                f"(Shard(0), as fully_shard makes them) or replicated along its second (shard) dimension, got a "
                f"parameter of shape {tuple(p.shape)} with placements ({_placement_name(p)}) on the mesh "
                f"{tuple(mesh.shape)}{_dim_names(mesh)}"
            )
    if mesh.ndim == 1:
        return ShardSpec(mesh=mesh, world=mesh.size(), rank=mesh.get_local_rank())
    return ShardSpec(mesh=mesh, world=mesh.size(1), rank=mesh.get_local_rank(1), replicas=mesh.size(0),
                     replica=mesh.get_local_rank(0))


def _dim_names(mesh) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    return f" (dimensions {tuple(names)})" if names else ""


def refuse_sharded(owner: str, params: Sequence[torch.Tensor], why: str) -> None:
    """``ValueError`` when any of ``params`` is a DTensor: ``owner`` cannot step sharded parameters, ``why``."""
    if any(is_sharded(p) for p in params):
        raise ValueError(f"{owner} does not support DTensor (sharded, e.g. FSDP2 fully_shard) parameters: {why}")


def _digest(value) -> int:
    """A 63-bit digest of ``repr(value)``: equal settings give equal digests on every rank."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class ShardGroup:
    """The collectives of a sharded optimizer over its mesh's shard dimension, counted.

    ``group`` is the process group of the shard dimension (a 1-D mesh's own; an
    HSDP mesh's second dimension), over which every sum over coordinates and every
    shared decision is all-reduced: the ranks of one replica group hold the same
    data, so each shard group decides what the others do. ``replica_group`` is the
    replicate dimension's (None on a 1-D mesh), used by :meth:`check_agree` only.
    ``bytes_all_reduced`` and ``all_reduce_calls`` count what :meth:`all_reduce`
    sent (each rank's tensor, in bytes); the agreement check is not counted.

    A collective that fails (a rank died, or stalled past the process group's
    timeout, the one ``init_process_group`` or the mesh's group was created with)
    raises :class:`~tritonopt.dist.CollectiveFailure` naming ``owner``, the
    collective, the ranks, the time waited and the timeout.
    """

    spec: ShardSpec
    bytes_all_reduced: int = 0
    all_reduce_calls: int = 0
    group: object = field(default=None, repr=False)
    replica_group: object = field(default=None, repr=False)
    owner: str = "a sharded optimizer"

    def __post_init__(self):
        if not isinstance(self.spec, ShardSpec):
            raise ValueError(f"ShardGroup needs a ShardSpec, got {type(self.spec).__name__}")
        mesh = self.spec.mesh
        if mesh.ndim == 1:
            self.group = mesh.get_group()
        else:
            self.group = mesh.get_group(mesh.ndim - 1)
            self.replica_group = mesh.get_group(0)

    def _run(self, what: str, collective, *args, group, **kwargs):
        """``collective(*args, group=group, **kwargs)``; a failure becomes a CollectiveFailure naming it."""
        began = time.monotonic()
        try:
            return collective(*args, group=group, **kwargs)
        except RuntimeError as exc:  # gloo and NCCL report a dead or late peer so (DistError included)
            raise CollectiveFailure(failure_message(
                self.owner, f"the collective {what!r}", ranks=dist.get_process_group_ranks(group),
                seconds=time.monotonic() - began, timeout=group_timeout(group), cause=exc,
                detail="The optimizer cannot go on: restart from a checkpoint.",
            )) from exc

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self.bytes_all_reduced += tensor.numel() * tensor.element_size()
        self.all_reduce_calls += 1
        self._run("all_reduce", dist.all_reduce, tensor, op=op, group=self.group)
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

    def _rank_names(self) -> list[str]:
        """How :meth:`check_agree` names each rank of the mesh, in the order it gathers them."""
        if self.replica_group is None:
            return [f"rank {r}" for r in range(self.spec.world)]
        ranks = self.spec.mesh.mesh.reshape(self.spec.replicas, self.spec.world).tolist()
        return [f"rank {ranks[i][j]} (replicate {i}, shard {j})"
                for i in range(self.spec.replicas) for j in range(self.spec.world)]

    def _gather_tensors(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """``mine`` from every rank of the mesh: over the shard dimension, then those over the replicate one."""
        gathered = [torch.empty_like(mine) for _ in range(self.spec.world)]
        self._run("all_gather", dist.all_gather, gathered, mine, group=self.group)
        if self.replica_group is None:
            return gathered
        rows = torch.stack(gathered)
        replicas = [torch.empty_like(rows) for _ in range(self.spec.replicas)]
        self._run("all_gather", dist.all_gather, replicas, rows, group=self.replica_group)
        return [row for replica in replicas for row in replica]

    def _gather_objects(self, mine) -> list:
        gathered = [None] * self.spec.world
        self._run("all_gather_object", dist.all_gather_object, gathered, mine, group=self.group)
        if self.replica_group is None:
            return gathered
        replicas = [None] * self.spec.replicas
        self._run("all_gather_object", dist.all_gather_object, replicas, gathered, group=self.replica_group)
        return [value for replica in replicas for value in replica]

    def check_agree(self, owner: str, settings: dict) -> None:
        """``ValueError`` on every rank of the mesh, naming each differing setting and every rank's value, unless
        all agree (on a 2-D mesh, the ranks of every replica group too).

        One all-gather of one 63-bit digest per setting (two on a 2-D mesh: over the shard dimension, then over
        the replicate one); the values themselves travel only when some differ.
        """
        if not isinstance(settings, dict):
            raise ValueError(f"check_agree needs the settings as a dict, got {type(settings).__name__}")
        names = sorted(settings)
        mine = torch.tensor([_digest(settings[name]) for name in names], dtype=torch.int64)
        gathered = self._gather_tensors(mine)
        differing = [name for i, name in enumerate(names) if any(int(g[i]) != int(mine[i]) for g in gathered)]
        # A rank that differs nowhere may still see others differ among themselves: it compares its digest with
        # every rank's, so any difference anywhere shows on every rank.
        if not differing:
            return
        values = self._gather_objects({name: repr(settings[name]) for name in differing})
        labels = self._rank_names()
        details = "; ".join(
            f"{name}: " + ", ".join(f"{label} has {value[name]}" for label, value in zip(labels, values))
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
    if not is_sharded(p):
        raise ValueError(f"like_param needs a DTensor parameter, got {type(p).__name__}")
    if local.shape != p.to_local().shape:
        raise ValueError(f"like_param: the local tensor has shape {tuple(local.shape)}, the parameter's local part "
                         f"{tuple(p.to_local().shape)}")
    return DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=_contiguous_stride(p.shape))


def like_param_rows(local: torch.Tensor, p) -> torch.Tensor:
    """A copy of ``local`` (``[r, *local shape of p]``: ``r`` vectors laid out like ``p``) as a ``[r, *p.shape]``
    DTensor: sharded along dimension 1 where ``p`` is ``Shard(0)``, replicated where ``p`` is (on a 2-D mesh,
    replicated along the replicate dimension as ``p`` is)."""
    if not is_sharded(p):
        raise ValueError(f"like_param_rows needs a DTensor parameter, got {type(p).__name__}")
    if local.dim() != p.dim() + 1 or local.shape[1:] != p.to_local().shape:
        raise ValueError(f"like_param_rows: the local tensor has shape {tuple(local.shape)}, expected [r, "
                         f"{', '.join(map(str, p.to_local().shape))}]")
    shape = (local.shape[0], *p.shape)
    return DTensor.from_local(local.clone(), p.device_mesh, rows_placements(p, 1), run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))


def rank_stacked(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``local`` (the same shape on every rank) as the shard-rank-``r`` slice of a ``[world * n, ...]`` DTensor
    (on a 2-D mesh replicated along the replicate dimension: every replica holds the same slices)."""
    if not isinstance(spec, ShardSpec):
        raise ValueError(f"rank_stacked needs a ShardSpec, got {type(spec).__name__}")
    if local.dim() < 1:
        raise ValueError("rank_stacked needs a tensor of at least one dimension, got a 0-d one")
    shape = (spec.world * local.shape[0], *local.shape[1:])
    placements = [Replicate()] * (spec.mesh.ndim - 1) + [Shard(0)]
    return DTensor.from_local(local, spec.mesh, placements, run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))
