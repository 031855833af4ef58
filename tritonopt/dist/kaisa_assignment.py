"""KAISA's work assignment and its memory/communication formulas (pure Python, no processes).

``grad_worker_fraction`` (gwf) sets how many ranks per layer hold its eigen
data and precondition its gradient: ``gw = gwf * W`` (paper sec. 3.1). Ranks
are split into ``W/gw`` **worker groups** of ``gw`` ranks and ``gw`` **receiver
groups** of ``W/gw`` ranks; each worker group meets each receiver group in
exactly one rank. ``layout="paper"`` (the paper's Fig. 4 and its code): worker
groups are contiguous (``{0..gw-1}, ...``), receiver groups strided
(``{i, i+gw, ...}``); ``layout="strided"`` (the maintained reference
implementation): the transpose.

Each layer's factors are decomposed by the ranks a longest-processing-time
greedy picks (paper sec. 3.2): layers by decreasing cost ``a^3 + g^3`` (or
``a^2 + g^2`` to balance memory), each to the least-loaded worker group and,
inside it, to its least-loaded rank. With ``colocate_factors`` (default) both
factors of a layer go to that one rank; without, each factor (by decreasing
cost) goes to the least-loaded rank of the chosen group, so ``A`` and ``G`` of
one layer may be decomposed on two ranks of the same group. A layer's gradient
workers are that group.
"""

from __future__ import annotations

import enum
from fractions import Fraction
from typing import Optional, Sequence, Union

from tritonopt.optim.kfac_functional import factor_row_stride

__all__ = [
    "KAISAAssignment",
    "LAYOUTS",
    "Strategy",
    "eigen_numel",
    "expected_bytes_per_rank",
    "expected_memory_per_rank",
    "resolve_grad_worker_fraction",
    "strategy_of",
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
    """Worker/receiver groups and the ranks that decompose each layer's factors.

    Args:
        costs: one entry per layer, in registration order: the layer's cost
            (``a^3 + g^3``), or the pair ``(cost of A, cost of G)`` (needed without
            ``colocate_factors``).
        world_size, grad_workers: ``W`` and ``gw`` (``gw`` divides ``W``).
        layout: ``"paper"`` or ``"strided"`` (see the module docstring).
        colocate_factors: decompose both factors of a layer on one rank.

    Attributes:
        factor_workers: per layer, ``(rank decomposing A, rank decomposing G)``.
        inv_worker: per layer, the rank decomposing A (and G, colocated).
        loads: the summed cost per rank.
    """

    def __init__(
        self,
        costs: Sequence[Union[float, tuple[float, float]]],
        world_size: int,
        grad_workers: int,
        layout: str = "paper",
        *,
        colocate_factors: bool = True,
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if world_size % grad_workers:
            raise ValueError(f"grad_workers={grad_workers} must divide world_size={world_size}")
        pairs = [c if isinstance(c, (tuple, list)) else None for c in costs]
        if not colocate_factors and any(p is None for p in pairs):
            raise ValueError("without colocate_factors every cost must be a pair (cost of A, cost of G)")
        self.world_size, self.grad_workers, self.layout = world_size, grad_workers, layout
        self.colocate_factors = colocate_factors
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
        self.costs = [float(sum(p)) if p is not None else float(c) for c, p in zip(costs, pairs)]
        self.loads = [0.0] * world_size
        self.factor_workers: list[tuple[int, int]] = [(0, 0)] * len(self.costs)
        # Longest processing time first; ties by registration order, group index, rank.
        for index in sorted(range(len(self.costs)), key=lambda i: (-self.costs[i], i)):
            group = min(self.worker_groups, key=lambda g: (sum(self.loads[r] for r in g), g[0]))
            if colocate_factors:
                rank = min(group, key=lambda r: (self.loads[r], r))
                self.factor_workers[index] = (rank, rank)
                self.loads[rank] += self.costs[index]
                continue
            chosen = {}
            for side in sorted((0, 1), key=lambda s: (-pairs[index][s], s)):
                rank = min(group, key=lambda r: (self.loads[r], r))
                chosen[side] = rank
                self.loads[rank] += float(pairs[index][side])
            self.factor_workers[index] = (chosen[0], chosen[1])
        self.inv_worker = [a for a, _ in self.factor_workers]

    def worker_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.worker_groups if rank in g)

    def receiver_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.receiver_groups if rank in g)

    def workers(self, layer: int) -> tuple[int, ...]:
        """The gradient workers of ``layer``: the worker group of the ranks decomposing its factors."""
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


