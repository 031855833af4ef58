"""``torch.distributed`` layers of tritonopt.

==========================  =====================================================
``KAISAPreconditioner``     K-FAC across ranks with KAISA's ``grad_worker_fraction``
``distributed_lanczos``     Lanczos with the basis sharded by rows (DHO2 Alg. 2)
``reconstruct_columns``     row shards to column shards with one ``all_to_all``
``DHO2`` / ``MRDHO2``       distributed FOSI, and its accelerator/worker form
``CollectiveFailure``       what a layer raises when a rank died or stalled past its timeout
``CountingCommunicator``    the collectives every layer issues, with per-label call and byte counters
``SSDSGD``                  SSD-SGD: several-steps-delay SGD with GLU local updates
``DSPStage``                one DSP pipeline stage per rank (layer-wise staleness)
``simulate_dsp``            the same DSP arithmetic in one process (``DSPSimulator``)
``split_stages``            cut a model into the blocks of a pipeline
``ef_topk_hook``            DDP communication hook: error-feedback blockwise Top-k (``EFTopKState``)
``lowrank_ef_hook``         DDP communication hook: error-feedback low rank (``LowRankState``)
==========================  =====================================================

Every layer uses ``torch.distributed`` collectives only (NCCL on GPU, gloo on
CPU), documents the collectives it issues and what each rank holds, and counts
the bytes it sends and receives per collective kind (DSP: per point-to-point
stream, ``isend``/``irecv`` between neighbouring ranks). The layers that take a
``comm``/``communicator`` argument issue every collective through that
:class:`CountingCommunicator`; a subclass may change how a collective travels
(an emulated slow link, a fault) by overriding its methods (``all_reduce``,
``broadcast``, ...) and calling the base method, which counts and issues it.
"""

from tritonopt.dist._collective_guard import CollectiveFailure
from tritonopt.dist._comm import CollectiveStats, CountingCommunicator
from tritonopt.dist.comm_hooks import EFTopKState, LowRankState, ef_topk_hook, lowrank_ef_hook
from tritonopt.dist.dho2 import DHO2, MRDHO2
from tritonopt.dist.dsp import DSPConfigurationError, DSPPeerError, DSPStage
from tritonopt.dist.dsp_sim import DSPSimulator, simulate_dsp
from tritonopt.dist.dsp_split import split_stages
from tritonopt.dist.kaisa import KAISAAssignment, KAISACollectiveError, KAISAPreconditioner, Strategy
from tritonopt.dist.lanczos import distributed_lanczos, reconstruct_columns
from tritonopt.dist.ssd_sgd import SSDSGD

__all__ = [
    "CollectiveFailure",
    "CollectiveStats",
    "CountingCommunicator",
    "DHO2",
    "DSPConfigurationError",
    "DSPPeerError",
    "DSPSimulator",
    "DSPStage",
    "EFTopKState",
    "KAISAAssignment",
    "KAISACollectiveError",
    "KAISAPreconditioner",
    "LowRankState",
    "MRDHO2",
    "SSDSGD",
    "Strategy",
    "distributed_lanczos",
    "ef_topk_hook",
    "lowrank_ef_hook",
    "reconstruct_columns",
    "simulate_dsp",
    "split_stages",
]
