"""``torch.distributed`` layers of tritonopt.

==========================  =====================================================
``KAISAPreconditioner``     K-FAC across ranks with KAISA's ``grad_worker_fraction``
``distributed_lanczos``     Lanczos with the basis sharded by rows (DHO2 Alg. 2)
``reconstruct_columns``     row shards to column shards with one ``all_to_all``
``DHO2`` / ``MRDHO2``       distributed FOSI, and its accelerator/worker form
``CollectiveFailure``       what a layer raises when a rank died or stalled past its timeout
``ef_topk_hook``            DDP communication hook: error-feedback blockwise Top-k (``EFTopKState``)
``lowrank_ef_hook``         DDP communication hook: error-feedback low rank (``LowRankState``)
==========================  =====================================================

Every layer uses ``torch.distributed`` collectives only (NCCL on GPU, gloo on
CPU), documents the collectives it issues and what each rank holds, and counts
the bytes it sends and receives per collective kind.
"""

from tritonopt.dist._collective_guard import CollectiveFailure
from tritonopt.dist.comm_hooks import EFTopKState, LowRankState, ef_topk_hook, lowrank_ef_hook
from tritonopt.dist.dho2 import DHO2, MRDHO2
from tritonopt.dist.kaisa import KAISAAssignment, KAISACollectiveError, KAISAPreconditioner, Strategy
from tritonopt.dist.lanczos import distributed_lanczos, reconstruct_columns

__all__ = [
    "CollectiveFailure",
    "DHO2",
    "EFTopKState",
    "KAISAAssignment",
    "KAISACollectiveError",
    "KAISAPreconditioner",
    "LowRankState",
    "MRDHO2",
    "Strategy",
    "distributed_lanczos",
    "ef_topk_hook",
    "lowrank_ef_hook",
    "reconstruct_columns",
]
