"""``torch.distributed`` layers of tritonopt.

==========================  =====================================================
``KAISAPreconditioner``     K-FAC across ranks with KAISA's ``grad_worker_fraction``
``distributed_lanczos``     Lanczos with the basis sharded by rows (DHO2 Alg. 2)
``reconstruct_columns``     row shards to column shards with one ``all_to_all``
``DHO2`` / ``MRDHO2``       distributed FOSI, and its accelerator/worker form
``CollectiveFailure``       what a layer raises when a rank died or stalled past its timeout
``SSDSGD``                  SSD-SGD: several-steps-delay SGD with GLU local updates
``DSPStage``                one DSP pipeline stage per rank (layer-wise staleness)
``simulate_dsp``            the same DSP arithmetic in one process (``DSPSimulator``)
``split_stages``            cut a model into the blocks of a pipeline
==========================  =====================================================

Every layer uses ``torch.distributed`` collectives only (NCCL on GPU, gloo on
CPU), documents the collectives it issues and what each rank holds, and counts
the bytes it sends and receives per collective kind (DSP: per point-to-point
stream, ``isend``/``irecv`` between neighbouring ranks).
"""

from tritonopt.dist._collective_guard import CollectiveFailure
from tritonopt.dist.dho2 import DHO2, MRDHO2
from tritonopt.dist.dsp import DSPConfigurationError, DSPPeerError, DSPStage
from tritonopt.dist.dsp_sim import DSPSimulator, simulate_dsp
from tritonopt.dist.dsp_split import split_stages
from tritonopt.dist.kaisa import KAISAAssignment, KAISACollectiveError, KAISAPreconditioner, Strategy
from tritonopt.dist.lanczos import distributed_lanczos, reconstruct_columns
from tritonopt.dist.ssd_sgd import SSDSGD

__all__ = [
    "CollectiveFailure",
    "DHO2",
    "DSPConfigurationError",
    "DSPPeerError",
    "DSPSimulator",
    "DSPStage",
    "KAISAAssignment",
    "KAISACollectiveError",
    "KAISAPreconditioner",
    "MRDHO2",
    "SSDSGD",
    "Strategy",
    "distributed_lanczos",
    "reconstruct_columns",
    "simulate_dsp",
    "split_stages",
]
