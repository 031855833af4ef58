"""``torch.optim``-style optimizers (and a K-FAC preconditioner) built on tritonopt's ops.

Besides the optimizers, the packed-group core they stand on is public, for optimizers
built elsewhere (the distributed layers): :class:`PackedOptimizer` (the non-finite
policy, parameter, gradient and checkpoint checks), :class:`PackedGroup` (a group's
flat buffers), :class:`CheckpointSpec` (what a saved state must hold) and
:class:`BlockLayout` (where each tensor lives in a flat buffer, with views and packing).
"""

from tritonopt.optim import functional
from tritonopt.optim._accounting import optimizer_state_bytes
from tritonopt.optim.flat_sgd import FlatSGD
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._packed import CheckpointSpec, PackedGroup, PackedOptimizer, apply_nonfinite_policy
from tritonopt.optim.fosi import FOSI
from tritonopt.optim.ggt import GGT, SparseGGT
from tritonopt.optim.kfac import KFACPreconditioner, UnsupportedLayerError
from tritonopt.optim.lowrank_mfac import LowRankMFAC
from tritonopt.optim.mfac import MFAC, SparseMFAC
from tritonopt.optim.sparse_adagrad import SparseAdaGrad

__all__ = [
    "BlockLayout",
    "CheckpointSpec",
    "FOSI",
    "FlatSGD",
    "GGT",
    "KFACPreconditioner",
    "LowRankMFAC",
    "MFAC",
    "PackedGroup",
    "PackedOptimizer",
    "SparseAdaGrad",
    "SparseGGT",
    "SparseMFAC",
    "UnsupportedLayerError",
    "apply_nonfinite_policy",
    "functional",
    "optimizer_state_bytes",
]
