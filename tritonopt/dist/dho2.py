"""DHO2 and MR-DHO2: distributed FOSI (Gu et al., secs. III and IV).

DHO2 (:class:`DHO2`) -- data parallel, every rank runs the same update:

* gradient: ``all_reduce`` of the flat gradient, divided by ``C`` ("grad_all_reduce", n);
* ESE: Algorithm 2 (:func:`tritonopt.dist.lanczos.distributed_lanczos`; ``D`` row
  shard ``[m, ceil(n/C)]`` per rank), ``eigh(B)`` on every rank, then one
  ``all_to_all`` turns the Ritz-vector row shard into ``r_c`` whole vectors
  (``V_c``: ``[r_c, n]``, rows ``[start_c, start_c + r_c)`` of ``V``);
* update, ``variant="algorithm3"`` (Algorithm 3 as printed, 4 n-sized all_reduces
  per step)::

      g  = AR(grad) / C;  g1 = AR(V_c^T V_c g);  d1 = AR(-V_c^T (s_c * V_c g1))
      u  = O(g - g1);     w += d1 + b (u - AR(V_c^T V_c u))

  ``variant="fused"`` (default, 3 all_reduces: "grad_all_reduce",
  "g1_all_reduce", "update_all_reduce"): the Newton term and the projection
  share one all_reduce: ``w += b u + AR(-V_c^T (s_c * V_c g1) - b V_c^T V_c u)``.

Each rank holds the model, the gradient, the base optimizer's state
(replicated, as in the paper), ``V_c`` (``r_c n``) and, during the ESE only,
its ``D`` shard. ``g1_momentum`` is not supported (the paper has none).
Checkpoints are therefore per rank: :meth:`DHO2.load_state_dict` issues one
one-integer all_reduce ("load_state_dict") and refuses, on every rank, a state
dict saved on another rank once curvature exists.

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
  a ``broadcast`` of the Ritz values from rank 0 ("eigenvalue_broadcast"), and
  the final model update (eq. 17) on the workers with 2 all_reduces among
  workers ("final_newton_and_projection" (2n), "final_reprojection" (n))::

      o = w - c;   w_new = c - sum_j V_j^T (s_j * V_j p~) + (I - P)(I - P) o

  ``p~ = p`` (``accumulated_gradient="sum"``, default, eq. 15 as printed) or
  ``p / I`` (``"mean"``). FOSI applies one Newton step per iteration, so over
  an epoch of ``I`` steps it moves by the Newton step of the summed gradients:
  the sum keeps alpha on the same scale as FOSI's; the mean applies a single
  step's worth and is the more cautious option.

Accelerators do not train; their weights follow the broadcast at each epoch start.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from tritonopt._ops.fosi_step import fosi_step
from tritonopt._runtime import nvtx_range
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist.lanczos import (
    column_split,
    distributed_lanczos,
    lanczos_shard_report,
    reconstruct_columns,
    shard_size,
)
from tritonopt.kernels.fosi_step import base_update_reference
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._lanczos import (
    default_breakdown_rtol,
    default_lanczos_iters,
    make_hvp,
    ritz_vectors,
    select_ritz,
)
from tritonopt.optim.fosi import FOSI, _Packed

__all__ = ["DHO2", "MRDHO2"]

_VARIANTS = ("fused", "algorithm3")


class DHO2(FOSI):
    """Data-parallel FOSI with distributed Lanczos and a column-sharded update (see the module docstring).

    Takes every argument of :class:`~tritonopt.optim.FOSI` (``g1_momentum`` must
    be 0), plus ``variant`` (``"fused"`` or ``"algorithm3"``), ``comm`` (a
    :class:`CountingCommunicator`; one is made if None), ``group`` (default:
    the world) and ``data_parallel_hvp`` (each rank's ``curvature_loss_fn``
    uses its own data and the HVP is averaged; default False: every rank must
    pass a loss on the same ESE batch). Call :meth:`step` after ``backward``
    on the rank's own batch: the gradient is averaged here (do not wrap the
    model in DDP).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, *, variant: str = "fused",
                 comm: Optional[CountingCommunicator] = None, group=None,
                 data_parallel_hvp: bool = False, **kwargs):
        if variant not in _VARIANTS:
            raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
        if kwargs.get("g1_momentum", 0.0):
            raise ValueError("g1_momentum is not supported by DHO2 (the paper's update has none)")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DHO2 needs an initialised torch.distributed process group")
        self.variant = variant
        self.group = group
        self.comm = CountingCommunicator(group) if comm is None else comm
        self.data_parallel_hvp = bool(data_parallel_hvp)
        self.world = dist.get_world_size(group)
        self.memory: dict = {}
        super().__init__(params, lr, **kwargs)

    def _reduce_gradient(self, grad: torch.Tensor) -> None:
        self.comm.all_reduce(grad, label="grad_all_reduce", group=self.group)
        grad.div_(self.world)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """FOSI's state dict; ``eigenvectors``/``eigenvalues`` are this rank's ``V_c`` (per rank)."""
        state = super().state_dict()
        state["fosi"]["rank"] = dist.get_rank(self.group)
        state["fosi"]["world_size"] = self.world
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Collective: every rank loads the state dict saved on that same rank.

        Once curvature exists, each rank holds different rows of ``V``; loading
        another rank's state would silently precondition with the wrong
        directions, so every rank raises ``ValueError`` (agreed by an
        all_reduce, before anything changes) when one of them got a foreign state.
        """
        extra = state_dict.get("fosi") if isinstance(state_dict, dict) else None
        foreign = False
        if isinstance(extra, dict):
            values = extra.get("all_eigenvalues")
            has_curvature = isinstance(values, torch.Tensor) and values.numel() > 0
            same_rank = (extra.get("rank"), extra.get("world_size")) == (dist.get_rank(self.group), self.world)
            foreign = has_curvature and not same_rank
        device = self.param_groups[0]["params"][0].device
        flag = torch.tensor([int(foreign)], dtype=torch.int32, device=device)
        self.comm.all_reduce(flag, label="load_state_dict", op=dist.ReduceOp.MAX, group=self.group)
        if int(flag.item()):
            raise ValueError(
                "DHO2 state dicts are per rank once curvature exists (each rank holds its own "
                "eigenvectors): every rank must load the state dict it saved"
            )
        super().load_state_dict(state_dict)

    def _compute_curvature(self, loss_fn, packed: _Packed):
        n = packed.layout.total
        with nvtx_range("tritonopt/dho2/lanczos"):
            result = distributed_lanczos(
                make_hvp(packed.layout.tensors, loss_fn), n, self.lanczos_iters(n), comm=self.comm,
                group=self.group, dtype=self.lanczos_dtype, device=packed.layout.device,
                passes=self.reorth_passes, seed=self.seed + self.ese_count,
                breakdown_rtol=default_breakdown_rtol(self.lanczos_dtype),
                data_parallel_hvp=self.data_parallel_hvp,
            )
        values, u_sel = select_ritz(result.tridiag, self.k, self.l, self.ritz_rtol)
        with nvtx_range("tritonopt/dho2/reconstruct"):
            rows_shard = ritz_vectors(result.basis, u_sel)
            columns, start = reconstruct_columns(rows_shard, n, comm=self.comm, group=self.group)
        mine = values[start : start + columns.shape[0]]
        report = {"steps": result.steps, "breakdown": result.breakdown,
                  **lanczos_shard_report(result, n, self.world),
                  "ritz_row_shard_numel": rows_shard.numel(), "v_columns_shape": tuple(columns.shape)}
        self.memory = report
        return mine, columns, values, report

    def _apply_update(self, packed: _Packed, group: dict) -> None:
        if self.all_eigenvalues.numel() == 0:  # warm-up: plain data-parallel base optimizer
            super()._apply_update(packed, group)
            return
        hyper = self._base_hyper(group)
        v = packed.basis
        s = self.newton_scale(self.eigenvalues).to(v.device)
        g = packed.grad
        with nvtx_range("tritonopt/dho2/update"):
            g1 = (v @ g) @ v
            self.comm.all_reduce(g1, label="g1_all_reduce", group=self.group)
            newton = -((s * (v @ g1)) @ v)
            u = base_update_reference(g - g1, packed.state_a, packed.state_b, self.base, **hyper)
            b = self.base_scale
            if self.variant == "algorithm3":
                self.comm.all_reduce(newton, label="delta1_all_reduce", group=self.group)
                projection = (v @ u) @ v
                self.comm.all_reduce(projection, label="projection_all_reduce", group=self.group)
                packed.weights.add_(newton + b * (u - projection))
            else:
                combined = newton - b * ((v @ u) @ v)
                self.comm.all_reduce(combined, label="update_all_reduce", group=self.group)
                packed.weights.add_(b * u + combined)


class MRDHO2:
    """Multi-role DHO2: accelerators estimate curvature while workers train (see the module docstring).

    Args:
        params: the model's parameters (every rank builds the same model).
        num_accelerators: ``A``, ranks ``0..A-1``; the other ``J = C - A`` ranks are workers.
        lr, base, betas, momentum, eps: the workers' base optimizer.
        k, l, alpha, num_lanczos_iters, lanczos_dtype, reorth_passes, ritz_rtol,
        paper_exact, seed: as in :class:`~tritonopt.optim.FOSI`.
        accumulated_gradient: ``"sum"`` (default, as printed) or ``"mean"``: how ``p`` enters eq. (17).
        comm: a :class:`CountingCommunicator` (made if None).

    Must be constructed on every rank at the same time (it creates process groups).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, num_accelerators: int, lr: float = 1e-3,
                 base: str = "adam", betas=(0.9, 0.999), momentum: float = 0.9, eps: float = 1e-8,
                 k: int = 10, l: int = 0, alpha: float = 0.1, num_lanczos_iters: Optional[int] = None,
                 lanczos_dtype: torch.dtype = torch.float64, reorth_passes: int = 2,
                 ritz_rtol: float = 1e-6, paper_exact: bool = False,
                 accumulated_gradient: str = "sum", seed: int = 0,
                 comm: Optional[CountingCommunicator] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("MRDHO2 needs an initialised torch.distributed process group")
        world = dist.get_world_size()
        if isinstance(num_accelerators, bool) or not isinstance(num_accelerators, int) or not 1 <= num_accelerators < world:
            raise ValueError(f"num_accelerators must be an int in [1, world_size - 1 = {world - 1}], got {num_accelerators!r}")
        if accumulated_gradient not in ("mean", "sum"):
            raise ValueError(f"accumulated_gradient must be 'mean' or 'sum', got {accumulated_gradient!r}")
        # A FOSI instance holds (and validates) the hyperparameters and the base state.
        self.params = [p for p in params if p.requires_grad]
        self._fosi = FOSI(self.params, lr, base=base, betas=betas, momentum=momentum, eps=eps, k=k, l=l,
                          alpha=alpha, num_lanczos_iters=num_lanczos_iters, lanczos_dtype=lanczos_dtype,
                          reorth_passes=reorth_passes, ritz_rtol=ritz_rtol, paper_exact=paper_exact, seed=seed)
        self.comm = CountingCommunicator() if comm is None else comm
        self.rank, self.world = dist.get_rank(), world
        self.accelerators = list(range(num_accelerators))
        self.workers = list(range(num_accelerators, world))
        self.first_worker = self.workers[0]
        self.accelerator_group = dist.new_group(self.accelerators)
        self.worker_group = dist.new_group(self.workers)
        self.bridge_group = dist.new_group(self.accelerators + [self.first_worker])
        self.is_worker = self.rank >= num_accelerators
        self.accumulated_gradient = accumulated_gradient
        self.layout = BlockLayout(self.params, sum(p.numel() for p in self.params))
        self.n = self.layout.total
        self.epoch = 0
        self._packed = self._fosi._ensure_packed()
        self._rows_shard: Optional[torch.Tensor] = None
        self._values: Optional[torch.Tensor] = None
        self.memory: dict = {}

    def _pack_weights(self) -> torch.Tensor:
        self.layout.pack(self.params, self._packed.weights.view(1, -1))
        return self._packed.weights

    @torch.no_grad()
    def _unpack_weights(self, flat: torch.Tensor) -> None:
        for p, value in zip(self.params, self.layout.views(flat.view(1, -1))):
            p.copy_(value)

    @torch.no_grad()
    def begin_epoch(self, curvature_loss_fn: Optional[Callable[[], torch.Tensor]] = None) -> None:
        """Share the epoch-start weights with the accelerators; accelerators run the ESE.

        ``curvature_loss_fn`` is needed on accelerators (the loss on their ESE
        batch, evaluated at the broadcast weights); workers may pass None.
        """
        w = self._pack_weights()
        if self.rank in self.accelerators or self.rank == self.first_worker:
            self.comm.broadcast(w, src=self.first_worker, label="weights_broadcast", group=self.bridge_group)
        if self.is_worker:
            self._checkpoint = w.clone()
            self._accumulated = torch.zeros_like(w)
            self._epoch_steps = 0
            return
        self._unpack_weights(w)
        if curvature_loss_fn is None:
            raise ValueError("curvature_loss_fn is required on accelerator ranks")
        fosi = self._fosi
        with nvtx_range("tritonopt/mrdho2/ese"):
            result = distributed_lanczos(
                make_hvp(self.params, curvature_loss_fn), self.n, fosi.lanczos_iters(self.n),
                comm=self.comm, group=self.accelerator_group, dtype=fosi.lanczos_dtype,
                device=w.device, passes=fosi.reorth_passes, seed=fosi.seed + self.epoch,
            )
        values, u_sel = select_ritz(result.tridiag, fosi.k, fosi.l, fosi.ritz_rtol)
        self._values = values
        self._rows_shard = ritz_vectors(result.basis, u_sel)
        self.memory = lanczos_shard_report(result, self.n, len(self.accelerators))

    @torch.no_grad()
    def step(self) -> None:
        """A worker's first-order step on the averaged gradient (eq. 13); accelerators must not call it."""
        if not self.is_worker:
            raise RuntimeError("MRDHO2.step runs on worker ranks only")
        grad = self._packed.grad
        self.layout.pack([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params],
                         grad.view(1, -1))
        self.comm.all_reduce(grad, label="worker_grad_all_reduce", group=self.worker_group)
        grad.div_(len(self.workers))
        if not bool(torch.isfinite(grad).all()):
            self._fosi.skipped_steps += 1
            return
        fosi, group = self._fosi, self._fosi.param_groups[0]
        fosi.base_step += 1
        w = self._pack_weights()
        empty = torch.zeros((0, self.n), dtype=torch.float32, device=w.device)
        fosi_step(w, grad, empty, torch.zeros(0, device=w.device), base=fosi.base,
                  state_a=self._packed.state_a, state_b=self._packed.state_b, **fosi._base_hyper(group))
        self._unpack_weights(w)
        self._accumulated.add_(grad)
        self._epoch_steps += 1

    @torch.no_grad()
    def end_epoch(self) -> None:
        """Scatter the Ritz vectors and values to the workers, which apply eq. (17)."""
        A, J = len(self.accelerators), len(self.workers)
        n_a = shard_size(self.n, A)
        device = self._packed.weights.device
        # How many Ritz pairs survived: known on accelerators, broadcast with the values.
        # Both live on the weights' device: NCCL only moves device tensors.
        count = torch.tensor([0 if self._values is None else self._values.numel()], dtype=torch.int64,
                             device=device)
        self.comm.broadcast(count, src=0, label="eigenvalue_broadcast")
        r = int(count[0])
        if self.rank == 0:
            known = self._values if self._values is not None else torch.zeros(0, dtype=torch.float64)
            values = known.to(device=device, dtype=torch.float64, copy=True)
        else:
            values = torch.zeros(r, dtype=torch.float64, device=device)
        self.comm.broadcast(values, src=0, label="eigenvalue_broadcast")
        values = values.cpu()  # the Ritz values stay on the host, as in FOSI
        splits = column_split(r, J)
        if self.is_worker:
            mine = splits[self.rank - A]
            send = torch.zeros((0, n_a), dtype=torch.float32, device=device)
            in_splits = [0] * self.world
            out_splits = [mine] * A + [0] * J
        else:
            send = self._rows_shard.contiguous()
            in_splits = [0] * A + splits
            out_splits = [0] * self.world
            mine = 0
        received = torch.empty((sum(out_splits), n_a), dtype=torch.float32, device=device)
        self.comm.all_to_all_single(received, send, out_splits, in_splits, label="ritz_scatter")
        self.epoch += 1
        if not self.is_worker:
            return
        j = self.rank - A
        start = sum(splits[:j])
        v = received.view(A, mine, n_a).permute(1, 0, 2).reshape(mine, A * n_a)[:, : self.n].contiguous()
        scale = self._fosi.newton_scale(values[start : start + mine]).to(device)
        w = self._pack_weights()
        self._weights_after = final_update_local(
            v, scale, self._checkpoint, w, self._accumulated, max(self._epoch_steps, 1),
            self.accumulated_gradient, comm=self.comm, group=self.worker_group,
        )
        self._unpack_weights(self._weights_after)


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
