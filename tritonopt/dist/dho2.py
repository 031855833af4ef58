"""DHO2 and MR-DHO2: distributed FOSI (Gu et al., secs. III and IV).

Both compose FOSI's public pieces (:mod:`tritonopt.optim.functional`,
:mod:`tritonopt.optim.lanczos`, :class:`~tritonopt.optim.fosi.FOSIConfig`) with
their collectives.

DHO2 (:class:`DHO2`) -- data parallel, every rank runs the same update. It is
:class:`~tritonopt.optim.FOSI` with a :class:`ShardedSubspace`:

* gradient: ``all_reduce`` of the flat gradient, divided by ``C`` ("grad_all_reduce", n);
* ESE: Algorithm 2 (:func:`tritonopt.dist.lanczos.distributed_lanczos`; ``D`` row
  shard ``[m, ceil(n/C)]`` per rank), ``eigh(B)`` on every rank, then one
  ``all_to_all`` turns the Ritz-vector row shard into ``r_c`` whole vectors
  (``V_c``: ``[r_c, n]``, rows ``[start_c, start_c + r_c)`` of ``V``); with
  ``g1_momentum``, one more ``all_reduce`` ("velocity_all_reduce", n) carries
  the velocity into the new basis;
* update, ``variant="algorithm3"`` (Algorithm 3 as printed, 4 n-sized all_reduces
  per step)::

      g  = AR(grad) / C;  g1 = AR(V_c^T V_c g);  d1 = AR(-rho V_c^T (s_c * q_c))
      u  = O(g - g1);     w += d1 + b (u - AR(V_c^T V_c u))

  with ``q_c = V_c g1`` or its velocity, ``rho`` the groups' Newton factors
  (``lr / initial_lr``), ``b`` the base-step scale. ``variant="fused"``
  (default, 3 all_reduces: "grad_all_reduce", "g1_all_reduce",
  "update_all_reduce"): the Newton term and the projection share one
  all_reduce: ``w += b u + AR(-rho V_c^T (s_c * q_c) - b V_c^T V_c u)``.

Each rank holds the model, the gradient, the base optimizer's state
(replicated, as in the paper), ``V_c`` (``r_c n``) and, during the ESE only,
its ``D`` shard. Checkpoints are per rank: :meth:`DHO2.load_state_dict` issues
one one-integer all_reduce ("load_state_dict") and refuses, on every rank, a
state dict saved on another rank once curvature exists.

MR-DHO2 (:class:`MRDHO2`) -- ranks ``0..A-1`` are accelerators, ``A..C-1`` workers.
Per epoch (the caller brackets each epoch with :meth:`MRDHO2.begin_epoch` /
:meth:`MRDHO2.end_epoch`; workers call :meth:`MRDHO2.step` after each backward):

* begin: ``broadcast`` of the weights ``c`` from the first worker to the
  accelerators ("weights_broadcast", group accelerators + first worker, n);
  accelerators run Algorithm 2 among themselves on ``curvature_loss_fn`` at ``c``;
* every worker step: ``all_reduce`` of the gradient among workers, divided by
  ``J`` ("worker_grad_all_reduce", n); ``w += O(g)``; ``p += g`` (eq. 13);
* end: one world ``all_to_all`` ("ritz_scatter") sends each worker ``j`` its
  ``r_j`` Ritz vectors (every accelerator sends its rows ``[n/A]`` of them),
  two ``broadcast`` from rank 0 of the count and of the Ritz values with the
  spectrum's scale ("eigenvalue_broadcast"), and the final model update
  (eq. 17) on the workers with 2 all_reduces among workers
  ("final_newton_and_projection" (2n), "final_reprojection" (n))::

      o = w - c;   w_new = c - sum_j V_j^T (s_j * V_j p~) + (I - P)(I - P) o

  ``p~ = p`` (``accumulated_gradient="sum"``, default, eq. 15 as printed) or
  ``p / I`` (``"mean"``). FOSI applies one Newton step per iteration, so over
  an epoch of ``I`` steps it moves by the Newton step of the summed gradients:
  the sum keeps alpha on the same scale as FOSI's; the mean applies a single
  step's worth and is the more cautious option.

Accelerators do not train; their weights follow the broadcast at each epoch start.

Both layers take a ``timeout`` that applies to every process group they
create (DHO2 creates one only when given a timeout), check at construction,
with two small ``all_gather`` of 8-byte digests ("config_check"), that every
rank has the same model shapes, hyperparameters and world layout (else every
rank raises ``ValueError`` naming the settings that differ and each rank's
value; a rank that refused its own arguments joins that check with its error,
so every rank raises at once, the others naming it), and re-raise a
failed collective (a rank that died, or stalled past the timeout) as
:class:`~tritonopt.dist._collective_guard.CollectiveFailure` naming the
collective and the ranks.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_choice, check_float, check_int
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import GuardedCommunicator, group_timeout, resolve_timeout, timed_group
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist.lanczos import (
    column_split,
    distributed_lanczos,
    lanczos_shard_report,
    reconstruct_columns,
    shard_size,
)
from tritonopt.optim import apply_nonfinite_policy
from tritonopt.optim.fosi import FOSI, Curvature, FOSIConfig
from tritonopt.optim.functional import (
    FOSIHyper,
    fosi_apply_weight_decay,
    fosi_base_steps,
    fosi_scale_segments,
    fosi_update,
)
from tritonopt.optim.lanczos import RitzSelection, default_breakdown_rtol, extreme_ritz, make_hvp, ritz_vectors

__all__ = ["DHO2", "MRDHO2", "ShardedSubspace"]

_VARIANTS = ("fused", "algorithm3")


def _require_process_group(layer: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{layer} needs an initialised torch.distributed process group")


def _setup_device(group) -> torch.device:
    """Where the start-up collectives' tensors live when the parameters cannot tell (NCCL: the GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model_layout(params) -> list[tuple]:
    return [(tuple(p.shape), str(p.dtype)) for p in params]


