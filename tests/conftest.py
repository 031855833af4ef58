"""Test set-up: without a GPU, Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET is read when Triton decorates a kernel, so it is set here,
before any test module imports tritonopt. With a GPU the interpreter stays off
and the Triton backend runs on CUDA tensors only: tests that force it go
through :func:`backend_device` / :func:`run_on_backend`, which put their
tensors where the backend runs.
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


def backend_device(backend: str) -> torch.device:
    """Where a test of ``backend`` puts its tensors: Triton on the GPU when there is one, else the CPU."""
    if backend == "triton" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def to_backend_device(backend: str, value):
    """``value``, built on the CPU, on :func:`backend_device`: the same numbers where ``backend`` runs.

    A tensor is copied there, a parameter becomes a leaf parameter there, a module is
    moved in place, and lists and tuples are mapped item by item. What is already
    there comes back as it is: on a machine without a GPU nothing changes.
    """
    target = backend_device(backend)
    if isinstance(value, torch.nn.Module):
        return value.to(target)
    if isinstance(value, torch.nn.Parameter):
        if value.device == target:
            return value
        return torch.nn.Parameter(value.detach().to(target), requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor):
        return value.to(target)
    if isinstance(value, (tuple, list)):
        return type(value)(to_backend_device(backend, v) for v in value)
    return value


def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def run_on_backend(backend: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``backend`` forced, its tensor arguments on that backend's device.

    CPU tensor arguments are moved, and copied back after the call (so in-place
    updates reach the caller's tensors); tensor results come back on the CPU. On
    a machine without a GPU nothing moves.
    """
    target = backend_device(backend)

    def move(t):  # CPU tensors only: a test's meta or CUDA tensors stay where they are
        return t.to(target) if t.device.type == "cpu" else t

    moved_args = [_map_tensors(a, move) for a in args]
    moved_kwargs = {k: _map_tensors(v, move) for k, v in kwargs.items()}
    with tritonopt_use_backend(backend):
        result = fn(*moved_args, **moved_kwargs)
    with torch.no_grad():
        for original, moved in zip(list(args) + list(kwargs.values()),
                                   moved_args + list(moved_kwargs.values())):
            if isinstance(original, torch.Tensor) and moved is not original:
                original.copy_(moved)
    return _map_tensors(result, lambda t: t.cpu())


def tritonopt_use_backend(backend: str):
    import tritonopt

    return tritonopt.use_backend(backend)


@pytest.fixture
def on_reference():
    """Run the test's optimizer logic on the reference path: the kernels equal it (their own tests and
    each optimizer's triton-against-reference test), in a fraction of the interpreter's time."""
    import tritonopt

    with tritonopt.use_backend("reference"):
        yield


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: the GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
