"""``torch.distributed`` layers of tritonopt.

==========================  =====================================================
``KAISAPreconditioner``     K-FAC across ranks with KAISA's ``grad_worker_fraction``
``distributed_lanczos``     Lanczos with the basis sharded by rows (DHO2 Alg. 2)
``reconstruct_columns``     row shards to column shards with one ``all_to_all``
``DHO2`` / ``MRDHO2``       distributed FOSI, and its accelerator/worker form
``SSDSGD``                  SSD-SGD: several-steps-delay SGD with GLU local updates
==========================  =====================================================

Every layer uses ``torch.distributed`` collectives only (NCCL on GPU, gloo on
CPU), documents the collectives it issues and what each rank holds, and counts
the bytes it sends and receives per collective kind.
"""

from tritonopt.dist.dho2 import DHO2, MRDHO2
from tritonopt.dist.kaisa import KAISAAssignment, KAISAPreconditioner, Strategy
from tritonopt.dist.lanczos import distributed_lanczos, reconstruct_columns
from tritonopt.dist.ssd_sgd import SSDSGD

__all__ = [
    "DHO2",
    "KAISAAssignment",
    "KAISAPreconditioner",
    "MRDHO2",
    "SSDSGD",
    "Strategy",
    "distributed_lanczos",
    "reconstruct_columns",
]