class ShardedSubspace:
    """DHO2's subspace for :class:`~tritonopt.optim.FOSI`: ``V`` sharded by rows over a group's ranks.

    Implements the subspace interface of :class:`~tritonopt.optim.fosi.LocalSubspace`
    with Algorithm 2 (ESE), the row-to-column reconstruction and Algorithm 3
    (update); see the module docstring for the collectives.
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
    """Data-parallel FOSI with distributed Lanczos and a column-sharded update (see the module docstring).

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
        _require_process_group("DHO2")
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
            check_ranks_agree("DHO2", None, comm=guarded, group=group, device=_setup_device(group), problem=problem)
        trainable = self._trainable()
        settings = {
            "model (shapes, dtypes)": _model_layout(trainable),
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


class MRDHO2:
    """Multi-role DHO2: accelerators estimate curvature while workers train (see the module docstring).

    Args:
        params: the model's parameters (every rank builds the same model).
        num_accelerators: ``A``, ranks ``0..A-1``; the other ``J = C - A`` ranks are workers.
        lr, base, betas, momentum, eps: the workers' base optimizer.
        k, l, alpha, num_lanczos_iters, lanczos_dtype, reorth_passes, ritz_rtol,
        eigenvalue_floor, paper_exact, seed: as in :class:`~tritonopt.optim.FOSI`.
        accumulated_gradient: ``"sum"`` (default, as printed) or ``"mean"``: how ``p`` enters eq. (17).
        comm: a :class:`CountingCommunicator` (made if None); its counters record every collective.
        timeout: seconds or a ``timedelta`` for every process group MR-DHO2 creates
            (a world copy and the accelerator, worker and bridge groups);
            None: the world's timeout.
        on_nonfinite: a worker gradient with NaN or inf: ``"skip"`` (warn, count
            in :attr:`skipped_steps`, change nothing) or ``"raise"``.

    Must be constructed on every rank at the same time (it checks that the
    ranks agree, then creates process groups). float64 models keep float64 buffers.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, num_accelerators: int, lr: float = 1e-3,
                 base: str = "adam", betas=(0.9, 0.999), momentum: float = 0.9, eps: float = 1e-8,
                 k: int = 10, l: int = 0, alpha: float = 0.1, num_lanczos_iters: Optional[int] = None,
                 lanczos_dtype: torch.dtype = torch.float64, reorth_passes: int = 2,
                 ritz_rtol: float = 1e-6, eigenvalue_floor: float = 1e-3, paper_exact: bool = False,
                 accumulated_gradient: str = "sum", seed: int = 0,
                 comm: Optional[CountingCommunicator] = None, timeout=None, on_nonfinite: str = "skip"):
        _require_process_group("MRDHO2")
        world = dist.get_world_size()
        # A bad argument is kept, not raised, until this rank has joined the configuration check:
        # the other ranks would otherwise wait there for it until the timeout.
        problem: Optional[Exception] = None
        try:
            self._check_arguments(params, num_accelerators, lr, base, betas, momentum, eps, k, l, alpha,
                                  num_lanczos_iters, lanczos_dtype, reorth_passes, ritz_rtol, eigenvalue_floor,
                                  paper_exact, accumulated_gradient, seed, on_nonfinite)
            self.timeout = resolve_timeout(timeout)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised
            problem = exc
        if problem is not None:
            try:
                self.timeout = resolve_timeout(timeout)
            except (TypeError, ValueError):
                self.timeout = group_timeout(None)
        self.comm = CountingCommunicator() if comm is None else comm
        self._collectives = GuardedCommunicator(self.comm, layer="MRDHO2", timeout=self.timeout)
        # Every collective runs on a group created here with the timeout, the world's too.
        self.world_group = timed_group(range(world), self.timeout, layer="MRDHO2")
        if problem is not None:
            check_ranks_agree("MRDHO2", None, comm=self._collectives, group=self.world_group,
                              device=_setup_device(None), problem=problem)
        self.rank, self.world = dist.get_rank(), world
        self.accelerators = list(range(num_accelerators))
        self.workers = list(range(num_accelerators, world))
        self.first_worker = self.workers[0]
        self.is_worker = self.rank >= num_accelerators
        device = self.params[0].device
        settings = {
            "model (shapes, dtypes)": _model_layout(self.params),
            **dataclasses.asdict(self.config),
            "base optimizer": (lr, tuple(betas), momentum, eps),
            "accumulated_gradient": accumulated_gradient,
            "world layout": (world, num_accelerators),
        }
        check_ranks_agree("MRDHO2", settings, comm=self._collectives, group=self.world_group, device=device)
        self.accelerator_group = timed_group(self.accelerators, self.timeout, layer="MRDHO2")
        self.worker_group = timed_group(self.workers, self.timeout, layer="MRDHO2")
        self.bridge_group = timed_group(self.accelerators + [self.first_worker], self.timeout, layer="MRDHO2")
        self.n = sum(p.numel() for p in self.params)
        self.dtype = torch.float64 if all(p.dtype == torch.float64 for p in self.params) else torch.float32
        self.weights = torch.zeros(self.n, dtype=self.dtype, device=device)
        self.grad = torch.zeros(self.n, dtype=self.dtype, device=device)
        self.base_state = [torch.zeros(self.n, dtype=self.dtype, device=device)
                           for _ in range({"adam": 2, "heavy_ball": 1, "sgd": 0}[base])]
        self.base_step = 0
        self.skipped_steps = 0
        self.epoch = 0
        self._rows_shard: Optional[torch.Tensor] = None
        self._ritz = None
        self.memory: dict = {}

    def _check_arguments(self, params, num_accelerators, lr, base, betas, momentum, eps, k, l, alpha,
                         num_lanczos_iters, lanczos_dtype, reorth_passes, ritz_rtol, eigenvalue_floor, paper_exact,
                         accumulated_gradient, seed, on_nonfinite) -> None:
        """Check this rank's arguments and keep the configuration and the parameters; no collective."""
        world = dist.get_world_size()
        check_int("num_accelerators", num_accelerators, low=1, high=world - 1)
        check_choice("accumulated_gradient", accumulated_gradient, ("sum", "mean"))
        check_choice("on_nonfinite", on_nonfinite, ("skip", "raise"))
        check_float("lr", lr, low=0.0)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_float("betas[0]", betas[0], low=0.0, high=1.0, high_open=True)
        check_float("betas[1]", betas[1], low=0.0, high=1.0, high_open=True)
        check_float("momentum", momentum, low=0.0, high=1.0)
        check_float("eps", eps, low=0.0)
        self.config = FOSIConfig(base=base, k=k, l=l, alpha=alpha, num_lanczos_iters=num_lanczos_iters,
                                 lanczos_dtype=lanczos_dtype, reorth_passes=reorth_passes, paper_exact=paper_exact,
                                 ritz_rtol=ritz_rtol, eigenvalue_floor=eigenvalue_floor, seed=seed)
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MRDHO2 needs at least one trainable parameter")
        if any(not p.is_floating_point() or p.is_complex() for p in self.params):
            raise ValueError("MRDHO2 needs real floating-point parameters")
        if len({p.device for p in self.params}) != 1:
            raise ValueError("all MRDHO2 parameters must be on one device")
        beta1 = momentum if base == "heavy_ball" else betas[0]
        self.segments = [FOSIHyper(sum(p.numel() for p in self.params), lr, beta1, betas[1], eps)]
        self.accumulated_gradient, self.on_nonfinite = accumulated_gradient, on_nonfinite

    def _pack(self, tensors, out: torch.Tensor) -> torch.Tensor:
        torch.cat([t.reshape(-1).to(self.dtype) for t in tensors], out=out)
        return out

    @torch.no_grad()
    def _unpack(self, flat: torch.Tensor) -> None:
        start = 0
        for p in self.params:
            p.copy_(flat[start : start + p.numel()].view(p.shape))
            start += p.numel()

    @torch.no_grad()
    def begin_epoch(self, curvature_loss_fn: Optional[Callable[[], torch.Tensor]] = None) -> None:
        """Share the epoch-start weights with the accelerators; accelerators run the ESE.

        ``curvature_loss_fn`` is needed on accelerators (the loss on their ESE
        batch, evaluated at the broadcast weights); workers may pass None.
        """
        w = self._pack(self.params, self.weights)
        if self.rank in self.accelerators or self.rank == self.first_worker:
            self._collectives.broadcast(w, src=self.first_worker, label="weights_broadcast", group=self.bridge_group)
        if self.is_worker:
            self._checkpoint = w.clone()
            self._accumulated = torch.zeros_like(w)
            self._epoch_steps = 0
            return
        self._unpack(w)
        if curvature_loss_fn is None:
            raise ValueError("curvature_loss_fn is required on accelerator ranks")
        config = self.config
        with nvtx_range("tritonopt/mrdho2/ese"):
            result = distributed_lanczos(
                make_hvp(self.params, curvature_loss_fn, self.dtype), self.n, config.lanczos_iters(self.n),
                comm=self._collectives, group=self.accelerator_group, dtype=config.lanczos_dtype,
                device=w.device, passes=config.reorth_passes, seed=config.seed + self.epoch,
            )
        self._ritz = extreme_ritz(result.tridiag, config.k, config.l, config.ritz_rtol)
        self._rows_shard = ritz_vectors(result.basis, self._ritz.vectors, self.dtype)
        self.memory = lanczos_shard_report(result, self.n, len(self.accelerators))

    @torch.no_grad()
    def step(self) -> None:
        """A worker's first-order step on the averaged gradient (eq. 13); accelerators must not call it."""
        if not self.is_worker:
            raise RuntimeError("MRDHO2.step runs on worker ranks only")
        grad = self._pack([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params], self.grad)
        self._collectives.all_reduce(grad, label="worker_grad_all_reduce", group=self.worker_group)
        grad.div_(len(self.workers))
        if not math.isfinite(float(grad.abs().amax())):
            apply_nonfinite_policy(self, "a gradient holds NaN or inf", "parameters and state are unchanged")
            return
        w = self._pack(self.params, self.weights)
        empty = w.new_zeros((0, self.n))
        fosi_update(w, grad, empty, w.new_zeros(0), base=self.config.base, segments=self.segments,
                    step=self.base_step + 1, first_moment=self.base_state[0] if self.base_state else None,
                    second_moment=self.base_state[1] if len(self.base_state) > 1 else None)
        self.base_step += 1
        self._unpack(w)
        self._accumulated.add_(grad)
        self._epoch_steps += 1

    @torch.no_grad()
    def end_epoch(self) -> None:
        """Scatter the Ritz vectors and values to the workers, which apply eq. (17)."""
        A, J = len(self.accelerators), len(self.workers)
        n_a = shard_size(self.n, A)
        device = self.weights.device
        # How many Ritz pairs survived: known on accelerators, broadcast with the values (and the
        # spectrum's scale, for the eigenvalue floor). Both on the weights' device: NCCL moves device tensors.
        count = torch.tensor([0 if self._ritz is None else self._ritz.values.numel()], dtype=torch.int64,
                             device=device)
        self._collectives.broadcast(count, src=0, label="eigenvalue_broadcast", group=self.world_group)
        r = int(count[0])
        if self.rank == 0:
            known = torch.cat([self._ritz.values, torch.tensor([self._ritz.scale], dtype=torch.float64)])
            values = known.to(device=device, dtype=torch.float64)
        else:
            values = torch.zeros(r + 1, dtype=torch.float64, device=device)
        self._collectives.broadcast(values, src=0, label="eigenvalue_broadcast", group=self.world_group)
        values, ritz_scale = values[:r].cpu(), float(values[r])  # the Ritz values stay on the host, as in FOSI
        splits = column_split(r, J)
        if self.is_worker:
            mine = splits[self.rank - A]
            send = torch.zeros((0, n_a), dtype=self.dtype, device=device)
            in_splits = [0] * self.world
            out_splits = [mine] * A + [0] * J
        else:
            send = self._rows_shard.contiguous()
            in_splits = [0] * A + splits
            out_splits = [0] * self.world
            mine = 0
        received = torch.empty((sum(out_splits), n_a), dtype=self.dtype, device=device)
        self._collectives.all_to_all_single(received, send, out_splits, in_splits, label="ritz_scatter",
                                            group=self.world_group)
        self.epoch += 1
        if not self.is_worker:
            return
        j = self.rank - A
        start = sum(splits[:j])
        v = received.view(A, mine, n_a).permute(1, 0, 2).reshape(mine, A * n_a)[:, : self.n].contiguous()
        scale = self.config.newton_scale(values[start : start + mine], ritz_scale).to(device=device, dtype=self.dtype)
        w = self._pack(self.params, self.weights)
        self._weights_after = final_update_local(
            v, scale, self._checkpoint, w, self._accumulated, max(self._epoch_steps, 1),
            self.accumulated_gradient, comm=self._collectives, group=self.worker_group,
        )
        self._unpack(self._weights_after)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """This rank's state; checkpoints are per rank (accelerators hold Ritz vectors, workers the epoch so far).

        The model's parameters are not in it: save them with the model. Saved between
        :meth:`begin_epoch` and :meth:`end_epoch`, it resumes the epoch where it was.
        """
        ritz = self._ritz
        return {
            "rank": self.rank, "world_size": self.world, "num_accelerators": len(self.accelerators),
            "n": self.n, "dtype": self.dtype, "epoch": self.epoch, "base_step": self.base_step,
            "skipped_steps": self.skipped_steps, "base_state": [t.clone() for t in self.base_state],
            "epoch_start": _clone_or_none(getattr(self, "_checkpoint", None)),
            "accumulated": _clone_or_none(getattr(self, "_accumulated", None)),
            "epoch_steps": getattr(self, "_epoch_steps", 0),
            "rows_shard": _clone_or_none(self._rows_shard),
            "ritz": None if ritz is None else {"values": ritz.values.clone(), "vectors": ritz.vectors.clone(),
                                               "scale": ritz.scale},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state dict saved by this rank; a collective (every rank loads at the same point).

        Every rank checks its own before anything changes; if any rank's is refused
        (another rank's, another model, a malformed one), or the ranks load different
        epochs, every rank raises and nothing is loaded anywhere.
        """
        problem: Optional[Exception] = None
        checked = None
        try:
            checked = self._checked_state(state_dict)
        except (TypeError, ValueError) as exc:
            problem = exc
        check_ranks_agree("MRDHO2.load_state_dict", None if problem else {"epoch": checked["epoch"]},
                          comm=self._collectives, group=self.world_group, device=self.weights.device,
                          label="load_state_dict", problem=problem, stage="while loading its state")
        for mine, saved in zip(self.base_state, checked["base_state"]):
            mine.copy_(saved)
        self.epoch, self.base_step = checked["epoch"], checked["base_step"]
        self.skipped_steps, self._epoch_steps = checked["skipped_steps"], checked["epoch_steps"]
        for name, key in (("_checkpoint", "epoch_start"), ("_accumulated", "accumulated")):
            if checked[key] is None:
                self.__dict__.pop(name, None)
            else:
                setattr(self, name, checked[key])
        self._rows_shard = checked["rows_shard"]
        ritz = checked["ritz"]
        self._ritz = None if ritz is None else RitzSelection(ritz["values"], ritz["vectors"], ritz["scale"])

    def _checked_state(self, state: dict) -> dict:
        """``state`` validated against this rank, its tensors copied to the weights' device; changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(f"MRDHO2: a state dict must be a dict, got {type(state).__name__}")
        expected = set(self.state_dict())
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"MRDHO2: not an MR-DHO2 state dict (missing {missing}, unexpected {extra})")
        saved = (state["rank"], state["world_size"], state["num_accelerators"])
        if saved != (self.rank, self.world, len(self.accelerators)):
            raise ValueError(
                f"MRDHO2: this state dict was saved on rank {saved[0]} of {saved[1]} with {saved[2]} accelerators, "
                f"not on this rank ({self.rank} of {self.world}, {len(self.accelerators)} accelerators): every "
                "rank must load the state dict it saved"
            )
        if (state["n"], state["dtype"]) != (self.n, self.dtype):
            raise ValueError(f"MRDHO2: the state dict is for {state['n']} {state['dtype']} parameters, this "
                             f"model has {self.n} {self.dtype}")
        for key in ("epoch", "base_step", "skipped_steps", "epoch_steps"):
            check_int(f"state_dict[{key!r}]", state[key], low=0)
        device = self.weights.device
        vector = (self.n,)

        def tensor(key, value, shape, dtype, optional=False):
            if value is None and optional:
                return None
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"MRDHO2: state_dict[{key!r}] must be a {dtype} tensor of shape {tuple(shape)}, "
                                 f"got {got}")
            return value.detach().to(device, copy=True)

        base = state["base_state"]
        if not isinstance(base, (list, tuple)) or len(base) != len(self.base_state):
            raise ValueError(f"MRDHO2: state_dict['base_state'] must hold {len(self.base_state)} buffers "
                             f"(base optimizer {self.config.base!r})")
        checked = {key: state[key] for key in ("epoch", "base_step", "skipped_steps", "epoch_steps")}
        checked["base_state"] = [tensor("base_state", t, vector, self.dtype) for t in base]
        for key in ("epoch_start", "accumulated"):
            checked[key] = tensor(key, state[key], vector, self.dtype, optional=True)
        ritz = state["ritz"]
        if ritz is None:
            checked["ritz"] = None
            if state["rows_shard"] is not None:
                raise ValueError("MRDHO2: state_dict['rows_shard'] without the Ritz values it belongs to")
            checked["rows_shard"] = None
        else:
            if not isinstance(ritz, dict) or set(ritz) != {"values", "vectors", "scale"}:
                raise ValueError("MRDHO2: state_dict['ritz'] must be None or a dict of values, vectors and scale")
            values = ritz["values"]
            r = values.shape[0] if isinstance(values, torch.Tensor) and values.dim() == 1 else -1
            steps = ritz["vectors"].shape[0] if isinstance(ritz["vectors"], torch.Tensor) else -1
            check_float("state_dict['ritz']['scale']", ritz["scale"], low=0.0)
            checked["ritz"] = {"values": tensor("ritz.values", values, (r,), torch.float64),
                               "vectors": tensor("ritz.vectors", ritz["vectors"], (steps, r), torch.float64),
                               "scale": float(ritz["scale"])}
            checked["ritz"]["values"] = checked["ritz"]["values"].cpu()
            checked["ritz"]["vectors"] = checked["ritz"]["vectors"].cpu()
            rows = shard_size(self.n, len(self.accelerators))
            checked["rows_shard"] = tensor("rows_shard", state["rows_shard"], (r, rows), self.dtype)
        return checked


def _clone_or_none(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.clone()


def final_update_local(v_j, scale_j, checkpoint, weights, accumulated, steps, mode, *, comm, group):
    """Eq. (17) from worker ``j``'s rows ``V_j`` (sums over workers are all_reduces)."""
    p = accumulated / steps if mode == "mean" else accumulated
    o = weights - checkpoint
    stacked = torch.stack([(scale_j * (v_j @ p)) @ v_j, (v_j @ o) @ v_j])
    comm.all_reduce(stacked, label="final_newton_and_projection", group=group)
    newton, projection = stacked[0], stacked[1]
    q = o - projection
    reprojection = ((v_j @ q) @ v_j).contiguous()
    comm.all_reduce(reprojection, label="final_reprojection", group=group)
    return checkpoint - newton + q - reprojection


def final_update_reference(v, scale, checkpoint, weights, accumulated, steps, mode="mean"):
    """Single-process eq. (17): ``c - V^T (s * V p~) + (I - P)(I - P) o`` (``V``: all ``r`` rows)."""
    p = accumulated / steps if mode == "mean" else accumulated
    o = weights - checkpoint
    q = o - (v @ o) @ v
    return checkpoint - (scale * (v @ p)) @ v + q - (v @ q) @ v
