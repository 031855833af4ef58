"""KAISA: K-FAC distributed with a tunable memory/communication trade-off (Pauloski et al., SC '21).

Training is data parallel (every rank holds the model, gradients are averaged by
DDP or by the caller before :meth:`KAISAPreconditioner.step`); the K-FAC work is
split across ranks (paper sec. 3.1-3.2):

* every rank holds the full factors ``A, G`` of every layer; each factor-update
  step the batch statistics are averaged over the world with one all-reduce;
* each layer has one **inverse worker** (chosen by a longest-processing-time
  greedy on cost ``a^3 + g^3``, paper sec. 3.2) that eigendecomposes its factors;
* ``gw = grad_worker_fraction * W`` **gradient workers** per layer hold its eigen
  data (``QA, QG, D`` with prediv) and precondition its gradient; the other
  ``W - gw`` ranks receive the preconditioned gradient.

=========== ======= ============================= ===============================
strategy    gwf     eigen broadcast (eigen steps)  preconditioned-gradient bcast
=========== ======= ============================= ===============================
MEM-OPT     1/W     none                          every step, groups of W
HYBRID-OPT  between inverse worker -> its gw      every step, gw concurrent groups
                    gradient workers              of W/gw
COMM-OPT    1       inverse worker -> all W       none
=========== ======= ============================= ===============================

Group layout. Ranks are split into ``W/gw`` **worker groups** of ``gw`` ranks and
``gw`` **receiver groups** of ``W/gw`` ranks; each worker group meets each receiver
group in exactly one rank. A layer's gradient workers are the worker group of its
inverse worker; rank ``r`` receives the layer's gradient from the one member of
that worker group in ``r``'s receiver group. ``layout="paper"`` (default; the
paper's Fig. 4 and its code): worker groups are contiguous (``{0..gw-1}, ...``),
receiver groups strided (``{i, i+gw, ...}``); ``layout="strided"`` (the
maintained reference implementation): the transpose. All groups are created once,
in the same order, on every rank.

Collectives (all through a :class:`~tritonopt.dist._comm.CountingCommunicator`,
every tensor contiguous), with bytes per rank per occurrence (``s`` = 4 bytes):

* ``factor_allreduce`` (factor-update steps): one flat buffer of
  ``s * sum(a^2 + g^2)`` (``symmetry_aware``: ``s * sum(a(a+1)/2 + g(g+1)/2)``,
  packed with :func:`~tritonopt._ops.kfac.triu_pack`);
* ``eigen_broadcast`` (eigen steps, ``gw > 1``): per layer, one flat buffer of
  ``s * (a^2 + g^2 + a g)`` (prediv; ``s * (a^2 + g^2 + a + g)`` without) from the
  inverse worker to the layer's worker group;
* ``grad_broadcast`` (every step, ``gw < W``): per layer, ``s * a g`` from the
  layer's gradient worker to each receiver group, all groups concurrently;
* ``load_state_dict`` (once per :meth:`~KAISAPreconditioner.load_state_dict`): a
  one-integer all-reduce (max) telling every rank whether some rank lacks eigen
  data (a checkpoint saved on another rank, or without eigen data), in which case
  the eigendecompositions are recomputed from the factors and re-broadcast.

Memory per rank (:meth:`KAISAPreconditioner.memory_usage`): factors
``s * sum(a^2 + g^2)`` (plus the same again for the batch buffers) on every rank,
and eigen data ``s * (a^2 + g^2 + a g)`` for each layer the rank is a gradient
worker of; averaged over ranks the eigen part is exactly ``gwf * sum_l M_eigen(l)``.
"""

from __future__ import annotations

import enum
from fractions import Fraction
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from tritonopt._ops.kfac import triu_pack, triu_unpack
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.optim._kfac_layers import KFACLayer
from tritonopt.optim.kfac import KFACPreconditioner

__all__ = [
    "KAISAAssignment",
    "KAISAPreconditioner",
    "Strategy",
    "expected_bytes_per_rank",
    "expected_memory_per_rank",
    "resolve_grad_worker_fraction",
    "valid_grad_worker_fractions",
]