def eigen_numel(a: int, g: int, prediv: bool = True, compute_method: str = "eigen") -> int:
    """Elements of one layer's eigen data (what a gradient worker keeps)."""
    if compute_method == "inverse":
        return a * a + g * g
    return a * a + g * g + (a * g if prediv else a + g)


def _factor_part_numel(dim: int, compute_method: str) -> int:
    # What travels per factor when the factors of a layer are decomposed on two ranks:
    # eigenvectors and eigenvalues, or the inverse (always float32).
    return dim * dim if compute_method == "inverse" else dim * dim + dim


def expected_memory_per_rank(
    dims: Sequence[tuple[int, int]],
    assignment: KAISAAssignment,
    rank: int,
    *,
    prediv: bool = True,
    compute_method: str = "eigen",
    element_size: int = 4,
    factor_element_size: Optional[int] = None,
) -> dict[str, int]:
    """KAISA's per-rank K-FAC memory (paper Table 5) for ``rank``, in bytes.

    ``dims`` is ``[(a, g), ...]``, one pair per layer. ``factors``: every rank holds
    every factor (``factor_element_size``, default ``element_size``); ``batch``:
    the float32 statistic buffers; both with their rows padded as K-FAC stores them
    (:func:`~tritonopt.optim.kfac_functional.factor_row_stride`); ``eigen``: the eigen
    data of the layers ``rank`` is a gradient worker of (``element_size``, the inverse dtype).
    """
    fes = element_size if factor_element_size is None else factor_element_size
    squares = sum(a * factor_row_stride(a) + g * factor_row_stride(g) for a, g in dims)
    eigen = element_size * sum(
        eigen_numel(a, g, prediv, compute_method)
        for i, (a, g) in enumerate(dims) if assignment.is_grad_worker(i, rank)
    )
    factors, batch = fes * squares, 4 * squares
    return {"factors": factors, "batch": batch, "eigen": eigen, "total": factors + batch + eigen}


def expected_bytes_per_rank(
    dims: Sequence[tuple[int, int]],
    assignment: KAISAAssignment,
    rank: int,
    *,
    factor_steps: int,
    eigen_steps: int,
    steps: int,
    prediv: bool = True,
    compute_method: str = "eigen",
    symmetry_aware: bool = False,
    element_size: int = 4,
    factor_element_size: Optional[int] = None,
    eigen_element_size: Optional[int] = None,
) -> dict[str, dict[str, int]]:
    """Bytes ``rank`` sends/receives per collective label over a run, from the collectives its strategy issues.

    ``factor_steps``/``eigen_steps``/``steps``: how many factor-update, eigen-update
    and preconditioning steps the run had. The factor all-reduce carries each
    layer's statistics (full or upper triangles) and one contribution count per
    layer, in ``factor_element_size`` (default ``element_size``); eigen data
    travel in ``eigen_element_size`` (default ``element_size``) when a layer's
    factors are colocated, and as float32 halves when they are not; preconditioned
    gradients in float32.
    """
    if symmetry_aware:
        factor = sum(a * (a + 1) // 2 + g * (g + 1) // 2 for a, g in dims)
    else:
        factor = sum(a * a + g * g for a, g in dims)
    factor += len(dims)  # the contribution counts
    fes = element_size if factor_element_size is None else factor_element_size
    ees = element_size if eigen_element_size is None else eigen_element_size
    out = {"factor_allreduce": {"sent": factor * fes * factor_steps, "received": factor * fes * factor_steps}}
    eig_sent = eig_received = 0
    if assignment.broadcast_inverses():
        for i, (a, g) in enumerate(dims):
            if not assignment.is_grad_worker(i, rank):
                continue
            if assignment.colocate_factors:
                size = ees * eigen_numel(a, g, prediv, compute_method)
                parts = [(assignment.inv_worker[i], size)]
            else:
                a_rank, g_rank = assignment.factor_workers[i]
                parts = [(a_rank, 4 * _factor_part_numel(a, compute_method)),
                         (g_rank, 4 * _factor_part_numel(g, compute_method))]
            for source, size in parts:
                if source == rank:
                    eig_sent += size
                else:
                    eig_received += size
    out["eigen_broadcast"] = {"sent": eig_sent * eigen_steps, "received": eig_received * eigen_steps}
    grad_sent = grad_received = 0
    if assignment.broadcast_gradients():
        for i, (a, g) in enumerate(dims):
            if assignment.is_grad_worker(i, rank):
                grad_sent += a * g
            else:
                grad_received += a * g
    out["grad_broadcast"] = {"sent": grad_sent * 4 * steps, "received": grad_received * 4 * steps}
    return out
