"""KAISA on an FSDP2-sharded model: each layer's whole gradient gathered, its preconditioned rows written back.

After ``fully_shard`` (FSDP2) a layer's weight and bias are DTensors: on a 1-D
mesh ``Shard(0)`` (each rank holds a block of the output rows, ``torch.chunk``'s
cut, so the last ranks hold fewer when the rows do not divide) or ``Replicate()``;
on a 2-D (HSDP) mesh ``(Replicate(), Shard(0))``. The forward and backward passes
still run every layer whole: FSDP2 all-gathers the weights before a layer's
forward and reduce-scatters its gradient after its backward. So K-FAC's factor
statistics (the layer's inputs and output gradients, which the hooks see) are
each rank's own, as under DDP, and KAISA all-reduces them as it does there.

What sharding changes is the gradient: after backward each rank holds only its
rows of the averaged gradient. ``P = QG [(QG^T grad QA) / D] QA^T`` mixes every
row of ``grad`` into every row of ``P``, so :class:`ShardedLayerGradients`
gathers each layer's whole ``[g, a]`` gradient over the mesh's shard dimension
(one ``all_gather_into_tensor`` per step, every layer's rows packed in one flat
buffer), KAISA then runs exactly as on an unsharded model (its gradient workers
precondition, its receivers get ``P`` by broadcast, the KL clip and the
non-finite checks see the same whole tensors on every rank), and each rank
writes back its own rows of ``P``. Given the same averaged gradients, the
result is the unsharded KAISA's bit for bit.

Bytes per step and rank (``grad_allgather``): ``4 * S * sum_p ceil(r_p / S) * c_p``
received, a ``1/S`` part of it sent, over the ``Shard(0)`` parameters ``p`` of
the registered layers (``r_p`` rows of ``c_p`` columns; ``S`` ranks along the
shard dimension); replicated parameters travel no bytes. Each rank holds every
layer's whole gradient for the step, on top of the factors every rank holds
anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tritonopt._distributed import common_mesh, is_dtensor
from tritonopt.optim.kfac import KFACLayer

try:
    from torch.distributed.tensor import Replicate, Shard
except ImportError:  # torch without DTensor: no parameter can be one (``of`` returns None first)
    Replicate = Shard = None

__all__ = ["ShardedLayerGradients", "expected_gather_bytes"]


def _chunk(rows: int, count: int, index: int) -> tuple[int, int, int]:
    """``(first row, rows held, chunk)`` of block ``index`` of ``rows`` cut into ``count`` as ``torch.chunk`` cuts."""
    chunk = -(-rows // count) if rows else 0
    first = min(index * chunk, rows)
    return first, min(rows, first + chunk) - first, chunk


@dataclass(frozen=True)
class _Param:
    """One registered parameter (weight or bias) as K-FAC's ``[g, a]`` matrix sees it."""

    tensor: torch.Tensor  # the DTensor the optimizer steps (its .grad is the sharded gradient)
    rows: int  # g: the output rows
    columns: int  # weight: a - has_bias columns; bias: 1
    row_sharded: bool


