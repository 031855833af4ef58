"""KAISA: K-FAC distributed with a tunable memory/communication trade-off (Pauloski et al., SC '21).

Training is data parallel (every rank holds the model, gradients are averaged by
DDP or by the caller before :meth:`KAISAPreconditioner.step`); the K-FAC work is
split across ranks (paper sec. 3.1-3.2; groups and assignment in
:mod:`tritonopt.dist.kaisa_assignment`):

* every rank holds the full factors ``A, G`` of every layer; each factor-update
  step the batch statistics are averaged over the world
  (:mod:`tritonopt.dist.kaisa_reduce`: bucketed all-reduces started from the
  backward hooks, so they overlap backward);
* each layer's factors are decomposed by one rank (``colocate_factors``) or two
  ranks of one worker group, chosen by a longest-processing-time greedy on cost
  ``n^3`` (paper sec. 3.2);
* ``gw = grad_worker_fraction * W`` **gradient workers** per layer hold its eigen
  data and precondition its gradient; the other ``W - gw`` ranks receive the
  preconditioned gradient.

=========== ======= ============================= ===============================
strategy    gwf     eigen broadcast (eigen steps)  preconditioned-gradient bcast
=========== ======= ============================= ===============================
MEM-OPT     1/W     none                          every step, groups of W
HYBRID-OPT  between inverse worker -> its gw      every step, gw concurrent groups
                    gradient workers              of W/gw
COMM-OPT    1       inverse worker -> all W       none
=========== ======= ============================= ===============================

The step is :class:`~tritonopt.optim.kfac.KFACPreconditioner`'s, composed from
the same public pieces (:class:`~tritonopt.optim.kfac_base.BaseKFACPreconditioner`
and :mod:`tritonopt.optim.kfac_functional`) with the collectives between them;
it returns False, changing nothing on any rank, when the non-finite policy
refuses it (every rank sees the same averaged statistics and gradients, so
all make the same decision).

Collectives (all through a :class:`~tritonopt.dist._comm.CountingCommunicator`,
every tensor contiguous), with bytes per rank per occurrence (``s`` = bytes per
element of the tensor's dtype):

* ``config_check`` (construction): all-gathers of one int64 digest per setting
  (see below);
* ``factor_allreduce`` (factor-update steps): buckets holding ``s * (sum(a^2 + g^2) + L)``
  in all (``symmetry_aware``: ``s * (sum(a(a+1)/2 + g(g+1)/2) + L)``, ``L`` layers:
  one contribution count each), in ``factor_comm_dtype``;
* ``eigen_broadcast`` (eigen steps, ``gw > 1``): per layer, one flat buffer of
  ``s * (a^2 + g^2 + a g)`` (prediv; ``a^2 + g^2 + a + g`` without; ``a^2 + g^2``
  with the inverse method) in ``inv_dtype`` from the rank that decomposed it to
  the layer's worker group; without ``colocate_factors``, one float32 buffer per
  factor (``a^2 + a`` and ``g^2 + g``; ``a^2`` and ``g^2`` for inverses) from
  each factor's rank, and each gradient worker computes ``D`` itself;
* ``grad_broadcast`` (every step, ``gw < W``): per layer, ``4 a g`` bytes from the
  layer's gradient worker to each receiver group, all groups concurrently;
* ``load_state_dict`` (once per :meth:`~KAISAPreconditioner.load_state_dict`): a
  one-integer all-reduce (max) telling every rank whether some rank refused its
  state dict (then every rank raises, before anything changes) or lacks eigen
  data (then the eigendecompositions are recomputed and re-broadcast).

Agreement. At construction the ranks compare a digest per setting (the
registered layers and their shapes, a checksum of their weights, each
hyperparameter, ``grad_worker_fraction`` and every other option) with
:func:`~tritonopt.dist._agreement.check_ranks_agree`, before any other group
exists; a disagreement raises ``ValueError`` on every rank, naming each setting
that differs with every rank's value.

A rank that refuses its own arguments (a bad hyperparameter, a model without
layers) still joins the world group and that check, passing its error: every
rank then raises at once, the others naming the refusing rank, instead of
waiting on a group it never joins.

Timeouts. Every group KAISA creates (its own world group and the worker and
receiver groups) takes ``timeout`` (default: the default process group's), and
every collective runs on those groups through
:class:`~tritonopt.dist._collective_guard.GuardedCommunicator`, so a rank that
dies or stalls makes the others raise :class:`KAISACollectiveError` (a
:class:`~tritonopt.dist.CollectiveFailure`, and a ``torch.distributed.DistError``)
within it, naming the collective, the ranks, the step and the time waited; the
preconditioner cannot go on after that (restart from a checkpoint).

Memory per rank (:meth:`KAISAPreconditioner.memory_usage`): factors
``s_f * sum(a^2 + g^2)`` and the float32 statistic buffers ``4 * sum(a^2 + g^2)``
on every rank (a factor of 128 or more columns counts its row padding to a
multiple of 4: ``a * ceil4(a)``), and the eigen data of each layer the rank is a
gradient worker of; averaged over ranks the eigen part is exactly
``gwf * sum_l M_eigen(l)``.

In one process (``torch.distributed`` not initialised, or one rank) it is K-FAC
with no collective.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from tritonopt._runtime import nvtx_range
from tritonopt._validation import FLOAT_DTYPES, check_bool, check_choice, check_float, check_int
from tritonopt.dist import kaisa_assignment
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import (
    CollectiveFailure,
    GuardedCommunicator,
    group_timeout,
    resolve_timeout,
    timed_group,
)
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist.kaisa_assignment import (  # noqa: F401 (re-exported)
    LAYOUTS,
    KAISAAssignment,
    Strategy,
    eigen_numel,
    expected_bytes_per_rank,
    expected_memory_per_rank,
    resolve_grad_worker_fraction,
    strategy_of,
    valid_grad_worker_fractions,
)
from tritonopt.dist.kaisa_reduce import FactorReducer
from tritonopt.dist.kaisa_sharded import ShardedLayerGradients
from tritonopt.optim.kfac import BaseKFACPreconditioner
from tritonopt.optim.kfac_functional import (EIGENBASIS_NAMES, Decomposition, eigenbasis_layout, kfac_eigen_data,
                                             kfac_precondition)

# The assignment's names are re-exported: this module is KAISA's entry point.
__all__ = ["KAISACollectiveError", "KAISAPreconditioner", *kaisa_assignment.__all__]

class KAISACollectiveError(CollectiveFailure, dist.DistError):
    """A KAISA collective failed: another rank stopped, or did not reach it within the timeout.

    A :class:`~tritonopt.dist.CollectiveFailure` like every layer's; still a
    ``torch.distributed.DistError``, as it was before the layers shared one.
    """


class _CompletionForwardHook:
    """Forward hook: on capturing steps, watch the output's gradient for the layer's completion."""

    def __init__(self, preconditioner: "KAISAPreconditioner", index: int):
        self.preconditioner, self.index = preconditioner, index

    def __call__(self, module, inputs, output):
        kaisa = self.preconditioner
        if kaisa is None or not (kaisa.capturing and module.training and torch.is_grad_enabled()):
            return
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(_CompletionGradHook(kaisa, self.index))

    def __deepcopy__(self, memo):  # a copied model does not carry KAISA's hooks
        return type(self)(None, self.index)

    def __reduce__(self):
        return type(self), (None, self.index)


class _CompletionGradHook:
    """Runs after the G statistic of one micro-batch was captured."""

    def __init__(self, preconditioner: "KAISAPreconditioner", index: int):
        self.preconditioner, self.index = preconditioner, index

    def __call__(self, grad):
        layer = self.preconditioner.layers[self.index]
        if layer.a_count and layer.g_count >= self.preconditioner.accumulation_steps:
            self.preconditioner.reducer.layer_complete(self.index)


class KAISAPreconditioner(BaseKFACPreconditioner):
    """K-FAC distributed over ``torch.distributed`` ranks (KAISA); K-FAC alone in one process.

    Every rank builds it with the same model (same weights) and arguments, and
    calls :meth:`step` at the same points, after the gradients were averaged
    across ranks (DDP). After ``step()`` every rank holds the same preconditioned
    gradients, so the optimizers stay in sync. Takes every argument of
    :class:`~tritonopt.optim.kfac_base.BaseKFACPreconditioner`, and (keyword-only):

    Args:
        grad_worker_fraction: ``gw / W`` in ``{1/W, ..., 1}`` (``gw`` dividing ``W``), or
            ``0`` (= ``1/W``), or a :class:`Strategy`. 1 is COMM-OPT, ``1/W`` MEM-OPT.
        layout: ``"paper"`` or ``"strided"`` process-group layout.
        colocate_factors: decompose a layer's A and G on one rank (default); False
            assigns each factor on its own (paper sec. 3.2), spreading the work finer.
        symmetry_aware: all-reduce only the upper triangles of the factor statistics.
        factor_comm_dtype: dtype the factor statistics are all-reduced in (float32,
            float16 or bfloat16; paper sec. 3.3); default: ``factor_dtype``.
        assignment_cost: ``"compute"`` (``n^3``, default) or ``"memory"`` (``n^2``) for the
            greedy load balance.
        bucket_cap_mb: size of the factor all-reduce buckets, started from the backward
            hooks to overlap backward; None all-reduces everything in ``step()``.
        accumulation_steps: forward/backward passes per ``step()`` (gradient
            accumulation): a layer's statistics are complete, and its bucket can
            start, after this many. More passes than this raise in ``step()``.
        timeout: for every group KAISA creates and so every collective it issues: a
            ``datetime.timedelta`` or seconds; default: the default group's timeout.
        communicator: a :class:`CountingCommunicator` (one is created by default);
            :attr:`communicator` holds the byte counts per collective label.

    Raises:
        ValueError: the ranks disagree on the model or the arguments (every rank
            raises, naming what differs), or a bad argument.
        KAISACollectiveError: a collective failed (a rank died or stalled past ``timeout``).
    """

    algorithm = "kaisa"
    copyable = False

    def __init__(
        self,
        model: nn.Module,
        *,
        grad_worker_fraction: Union[float, Strategy] = 1.0,
        layout: str = "paper",
        colocate_factors: bool = True,
        symmetry_aware: bool = False,
        factor_comm_dtype: Optional[torch.dtype] = None,
        assignment_cost: str = "compute",
        bucket_cap_mb: Optional[float] = 25.0,
        accumulation_steps: int = 1,
        timeout: Union[datetime.timedelta, float, None] = None,
        communicator: Optional[CountingCommunicator] = None,
        **kwargs,
    ):
        distributed = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if distributed else 1
        try:
            self._configure(model, grad_worker_fraction, layout, colocate_factors, symmetry_aware,
                            factor_comm_dtype, assignment_cost, bucket_cap_mb, accumulation_steps, timeout,
                            communicator, kwargs)
        except Exception as exc:
            if getattr(self, "_handles", None):
                self.remove_hooks()
            if world_size > 1:
                self._share_startup_problem(exc, timeout)  # raises ``exc``
            raise
        try:
            self._build_groups()
        except BaseException:
            self.remove_hooks()
            raise

    def _configure(self, model, grad_worker_fraction, layout, colocate_factors, symmetry_aware,
                   factor_comm_dtype, assignment_cost, bucket_cap_mb, accumulation_steps, timeout,
                   communicator, kwargs) -> None:
        """Check every argument and set up this rank's K-FAC; no collective."""
        check_choice("layout", layout, LAYOUTS)
        check_choice("assignment_cost", assignment_cost, ("compute", "memory"))
        check_bool("colocate_factors", colocate_factors)
        check_bool("symmetry_aware", symmetry_aware)
        if factor_comm_dtype is not None:
            check_choice("factor_comm_dtype", factor_comm_dtype, FLOAT_DTYPES)
        if bucket_cap_mb is not None:
            check_float("bucket_cap_mb", bucket_cap_mb, low=0.0)
        check_int("accumulation_steps", accumulation_steps, low=1)
        if timeout is not None:
            timeout = resolve_timeout(timeout)
        if communicator is not None and not isinstance(communicator, CountingCommunicator):
            raise TypeError("communicator must be a CountingCommunicator")
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self.grad_worker_fraction, self.grad_workers = resolve_grad_worker_fraction(
            grad_worker_fraction, self.world_size
        )
        self.strategy = strategy_of(self.grad_workers, self.world_size)
        super().__init__(model, **kwargs)
        # An FSDP2 model's layers: their whole gradients are gathered each step (see kaisa_sharded).
        self.sharded = ShardedLayerGradients.of(self.layers, self.world_size, "KAISAPreconditioner")
        self.layout = layout
        self.colocate_factors = colocate_factors
        self.symmetry_aware = symmetry_aware
        self.factor_comm_dtype = self.factor_dtype if factor_comm_dtype is None else factor_comm_dtype
        self.assignment_cost = assignment_cost
        self.bucket_cap_mb = bucket_cap_mb
        self.accumulation_steps = accumulation_steps
        self.timeout = timeout if timeout is not None or not distributed else group_timeout(None)
        self.communicator = communicator if communicator is not None else CountingCommunicator()
        self._collectives = self._guard(self.communicator, self.timeout)
        self._groups: dict[tuple[int, ...], object] = {}
        self._world_group = None
        self.reducer: Optional[FactorReducer] = None

    def _build_groups(self) -> None:
        """Check that the ranks agree, assign the layers, create the groups and the factor reducer."""
        if self.world_size > 1:
            self._world_group = self._new_group(tuple(range(self.world_size)))
            check_ranks_agree("KAISAPreconditioner", self._settings(), comm=self._collectives,
                              group=self._world_group, device=self.layers[0].weight.device)
        power = 3 if self.assignment_cost == "compute" else 2
        costs = [(l.a_dim**power, l.g_dim**power) for l in self.layers]
        self.assignment = KAISAAssignment(costs, self.world_size, self.grad_workers, self.layout,
                                          colocate_factors=self.colocate_factors)
        # Every rank creates every group, in the same order (a torch.distributed rule).
        for ranks in self.assignment.worker_groups + self.assignment.receiver_groups:
            if len(ranks) == self.world_size:
                self._groups[ranks] = self._world_group
            elif len(ranks) > 1 and ranks not in self._groups:
                self._groups[ranks] = self._new_group(ranks)
        if self.sharded is not None:
            for ranks in self.sharded.shard_groups:
                if len(ranks) == self.world_size:
                    self._groups.setdefault(ranks, self._world_group)
                elif len(ranks) > 1 and ranks not in self._groups:
                    self._groups[ranks] = self._new_group(ranks)
            self.sharded.group = self._groups.get(self.sharded.my_group)
        if self.world_size > 1:
            self.reducer = FactorReducer(
                self.layers, self._factor_all_reduce, comm_dtype=self.factor_comm_dtype,
                symmetry_aware=self.symmetry_aware, bucket_cap_mb=self.bucket_cap_mb,
                accumulation_steps=self.accumulation_steps,
            )
            if self.bucket_cap_mb is not None:
                self._handles += [
                    layer.module.register_forward_hook(_CompletionForwardHook(self, i))
                    for i, layer in enumerate(self.layers)
                ]

    @property
    def layer_dims(self) -> list[tuple[int, int]]:
        return [(l.a_dim, l.g_dim) for l in self.layers]

    def __getstate__(self):
        raise TypeError(
            "KAISAPreconditioner holds process groups and cannot be copied or pickled; checkpoint it with "
            "state_dict() and build a new one"
        )

    # ------------------------------------------------------------------ groups and failures

    def _guard(self, communicator: CountingCommunicator, timeout: datetime.timedelta) -> GuardedCommunicator:
        """Every collective goes through this: a failed one raises KAISACollectiveError naming it."""
        return GuardedCommunicator(
            communicator, layer="KAISAPreconditioner", timeout=timeout, error=KAISACollectiveError,
            detail=lambda: f"At K-FAC step {getattr(self, 'steps', 0)}: K-FAC cannot go on (restart from a "
                           "checkpoint).",
        )

    def _share_startup_problem(self, problem: Exception, timeout) -> None:
        """This rank refused its arguments: join the world group and the configuration check with ``problem``.

        Every rank then raises at once (this one ``problem``, the others naming this rank) instead of
        the others waiting on a group this rank never joins. The arguments may be the bad ones: the
        timeout falls back to the default group's, the communicator to a new one, the device to the
        backend's.
        """
        try:
            timeout = resolve_timeout(timeout)
        except (TypeError, ValueError):
            timeout = group_timeout(None)
        communicator = getattr(self, "communicator", None)
        if not isinstance(communicator, CountingCommunicator):
            communicator = CountingCommunicator()
        layers = getattr(self, "layers", None)
        if layers:
            device = layers[0].weight.device
        elif dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        world = timed_group(range(dist.get_world_size()), timeout, layer="KAISAPreconditioner",
                            error=KAISACollectiveError)
        check_ranks_agree("KAISAPreconditioner", None, comm=self._guard(communicator, timeout), group=world,
                          device=device, problem=problem)

    def _new_group(self, ranks: tuple[int, ...]):
        return timed_group(ranks, self.timeout, layer="KAISAPreconditioner", error=KAISACollectiveError)

    def _factor_all_reduce(self, flat: torch.Tensor, async_op: bool):
        return self._collectives.all_reduce(flat, label="factor_allreduce", group=self._world_group,
                                            async_op=async_op)

    def _settings(self) -> dict[str, object]:
        """What every rank must hold alike: the layers, their weights, every hyperparameter and option."""
        checksum = hashlib.blake2b(digest_size=8)
        for layer in self.layers:
            for p in layer.module.parameters(recurse=False):
                if self.sharded is not None:  # each rank holds other rows: only the layout can be compared
                    continue
                checksum.update(p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
        settings = {
            "layers": tuple((l.name, type(l.module).__name__, l.a_dim, l.g_dim, l.has_bias, l.weight.dtype)
                            for l in self.layers),
            "weights": f"checksum {checksum.hexdigest()}",
            "grad_scaler": type(self.grad_scaler).__name__,
        }
        for name, value in self.hyperparameters.items():
            settings[name] = f"a function, {value(0)!r} at step 0" if callable(value) else value
        for name in ("grad_worker_fraction", "layout", "colocate_factors", "symmetry_aware", "factor_comm_dtype",
                     "assignment_cost", "bucket_cap_mb", "accumulation_steps", "timeout", "g_batch_scale",
                     "prediv", "compute_method", "factor_dtype", "inv_dtype", "precision", "on_nonfinite"):
            settings[name] = getattr(self, name)
        if self.sharded is not None:
            settings.update(self.sharded.settings())
        return settings

    # ------------------------------------------------------------------ the step

    def read_gradients(self) -> dict[int, torch.Tensor]:
        """The layers' whole ``[g, a]`` gradients; on a sharded model gathered over the shard group."""
        if self.sharded is None:
            return super().read_gradients()
        with nvtx_range(f"tritonopt/{self.algorithm}/grad_allgather"):
            return self.sharded.gather(self._collectives)

    def write_gradient(self, index: int, matrix: torch.Tensor) -> None:
        if self.sharded is None:
            super().write_gradient(index, matrix)
        else:
            self.sharded.write(index, matrix)

    @torch.no_grad()
    def step(self) -> bool:
        """Average the factor statistics, refresh and share eigen data, precondition and share the gradients.

        Returns True when the gradients were replaced by preconditioned ones, False
        when the step was refused on every rank (nothing changed; skip the
        optimizer's step). A collective: every rank calls it at the same points.
        """
        try:
            hyper = self.step_hyperparameters()
            grads = self.read_gradients()
            if self.reducer is not None and self.capturing:
                with nvtx_range(f"tritonopt/{self.algorithm}/factor_reduce"):
                    statistics = self.reducer.finish()
                if self.reducer.problem:
                    raise ValueError(f"KAISAPreconditioner: {self.reducer.problem}; set accumulation_steps to "
                                     "the number of forward/backward passes per step()")
            else:
                statistics = self.pending_statistics()
            self.check_capture(grads)
            return self.run_step(hyper, grads, statistics, eigen_update=self._eigen_update,
                                 precondition=self._precondition)
        finally:
            if self.reducer is not None:
                self.reducer.reset()
            self.end_capture()

    def _broadcast_flat(self, tensors: list[torch.Tensor], numel: int, dtype, source: int, group, device):
        """Start one broadcast of ``tensors`` flattened (the source's) into a flat buffer; returns (flat, work)."""
        if source == self.rank:
            flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        else:
            flat = torch.empty(numel, dtype=dtype, device=device)
        work = self._collectives.broadcast(flat, source, label="eigen_broadcast", group=group, async_op=True)
        return flat, work

    def _eigen_update(self, folded: dict, damping: float) -> dict[int, dict[str, torch.Tensor]]:
        """Decompose this rank's factors and bring every gradient worker its layers' eigen data."""
        # Every rank holds every factor, so every rank picks the same layers here.
        usable = self.finite_factor_layers(range(len(self.layers)), folded)
        a = self.assignment
        jobs = [(i, side) for i in usable for side in (0, 1) if a.factor_workers[i][side] == self.rank]
        parts = dict(zip(jobs, self.decompose([self.factors_of(i, folded)[side] for i, side in jobs], damping,
                                              strict=True)))
        if a.colocate_factors or not a.broadcast_inverses():
            # Both factors of each layer were decomposed on one rank (colocated, or groups of one).
            eigen = {i: self._eigen_data(parts[(i, 0)], parts[(i, 1)], damping)
                     for i in usable if a.inv_worker[i] == self.rank}
            if a.broadcast_inverses():
                eigen.update(self._share_layer_eigen(usable, eigen))
            return eigen
        halves = self._share_factor_halves(usable, parts)
        return {i: self._eigen_data(halves[(i, 0)], halves[(i, 1)], damping)
                for i in usable if a.is_grad_worker(i, self.rank)}

    def _eigen_data(self, a, g, damping: float) -> dict[str, torch.Tensor]:
        return kfac_eigen_data(a, g, damping=damping, prediv=self.prediv, dtype=self.inv_dtype)

    def _share_layer_eigen(self, usable: list[int], eigen: dict) -> dict[int, dict[str, torch.Tensor]]:
        """Broadcast each layer's eigen data from the rank that computed it to its worker group."""
        a, pending = self.assignment, []
        for i in usable:
            if not a.is_grad_worker(i, self.rank):
                continue
            layer, source = self.layers[i], a.inv_worker[i]
            shapes = self.eigen_shapes(layer)
            numel = sum(torch.Size(shape).numel() for shape in shapes.values())
            tensors = list(eigen[i].values()) if source == self.rank else []
            flat, work = self._broadcast_flat(tensors, numel, self.inv_dtype, source, self._groups[a.workers(i)],
                                              layer.weight.device)
            pending.append((i, source, shapes, flat, work))
        received = {}
        for i, source, shapes, flat, work in pending:
            work.wait()
            if source != self.rank:
                received[i] = self._split(flat, shapes)
        return received

    def _share_factor_halves(self, usable: list[int], parts: dict) -> dict[tuple[int, int], object]:
        """Broadcast each factor's decomposition (or inverse), in float32, from its rank to the layer's
        worker group; returns every half this rank's layers need, its own included."""
        a, pending = self.assignment, []
        inverse = self.compute_method == "inverse"
        for i in usable:
            if not a.is_grad_worker(i, self.rank):
                continue
            layer = self.layers[i]
            for side, dim in ((0, layer.a_dim), (1, layer.g_dim)):
                mine = parts.get((i, side))
                tensors = [] if mine is None else [mine] if inverse else [mine.vectors, mine.values]
                numel = dim * dim if inverse else dim * dim + dim
                flat, work = self._broadcast_flat(tensors, numel, torch.float32, a.factor_workers[i][side],
                                                  self._groups[a.workers(i)], layer.weight.device)
                pending.append((i, side, dim, flat, work))
        halves = {}
        for i, side, dim, flat, work in pending:
            work.wait()
            square = flat[: dim * dim].view(dim, dim)
            halves[(i, side)] = (square.clone() if inverse
                                 else Decomposition(flat[dim * dim :].clone(), eigenbasis_layout(square)))
        return halves

    @staticmethod
    def _split(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape in shapes.items():
            n = torch.Size(shape).numel()
            part = flat[offset : offset + n].view(shape)
            out[name] = eigenbasis_layout(part) if name in EIGENBASIS_NAMES else part.clone()
            offset += n
        return out

    def _precondition(self, grads: dict[int, torch.Tensor], eigen: dict, damping: float) -> dict[int, torch.Tensor]:
        """``P`` of every layer with a gradient: computed by its gradient workers, broadcast to the others."""
        out, pending = {}, []
        a = self.assignment
        for i, grad in grads.items():
            layer = self.layers[i]
            if a.is_grad_worker(i, self.rank):
                out[i] = kfac_precondition(grad, eigen.get(i, layer.eigen), damping=damping,
                                           precision=self.precision).contiguous()
            else:
                out[i] = torch.empty((layer.g_dim, layer.a_dim), dtype=torch.float32, device=layer.weight.device)
            if a.broadcast_gradients():
                group = self._groups[a.receiver_group_of(self.rank)]
                source = a.src(i, self.rank)
                tensor = out[i]
                pending.append(self._collectives.broadcast(tensor, source, label="grad_broadcast", group=group,
                                                           async_op=True))
        for work in pending:
            work.wait()
        return out

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict, compute_inverses: bool = True) -> None:
        """Restore a state dict (checked before anything changes); a collective.

        Eigen data are per rank: a state dict saved on another rank (the usual
        "save on rank 0, load everywhere") lacks those of the layers this rank works
        on. If any rank lacks eigen data it needs, every rank recomputes and
        re-broadcasts them from the saved factors (with ``compute_inverses``).

        Every rank checks its own state dict before any rank changes anything: if
        one refuses it, every rank raises (the others naming that rank) and nothing
        is loaded anywhere.
        """
        def needs_eigen(i: int) -> bool:
            return self.assignment.is_grad_worker(i, self.rank)

        problem: Optional[Exception] = None
        lacks_eigen = False
        try:
            self.check_state_dict(state_dict)
            lacks_eigen = any(needs_eigen(i) and not state_dict["layers"][layer.name].get("eigen")
                              and state_dict["layers"][layer.name]["a_factor"] is not None
                              for i, layer in enumerate(self.layers))
        except (TypeError, ValueError) as exc:
            problem = exc
        verdict = self._load_verdict(problem, lacks_eigen)
        if problem is not None:
            raise problem
        if verdict >= 2:
            raise ValueError(f"KAISAPreconditioner: rank {verdict - 2} refused its state dict (see its error); "
                             "nothing was loaded on any rank")
        self.restore_state(state_dict, needs_eigen=needs_eigen)
        if compute_inverses and verdict == 1:
            for i, data in self._eigen_update({}, self.hyperparameter("damping")).items():
                self.layers[i].eigen = data

    def _load_verdict(self, problem: Optional[Exception], lacks_eigen: bool) -> int:
        """One integer all-reduced (max) over the ranks: ``2 + r`` when rank ``r`` refused its state
        dict (the highest such rank), else 1 when some rank lacks eigen data it needs, else 0."""
        flag = 2 + self.rank if problem is not None else int(lacks_eigen)
        if self.world_size == 1:
            return flag
        value = torch.tensor([flag], dtype=torch.int32, device=self.layers[0].weight.device)
        self._collectives.all_reduce(value, label="load_state_dict", op=dist.ReduceOp.MAX, group=self._world_group)
        return int(value.item())

    # ------------------------------------------------------------------ reports

    def expected_memory(self) -> dict[str, int]:
        """This rank's K-FAC memory according to :func:`expected_memory_per_rank`."""
        return expected_memory_per_rank(
            self.layer_dims, self.assignment, self.rank, prediv=self.prediv, compute_method=self.compute_method,
            element_size=self.inv_dtype.itemsize, factor_element_size=self.factor_dtype.itemsize,
        )
