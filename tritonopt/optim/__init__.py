"""``torch.optim``-style optimizers (and a K-FAC preconditioner) built on tritonopt's ops."""

from tritonopt.optim import functional
from tritonopt.optim._accounting import optimizer_state_bytes
from tritonopt.optim.flat_sgd import FlatSGD
from tritonopt.optim.fosi import FOSI
from tritonopt.optim.ggt import GGT, SparseGGT
from tritonopt.optim.kfac import KFACPreconditioner, UnsupportedLayerError
from tritonopt.optim.lowrank_mfac import LowRankMFAC
from tritonopt.optim.mfac import MFAC, SparseMFAC
from tritonopt.optim.sparse_adagrad import SparseAdaGrad

__all__ = [
    "FOSI",
    "FlatSGD",
    "GGT",
    "KFACPreconditioner",
    "LowRankMFAC",
    "MFAC",
    "SparseAdaGrad",
    "SparseGGT",
    "SparseMFAC",
    "UnsupportedLayerError",
    "functional",
    "optimizer_state_bytes",
]
