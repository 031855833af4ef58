"""``torch.optim``-style optimizers built on tritonopt's ops."""

from tritonopt.optim._accounting import optimizer_state_bytes
from tritonopt.optim.sparse_adagrad import SparseAdaGrad

__all__ = ["SparseAdaGrad", "optimizer_state_bytes"]