def expected_gather_bytes(shapes: Sequence[tuple[int, int]], shards: int) -> dict[str, int]:
    """Bytes one rank sends and receives in a step's ``grad_allgather`` for the ``Shard(0)`` parameters
    ``shapes`` (``(rows, columns)`` each) over ``shards`` ranks: float32, each rank's block padded to the chunk."""
    padded = sum(-(-rows // shards) * columns for rows, columns in shapes)
    return {"sent": 4 * padded, "received": 4 * (shards - 1) * padded}


class ShardedLayerGradients:
    """The sharded parameters of KAISA's layers: their mesh, the gradient gather and the write-back.

    Build it with :meth:`of` (None for an unsharded model). ``shard_dim`` is the
    mesh dimension the rows are cut along (None when every parameter is
    replicated), ``shards`` the ranks along it and ``shard_index`` this rank's
    place there; ``shard_groups`` lists the global ranks of every group along that
    dimension (the caller creates them, every rank all of them in this order),
    ``my_group`` this rank's.
    """

    def __init__(self, layers: Sequence[KFACLayer], params: list[list[_Param]], mesh, shard_dim: Optional[int]):
        self.layers = list(layers)
        self.params = params
        self.mesh = mesh
        self.shard_dim = shard_dim
        ranks = mesh.mesh  # the global rank at each mesh coordinate
        if shard_dim is None:
            self.shards, self.shard_index = 1, 0
            self.shard_groups: list[tuple[int, ...]] = []
            self.my_group: tuple[int, ...] = ()
        else:
            self.shards = mesh.size(shard_dim)
            self.shard_index = mesh.get_local_rank(shard_dim)
            lines = ranks.movedim(shard_dim, -1).reshape(-1, self.shards)
            self.shard_groups = [tuple(int(r) for r in line) for line in lines]
            me = mesh.get_rank()
            self.my_group = next(group for group in self.shard_groups if me in group)
        # A process group orders its members by global rank; the blocks are wanted in mesh order.
        members = sorted(self.my_group)
        self._block_order = [members.index(r) for r in self.my_group]
        self.group = None  # set by the caller: the process group of ``my_group`` (with its timeout)

    # ------------------------------------------------------------------ construction

    @classmethod
    def of(cls, layers: Sequence[KFACLayer], world_size: int, owner: str) -> Optional["ShardedLayerGradients"]:
        """The sharded view of ``layers``' parameters, None when none is a DTensor.

        Raises ``ValueError`` naming what is not supported: DTensors mixed with plain
        tensors among the layers, several meshes, a mesh that is not the whole
        ``torch.distributed`` world, or placements other than ``Replicate()`` and
        ``Shard(0)`` on one mesh dimension.
        """
        plain = [layer.name for layer in layers if not all(is_dtensor(p) for p in _layer_params(layer))]
        if plain and len(plain) < len(layers):
            raise ValueError(
                f"{owner}: layers {plain} have plain-tensor parameters while others are DTensors (FSDP2): shard "
                "every preconditioned layer (fully_shard the root module too) or none"
            )
        mesh = common_mesh(owner, [p for layer in layers for p in _layer_params(layer)])
        if mesh is None:
            return None
        if mesh.size() != world_size:
            raise ValueError(
                f"{owner} averages its factors over all {world_size} ranks of torch.distributed, but the "
                f"parameters' device mesh {tuple(mesh.shape)} holds {mesh.size()}: the mesh must span the world"
            )
        shard_dims = set()
        for layer in layers:
            for p in _layer_params(layer):
                for dim, placement in enumerate(p.placements):
                    if isinstance(placement, Shard) and placement.dim == 0 and type(placement) is Shard:
                        shard_dims.add(dim)
                    elif not isinstance(placement, Replicate):
                        raise ValueError(
                            f"{owner} supports DTensor parameters sharded along their first dimension (Shard(0), "
                            f"as fully_shard makes them) or replicated, got {placement!r} on mesh dimension {dim} "
                            f"for a parameter of layer {layer.name!r} of shape {tuple(p.shape)}"
                        )
                if sum(isinstance(pl, Shard) for pl in p.placements) > 1:
                    raise ValueError(f"{owner}: layer {layer.name!r} has a parameter sharded along several mesh "
                                     f"dimensions ({p.placements}); one Shard(0) dimension is supported")
        if len(shard_dims) > 1:
            raise ValueError(f"{owner}: the parameters are sharded along mesh dimensions {sorted(shard_dims)}; "
                             "one shard dimension (and replicas along the others, as HSDP makes them) is supported")
        shard_dim = shard_dims.pop() if shard_dims else None
        params = []
        for layer in layers:
            entries = [_Param(layer.weight, layer.g_dim, layer.a_dim - int(layer.has_bias),
                              shard_dim is not None and isinstance(layer.weight.placements[shard_dim], Shard))]
            if layer.has_bias:
                entries.append(_Param(layer.bias, layer.g_dim, 1,
                                      shard_dim is not None and isinstance(layer.bias.placements[shard_dim], Shard)))
            params.append(entries)
        return cls(layers, params, mesh, shard_dim)

    def settings(self) -> dict[str, object]:
        """What every rank must hold alike about the sharding (for KAISA's agreement check)."""
        return {
            "mesh": (tuple(self.mesh.shape), self.mesh.mesh_dim_names),
            "placements": tuple(tuple(str(pl) for pl in entry.tensor.placements)
                                for entries in self.params for entry in entries),
        }

    def row_sharded_shapes(self) -> list[tuple[int, int]]:
        """``(rows, columns)`` of every ``Shard(0)`` parameter: what the gather carries."""
        return [(e.rows, e.columns) for entries in self.params for e in entries if e.row_sharded]

    # ------------------------------------------------------------------ the step

    def has_grad(self, index: int) -> bool:
        return all(e.tensor.grad is not None for e in self.params[index])

    def gather(self, comm) -> dict[int, torch.Tensor]:
        """``{layer index: whole [g, a] float32 gradient}`` of the layers that have gradients, the same on every
        rank: one ``all_gather_into_tensor`` (label ``grad_allgather``) over the shard group."""
        present = [i for i in range(len(self.layers)) if self.has_grad(i)]
        blocks = []
        for i in present:
            for e in self.params[i]:
                if e.row_sharded:
                    blocks.append(self._padded_block(e))
        gathered = None
        if blocks:
            flat = torch.cat([b.reshape(-1) for b in blocks])
            if self.shards == 1:
                gathered = flat.view(1, -1)
            else:
                gathered = torch.empty(self.shards * flat.numel(), dtype=torch.float32, device=flat.device)
                comm.all_gather_into_tensor(gathered, flat, label="grad_allgather", group=self.group)
                gathered = gathered.view(self.shards, flat.numel())
                if self._block_order != sorted(self._block_order):
                    gathered = gathered[self._block_order]
        grads, offset = {}, 0
        for i in present:
            pieces = []
            for e in self.params[i]:
                if e.row_sharded:
                    chunk = -(-e.rows // self.shards)
                    n = chunk * e.columns
                    whole = gathered[:, offset : offset + n].reshape(self.shards * chunk, e.columns)[: e.rows]
                    offset += n
                else:
                    whole = e.tensor.grad.to_local().reshape(e.rows, e.columns).to(torch.float32)
                pieces.append(whole)
            grads[i] = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].contiguous()
        return grads

    def _padded_block(self, e: _Param) -> torch.Tensor:
        """This rank's rows of ``e``'s gradient, float32 ``[chunk, columns]``, zero rows after its own."""
        local = e.tensor.grad.to_local()
        _, held, chunk = _chunk(e.rows, self.shards, self.shard_index)
        if local.shape[0] != held:
            raise RuntimeError(f"a gradient of shape {tuple(e.tensor.shape)} holds {local.shape[0]} rows on this "
                               f"rank, expected {held} (torch.chunk's cut over {self.shards} ranks)")
        block = torch.zeros(chunk, e.columns, dtype=torch.float32, device=local.device)
        block[:held] = local.reshape(held, e.columns)
        return block

    def write(self, index: int, matrix: torch.Tensor) -> None:
        """Copy this rank's rows of the whole ``[g, a]`` matrix into the layer's local gradients (their dtypes)."""
        column = 0
        for e in self.params[index]:
            local = e.tensor.grad.to_local()
            part = matrix[:, column : column + e.columns]
            column += e.columns
            if e.row_sharded:
                first, held, _ = _chunk(e.rows, self.shards, self.shard_index)
                part = part[first : first + held]
            local.copy_(part.reshape(local.shape))


def _layer_params(layer: KFACLayer) -> list[torch.Tensor]:
    return [layer.weight] + ([layer.bias] if layer.has_bias else [])
