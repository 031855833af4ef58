"""``torch.distributed`` layers of tritonopt.

==========================  =====================================================
``KAISAPreconditioner``     K-FAC across ranks with KAISA's ``grad_worker_fraction``
==========================  =====================================================

Every layer uses ``torch.distributed`` collectives only (NCCL on GPU, gloo on
CPU), documents the collectives it issues and what each rank holds, and counts
the bytes it sends and receives per collective kind.
"""

from tritonopt.dist.kaisa import KAISAAssignment, KAISAPreconditioner, Strategy

__all__ = [
    "KAISAAssignment",
    "KAISAPreconditioner",
    "Strategy",
]