LAYOUTS = ("paper", "strided")


class Strategy(enum.Enum):
    COMM_OPT = "comm-opt"
    HYBRID_OPT = "hybrid-opt"
    MEM_OPT = "mem-opt"


def valid_grad_worker_fractions(world_size: int) -> list[Fraction]:
    """``gw / W`` for every ``gw`` dividing ``W``: the fractions KAISA accepts."""
    return [Fraction(gw, world_size) for gw in range(1, world_size + 1) if world_size % gw == 0]


def resolve_grad_worker_fraction(value: Union[float, Strategy], world_size: int) -> tuple[float, int]:
    """``(fraction, gw)`` for a fraction or :class:`Strategy`; ``0`` means ``1/W``.

    Raises ``ValueError`` listing the valid fractions when ``value * W`` is not an
    integer dividing ``W``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    valid = valid_grad_worker_fractions(world_size)
    listing = ", ".join(f"{f.numerator}/{f.denominator}" if f != 1 else "1" for f in valid)
    if isinstance(value, Strategy):
        value = {Strategy.COMM_OPT: 1.0, Strategy.HYBRID_OPT: 0.5, Strategy.MEM_OPT: 1.0 / world_size}[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"grad_worker_fraction must be a number or a Strategy, got {type(value).__name__}")
    if value == 0:
        value = 1.0 / world_size
    workers = value * world_size
    gw = round(workers)
    if not 0 <= value <= 1 or abs(workers - gw) > 1e-9 or gw < 1 or world_size % gw:
        raise ValueError(
            f"grad_worker_fraction={value!r} is not valid for world size {world_size}: it must "
            f"be one of {listing} (or 0 for 1/{world_size})"
        )
    return gw / world_size, gw


def strategy_of(gw: int, world_size: int) -> Strategy:
    if gw == world_size:
        return Strategy.COMM_OPT
    if gw == 1:
        return Strategy.MEM_OPT
    return Strategy.HYBRID_OPT


class KAISAAssignment:
    """Worker/receiver groups and the inverse worker of each layer (pure Python).

    Args:
        costs: one cost per layer (``a^3 + g^3``), in registration order.
        world_size, grad_workers: ``W`` and ``gw`` (``gw`` divides ``W``).
        layout: ``"paper"`` or ``"strided"`` (see the module docstring).
    """

    def __init__(self, costs: Sequence[float], world_size: int, grad_workers: int, layout: str = "paper"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if world_size % grad_workers:
            raise ValueError(f"grad_workers={grad_workers} must divide world_size={world_size}")
        self.world_size, self.grad_workers, self.layout = world_size, grad_workers, layout
        per_receiver = world_size // grad_workers
        if layout == "paper":
            self.worker_groups = [
                tuple(j * grad_workers + i for i in range(grad_workers)) for j in range(per_receiver)
            ]
            self.receiver_groups = [
                tuple(j * grad_workers + i for j in range(per_receiver)) for i in range(grad_workers)
            ]
        else:
            self.worker_groups = [
                tuple(c + r * per_receiver for r in range(grad_workers)) for c in range(per_receiver)
            ]
            self.receiver_groups = [
                tuple(r * per_receiver + c for c in range(per_receiver)) for r in range(grad_workers)
            ]
        self.costs = [float(c) for c in costs]
        self.loads = [0.0] * world_size
        self.inv_worker = [0] * len(self.costs)
        # Longest processing time first; ties by registration order, group index, rank.
        for index in sorted(range(len(self.costs)), key=lambda i: (-self.costs[i], i)):
            group = min(self.worker_groups, key=lambda g: (sum(self.loads[r] for r in g), g[0]))
            rank = min(group, key=lambda r: (self.loads[r], r))
            self.inv_worker[index] = rank
            self.loads[rank] += self.costs[index]

    def worker_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.worker_groups if rank in g)

    def receiver_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.receiver_groups if rank in g)

    def workers(self, layer: int) -> tuple[int, ...]:
        """The gradient workers of ``layer``: its inverse worker's worker group."""
        return self.worker_group_of(self.inv_worker[layer])

    def is_grad_worker(self, layer: int, rank: int) -> bool:
        return rank in self.workers(layer)

    def src(self, layer: int, rank: int) -> int:
        """The rank ``rank`` gets ``layer``'s preconditioned gradient from (itself for workers)."""
        (source,) = set(self.workers(layer)) & set(self.receiver_group_of(rank))
        return source

    def broadcast_gradients(self) -> bool:
        return self.grad_workers < self.world_size

    def broadcast_inverses(self) -> bool:
        return self.grad_workers > 1


