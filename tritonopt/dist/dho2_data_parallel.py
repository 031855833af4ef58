"""DHO2: data-parallel FOSI, every rank running the same update on a subspace sharded by rows.

:class:`DHO2` is :class:`~tritonopt.optim.FOSI` with a :class:`ShardedSubspace`,
which runs Algorithm 2 (ESE), the row-to-column reconstruction and Algorithm 3
(the update) over a group's ranks. Its collectives, what each rank holds and its
checkpoints: :mod:`tritonopt.dist.dho2`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_choice
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import GuardedCommunicator, group_timeout, resolve_timeout, timed_group
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist._startup import agreement_device, model_layout, require_process_group
from tritonopt.dist.lanczos import distributed_lanczos, lanczos_shard_report, reconstruct_columns
from tritonopt.optim.fosi import FOSI, Curvature, FOSIConfig
from tritonopt.optim.functional import fosi_apply_weight_decay, fosi_base_steps, fosi_scale_segments, fosi_update
from tritonopt.optim.lanczos import default_breakdown_rtol, extreme_ritz, ritz_vectors

__all__ = ["DHO2", "ShardedSubspace"]

_VARIANTS = ("fused", "algorithm3")


class ShardedSubspace:
    """DHO2's subspace for :class:`~tritonopt.optim.FOSI`: ``V`` sharded by rows over a group's ranks.

    Implements the subspace interface of :class:`~tritonopt.optim.fosi.LocalSubspace`
    with Algorithm 2 (ESE), the row-to-column reconstruction and Algorithm 3
    (update); see :mod:`tritonopt.dist.dho2` for the collectives.
    """

    def __init__(self, comm: GuardedCommunicator, group, *, variant: str = "fused", data_parallel_hvp: bool = False):
        self.comm = comm
        self.group = group
        self.variant = variant
        self.data_parallel_hvp = data_parallel_hvp
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.memory: dict = {}

    def __reduce__(self):
        raise TypeError("DHO2 holds a process group and cannot be copied or pickled; save its state_dict "
                        "on every rank instead")

    def reduce_gradient(self, grad: torch.Tensor) -> None:
        self.comm.all_reduce(grad, label="grad_all_reduce", group=self.group)
        grad.div_(self.world)

    def extreme_spectrum(self, hvp, n: int, config: FOSIConfig, *, dtype, device, seed: int) -> Curvature:
        with nvtx_range("tritonopt/dho2/lanczos"):
            result = distributed_lanczos(
                hvp, n, config.lanczos_iters(n), comm=self.comm, group=self.group, dtype=config.lanczos_dtype,
                device=device, passes=config.reorth_passes, seed=seed,
                breakdown_rtol=default_breakdown_rtol(config.lanczos_dtype),
                data_parallel_hvp=self.data_parallel_hvp,
            )
        ritz = extreme_ritz(result.tridiag, config.k, config.l, config.ritz_rtol)
        with nvtx_range("tritonopt/dho2/reconstruct"):
            rows_shard = ritz_vectors(result.basis, ritz.vectors, dtype)
            columns, start = reconstruct_columns(rows_shard, n, comm=self.comm, group=self.group)
        report = {"steps": result.steps, "breakdown": result.breakdown,
                  **lanczos_shard_report(result, n, self.world),
                  "ritz_row_shard_numel": rows_shard.numel(), "v_columns_shape": tuple(columns.shape)}
        self.memory = report
        mine = ritz.values[start : start + columns.shape[0]]
        return Curvature(mine, columns, ritz.values, ritz.scale, report)

    def carry_velocity(self, new_basis: torch.Tensor, old_basis: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        full = (velocity @ old_basis).contiguous()  # V_old^T z, summed over the ranks' rows
        self.comm.all_reduce(full, label="velocity_all_reduce", group=self.group)
        return new_basis @ full

    def update(self, weights, grad, basis, newton_scale, *, all_rows: int, base: str, segments, step: int,
               first_moment=None, second_moment=None, base_scale: float = 1.0, g1_velocity=None, g1_decay: float = 0.0,
               g1_gain: float = 1.0) -> None:
        if all_rows == 0:  # warm-up: the plain (data-parallel) base optimizer
            fosi_update(weights, grad, basis, newton_scale, base=base, segments=segments, step=step,
                        first_moment=first_moment, second_moment=second_moment, base_scale=base_scale)
            return
        fosi_apply_weight_decay(weights, segments)
        v, b = basis, base_scale
        with nvtx_range("tritonopt/dho2/update"):
            g1 = (v @ grad) @ v
            self.comm.all_reduce(g1, label="g1_all_reduce", group=self.group)
            coef = v @ g1
            q = coef if g1_velocity is None else g1_velocity.mul_(g1_decay).add_(coef, alpha=g1_gain)
            newton = -fosi_scale_segments((newton_scale * q) @ v, segments)
            u = fosi_base_steps(grad - g1, first_moment, second_moment, base=base, segments=segments, step=step)
            if self.variant == "algorithm3":
                self.comm.all_reduce(newton, label="delta1_all_reduce", group=self.group)
                projection = (v @ u) @ v
                self.comm.all_reduce(projection, label="projection_all_reduce", group=self.group)
                weights.add_(newton + b * (u - projection))
            else:
                combined = newton - b * ((v @ u) @ v)
                self.comm.all_reduce(combined, label="update_all_reduce", group=self.group)
                weights.add_(b * u + combined)

    def identity(self) -> dict:
        return {"rank": self.rank, "world_size": self.world}

    def check_checkpoint(self, entry, device: torch.device, problem: Optional[Exception]) -> None:
        """Collective: every rank raises if any rank's state dict is malformed (``problem``) or was
        saved on another rank once curvature exists (each rank holds other rows of ``V``)."""
        foreign = False
        if problem is None:
            values = entry.get("all_eigenvalues")
            has_curvature = isinstance(values, torch.Tensor) and values.numel() > 0
            foreign = has_curvature and (entry.get("rank"), entry.get("world_size")) != (self.rank, self.world)
        flag = torch.tensor([2 if problem is not None else int(foreign)], dtype=torch.int32, device=device)
        self.comm.all_reduce(flag, label="load_state_dict", op=dist.ReduceOp.MAX, group=self.group)
        if problem is not None:
            raise problem
        if int(flag.item()) == 2:
            raise ValueError("DHO2: another rank's state dict was refused (see its error); nothing was loaded")
        if int(flag.item()):
            raise ValueError(
                "DHO2 state dicts are per rank once curvature exists (each rank holds its own "
                "eigenvectors): every rank must load the state dict it saved"
            )


class DHO2(FOSI):
    """Data-parallel FOSI with distributed Lanczos and a column-sharded update (see :mod:`tritonopt.dist.dho2`).

    Takes every argument of :class:`~tritonopt.optim.FOSI` (parameter groups,
    schedulers, ``weight_decay``, ``g1_momentum``, ``learning_rate_clip``,
    ``warmup_steps=None``, float64 models), plus:

    Args:
        variant: ``"fused"`` (3 all_reduces per step) or ``"algorithm3"`` (4, as printed).
        comm: a :class:`~tritonopt.dist._comm.CountingCommunicator` whose counters
            record every collective (one is made if None).
        group: the ranks that train together (default: the world).
        data_parallel_hvp: each rank's ``curvature_loss_fn`` uses its own data and
            the HVP is averaged; default False: every rank must pass a loss on
            the same ESE batch.
        timeout: seconds or a ``timedelta``. DHO2 then runs on its own copy of
            ``group`` created with this timeout, so a rank that dies or stalls
            makes the others raise within it; None (default) uses ``group``
            (and its timeout) as it is.

    Must be constructed on every rank of ``group`` at the same time (the
    configuration check is a collective). Call :meth:`step` after ``backward``
    on the rank's own batch: the gradient is averaged here (do not wrap the
    model in DDP). ``copy.deepcopy`` and ``pickle`` are refused (a process
    group cannot be copied); checkpoint with ``state_dict`` on every rank.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, *, variant: str = "fused",
                 comm: Optional[CountingCommunicator] = None, group=None, data_parallel_hvp: bool = False,
                 timeout=None, **kwargs):
        require_process_group("DHO2")
        # A bad argument is kept, not raised, until this rank has joined the configuration check:
        # the other ranks would otherwise wait there for it until the timeout.
        problem: Optional[Exception] = None
        try:
            check_choice("variant", variant, _VARIANTS)
            resolved = resolve_timeout(timeout, group)
        except (TypeError, ValueError) as exc:
            problem, resolved = exc, group_timeout(group)
        if timeout is not None:
            members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            group = timed_group(members, resolved, layer="DHO2", local=True)
        self.comm = CountingCommunicator(group) if comm is None else comm
        self.group, self.variant, self.world = group, variant, dist.get_world_size(group)
        self.timeout = resolved
        guarded = GuardedCommunicator(self.comm, layer="DHO2", timeout=resolved)
        if problem is None:
            try:
                subspace = ShardedSubspace(guarded, group, variant=variant, data_parallel_hvp=bool(data_parallel_hvp))
                super().__init__(params, lr, subspace=subspace, **kwargs)
            except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised
                problem = exc
        if problem is not None:
            check_ranks_agree("DHO2", None, comm=guarded, group=group, device=agreement_device(group), problem=problem)
        trainable = self._trainable()
        settings = {
            "model (shapes, dtypes)": model_layout(trainable),
            **dataclasses.asdict(self.config),
            "variant": variant,
            "data_parallel_hvp": bool(data_parallel_hvp),
            "world layout": dist.get_process_group_ranks(group if group is not None else dist.group.WORLD),
            **{key: [g[key] for g in self.param_groups] for key in ("lr", "betas", "momentum", "eps", "weight_decay")},
            "parameter groups": [len(g["params"]) for g in self.param_groups],
        }
        device = trainable[0].device if trainable else torch.device("cpu")
        check_ranks_agree("DHO2", settings, comm=guarded, group=group, device=device)

    @property
    def memory(self) -> dict:
        """What this rank held at the last ESE: its D shard and its Ritz vectors."""
        return self.subspace.memory
