"""Distributed Lanczos with a row-sharded basis (Gu et al., Algorithm 2) and the row-to-column reconstruction (Fig. 4).

Layout. The flat parameter vector (length ``n``) is zero-padded to
``C * n_c`` with ``n_c = ceil(n / C)``; rank ``c`` holds columns
``[c n_c, (c+1) n_c)`` of every Lanczos vector: its shard of ``D`` is
``[m, n_c]`` (exactly ``m * ceil(n / C)`` elements). ``B`` is replicated.

Collectives per Lanczos iteration (all through a
:class:`~tritonopt.dist._comm.CountingCommunicator`, labels in quotes):

* ``"lanczos_all_gather"``: all_gather of the current vector's shard (``n_c`` sent, ``C n_c`` received);
* ``"lanczos_coef"``: all_reduce of the Gram-Schmidt coefficients, ``i + 1``
  entries at iteration ``i`` (rows not yet written are not sent), once per pass;
* ``"lanczos_norm"``: all_reduce of the squared residual norm (1 entry);
* ``"lanczos_hvp"`` (only with ``data_parallel_hvp=True``): all_reduce of the
  Hessian-vector product (``n``), which is then averaged.

Start-up agreement (``"lanczos_config_check"``, counted under its own label so
that the per-iteration figures above stay exact): before the first iteration,
:func:`~tritonopt.dist._agreement.check_ranks_agree` compares ``n``, ``num_iters``,
``dtype``, ``passes``, ``seed``, ``breakdown_rtol``, ``data_parallel_hvp`` and the
group's ranks, two all-gathers of ``8`` and ``8 * 9`` bytes per rank. Ranks that
differ (or a rank that refused its own arguments) make every rank raise a
``ValueError`` naming the setting, instead of running apart.

Every rank computes the full-length HVP. By default each rank uses the same
loss (the same ESE batch), so ``h`` and hence ``B`` agree across ranks
(the default: ranks need not agree on anything but the seed);
``data_parallel_hvp=True`` lets each rank use its own shard of the batch and
averages ``h``.

Reconstruction (``"reconstruct_all_to_all"``): one ``all_to_all`` turns the
row shard of the Ritz vectors ``V[:, cols of rank c]`` (``[r, n_c]``) into a
block of whole vectors ``V[rows_c, :]`` (``[r_c, n]``), ``r_c = r // C`` plus
one for the first ``r % C`` ranks. It is a pure permutation of the data.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tritonopt._validation import check_bool, check_float, check_int
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import GuardedCommunicator, group_timeout
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.ops import gram_schmidt_coefficients, gram_schmidt_subtract
from tritonopt.optim.lanczos import LanczosResult, check_lanczos_arguments, default_breakdown_rtol, lanczos_loop

__all__ = ["column_split", "distributed_lanczos", "reconstruct_columns", "shard_size"]


def shard_size(n: int, world: int) -> int:
    """``ceil(n / world)``: columns of ``D`` per rank."""
    return -(-n // world)


def column_split(r: int, world: int) -> list[int]:
    """Rows of ``V`` (eigen-directions) per rank: as even as possible, extra ones first."""
    return [r // world + (1 if j < r % world else 0) for j in range(world)]


def distributed_lanczos(
    hvp: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    num_iters: int,
    *,
    comm: Optional[CountingCommunicator] = None,
    group: Optional[dist.ProcessGroup] = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    passes: int = 2,
    seed: int = 0,
    breakdown_rtol: Optional[float] = None,
    data_parallel_hvp: bool = False,
) -> LanczosResult:
    """Algorithm 2: Lanczos with this rank's row shard of ``D`` (``result.basis``: ``[steps, ceil(n/C)]``).

    Same arguments as :func:`tritonopt.optim.lanczos.lanczos`, plus the
    communicator, the process group (default: the world) and the HVP mode.
    Every rank must call it with the same ``n``, ``num_iters``, ``dtype``,
    ``passes``, ``seed``, ``breakdown_rtol`` and ``data_parallel_hvp``: a
    start-up agreement (module docstring) checks them and raises ``ValueError``
    on every rank, naming each setting that differs. It creates no group: a rank
    that dies or stalls makes the others raise
    :class:`~tritonopt.dist.CollectiveFailure` (naming the collective and the
    ranks) within ``group``'s timeout, so pass a group created with the timeout
    you want.
    Host synchronisations: one per iteration, as the single-process loop.
    """
    comm = CountingCommunicator(group) if comm is None else comm
    if not isinstance(comm, GuardedCommunicator):  # DHO2 passes its own, which names DHO2
        comm = GuardedCommunicator(comm, layer="distributed_lanczos", timeout=group_timeout(group))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    problem, settings = None, None
    try:
        check_lanczos_arguments(n, num_iters, dtype)
        check_int("passes", passes, low=1)
        check_int("seed", seed)
        if breakdown_rtol is not None:
            check_float("breakdown_rtol", breakdown_rtol, low=0.0)
        check_bool("data_parallel_hvp", data_parallel_hvp)
        device = torch.device(device)
        breakdown_rtol = default_breakdown_rtol(dtype) if breakdown_rtol is None else float(breakdown_rtol)
        settings = {"n": n, "num_iters": num_iters, "dtype": str(dtype), "passes": passes, "seed": seed,
                    "breakdown_rtol": breakdown_rtol, "data_parallel_hvp": data_parallel_hvp,
                    "ranks": dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)}
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: an unknown device string
        problem = exc
    check_ranks_agree("distributed_lanczos", settings, comm=comm, group=group,
                      device=device if problem is None else "cpu", label="lanczos_config_check", problem=problem)
    n_c = shard_size(n, world)

    def gather(shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(world * n_c, dtype=shard.dtype, device=shard.device)
        comm.all_gather_into_tensor(full, shard.contiguous(), label="lanczos_all_gather", group=group)
        return full

    def project(basis: torch.Tensor, h: torch.Tensor, rows: int):
        for _ in range(passes):
            coef = gram_schmidt_coefficients(basis, h, rows)
            comm.all_reduce(coef, label="lanczos_coef", group=group)
            h, sq_norm = gram_schmidt_subtract(basis, h, coef)
        sq_norm = sq_norm.reshape(1).clone()
        comm.all_reduce(sq_norm, label="lanczos_norm", group=group)
        return h, sq_norm[0]

    local_hvp = hvp
    if data_parallel_hvp:
        def local_hvp(v):  # noqa: F811  (the averaged, data-parallel product)
            h = hvp(v).contiguous()
            comm.all_reduce(h, label="lanczos_hvp", group=group)
            return h / world

    return lanczos_loop(
        local_hvp, n, min(num_iters, n), shard_start=rank * n_c, shard_len=n_c, gather=gather,
        project=project, dtype=dtype, device=device, seed=seed, breakdown_rtol=breakdown_rtol,
    )


def reconstruct_columns(
    rows_shard: torch.Tensor,
    n: int,
    *,
    comm: Optional[CountingCommunicator] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> tuple[torch.Tensor, int]:
    """Row shard ``[r, n_c]`` -> this rank's whole vectors ``[r_c, n]`` and the first one's index.

    One ``all_to_all_single``: rank ``c`` sends rows ``cols_j`` of its shard to
    rank ``j`` and stacks what it receives in rank order along the columns.
    """
    comm = CountingCommunicator(group) if comm is None else comm
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    r, n_c = rows_shard.shape
    if n_c != shard_size(n, world):
        raise ValueError(f"rows_shard must have ceil(n / world) = {shard_size(n, world)} columns, got {n_c}")
    splits = column_split(r, world)
    mine = splits[rank]
    received = torch.empty((world * mine, n_c), dtype=rows_shard.dtype, device=rows_shard.device)
    comm.all_to_all_single(received, rows_shard.contiguous(), [mine] * world, splits,
                           label="reconstruct_all_to_all", group=group)
    whole = received.view(world, mine, n_c).permute(1, 0, 2).reshape(mine, world * n_c)[:, :n]
    return whole.contiguous(), sum(splits[:rank])


def lanczos_shard_report(result: LanczosResult, n: int, world: int) -> dict:
    """What this rank holds for the ESE: the D shard's shape and element count."""
    return {
        "d_shard_shape": tuple(result.basis.shape),
        "d_shard_numel": result.basis.numel(),
        "expected_numel": result.steps * math.ceil(n / world),
    }
