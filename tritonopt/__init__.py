"""tritonopt: Triton kernels for compressed, second-order and distributed optimizers.

* :mod:`tritonopt.ops` -- the kernels as ``torch.library`` custom ops;
* :mod:`tritonopt.optim` -- ``torch.optim``-style optimizers built on them;
* :mod:`tritonopt.dist` -- ``torch.distributed`` layers (imported on first use).

Every op has a Triton kernel and a plain-PyTorch reference; see
:func:`select_backend` for which one runs.
"""

from tritonopt import ops, optim
from tritonopt._runtime import (
    BackendUnavailableError,
    interpreter_enabled,
    nvtx_range,
    select_backend,
    use_backend,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # tritonopt.dist pulls in torch.distributed: loaded when first named, not by every import.
    if name == "dist":
        import importlib

        return importlib.import_module("tritonopt.dist")
    raise AttributeError(f"module 'tritonopt' has no attribute {name!r}")

__all__ = [
    "BackendUnavailableError",
    "interpreter_enabled",
    "nvtx_range",
    "ops",
    "optim",
    "select_backend",
    "use_backend",
    "__version__",
    "dist",
]
