"""Test set-up: without a GPU, Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET is read when Triton decorates a kernel, so it is set here,
before any test module imports tritonopt.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=400)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def triton_runs_here() -> bool:
    from tritonopt._runtime import HAS_TRITON, INTERPRETER

    return HAS_TRITON and (torch.cuda.is_available() or INTERPRETER)


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: the GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