def _eigen_numel(a: int, g: int, prediv: bool) -> int:
    return a * a + g * g + (a * g if prediv else a + g)


def expected_memory_per_rank(
    dims: Sequence[tuple[int, int]], assignment: KAISAAssignment, rank: int, *, prediv: bool = True,
    element_size: int = 4,
) -> dict[str, int]:
    """KAISA's per-rank K-FAC memory (paper Table 5) for ``rank``.

    ``dims`` is ``[(a, g), ...]``, one pair per layer.
    """
    factors = element_size * sum(a * a + g * g for a, g in dims)
    eigen = element_size * sum(
        _eigen_numel(a, g, prediv) for i, (a, g) in enumerate(dims) if assignment.is_grad_worker(i, rank)
    )
    return {"factors": factors, "batch": factors, "eigen": eigen, "total": 2 * factors + eigen}


def expected_bytes_per_rank(
    dims: Sequence[tuple[int, int]], assignment: KAISAAssignment, rank: int, *, factor_steps: int,
    eigen_steps: int, steps: int, prediv: bool = True, symmetry_aware: bool = False, element_size: int = 4,
    factor_element_size: Optional[int] = None,
) -> dict[str, dict[str, int]]:
    """Bytes ``rank`` sends/receives per collective label over a run, from the collectives its strategy issues.

    ``factor_steps``/``eigen_steps``/``steps``: how many factor-update, eigen-update
    and preconditioning steps the run had.
    """
    if symmetry_aware:
        factor = sum(a * (a + 1) // 2 + g * (g + 1) // 2 for a, g in dims)
    else:
        factor = sum(a * a + g * g for a, g in dims)
    fs = element_size if factor_element_size is None else factor_element_size
    out = {"factor_allreduce": {"sent": factor * fs * factor_steps, "received": factor * fs * factor_steps}}
    eig_sent = eig_received = 0
    if assignment.broadcast_inverses():
        for i, (a, g) in enumerate(dims):
            if not assignment.is_grad_worker(i, rank):
                continue
            if assignment.inv_worker[i] == rank:
                eig_sent += _eigen_numel(a, g, prediv)
            else:
                eig_received += _eigen_numel(a, g, prediv)
    out["eigen_broadcast"] = {"sent": eig_sent * element_size * eigen_steps,
                              "received": eig_received * element_size * eigen_steps}
    grad_sent = grad_received = 0
    if assignment.broadcast_gradients():
        for i, (a, g) in enumerate(dims):
            if assignment.is_grad_worker(i, rank):
                grad_sent += a * g
            else:
                grad_received += a * g
    out["grad_broadcast"] = {"sent": grad_sent * element_size * steps,
                             "received": grad_received * element_size * steps}
    return out


class KAISAPreconditioner(KFACPreconditioner):
    """:class:`~tritonopt.optim.kfac.KFACPreconditioner` distributed over ``torch.distributed`` ranks.

    Needs an initialised default process group; every rank builds it with the
    same model and arguments and calls :meth:`step` at the same points, after the
    gradients were averaged across ranks (DDP). After ``step()`` every rank holds
    the same preconditioned gradients, so the optimizers stay in sync.

    Args (beyond those of :class:`KFACPreconditioner`, all keyword-only):
        grad_worker_fraction: ``gw / W`` in ``{1/W, ..., 1}`` (``gw`` dividing ``W``), or
            ``0`` (= ``1/W``), or a :class:`Strategy`. 1 is COMM-OPT, ``1/W`` MEM-OPT.
        layout: ``"paper"`` or ``"strided"`` process-group layout.
        symmetry_aware: all-reduce only the upper triangles of the factor statistics.
        factor_comm_dtype: dtype the factor statistics are all-reduced in (float32,
            float16 or bfloat16; paper sec. 3.3 communicates in the data's precision);
            they are cast back to float32 before the running average.
        assignment_cost: ``"compute"`` (``n^3``, default) or ``"memory"`` (``n^2``) for the
            greedy load balance.
        communicator: a :class:`CountingCommunicator` (one is created by default);
            :attr:`communicator` holds the byte counts per collective label.
    """

    algorithm = "kaisa"
    _raise_on_eigh_failure = True

    def __init__(
        self,
        model: nn.Module,
        *,
        grad_worker_fraction: Union[float, Strategy] = 1.0,
        layout: str = "paper",
        symmetry_aware: bool = False,
        factor_comm_dtype: torch.dtype = torch.float32,
        assignment_cost: str = "compute",
        communicator: Optional[CountingCommunicator] = None,
        **kwargs,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("KAISAPreconditioner needs torch.distributed to be initialised")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if assignment_cost not in ("compute", "memory"):
            raise ValueError(f"assignment_cost must be 'compute' or 'memory', got {assignment_cost!r}")
        if not isinstance(symmetry_aware, bool):
            raise TypeError(f"symmetry_aware must be a bool, got {type(symmetry_aware).__name__}")
        if factor_comm_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(
                f"factor_comm_dtype must be torch.float32, float16 or bfloat16, got {factor_comm_dtype!r}"
            )
        if communicator is not None and not isinstance(communicator, CountingCommunicator):
            raise TypeError("communicator must be a CountingCommunicator")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.grad_worker_fraction, self.grad_workers = resolve_grad_worker_fraction(
            grad_worker_fraction, self.world_size
        )
        self.strategy = strategy_of(self.grad_workers, self.world_size)
        super().__init__(model, **kwargs)
        self.symmetry_aware = symmetry_aware
        self.factor_comm_dtype = factor_comm_dtype
        self.communicator = communicator if communicator is not None else CountingCommunicator()
        power = 3 if assignment_cost == "compute" else 2
        costs = [l.a_dim**power + l.g_dim**power for l in self.layers]
        self.assignment = KAISAAssignment(costs, self.world_size, self.grad_workers, layout)
        # Every rank creates every group, in the same order (a torch.distributed rule).
        self._groups: dict[tuple[int, ...], object] = {}
        for ranks in self.assignment.worker_groups + self.assignment.receiver_groups:
            if len(ranks) == self.world_size:
                self._groups[ranks] = None  # the default group
            elif len(ranks) > 1 and ranks not in self._groups:
                self._groups[ranks] = dist.new_group(list(ranks))
        self._index = {layer.name: i for i, layer in enumerate(self.layers)}

    @property
    def layer_dims(self) -> list[tuple[int, int]]:
        return [(l.a_dim, l.g_dim) for l in self.layers]

    # ------------------------------------------------------------------ factors

    def _reduce_factor_batches(self, layers: list[KFACLayer]) -> None:
        if not layers or self.world_size == 1:
            return
        pieces = []
        dtype = self.factor_comm_dtype
        for layer in layers:
            for batch in (layer.a_batch, layer.g_batch):
                pieces.append(triu_pack(batch, dtype) if self.symmetry_aware else batch.reshape(-1).to(dtype))
        flat = torch.cat(pieces)
        self.communicator.all_reduce(flat, label="factor_allreduce")
        offset = 0
        inv_world = 1.0 / self.world_size
        for layer in layers:
            for batch in (layer.a_batch, layer.g_batch):
                dim = batch.shape[0]
                n = dim * (dim + 1) // 2 if self.symmetry_aware else dim * dim
                chunk = flat[offset : offset + n]
                offset += n
                if self.symmetry_aware:
                    batch.copy_(triu_unpack(chunk.contiguous(), dim, torch.float32, scale=inv_world))
                else:
                    # The backend may sum (i, j) and (j, i) in different orders: mirror the
                    # upper triangle so the factors stay symmetric to the last bit.
                    summed = chunk.view(dim, dim).to(torch.float32)
                    batch.copy_(torch.triu(summed) + torch.triu(summed, 1).T).mul_(inv_world)

    # ------------------------------------------------------------------ eigen

    def _eigen_owner_layers(self) -> list[KFACLayer]:
        return [l for i, l in enumerate(self.layers) if self.assignment.inv_worker[i] == self.rank]

    def _update_eigen(self, damping: float) -> None:
        self._decompose(self._eigen_owner_layers(), damping)
        if not self.assignment.broadcast_inverses():
            return
        pending = []
        for i, layer in enumerate(self.layers):
            if not self.assignment.is_grad_worker(i, self.rank):
                continue
            # Factors are identical on every rank, so every rank makes the same call here.
            if not self._finite_factors(layer):
                continue
            source = self.assignment.inv_worker[i]
            shapes = self._eigen_shapes(layer)
            if source == self.rank:
                flat = torch.cat([layer.eigen[n].reshape(-1) for n in self._eigen_names()])
            else:
                flat = torch.empty(sum(torch.Size(s).numel() for s in shapes), dtype=torch.float32,
                                   device=layer.weight.device)
            group = self._groups[self.assignment.workers(i)]
            work = self.communicator.broadcast(flat, source, label="eigen_broadcast", group=group,
                                               async_op=True)
            pending.append((layer, source, shapes, flat, work))
        for layer, source, shapes, flat, work in pending:
            work.wait()
            if source == self.rank:
                continue
            eigen, offset = {}, 0
            for name, shape in zip(self._eigen_names(), shapes):
                n = torch.Size(shape).numel()
                eigen[name] = flat[offset : offset + n].view(shape).clone()
                offset += n
            layer.eigen = eigen

    # ------------------------------------------------------------------ checkpoints

    def _saved_eigen_usable(self, index: int, entry: dict) -> bool:
        # Eigen data are per rank: a state dict saved on another rank (the usual
        # "save on rank 0, load everywhere") lacks the layers this rank works on.
        if "eigen" not in entry:
            return False
        if not self.assignment.is_grad_worker(index, self.rank):
            return True  # not needed here
        has_factors = entry.get("a_factor") is not None and entry.get("g_factor") is not None
        return bool(entry["eigen"]) or not has_factors

    def _saved_eigen_kept(self, index: int, entry: dict) -> dict:
        return entry["eigen"] if self.assignment.is_grad_worker(index, self.rank) else {}

    def _any_process(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.layers[0].weight.device)
        self.communicator.all_reduce(value, label="load_state_dict", op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _restore_eigen(self, layers: list[KFACLayer]) -> None:
        # Collective: every rank recomputes/re-broadcasts, whatever it was missing.
        self._update_eigen(self.hyperparameter("damping"))

    # ------------------------------------------------------------------ preconditioning

    def _precondition_layers(self, layers: list[KFACLayer], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out, pending = {}, []
        for layer in layers:
            i = self._index[layer.name]
            if self.assignment.is_grad_worker(i, self.rank):
                out[layer.name] = self._precondition_one(layer, grads[layer.name]).contiguous()
            else:
                out[layer.name] = torch.empty((layer.g_dim, layer.a_dim), dtype=torch.float32,
                                              device=layer.weight.device)
            if self.assignment.broadcast_gradients():
                group = self._groups[self.assignment.receiver_group_of(self.rank)]
                source = self.assignment.src(i, self.rank)
                pending.append(self.communicator.broadcast(
                    out[layer.name], source, label="grad_broadcast", group=group, async_op=True
                ))
        for work in pending:
            work.wait()
        return out

    # ------------------------------------------------------------------ reports

    def expected_memory(self) -> dict[str, int]:
        """This rank's K-FAC memory according to :func:`expected_memory_per_rank`."""
        return expected_memory_per_rank(self.layer_dims, self.assignment, self.rank, prediv=self.prediv)
