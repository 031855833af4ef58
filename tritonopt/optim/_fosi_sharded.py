"""FOSI's subspace on DTensor parameters (FSDP2's ``fully_shard``): the basis sharded like the parameters.

Each rank keeps its own coordinates of every Lanczos vector and of the basis
``V``: the rows of each ``Shard(0)`` parameter it holds, a ``Replicate()``
parameter whole. Every sum over coordinates (a dot product, a norm, a
Gram-Schmidt coefficient) is the rank's partial sum, then an all-reduce through
the optimizer's :class:`~tritonopt.optim._sharding.ShardGroup`, over the mesh's
shard dimension (a 1-D mesh's only one; on a 2-D HSDP mesh the ranks of a
replica group hold the same coordinates and compute the same sums); a
replicated coordinate counts on shard rank 0 only. The Lanczos start vector is the unsharded
run's, cut to the rank's coordinates, so the sharded run computes what FOSI on
the unsharded model computes, with the sums taken in another order.

All-reduces (through the ``ShardGroup``, so its byte count has them; ``d`` the
Lanczos dtype's bytes, ``w`` the weights', ``r`` the rows of ``V``):

* ESE, Lanczos iteration ``i`` of ``m`` (``i < m - 1``): ``reorth_passes``
  all-reduces of the ``i + 1`` Gram-Schmidt coefficients (``d`` bytes each),
  then one of 4 float64 (the rank's parts of ``B[i, i]``, ``||h||^2``,
  ``||H v||^2`` and its count of non-finite entries); the last iteration, one
  float64. Per estimate of ``m`` iterations:
  ``d passes m (m - 1) / 2 + 32 (m - 1) + 8`` bytes in ``passes (m - 1) + m`` calls;
* the gradient-difference product's default step: one float64 (``||theta||^2``);
* with ``g1_momentum``, at an ESE that replaces a basis: ``r`` entries (``w`` bytes each);
* each step with ``r > 0``: two all-reduces of ``r`` entries (``V g`` and ``V u``).

The Hessian-vector products add the model's own traffic (FSDP2's all-gathers
and reduce-scatters: one forward and backward per gradient), which the
``ShardGroup`` does not see.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tritonopt.optim._fosi_config import Curvature, FOSIConfig, curvature_from_lanczos
from tritonopt.optim._sharding import Coordinates, ShardGroup, local_coordinates
from tritonopt.optim.functional import fosi_apply_weight_decay, fosi_base_steps, fosi_scale_segments, fosi_update
from tritonopt.optim.lanczos import default_breakdown_rtol, lanczos_loop, start_vector
from tritonopt.ops import gram_schmidt_coefficients, gram_schmidt_subtract


class ParameterShardedSubspace:
    """FOSI's subspace for DTensor parameters: ``V`` sharded like the parameters over their mesh.

    Implements the subspace interface of :class:`~tritonopt.optim.fosi.LocalSubspace`
    (see the module docstring for the collectives); :meth:`bind` tells it the
    parameters whose local parts make the rank's vector.
    """

    def __init__(self, shards: ShardGroup):
        self.shards = shards
        self.coordinates: Optional[Coordinates] = None

    def bind(self, params) -> None:
        self.coordinates = local_coordinates(params, self.shards.spec)

    @property
    def total(self) -> int:
        """Entries of the whole vector (every parameter counted once)."""
        return self.coordinates.total

    def _counted(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        counted = self.coordinates.counted
        return None if counted is None else counted.to(device=like.device, dtype=like.dtype)

    def _counted_matvec(self, basis: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        """``basis @ vector`` summed over the ranks, each coordinate once (one all-reduce)."""
        counted = self._counted(vector)
        return self.shards.all_reduce(basis @ (vector if counted is None else vector * counted))

    def squared_norm(self, vector: torch.Tensor) -> float:
        """``||vector||^2`` of the whole vector whose local part is ``vector`` (float64, one all-reduce)."""
        vector = vector.double()
        counted = self._counted(vector)
        local = torch.dot(vector if counted is None else vector * counted, vector)
        return float(self.shards.all_reduce(local.reshape(1))[0])

    def reduce_gradient(self, grad: torch.Tensor) -> None:
        return None  # FSDP2 (or the caller) already made each rank's part of the whole gradient

    def extreme_spectrum(self, hvp, n: int, config: FOSIConfig, *, dtype, device, seed: int) -> Curvature:
        total, lanczos_dtype = self.total, config.lanczos_dtype
        counted = self.coordinates.counted
        counted = None if counted is None else counted.to(device)
        counted_lanczos = None if counted is None else counted.to(lanczos_dtype)

        def project(basis: torch.Tensor, h: torch.Tensor, rows: int):
            for _ in range(config.reorth_passes):
                coef = gram_schmidt_coefficients(basis, h if counted is None else h * counted_lanczos, rows)
                self.shards.all_reduce(coef)
                h, sq_norm = gram_schmidt_subtract(basis, h, coef)
            if counted is not None:
                sq_norm = torch.dot(h * counted_lanczos, h)
            return h, sq_norm  # this rank's part: lanczos_loop sums it over the ranks with B[i, i]

        first = start_vector(total, seed)[self.coordinates.indices]
        result = lanczos_loop(
            hvp, n, config.lanczos_iters(total), shard_start=0, shard_len=n, gather=lambda shard: shard,
            project=project, dtype=lanczos_dtype, device=device, seed=seed,
            breakdown_rtol=default_breakdown_rtol(lanczos_dtype), first=first, reduce=self.shards.all_reduce,
            counted=counted,
        )
        return curvature_from_lanczos(result, config, dtype)

    def carry_velocity(self, new_basis: torch.Tensor, old_basis: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        return self._counted_matvec(new_basis, velocity @ old_basis)

    def update(self, weights, grad, basis, newton_scale, *, all_rows: int, base: str, segments, step: int,
               first_moment=None, second_moment=None, base_scale: float = 1.0, g1_velocity=None, g1_decay: float = 0.0,
               g1_gain: float = 1.0) -> None:
        """:func:`~tritonopt.optim.functional.fosi_update`'s arithmetic with ``V g`` and ``V u`` summed over the ranks."""
        if all_rows == 0:  # no basis: the base optimizer's step, coordinate by coordinate
            fosi_update(weights, grad, basis, newton_scale, base=base, segments=segments, step=step,
                        first_moment=first_moment, second_moment=second_moment, base_scale=base_scale)
            return
        fosi_apply_weight_decay(weights, segments)
        g = grad.to(weights.dtype)
        coef = self._counted_matvec(basis, g)
        q = coef if g1_velocity is None else g1_velocity.mul_(g1_decay).add_(coef, alpha=g1_gain)
        newton = fosi_scale_segments((newton_scale * q) @ basis, segments)
        u = fosi_base_steps(g - coef @ basis, first_moment, second_moment, base=base, segments=segments, step=step)
        weights.add_(base_scale * (u - self._counted_matvec(basis, u) @ basis) - newton)

    def identity(self) -> dict:
        return {}

    def check_checkpoint(self, entry, device: torch.device, problem: Optional[Exception]) -> None:
        """Collective: every rank raises when any rank's state dict was refused (one all-reduce of one int)."""
        flag = torch.tensor([int(problem is not None)], dtype=torch.int32, device=device)
        self.shards.all_reduce(flag, dist.ReduceOp.MAX)
        if problem is not None:
            raise problem
        if int(flag[0]):
            raise ValueError("FOSI: another rank's state dict was refused (see its error); nothing was loaded")
